"""Plain-copy versions of every kernel op (torch, and numpy views on the CPU): the semantics oracle,
and the path for CPU tensors.

The ring copies take exactly what the kernels take (``layout.py``) and loop over rows in Python, so
they read the metadata back to the host, and copy each row's span in at most two runs (the ring
wraps once at most); the row gather copies the blocks of a ``GatherJobs`` directly. That is fine on
the CPU and for tests; the GPU paths never do it. On CPU tensors a run is a numpy view of the
tensor's memory (about a microsecond to make, where ``torch.as_strided`` takes several): the
serving path on a CPU copies every request's chunk this way each step.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, N, POS, SLOT

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # copies are bitwise: any dtype


class _Elements:
    """A tensor's memory from its first element on, addressed by element offsets as the kernels
    address it (its own strides play no part). For a CPU tensor whose element size numpy has an
    integer for, ``np`` is the same bytes as a 1-D numpy array (None otherwise)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.np = None
        bits = _BITS.get(t.element_size())
        if t.device.type == "cpu" and bits is not None:
            size = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
            if size == t.numel() and t.is_contiguous():  # the tensor is the rest of its storage
                self.np = t.detach().reshape(-1).view(bits).numpy()
                return
            flat = torch.as_strided(t.detach(), (size,), (1,), t.storage_offset()) if size > 0 else \
                torch.empty(0, dtype=t.dtype)  # (an empty tensor may start past its storage's end)
            self.np = flat.view(bits).numpy()

    def run(self, offset: int, start: int, frames: int, frame_elems: int, stride: int, last: bool):
        """A view of ``frames`` frames from frame ``start`` of the span at element ``offset`` whose
        lead rows (CONCAT_LAST: ``[frame, time]``) or frames (CONCAT_DIM0: ``[time, frame]``) are
        ``stride`` elements apart: numpy where ``np`` is, else torch."""
        if last:
            shape, strides, at = (frame_elems, frames), (stride, 1), offset + start
        else:
            shape, strides, at = (frames, frame_elems), (stride, 1), offset + start * stride
        if self.np is None:
            return torch.as_strided(self.t, shape, strides, self.t.storage_offset() + at)
        size = self.np.itemsize
        return np.ndarray(shape, self.np.dtype, self.np, at * size, (strides[0] * size, size))


def _copy(arena: _Elements, lin: _Elements, row, pos: int, frame_elems: int, last: bool, into_ring: bool) -> None:
    """Copy the row's span of N frames between its ring region (from ring frame ``pos``) and ``lin``
    (from LIN_OFF), in at most two runs: the ring wraps once at most. The arena and ``lin`` share
    dtype and device. Where both sides of a run are contiguous elements (one channel, or frames
    back to back) and numpy sees them, the run is a copy between two numpy slices."""
    n, cap, stride = row[N], row[CAP], row[LIN_STRIDE]
    first = min(n, cap - pos)
    contiguous = arena.np is not None and (frame_elems == 1 if last else stride == frame_elems)
    for ring_at, lin_at, k in ((pos, 0, first), (0, first, n - first)):
        if not k:
            continue
        if contiguous:
            r, f, m = row[BASE] + ring_at * frame_elems, row[LIN_OFF] + lin_at * frame_elems, k * frame_elems
            if into_ring:
                arena.np[r:r + m] = lin.np[f:f + m]
            else:
                lin.np[f:f + m] = arena.np[r:r + m]
            continue
        ring = arena.run(row[BASE], ring_at, k, frame_elems, cap if last else frame_elems, last)
        flat = lin.run(row[LIN_OFF], lin_at, k, frame_elems, stride, last)
        dst, src = (ring, flat) if into_ring else (flat, ring)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src)
        else:
            dst.copy_(src)


def _rows(meta: torch.Tensor, rows: int) -> list[list[int]]:
    """The launch's metadata rows as Python ints (through numpy: about twice as fast as torch's ``tolist``)."""
    head = meta[:rows]
    return (head.numpy() if head.device.type == "cpu" else head.cpu().numpy()).tolist()


def ring_write(arena, state, meta, src, *, rows: int, frame_elems: int, last: bool) -> None:
    """Copy each row's chunk from ``src`` into its ring region at the head; advance the head. The
    heads are read and written in place through numpy (a CPU ``state``) or a host copy of it."""
    table = _rows(meta, rows)
    if not table:
        return
    host = state if state.device.type == "cpu" else state.cpu()
    heads = host.numpy()
    ring, lin = _Elements(arena), _Elements(src)
    for row in table:
        n, cap, slot = row[N], row[CAP], row[SLOT]
        pos = row[POS] if row[POS] >= 0 else int(heads[slot]) >> HEAD_SHIFT
        if n:
            _copy(ring, lin, row, pos, frame_elems, last, into_ring=True)
        heads[slot] = ((pos + n) % cap) << HEAD_SHIFT
    if host is not state:
        state.copy_(host)


def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool) -> None:
    """Copy each row's ring span starting at POS into ``out`` at LIN_OFF (contiguous per row)."""
    ring, lin = _Elements(arena), _Elements(out)
    for row in _rows(meta, rows):
        if row[N]:
            _copy(ring, lin, row, row[POS], frame_elems, last, into_ring=False)


def row_gather(jobs) -> None:
    """Carry out every job of a ``GatherJobs`` with plain torch copies (the gather's oracle).

    Jobs write disjoint rows, so their order does not matter; int rows convert exactly between int32
    and int64 (values in int32 range when narrowing).
    """
    for blocks in (jobs.float_blocks, jobs.int_blocks):
        for src, src_rows, dst, dst_rows in blocks:
            if type(src) is list:  # rows_each / ints_each: each source's rows from its start row on
                for s, d in zip(src, dst_rows.tolist()):
                    dst[d:d + s.shape[0]].copy_(s.reshape(dst[d:d + s.shape[0]].shape))
                continue
            if isinstance(dst_rows, int):
                dst[dst_rows].copy_(src[src_rows])
                continue
            rows_in = torch.arange(len(dst_rows)) if src_rows is None else torch.from_numpy(src_rows)
            picked = src.index_select(0, rows_in.to(src.device)).to(dst.dtype)
            dst.index_copy_(0, torch.from_numpy(dst_rows).to(dst.device), picked)
    for dst, values in jobs.value_blocks:
        dst.copy_(torch.from_numpy(values).to(dst.dtype))
