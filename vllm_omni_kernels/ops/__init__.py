"""One front per kernel operation: what the ring pools, the worker accumulator and the gathers call.

    ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems)
        Append each metadata row's chunk of ``src`` into its ring region and advance the device
        heads. ``arena``: 1-D pool storage; ``state``: int64 ``[slots]`` head words; ``meta``: int64
        ``[>= rows, META_COLS]`` (``layout.py``; on the device, or pinned host memory read in place);
        ``src``: a tensor of the arena's dtype addressed by element offsets. Elements of 1, 2, 4 or 8
        bytes (a complex one is copied as an integer of its size).
    ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems)
        Copy each row's ring span (from POS, N frames) into ``out`` at LIN_OFF.
    row_gather(jobs, table, base, *, grid_rows=None, aligned=None)
        Carry out every job of ``jobs`` (a ``gather.jobs.GatherJobs``) in one launch, from ``table``
        (what ``jobs.encode`` wrote, on the device or pinned) with offsets from ``base``.
    set_programmatic_launch(enabled)
        Launch the compiled and Triton kernels with or without programmatic dependent launch (``pdl.py``).

``max_elems`` is the host-known largest ``N * F`` of the launch: it sizes the grid (the reference
ignores it). Validation is the caller's; the kernel backends never sync with the host. Each op runs
on the backend ``backend.select`` names for the tensors' device: the compiled extension
(``cuda_ext``), CuPy (``cupy_nvrtc``), Triton (``triton_ring``, ``triton_gather``) or the torch
reference (``reference``).
"""

from __future__ import annotations

import functools
import importlib

import torch

from .. import backend as _backend
from . import pdl, reference
from .reference import ELEMENT_BITS

_MODULES = {("cuda", "ring"): "cuda_ext", ("cuda", "gather"): "cuda_ext", ("cupy", "ring"): "cupy_nvrtc",
            ("cupy", "gather"): "cupy_nvrtc", ("triton", "ring"): "triton_ring", ("triton", "gather"): "triton_gather",
            ("torch", "ring"): "reference", ("torch", "gather"): "reference"}


def _impl(is_cuda: bool, op: str = "ring"):
    """The backend module that runs ``op`` ("ring" or "gather") on CUDA (``is_cuda``) or CPU tensors
    (``reference`` for the torch backend)."""
    return _module(_backend.name_for(is_cuda), op)


@functools.cache
def _module(backend: str, op: str):
    return importlib.import_module(f"{__name__}.{_MODULES[(backend, op)]}")


def set_programmatic_launch(enabled: bool) -> None:
    """Launch the compiled and Triton kernels with (True) or without programmatic dependent launch
    from now on; a captured graph keeps the setting it was captured with."""
    pdl.set_enabled(enabled)


def not_plain(t) -> str | None:
    """Why ``t`` is not a tensor the kernels can read (plain strided memory, which they address by
    element offsets), or None."""
    if not isinstance(t, torch.Tensor):
        return f"expected a tensor, got {type(t).__name__}"
    if t.layout is not torch.strided or t.is_nested or t.is_quantized:
        return (f"a tensor of layout {t.layout} (nested: {t.is_nested}, quantized: {t.is_quantized}): the kernels "
                "read plain strided tensors")
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as integers of its element size (the rings copy bits; complex128, which only
    the reference copies, stays as it is); any other as it is."""
    return t.view(ELEMENT_BITS[t.element_size()]) if t.is_complex() and t.element_size() in ELEMENT_BITS else t


def ring_write(arena, state, meta, src, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    _impl(arena.is_cuda).ring_write(_bits(arena), state, meta, _bits(src), rows=rows, frame_elems=frame_elems,
                                    last=last, max_elems=max_elems)


def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    _impl(arena.is_cuda).ring_read(_bits(arena), meta, _bits(out), rows=rows, frame_elems=frame_elems, last=last,
                                   max_elems=max_elems)


def uses_kernel(is_cuda: bool) -> bool:
    """Whether ops on CUDA (``is_cuda``) or CPU tensors run a kernel backend (which reads a table) or
    the reference (which reads the recorded jobs)."""
    return _backend.name_for(is_cuda) != "torch"


def row_gather(jobs, table, base, *, grid_rows: int | None = None, aligned: bool | None = None) -> None:
    impl = _impl(jobs.is_cuda, "gather")
    if impl is reference:  # the reference copies the recorded jobs; a kernel reads the table
        reference.row_gather(jobs)
    else:
        impl.row_gather(base, table, jobs.outputs(), width=jobs.width,
                        grid_rows=jobs.n_float + jobs.n_int if grid_rows is None else grid_rows,
                        aligned=jobs.aligned if aligned is None else aligned)
