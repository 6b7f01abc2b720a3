"""Pure-torch versions of every kernel op: the semantics oracle, and the path for CPU tensors.

The ring copies take exactly what the kernels take (``layout.py``) and loop over rows in Python, so
they read the metadata back to the host, and copy each row's span in at most two runs (the ring
wraps once at most); the row gather copies the blocks of a ``GatherJobs`` directly. That is fine on
the CPU and for tests; the GPU paths never do it.
"""

from __future__ import annotations

import torch

from .layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, N, POS, SLOT


def _run(t, offset: int, start: int, frames: int, frame_elems: int, stride: int, last: bool):
    """A view of ``frames`` frames from frame ``start`` of the span at element ``offset`` of ``t``
    whose lead rows (CONCAT_LAST: ``[frame, time]``) or frames (CONCAT_DIM0: ``[time, frame]``) are
    ``stride`` elements apart; offsets count from ``t``'s first element, as in the kernels."""
    if last:
        return torch.as_strided(t, (frame_elems, frames), (stride, 1), t.storage_offset() + offset + start)
    return torch.as_strided(t, (frames, frame_elems), (stride, 1), t.storage_offset() + offset + start * stride)


def _copy(arena, lin, row, pos: int, frame_elems: int, last: bool, into_ring: bool) -> None:
    """Copy the row's span of N frames between its ring region (from ring frame ``pos``) and ``lin``
    (from LIN_OFF), in at most two runs: the ring wraps once at most."""
    n, cap = row[N], row[CAP]
    first = min(n, cap - pos)
    for ring_at, lin_at, k in ((pos, 0, first), (0, first, n - first)):
        if k:
            ring = _run(arena, row[BASE], ring_at, k, frame_elems, cap if last else frame_elems, last)
            flat = _run(lin, row[LIN_OFF], lin_at, k, frame_elems, row[LIN_STRIDE], last)
            if into_ring:
                ring.copy_(flat)
            else:
                flat.copy_(ring)


def ring_write(arena, state, meta, src, *, rows: int, frame_elems: int, last: bool) -> None:
    """Copy each row's chunk from ``src`` into its ring region at the head; advance the head. The
    heads are read once and written once per launch."""
    table = meta[:rows].tolist()
    if not table:
        return
    heads = state.tolist()
    for row in table:
        n, cap, slot = row[N], row[CAP], row[SLOT]
        pos = row[POS] if row[POS] >= 0 else heads[slot] >> HEAD_SHIFT
        if n:
            _copy(arena, src, row, pos, frame_elems, last, into_ring=True)
        heads[slot] = ((pos + n) % cap) << HEAD_SHIFT
    state.copy_(torch.tensor(heads, dtype=state.dtype))


def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool) -> None:
    """Copy each row's ring span starting at POS into ``out`` at LIN_OFF (contiguous per row)."""
    for row in meta[:rows].tolist():
        if row[N]:
            _copy(arena, out, row, row[POS], frame_elems, last, into_ring=False)


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
