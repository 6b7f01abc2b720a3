#!/usr/bin/env bash
# Adds to an offline vLLM bundle (../shared/tools/offline-vllm-bundle.sh BUNDLE) the wheels that
# vLLM's API server needs and the GPU image lacks, so that `serve` and profiling/load_speech.py run
# on a host without network (aiohttp, h11, click, uvloop and prometheus-client are in that image).
# Run it where pip reaches an index; then `bash scripts/gpu_host.sh BUNDLE ...` installs them too.
#
#   bash scripts/server_wheels.sh BUNDLE [PYTHON_VERSION]      (default 3.12, the GPU image's)
set -euo pipefail
bundle=${1:?usage: server_wheels.sh BUNDLE [PYTHON_VERSION]}
version=${2:-3.12}
mkdir -p "$bundle/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" -d "$bundle/wheels" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  orjson uvicorn httptools watchfiles prometheus-fastapi-instrumentator python-multipart \
  model-hosting-container-standards jmespath supervisor
ls "$bundle/wheels"
