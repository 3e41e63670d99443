"""How tests/data/v2_checkpoint was made: by the main branch's code at dd5f549 (format version 2,
one file per chunk), before the aggregated layout existed. Kept to regenerate it the same way:

    PYTHONPATH=<checkout of dd5f549> XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python tests/data/make_v2_checkpoint.py tests/data/v2_checkpoint
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp

mesh = Mesh(np.array(jax.devices()[:2]), ("a",))
params = {
    "w": jax.device_put(
        np.arange(8 * 6, dtype=np.float32).reshape(8, 6), NamedSharding(mesh, P("a"))
    ),
    "e": jnp.asarray(np.linspace(-1, 1, 12).reshape(4, 3), jnp.bfloat16),
    "s": np.float32(2.5),
}
opt = optax.adam(1e-3).init(params)
ucp.save(sys.argv[1], params, opt, step=11, extra={"made_by": "main dd5f549, format version 2"})
print(ucp.__file__)
