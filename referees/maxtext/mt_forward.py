"""MaxText's own forward pass on a fixed batch (runs in the MaxText venv, Python 3.12).

    python mt_forward.py OUT.npy TOKENS.npy key=value ...   (MaxText config overrides)

Builds the model from MaxText's base.yml and the overrides, loads its parameters from
`load_parameters_path` (a `<step>/items` folder) with MaxText's `from_pretrained`, and writes the
float32 logits of the tokens (positions 0..seq-1, no dropout) to OUT.npy.
"""

import os
import sys

import jax
import numpy as np
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils

BASE = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")


def main() -> None:
    out, tokens_path, *overrides = sys.argv[1:]
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    config = pyconfig.initialize([sys.argv[0], BASE, *overrides])
    model, mesh = model_creation_utils.from_pretrained(config)
    tokens = np.load(tokens_path).astype(np.int32)
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with mesh:
        logits = model(tokens, pos, enable_dropout=False)
    np.save(out, np.asarray(logits, np.float32))
    print("logits", logits.shape, logits.dtype)


if __name__ == "__main__":
    main()
