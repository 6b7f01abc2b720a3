"""The compiled CUDA C++ backend: ``_vok_ops*.so`` built from the package's ``kernels/`` (CMakeLists.txt).

Loading the library (``torch.ops.load_library``) registers ``torch.ops.vllm_omni_kernels.{ring_write,
ring_read, row_gather}`` (``vllm_omni_kernels/kernels/vok_torch.cu``); this module registers their fake implementations
(they mutate their arguments and return nothing) so ``torch.compile`` can trace callers, and wraps
them with the launch functions every backend has.

Search order: ``$VLLM_OMNI_KERNELS_EXT`` (a path to the library), the package directory, ``build/`` of
a source checkout.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

_PKG = Path(__file__).resolve().parents[1]
_OPS = ("ring_write", "ring_read", "row_gather")


def _candidates() -> list[Path]:
    env = os.environ.get("VLLM_OMNI_KERNELS_EXT")
    found = [Path(env)] if env else []
    for d in (_PKG, _PKG.parent / "build"):
        found += sorted(d.glob("_vok_ops*.so"))
    return found


@functools.cache
def load() -> str | None:
    """Load the library once; None when loaded, else why it is unavailable."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    paths = _candidates()
    if not paths:
        return ("compiled extension not built (pip install --no-build-isolation -e . with nvcc and a CUDA "
                "torch, or cmake -S . -B build && cmake --build build)")
    if not hasattr(torch.ops.vllm_omni_kernels, "ring_write"):
        try:
            torch.ops.load_library(str(paths[0]))
        except OSError as exc:
            return f"cannot load {paths[0]}: {exc}"
    for name in _OPS:
        try:
            torch.library.register_fake(f"vllm_omni_kernels::{name}")(lambda *args, **kwargs: None)
        except RuntimeError:  # registered already
            pass
    from . import pdl

    pdl.set_enabled(pdl.enabled())  # the library starts with the setting
    return None


def ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems) -> None:
    torch.ops.vllm_omni_kernels.ring_write.default(arena, state, meta, src, rows, frame_elems, last, max_elems)


def ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems) -> None:
    torch.ops.vllm_omni_kernels.ring_read.default(arena, meta, out, rows, frame_elems, last, max_elems)


def row_gather(base, table, outputs, *, width, grid_rows, aligned) -> None:
    torch.ops.vllm_omni_kernels.row_gather.default(base, table, outputs, width, grid_rows, aligned)
