"""One front per kernel operation; each dispatches on the tensors' device and the backend setting.

Ring copies (semantics in ``reference.py``, layout in ``layout.py``):
    ring_write(arena, state, meta, src, rows=, frame_elems=, last=, max_elems=)
    ring_read(arena, meta, out, rows=, frame_elems=, last=, max_elems=)
    ring_step(is_cuda) -> a factory of one-call append steps (plan + ring_write), or None (compiled only)
    setting() -> what a caller keeping a resolved step compares (``is``) to know it still holds
``max_elems`` is the host-known largest ``N * F`` of the step; it sizes the grid.

Launch setting: set_programmatic_launch(enabled) (``pdl.py``: programmatic dependent launch of the
compiled and Triton kernels on Hopper and newer; on unless ``VLLM_OMNI_KERNELS_PDL=0``).

Row gather (the fused decode gather; jobs and table in ``gather_jobs.py``):
    row_gather(jobs, table, anchor, layout=, grid_rows=)
    gather_step(is_cuda) -> a factory of one-call gather launches (encode + row_gather), or None (compiled only)
"""

from __future__ import annotations

import importlib

import torch

from .. import backend as _backend
from . import reference
from .layout import META_COLS  # noqa: F401  (re-exported for callers building metadata)


_MODULES = {("cuda", "ring"): "cuda_ext", ("cuda", "gather"): "cuda_ext", ("cupy", "ring"): "cupy_nvrtc",
            ("cupy", "gather"): "cupy_nvrtc", ("triton", "ring"): "triton_ring", ("triton", "gather"): "triton_gather"}
_loaded: dict[str, object] = {}


def _impl(is_cuda: bool, module: str = "ring"):
    """The backend module that implements ``module`` ("ring" or "gather") for CUDA (``is_cuda``) or
    CPU tensors, or None for the torch reference. Every launch asks, so this is two dict hits."""
    name = _backend.name_for(is_cuda)
    if name == "torch":
        return None
    mod_name = _MODULES[(name, module)]
    mod = _loaded.get(mod_name)
    if mod is None:
        mod = _loaded[mod_name] = importlib.import_module(f"{__name__}.{mod_name}")
    return mod


# The backend setting as an object that stays the same (``is``) while the setting is unchanged.
# Launch paths that keep what ``ring_step``/``gather_step`` resolved compare it instead of resolving
# again every call (the setting may change at run time: benchmarks and tests switch it).
setting = _backend._raw


def set_programmatic_launch(enabled: bool) -> None:
    """Launch the compiled and Triton kernels with (True) or without programmatic dependent launch
    from now on (``pdl.py``); a captured graph keeps the setting it was captured with."""
    from . import pdl

    pdl.set_enabled(enabled)


def uses_kernel(is_cuda: bool) -> bool:
    """Whether ops on CUDA (``is_cuda``) or CPU tensors run a kernel backend (which reads device
    metadata) or the reference."""
    return _impl(is_cuda) is not None


def ring_write(arena, state, meta, src, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    """Append each metadata row's chunk of ``src`` into its ring region; advance device heads.

    Shapes: ``arena`` 1-D pool storage, ``state`` int64 [slots] (head words), ``meta`` int64 [>=rows, 8],
    ``src`` any contiguous tensor of the arena's dtype (addressed by element offsets). All on one
    device. No host sync on the kernel backends; validation is the caller's (``ring.RingPool``).
    """
    impl = _impl(arena.is_cuda)
    if impl is None:
        reference.ring_write(arena, state, meta, src, rows=rows, frame_elems=frame_elems, last=last)
    else:
        impl.ring_write(arena, state, meta, src, rows=rows, frame_elems=frame_elems, last=last,
                        max_elems=max_elems)


def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    """Copy each metadata row's ring span (from POS, N frames) into ``out`` at its LIN_OFF."""
    impl = _impl(arena.is_cuda)
    if impl is None:
        reference.ring_read(arena, meta, out, rows=rows, frame_elems=frame_elems, last=last)
    else:
        impl.ring_read(arena, meta, out, rows=rows, frame_elems=frame_elems, last=last, max_elems=max_elems)


def ring_step(is_cuda: bool):
    """The backend's factory of one-call append steps, or None when the backend has none and the
    caller plans with ``RingPool._plan_numpy`` and calls ``ring_write``.

    ``factory(arena, state, table, frame_shape, last)`` binds a pool (``table``: its host slot table,
    int64 ``[slots, 8]``, advanced in place). The step ``step(ids, data, lengths, version)`` checks,
    plans and launches one append of a ``PaddedBatch`` and returns B; 0 when ``ids``/``version`` are
    not the ones last given to ``step.set_slots(ids_tuple, slots, version)`` (give them, call again);
    -1 when the step is not for it (nothing changed). ``step.call`` is the same call as a plain
    CPython callable (positional arguments, no pybind11 dispatch): the per-step entry.
    ``kernels/vok_python.cpp`` has the contract.
    """
    impl = _impl(is_cuda)
    return None if impl is None else getattr(impl, "ring_step", None)


def gather_step(is_cuda: bool):
    """The backend's factory of one-call gather launches, or None when the backend has none and the
    caller encodes with ``GatherJobs.encode`` and calls ``row_gather``.

    ``factory(anchor, width, capacity)`` binds a gather (float offsets are relative to ``anchor``, a
    tensor of the float dtype on the launch's device; ``capacity`` a ``TableLayout`` of its limits).
    ``step(float_blocks, int_blocks, value_blocks, n_float, n_int, n_values, aligned)`` checks the
    counts against ``capacity`` (``ValueError``), encodes a ``GatherJobs``'s jobs into the launch's
    parameters (a table of more than 4088 words into its own pinned table, read in place) and
    launches the kernel; it returns the launches (0 without jobs).
    ``step.call`` is the same call without pybind11's dispatch (positional arguments): the per-step
    entry.
    """
    impl = _impl(is_cuda, "gather")
    return None if impl is None else getattr(impl, "gather_step", None)


def row_gather(jobs, table, anchor, *, layout, grid_rows: int | None = None, aligned: bool | None = None) -> None:
    """Carry out every job of ``jobs`` (a ``GatherJobs``) in one launch.

    ``table``: the device int64 table ``jobs`` was encoded into (``layout``), with float offsets
    relative to ``anchor`` (a tensor of the float dtype) and int offsets relative to the table;
    ignored by the reference backend. ``grid_rows``: jobs the grid covers (default: this launch's
    count; a captured graph passes its upper bound). ``aligned``: promise 16-byte aligned float rows
    (default: ``jobs.aligned``). One launch, no host sync; nothing at all when there are no jobs.
    """
    impl = _impl(jobs.is_cuda, "gather")
    if impl is None:
        reference.row_gather(jobs)
        return
    rows = jobs.n_float + jobs.n_int if grid_rows is None else grid_rows
    if rows == 0:
        return
    aligned = jobs.aligned if aligned is None else aligned
    impl.row_gather(anchor, table.view(torch.int32), table, width=jobs.width, int_off=layout.int_off,
                    grid_rows=rows, align=jobs.vector if aligned else 1)
