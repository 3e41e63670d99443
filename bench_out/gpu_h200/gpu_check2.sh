#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 .whl/save_ab.py > $OUT/save_ab.txt 2>&1; echo "save_ab rc=$? at +$(( $(date +%s)-T0 ))s"
grep -E "^(large|model) " $OUT/save_ab.txt | cut -c1-700
timeout 160 python3 benchmarks/roofline.py --accelerator --gb 0.8 --repeats 3 --out $OUT/roofline_gpu2.json > $OUT/roofline_gpu2.txt 2>&1; echo "roofline rc=$? at +$(( $(date +%s)-T0 ))s"
grep -E "ucp_save|orbax_save|ucp_restore_reshard_warm|Orbax" $OUT/roofline_gpu2.txt | cut -c1-200
UCP_TEST_ACCELERATOR=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m pytest -q -n 8 --timeout 140 -rfEs --ignore=tests/test_torchtitan_referee.py --junitxml=$OUT/junit2.xml tests > $OUT/test_gpu2.log 2>&1
echo "pytest rc=$? at +$(( $(date +%s)-T0 ))s"
grep -E "^(FAILED|ERROR)" $OUT/test_gpu2.log | cut -c1-250 | head -40
tail -2 $OUT/test_gpu2.log
