"""On the GPU: where a ucp save's time goes, and the pinned-host copies against pageable ones."""
import cProfile, io, json, os, pstats, shutil, sys, tempfile, time
sys.path.insert(0, "benchmarks"); sys.argv.append("--accelerator")  # roofline: no forced CPU devices
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, numpy as np
from jax.sharding import SingleDeviceSharding
import roofline as R, roofline_limits as lim
import ucp_jax as ucp
import orbax.checkpoint as ocp

out = {}
root = tempfile.mkdtemp(dir="/tmp")
def clean(p):
    shutil.rmtree(p, ignore_errors=True)
def t(fn):
    os.sync(); t0 = time.perf_counter(); fn(); return time.perf_counter() - t0

for name, spec, dt in (("large", R.large_leaves(0.8), "f32"), ("model", R.model_like(0.8), "bf16")):
    params, opt, _, _ = R.build(spec, R.DTYPES[dt])
    full = (params, opt); leaves = jax.tree.leaves(full)
    nb = R.state_bytes(full); res = {"bytes": nb}
    dev = jax.devices()[0]
    # device -> host, three ways (no disk)
    def pageable():
        for x in leaves: x.copy_to_host_async()
        [np.asarray(x) for x in leaves]
    def pinned():
        st = jax.device_put(leaves, SingleDeviceSharding(dev, memory_kind="pinned_host"))
        [np.asarray(x) for x in st]
    def fresh_pageable():
        [np.array(x) for x in (l + 0 for l in leaves)]
    for k, fn in (("d2h_pageable", pageable), ("d2h_pinned", pinned)):
        fn(); res[k] = min(t(fn) for _ in range(3))
    shards = lim.unique_shards(full)
    ck = ocp.StandardCheckpointer()
    for r in range(3):
        d = os.path.join(root, "raw"); tw, _ = lim.write_fsync(shards, d, 16); clean(d)
        res.setdefault("limit_write", []).append(tw)
        for mode in ("none", "auto"):
            os.environ["UCP_STAGING"] = mode; p = os.path.join(root, "u")
            res.setdefault(f"ucp_save_{mode}", []).append(t(lambda: ucp.save(p, params, opt, step=1))); clean(p)
        p = os.path.join(root, "o")
        def osave():
            ck.save(p, {"params": params, "opt_state": opt}); ck.wait_until_finished()
        res.setdefault("orbax_save", []).append(t(osave)); clean(p)
    for mode in ("none", "auto"):
        os.environ["UCP_STAGING"] = mode; p = os.path.join(root, "u")
        pr = cProfile.Profile(); pr.enable(); ucp.save(p, params, opt, step=1); pr.disable(); clean(p)
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(f"== {name}/{dt} cProfile UCP_STAGING={mode} (main thread, by own time)"); print(s.getvalue()[-3200:])
    os.environ["UCP_STAGING"] = "auto"
    out[f"{name}/{dt}"] = res
    print(name, dt, json.dumps({k: (sorted(v) if isinstance(v, list) else v) for k, v in res.items()}))
    del params, opt, full, leaves
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "save_ab.json"), "w"), indent=1)
