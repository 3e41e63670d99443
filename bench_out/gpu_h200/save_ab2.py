"""On the GPU: ucp save with 256 MiB (before) and 8 MiB (now) version-3 shards, Orbax, the write limit."""
import json, os, shutil, sys, tempfile, time
sys.path.insert(0, "benchmarks"); sys.argv.append("--accelerator")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, numpy as np
import roofline as R, roofline_limits as lim
import ucp_jax as ucp
from ucp_jax._src.format import store
import orbax.checkpoint as ocp

root = tempfile.mkdtemp(dir="/tmp"); out = {}
def t(fn):
    os.sync(); lim.trim_heap(); t0 = time.perf_counter(); fn(); return time.perf_counter() - t0
for name, spec, dt in (("large", R.large_leaves(0.8), "f32"), ("model", R.model_like(0.8), "bf16")):
    params, opt, (tp, to), (rp, ro) = R.build(spec, R.DTYPES[dt])
    full = (params, opt); shards = lim.unique_shards(full); res = {"bytes": R.state_bytes(full)}
    ck = ocp.StandardCheckpointer()
    for r in range(3):
        d = os.path.join(root, "raw"); tw, _ = lim.write_fsync(shards, d, 16); shutil.rmtree(d)
        res.setdefault("limit_write", []).append(tw)
        for mb in ((256, 8) if r % 2 == 0 else (8, 256)):
            store.AGGREGATED_SHARD_BYTES = mb << 20; p = os.path.join(root, f"u{mb}")
            res.setdefault(f"ucp_save_{mb}MiB", []).append(t(lambda: ucp.save(p, params, opt, step=1)))
            if r < 2: shutil.rmtree(p)
        p = os.path.join(root, "o")
        def osave():
            ck.save(p, {"params": params, "opt_state": opt}); ck.wait_until_finished()
        res.setdefault("orbax_save", []).append(t(osave)); shutil.rmtree(p)
    for mb in (256, 8):
        p = os.path.join(root, f"u{mb}")
        for _ in range(2):
            tr = t(lambda: jax.block_until_ready(ucp.restore(p, rp, ro)))
            res.setdefault(f"ucp_restore_{mb}MiB", []).append(tr)
        got = ucp.restore(p, rp, ro)
        res[f"bitexact_{mb}MiB"] = R.identical(got, full)
        shutil.rmtree(p); del got
    out[f"{name}/{dt}"] = res
    print(name, dt, json.dumps({k: (sorted(round(x, 3) for x in v) if isinstance(v, list) else v) for k, v in res.items()}), flush=True)
    del params, opt, full, shards
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "save_ab2.json"), "w"), indent=1)
