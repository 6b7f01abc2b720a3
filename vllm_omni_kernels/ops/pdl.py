"""Programmatic dependent launch (PDL): one setting for the backends that launch with it.

On Hopper and newer the compiled extension (``kernels/vok_launch.h``) and the Triton kernels launch
with PDL: a kernel's blocks may be scheduled while the kernel ahead of it in the stream finishes.
Every kernel of the package waits for that kernel before it touches memory, so results do not
depend on the setting; a chain of small kernels in a CUDA graph loses a launch latency per kernel.
CuPy launches without it (the kernels' wait then returns at once).

On by default; ``VLLM_OMNI_KERNELS_PDL=0`` in the environment turns it off, ``set_enabled`` at run
time (for launches from then on: a captured graph keeps the setting it was captured with).
"""

from __future__ import annotations

import functools
import os

import torch

_ENV = "VLLM_OMNI_KERNELS_PDL"
_enabled: bool | None = None  # None: not read from the environment yet


def enabled() -> bool:
    """Whether launches on devices that support it use PDL."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get(_ENV, "1").strip() != "0"
    return _enabled


def set_enabled(flag: bool) -> None:
    """Launch with (True) or without PDL from now on, on every backend that can (the compiled
    extension once loaded, and Triton)."""
    global _enabled
    _enabled = bool(flag)
    from . import cuda_ext

    setter = getattr(cuda_ext._module, "set_programmatic_launch", None)  # the extension, once loaded
    if setter is not None:
        setter(_enabled)


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def for_tensor(t: torch.Tensor) -> bool:
    """Whether a Triton launch on ``t``'s device uses PDL: the setting, and a Hopper or newer GPU."""
    return t.is_cuda and enabled() and _supported(t.device.index)
