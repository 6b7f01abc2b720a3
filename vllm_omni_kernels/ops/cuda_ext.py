"""The compiled CUDA C++ backend: torch custom ops from ``kernels/vok_torch.cu``.

The extension (``_vok_ops*.so``, built by CMakeLists.txt through setup.py or by hand) registers
``torch.ops.vllm_omni_kernels.{ring_write, ring_read, row_gather}`` with ``TORCH_LIBRARY`` (def +
impl: the dispatcher's direct path, a few microseconds a call). This module finds and loads it,
registers fake implementations so ``torch.compile`` can trace callers, and exposes the same launch
functions as ``triton_ring``/``triton_gather``, plus ``ring_planned_append``: the pool's host planning
of an append step (``ring_plan``) and its launch in one call. The planning ops read and advance host
tables, so they have no fake implementation.

Search order: ``$VLLM_OMNI_KERNELS_EXT`` (a path to the .so), the package directory, ``build/`` of
a source checkout.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

_PKG = Path(__file__).resolve().parents[1]


def _candidates() -> list[Path]:
    env = os.environ.get("VLLM_OMNI_KERNELS_EXT")
    found = [Path(env)] if env else []
    for d in (_PKG, _PKG.parent / "build"):
        found += sorted(d.glob("_vok_ops*.so"))
    return found


@functools.cache
def load() -> str | None:
    """Load the extension once; None when loaded, else why it is unavailable."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    paths = _candidates()
    if not paths:
        return ("compiled extension not built (pip install --no-build-isolation -e . with nvcc and a CUDA "
                "torch, or cmake -S . -B build && cmake --build build)")
    try:
        torch.ops.load_library(str(paths[0]))
    except OSError as exc:
        return f"cannot load {paths[0]}: {exc}"
    _register_fakes()
    return None


def _register_fakes() -> None:
    """Every op mutates its arguments and returns nothing, so the fake implementations do nothing."""
    for name in ("ring_write", "ring_read", "row_gather"):
        qual = f"vllm_omni_kernels::{name}"
        try:
            torch.library.register_fake(qual)(lambda *args, **kwargs: None)
        except RuntimeError:  # already registered (a second load in one process)
            pass


def ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems) -> None:
    torch.ops.vllm_omni_kernels.ring_write(arena, state, meta, src, rows, frame_elems, last, max_elems)


def ring_planned_append(arena, state, table, slots, n, staged, src, row_elems, axis_len, lin_stride, frame_elems,
                        last) -> int:
    """Plan and launch one append step in one host call (``ops.ring_planned_append`` has the contract)."""
    return torch.ops.vllm_omni_kernels.ring_append(arena, state, table, slots, n, staged, src, row_elems, axis_len,
                                                   lin_stride, frame_elems, last)


def ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems) -> None:
    torch.ops.vllm_omni_kernels.ring_read(arena, meta, out, rows, frame_elems, last, max_elems)


def gather_planned_launch(anchor, table, desc, rowbuf, n_float, n_int, int_off, width, aligned) -> None:
    """Encode the job table and launch the gather in one host call (``ops.gather_planned_launch``)."""
    torch.ops.vllm_omni_kernels.gather_launch(anchor, table, desc, rowbuf, n_float, n_int, int_off, width, aligned)


def row_gather(fbase, ibase, table, *, width, int_off, grid_rows, align) -> None:
    torch.ops.vllm_omni_kernels.row_gather(fbase, table, width, int_off, grid_rows, align > 1)
