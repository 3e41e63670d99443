#!/usr/bin/env bash
# One device call: versions, carried wheels, the C extension, the roofline on the GPU, the suite on the GPU.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi -L; nproc; free -g | head -2; df -h /tmp | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
python3 - <<'PY' 2>&1 | tee $OUT/versions.txt
import importlib, jax
for m in ("jax","jaxlib","tensorstore","orbax.checkpoint","optax","flax","numpy","ml_dtypes","torch","transformers","crc32c","zlib_ng","pytest","xdist"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e: print(m, "MISSING", type(e).__name__, e)
print("devices", jax.devices(), jax.default_backend())
print("memories", [m.kind for m in jax.devices()[0].addressable_memories()])
from ucp_jax._src.format import scatter_read as s; print("scatter-read built:", s.built())
PY
echo "setup done at +$(( $(date +%s)-T0 ))s"
timeout ${ROOF_S:-170} python3 benchmarks/roofline.py --accelerator --gb 0.8 --repeats 3 --tiny 20 --out $OUT/roofline_gpu.json 2>&1 | tee $OUT/roofline_gpu.txt | grep -v "^\s*$"
echo "roofline rc=${PIPESTATUS[0]} at +$(( $(date +%s)-T0 ))s"
UCP_TEST_ACCELERATOR=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_S:-290} python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 150 -rfEs --ignore=tests/test_torchtitan_referee.py --junitxml=$OUT/junit.xml ${TESTS:-tests} > $OUT/test_gpu.log 2>&1
echo "pytest rc=$? at +$(( $(date +%s)-T0 ))s"
grep -E "^(FAILED|ERROR)" $OUT/test_gpu.log | cut -c1-300 | head -60
tail -3 $OUT/test_gpu.log
