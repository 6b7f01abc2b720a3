#!/usr/bin/env bash
# The test command. On a machine without a GPU the Triton kernels run under TRITON_INTERPRET=1
# (tests/conftest.py sets it) and GPU-marked tests are deselected.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec "$PY" -m pytest -q "$@"
fi
exec "$PY" -m pytest -q -m "not gpu" "$@"
