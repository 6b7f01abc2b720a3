"""The CuPy backend: ``vllm_omni_kernels/kernels/vok_kernels.cuh`` (package data) compiled at run time
with NVRTC, for machines without a build of the extension. The kernels are the compiled backend's
own source, with the same definitions (``layout.cuda_defines``), launched with torch tensors' device
pointers on torch's current stream (an ``ExternalStream`` per torch stream: no copy, no stream
mix-up), with the grids of ``vok_torch.cu`` beside it.

Sources: ``$VLLM_OMNI_KERNELS_SOURCES`` (a directory), else the package's ``kernels/``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from .layout import GATHER_THREADS, RING_PER_THREAD, RING_THREADS, cuda_defines, gather_row_blocks

_SOURCE = "vok_kernels.cuh"


def _source_dir() -> Path:
    env = os.environ.get("VLLM_OMNI_KERNELS_SOURCES")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "kernels"


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
def _function(name: str):
    import cupy

    code = (_source_dir() / _SOURCE).read_text()
    return cupy.RawModule(code=code, options=("-std=c++17", *cuda_defines())).get_function(name)


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
    if max_elems > 2**31 - 1:
        raise ValueError("a row of at most 2**31 - 1 elements per launch (the kernels index rows in 32 bits)")
    return max(1, -(-max_elems // (RING_THREADS * RING_PER_THREAD))), rows


def ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems) -> None:
    if rows:
        _launch(f"vok_ring_write_e{arena.element_size()}", _ring_grid(rows, max_elems), RING_THREADS,
                (_ptr(arena), _ptr(state), _ptr(meta), _ptr(src), np.int64(frame_elems), np.int32(last)))


def ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems) -> None:
    if rows and max_elems:
        _launch(f"vok_ring_read_e{arena.element_size()}", _ring_grid(rows, max_elems), RING_THREADS,
                (_ptr(arena), _ptr(meta), _ptr(out), np.int64(frame_elems), np.int32(last)))


def row_gather(base, table, outputs, *, width, grid_rows, aligned) -> None:
    if grid_rows:
        es = base.element_size()
        _launch(f"vok_row_gather_e{es}_a{int(aligned)}", (grid_rows, gather_row_blocks(width, es)), GATHER_THREADS,
                (_ptr(base), _ptr(table), np.int64(width)))
