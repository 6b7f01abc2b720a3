"""The ring's one planner: the metadata rows (``ops/layout.py``) of a write or read launch, made with
numpy from a pool's host table into a staging buffer. Every backend launches from these rows.

The pool's table has one row per slot, laid out like a metadata row: SLOT, BASE, CAP and POS (-1:
"the kernel reads the device head"; a new or grown slot's head override until a write has used it)
are the slot's own, UNREAD is the host mirror of its unread frames. A launch's rows start as one
gather of the table (``np.take``), then get the launch's own columns.
"""

from __future__ import annotations

import numpy as np

from ..ops.layout import LIN_OFF, LIN_STRIDE, N, POS, UNREAD


def plan_write(table: np.ndarray, slots: np.ndarray, n: np.ndarray, lin_off, lin_stride, out: np.ndarray) -> int:
    """Rows of a write of ``n[b]`` frames of the linear tensor (request b's chunk from element
    ``lin_off[b]``, rows ``lin_stride`` apart) into ``slots[b]``, into ``out[:B]``. Returns the
    largest ``n`` (the grid's size); the caller has checked that every chunk fits."""
    rows = out[:len(slots)]
    np.take(table, slots, axis=0, out=rows)
    rows[:, LIN_OFF] = lin_off
    rows[:, N] = n
    rows[:, LIN_STRIDE] = lin_stride
    return int(n.max()) if len(n) else 0


def plan_read(table: np.ndarray, slots: np.ndarray, tail: np.ndarray, frame_elems: int, last: bool,
              out: np.ndarray, frames: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a read of every slot's unread span (from its ``tail``; its first ``frames[b]`` frames
    at most, when given) back to back into a linear tensor, into ``out[:B]``. Returns each span's
    element offset there and its frames."""
    rows = out[:len(slots)]
    np.take(table, slots, axis=0, out=rows)
    n = rows[:, UNREAD].copy() if frames is None else np.minimum(rows[:, UNREAD], frames)
    starts = np.zeros(len(slots), np.int64)
    np.cumsum(n[:-1] * frame_elems, out=starts[1:])
    rows[:, LIN_OFF] = starts
    rows[:, N] = n
    rows[:, POS] = tail
    rows[:, LIN_STRIDE] = n if last else frame_elems  # a span's lead rows are n apart
    return starts, n
