"""The compiled CUDA C++ backend: the extension module ``_vok_ops`` built from ``kernels/``.

The extension (``_vok_ops*.so``, built by CMakeLists.txt through setup.py or by hand) is a Python
module. Importing it registers ``torch.ops.vllm_omni_kernels.{ring_write, ring_read, row_gather}``
with ``TORCH_LIBRARY`` (def + impl: the dispatcher's direct path); this module registers their fake
implementations so ``torch.compile`` can trace callers, and exposes the same launch functions as
``triton_ring``/``triton_gather``. The eager hot paths skip the dispatcher, whose argument handling
costs more than the rest of a step: ``ring_step`` (a pool's append step, checked, planned and
launched in one call) and ``gather_step`` (a gather's table encoded from its job blocks and launched
in one call) make the module's own step objects (``kernels/vok_python.cpp``).

Search order: ``$VLLM_OMNI_KERNELS_EXT`` (a path to the .so), the package directory, ``build/`` of
a source checkout.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

_PKG = Path(__file__).resolve().parents[1]
_module = None  # the extension module, once loaded


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
    global _module
    try:
        _module = import_extension(paths[0])
    except ImportError as exc:
        return f"cannot load {paths[0]}: {exc}"
    _register_fakes()
    from . import pdl

    setter = getattr(_module, "set_programmatic_launch", None)  # absent from builds before it existed
    if setter is not None:
        setter(pdl.enabled())  # the one setting (ops.set_programmatic_launch)
    return None


def import_extension(path: Path):
    """Import the extension module at ``path`` (which registers its torch ops); one per process."""
    spec = importlib.util.spec_from_file_location("vllm_omni_kernels._vok_ops", path)
    if spec is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _register_fakes() -> None:
    """Every op mutates its arguments and returns nothing, so the fake implementations do nothing."""
    for name in ("ring_write", "ring_read", "row_gather"):
        qual = f"vllm_omni_kernels::{name}"
        try:
            torch.library.register_fake(qual)(lambda *args, **kwargs: None)
        except RuntimeError:  # already registered (a second load in one process)
            pass


def programmatic_launch() -> bool | None:
    """Whether the extension launches with programmatic dependent launch (on devices that support
    it: Hopper and newer); None when it is not loaded. ``ops.set_programmatic_launch`` sets it."""
    return None if _module is None else bool(_module.programmatic_launch())


def ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems) -> None:
    torch.ops.vllm_omni_kernels.ring_write(arena, state, meta, src, rows, frame_elems, last, max_elems)


def ring_step(arena, state, table, frame_shape, last):
    """A pool's one-call append step (``ops.ring_step`` has the contract)."""
    return _module.RingStep(arena, state, table, list(frame_shape), last)


def ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems) -> None:
    torch.ops.vllm_omni_kernels.ring_read(arena, meta, out, rows, frame_elems, last, max_elems)


def gather_step(anchor, width, capacity):
    """A gather's one-call launch step (``ops.gather_step`` has the contract)."""
    return _module.GatherStep(anchor, width, capacity.float_cap, capacity.int_cap, capacity.payload_cap)


def row_gather(fbase, ibase, table, *, width, int_off, grid_rows, align) -> None:
    torch.ops.vllm_omni_kernels.row_gather(fbase, table, width, int_off, grid_rows, align > 1)
