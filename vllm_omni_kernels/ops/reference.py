"""Plain-copy versions of every kernel op (torch, and numpy views on the CPU): the semantics oracle,
and the path for CPU tensors.

The ring copies take exactly what the kernels take (``layout.py``), read the metadata back to the
host, and copy each row's span in at most two runs (the ring wraps once at most); the row gather
copies the blocks of a ``GatherJobs`` directly. The GPU paths never do this; the serving path on a
CPU does, every step: there a launch's runs are computed for all rows at once with numpy and each
is one copy between numpy slices of the tensors' memory (a tenth of a microsecond for a frame of
audio, where a strided view of either side costs several), and only spans with strided elements
(CONCAT_LAST with channels, CONCAT_DIM0 sources with padded frames) go row by row through views.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, N, POS, SLOT

# the integer of each element size the kernels copy (a complex one, say, goes as its bits); the
# reference copies bitwise too, through these where numpy has them, any dtype otherwise
ELEMENT_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Elements:
    """A tensor's memory from its first element on, addressed by element offsets as the kernels
    address it (its own strides play no part). For a CPU tensor whose element size numpy has an
    integer for, ``np`` is the same bytes as a 1-D numpy array (None otherwise)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.np = None
        bits = ELEMENT_BITS.get(t.element_size())
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
    (from LIN_OFF), in at most two runs (the ring wraps once at most), through strided views. The
    arena and ``lin`` share dtype and device."""
    n, cap, stride = row[N], row[CAP], row[LIN_STRIDE]
    first = min(n, cap - pos)
    for ring_at, lin_at, k in ((pos, 0, first), (0, first, n - first)):
        if not k:
            continue
        ring = arena.run(row[BASE], ring_at, k, frame_elems, cap if last else frame_elems, last)
        flat = lin.run(row[LIN_OFF], lin_at, k, frame_elems, stride, last)
        dst, src = (ring, flat) if into_ring else (flat, ring)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src)
        else:
            dst.copy_(src)


def _copy_rows(arena: _Elements, lin: _Elements, m: np.ndarray, pos: np.ndarray, frame_elems: int, last: bool,
               into_ring: bool) -> None:
    """Copy every row's span (``_copy``). Where a span's elements lie back to back on both sides (one
    channel, or frames back to back in ``lin``) and numpy sees both tensors, the two runs of every
    row are computed at once and each is one copy between numpy slices."""
    F = frame_elems
    if arena.np is None or lin.np is None or (F != 1 if last else (m[:, LIN_STRIDE] != F).any()):
        for row, p in zip(m.tolist(), pos.tolist()):
            if row[N]:
                _copy(arena, lin, row, p, F, last, into_ring)
        return
    first = np.minimum(m[:, N], m[:, CAP] - pos)
    ring0, lin0, k0 = m[:, BASE] + pos * F, m[:, LIN_OFF], first * F  # up to the ring's end
    ring1, lin1, k1 = m[:, BASE], lin0 + k0, (m[:, N] - first) * F  # the rest, from the ring's start
    ring, flat = (arena.np, ring0, ring1), (lin.np, lin0, lin1)
    (dst, dst0, dst1), (src, src0, src1) = (ring, flat) if into_ring else (flat, ring)
    for d0, s0, c0, d1, s1, c1 in zip(dst0.tolist(), src0.tolist(), k0.tolist(), dst1.tolist(), src1.tolist(),
                                      k1.tolist()):
        dst[d0:d0 + c0] = src[s0:s0 + c0]
        if c1:
            dst[d1:d1 + c1] = src[s1:s1 + c1]


def _meta(meta: torch.Tensor, rows: int) -> np.ndarray:
    """The launch's metadata rows as an int64 numpy array (read back from the device if needed)."""
    head = meta[:rows]
    return head.numpy() if head.device.type == "cpu" else head.cpu().numpy()


@torch.compiler.disable  # (bit copies through numpy views: a compiler tracing them made value conversions of them)
def ring_write(arena, state, meta, src, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    """Copy each row's chunk from ``src`` into its ring region at the head; advance the head. The
    heads are read and written in place through numpy (a CPU ``state``) or a host copy of it.
    ``max_elems`` (the kernels' grid size) is ignored."""
    m = _meta(meta, rows)
    if not len(m):
        return
    host = state if state.device.type == "cpu" else state.cpu()
    heads = host.numpy()
    slots = m[:, SLOT]
    pos = np.where(m[:, POS] >= 0, m[:, POS], heads[slots] >> HEAD_SHIFT)
    _copy_rows(_Elements(arena), _Elements(src), m, pos, frame_elems, last, into_ring=True)
    heads[slots] = ((pos + m[:, N]) % m[:, CAP]) << HEAD_SHIFT
    if host is not state:
        state.copy_(host)


@torch.compiler.disable
def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool, max_elems: int) -> None:
    """Copy each row's ring span starting at POS into ``out`` at LIN_OFF (contiguous per row);
    ``max_elems`` as in ``ring_write``."""
    m = _meta(meta, rows)
    if len(m):
        _copy_rows(_Elements(arena), _Elements(out), m, m[:, POS], frame_elems, last, into_ring=False)


@torch.compiler.disable
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
