"""Programmatic dependent launch (PDL): one setting for the backends that launch with it.

On Hopper and newer the compiled and the Triton kernels launch with PDL: a kernel's blocks may be
scheduled while the kernel ahead of it in the stream finishes. Every kernel of the package waits for
that kernel before it touches memory, so results do not depend on the setting; a chain of small
kernels in a CUDA graph loses a launch latency per kernel. CuPy launches without it (the kernels'
wait then returns at once).

On by default; ``VLLM_OMNI_KERNELS_PDL=0`` turns it off, ``set_enabled`` at run time (for launches from
then on: a captured graph keeps the setting it was captured with).
"""

from __future__ import annotations

import functools
import os

import torch

_enabled = os.environ.get("VLLM_OMNI_KERNELS_PDL", "1").strip() != "0"


def enabled() -> bool:
    """Whether launches on devices that support it use PDL."""
    return _enabled


def set_enabled(flag: bool) -> None:
    """Launch with (True) or without PDL from now on, on every backend that can."""
    global _enabled
    _enabled = bool(flag)
    if hasattr(torch.ops.vllm_omni_kernels, "set_programmatic_launch"):  # the compiled library, once loaded
        torch.ops.vllm_omni_kernels.set_programmatic_launch(_enabled)


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def for_tensor(t: torch.Tensor) -> bool:
    """Whether a Triton launch on ``t``'s device uses PDL: the setting, and a Hopper or newer GPU."""
    return t.is_cuda and _enabled and _supported(t.device.index)
