#!/usr/bin/env bash
# Idempotent set-up of .venv with everything the main job and the tests need.
# vllm 0.33.0 pins torch 2.14.0 and triton 3.8.0; it is installed so the vLLM integration tests
# run against the real package. Set VOK_NO_VLLM=1 to skip it (kernels and accumulation only).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
extras="test,bench,triton"
if [ "${VOK_NO_VLLM:-0}" = "0" ]; then extras="$extras,vllm"; fi
.venv/bin/python -m pip install -q -e ".[${extras}]"
.venv/bin/python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
