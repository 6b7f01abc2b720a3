#!/usr/bin/env bash
# The test command. On a machine without a GPU the Triton kernels run under TRITON_INTERPRET=1
# (tests/conftest.py sets it) and GPU-marked tests are deselected.
# With pytest-xdist (the test extra) the CPU run takes two worker processes, each test module on one
# of them (its servers and engines start once); most of the suite waits on engine and server
# processes starting, which a second worker overlaps. `-n 0` runs it in one process. The slowest
# tests are listed at the end (CI has 20 minutes for set-up and tests).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
if "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  exec "$PY" -m pytest -q "$@"
fi
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 2 --dist loadscope); fi
exec "$PY" -m pytest -q -m "not gpu" --durations=15 "${workers[@]}" "$@"
