"""One front per kernel operation; each dispatches on the tensors' device and the backend setting.

Ring copies (semantics in ``reference.py``, layout in ``layout.py``):
    ring_write(arena, state, meta, src, rows=, frame_elems=, last=, max_elems=)
    ring_read(arena, meta, out, rows=, frame_elems=, last=, max_elems=)
``max_elems`` is the host-known largest ``N * F`` of the step; it sizes the grid.
"""

from __future__ import annotations

import torch

from .. import backend as _backend
from . import reference
from .layout import META_COLS  # noqa: F401  (re-exported for callers building metadata)


def _impl(device: torch.device):
    name, _ = _backend.select(device)
    if name == "triton":
        from . import triton_ring

        return triton_ring
    return None


def ring_write(arena, state, meta, src, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    """Append each metadata row's chunk of ``src`` into its ring region; advance device heads.

    Shapes: ``arena`` 1-D pool storage, ``state`` int64 [slots, 2], ``meta`` int64 [>=rows, 8],
    ``src`` any contiguous tensor of the arena's dtype (addressed by element offsets). All on one
    device. No host sync on the kernel backends; validation is the caller's (``ring.RingPool``).
    """
    impl = _impl(arena.device)
    if impl is None:
        reference.ring_write(arena, state, meta, src, rows=rows, frame_elems=frame_elems, last=last)
    else:
        impl.ring_write(arena, state, meta, src, rows=rows, frame_elems=frame_elems, last=last,
                        max_elems=max_elems)


def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    """Copy each metadata row's ring span (from POS, N frames) into ``out`` at its LIN_OFF."""
    impl = _impl(arena.device)
    if impl is None:
        reference.ring_read(arena, meta, out, rows=rows, frame_elems=frame_elems, last=last)
    else:
        impl.ring_read(arena, meta, out, rows=rows, frame_elems=frame_elems, last=last, max_elems=max_elems)
