"""nvtx ranges for Nsight, off unless ``VLLM_OMNI_KERNELS_NVTX=1``.

Uses the ``nvtx`` package when installed (it colours and categorises ranges), else
``torch.cuda.nvtx`` on CUDA builds, else nothing. Disabled ranges cost one function call.
"""

from __future__ import annotations

import contextlib
import os

_ENABLED = os.environ.get("VLLM_OMNI_KERNELS_NVTX", "0") not in ("", "0")


def _make_range():
    off = contextlib.nullcontext()  # reusable: it does nothing on entry and exit
    if not _ENABLED:
        return lambda name: off
    try:
        import nvtx  # type: ignore[import-not-found]

        return lambda name: nvtx.annotate(name, domain="vllm_omni_kernels")
    except ImportError:
        import torch

        if torch.cuda.is_available():
            @contextlib.contextmanager
            def _torch_range(name):
                torch.cuda.nvtx.range_push(name)
                try:
                    yield
                finally:
                    torch.cuda.nvtx.range_pop()

            return _torch_range
        return lambda name: off


nvtx_range = _make_range()
nvtx_range.__doc__ = "Context manager marking a named nvtx range (no-op when disabled)."
