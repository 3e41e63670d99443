#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
timeout 110 python3 .whl/save_ab2.py 2>&1 | tee $OUT/save_ab2.txt | grep -E "^(large|model) |Error"
echo "rc=$? at +$(( $(date +%s)-T0 ))s"
