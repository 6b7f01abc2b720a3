"""The CuPy backend: ``kernels/vok_kernels.cuh`` compiled at run time with NVRTC (``RawModule``).

For machines without a build of the extension. The kernels are the compiled backend's own source
(no torch headers in it). They are launched with torch tensors' device pointers on torch's current
stream (an ``ExternalStream`` per torch stream, cached), so there is no copy and no stream mix-up;
grids and arguments are those of ``kernels/vok_torch.cu``.

Sources: ``$VLLM_OMNI_KERNELS_SOURCES`` (a directory), else ``kernels/`` of the source checkout.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from .gather_jobs import GATHER_THREADS, gather_row_blocks

RING_THREADS, RING_PER_THREAD = 256, 8
_SOURCE = "vok_kernels.cuh"


def _source_dir() -> Path:
    env = os.environ.get("VLLM_OMNI_KERNELS_SOURCES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "kernels"


@functools.cache
def load() -> str | None:
    """None when usable, else why not."""
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'vllm-omni-kernels[cupy]')"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not (_source_dir() / _SOURCE).is_file():
        return f"kernel source {_source_dir() / _SOURCE} not found (set VLLM_OMNI_KERNELS_SOURCES)"
    return None


@functools.cache
def _module():
    import cupy

    code = (_source_dir() / _SOURCE).read_text()
    return cupy.RawModule(code=code, options=("-std=c++17",))


@functools.cache
def _function(name: str):
    return _module().get_function(name)


_streams: dict[int, object] = {}


def _launch(name: str, grid, block: int, args) -> None:
    import cupy

    ptr = torch.cuda.current_stream().cuda_stream
    stream = _streams.get(ptr)
    if stream is None:
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream for protocol objects; a raw
            warnings.simplefilter("ignore", DeprecationWarning)  # pointer is what torch gives us here
            stream = _streams[ptr] = cupy.cuda.ExternalStream(ptr)
    with stream:
        _function(name)(grid, (block,), args)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _ring_grid(rows: int, max_elems: int) -> tuple[int, int]:
    """The grid of ``kernels/vok_torch.cu`` (at least one block per row: a write with nothing to copy
    still publishes head overrides)."""
    if max_elems > 2**31 - 1:
        raise ValueError("a row of at most 2**31 - 1 elements per launch (the kernels index rows in 32 bits)")
    return max(1, -(-max_elems // (RING_THREADS * RING_PER_THREAD))), rows


def ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems) -> None:
    if rows == 0:
        return
    grid = _ring_grid(rows, max_elems)
    name = f"vok_ring_write_e{arena.element_size()}_{'last' if last else 'dim0'}"
    _launch(name, grid, RING_THREADS, (_ptr(arena), _ptr(state), _ptr(meta), _ptr(src), np.int64(frame_elems),
                                       np.int32(last and frame_elems == 1)))


def ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems) -> None:
    if rows == 0 or max_elems == 0:
        return
    grid = _ring_grid(rows, max_elems)
    name = f"vok_ring_read_e{arena.element_size()}_{'last' if last else 'dim0'}"
    _launch(name, grid, RING_THREADS, (_ptr(arena), _ptr(meta), _ptr(out), np.int64(frame_elems),
                                       np.int32(last and frame_elems == 1)))


def row_gather(fbase, ibase, table, *, width, int_off, grid_rows, align) -> None:
    if grid_rows == 0:
        return
    es = fbase.element_size()
    grid = (grid_rows, gather_row_blocks(width, es))
    name = f"vok_row_gather_e{es}_a{int(align > 1)}"
    _launch(name, grid, GATHER_THREADS, (_ptr(fbase), _ptr(table), _ptr(table), np.int64(width), np.int64(int_off)))
