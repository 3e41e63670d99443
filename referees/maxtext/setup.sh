#!/usr/bin/env bash
# MaxText 0.2.5's own venv for the referees: Python 3.12 (MaxText needs >= 3.12; a pyenv 3.12 will
# do), the maxtext wheel (which declares no base dependencies) and the requirements MaxText
# generates for DECOUPLE_GCLOUD=TRUE (no accelerator wheels). ~2.5 GB, 2-3 minutes. Idempotent.
set -euo pipefail
P=${REF_DIR:-/tmp/ucp-referees}; V=$P/mt-venv
[ -x "$V/bin/python" ] && "$V/bin/python" -c 'import maxtext' 2>/dev/null && exit 0
PY312=
for c in python3.12 ~/.pyenv/versions/3.12*/bin/python3; do
  "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { PY312=$c; break; }
done
[ -n "$PY312" ] || { echo "MaxText needs a Python 3.12 (python3.12 or a pyenv 3.12)"; exit 2; }
mkdir -p "$P" && "$PY312" -m venv "$V"
"$V/bin/pip" install -q maxtext==0.2.5
"$V/bin/pip" install -q -r "$V/lib/python3.12/site-packages/dependencies/requirements/generated_requirements/decoupled-requirements.txt"
