#!/usr/bin/env bash
# Runs a command on a GPU host whose torch is not vLLM's pin and that has no network (the H200 image:
# torch 2.11 + CUDA 13): vLLM 0.33's Python layer from an offline bundle made elsewhere with
# ../shared/tools/offline-vllm-bundle.sh BUNDLE, and this package installed in place with its compiled
# extension (nvcc and a CUDA torch build it; without them it installs without, and CuPy or Triton
# run the kernels).
#
#   bash scripts/gpu_host.sh BUNDLE command [args ...]     e.g. ... python3 -m pytest -m gpu tests
#
# `serve` and profiling/load_speech.py need the API server's wheels in the bundle too
# (scripts/server_wheels.sh BUNDLE, where pip reaches an index).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:?usage: gpu_host.sh BUNDLE command [args ...]}
shift
site=$(bash "$bundle/install.sh" | tail -n 1)
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}  # vLLM's platform; the talker runs on the GPU
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
exec "$@"
