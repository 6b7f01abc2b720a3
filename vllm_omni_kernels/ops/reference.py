"""Pure-torch versions of every kernel op: the semantics oracle, and the path for CPU tensors.

The ring copies take exactly what the kernels take (``layout.py``) and loop over rows in Python, so
they read the metadata back to the host, and copy each row's span in at most two runs (the ring
wraps once at most); the row gather copies the blocks of a ``GatherJobs`` directly. That is fine on
the CPU and for tests; the GPU paths never do it.
"""

from __future__ import annotations

import torch

from .layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, N, POS, SLOT


def _views(arena, lin, row, frame_elems, last):
    """(ring region, the row's span of ``lin``), both as ``[frame, time]`` (CONCAT_LAST) or
    ``[time, frame]`` (CONCAT_DIM0)."""
    n, base, cap = row[N], row[BASE], row[CAP]
    region = arena.narrow(0, base, cap * frame_elems)
    offset = lin.storage_offset() + row[LIN_OFF]  # LIN_OFF counts from lin's first element, as in the kernels
    if last:
        ring = region.view(frame_elems, cap)
        flat = torch.as_strided(lin, (frame_elems, n), (row[LIN_STRIDE], 1), offset)
    else:
        ring = region.view(cap, frame_elems)
        flat = torch.as_strided(lin, (n, frame_elems), (row[LIN_STRIDE], 1), offset)
    return ring, flat


def _pieces(pos: int, n: int, cap: int):
    """The span of ``n`` ring frames from ``pos`` as at most two runs: (ring start, span start, frames)."""
    first = min(n, cap - pos)
    return [(pos, 0, first)] + ([(0, first, n - first)] if n > first else [])


def _copy_runs(ring, flat, pos: int, n: int, cap: int, last: bool, into_ring: bool) -> None:
    """Copy the span of ``n`` frames between the ring (from ``pos``) and ``flat`` (from 0)."""
    axis = 1 if last else 0
    for r0, s0, k in _pieces(pos, n, cap):
        run, span = ring.narrow(axis, r0, k), flat.narrow(axis, s0, k)
        if into_ring:
            run.copy_(span)
        else:
            span.copy_(run)


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
            ring, flat = _views(arena, src, row, frame_elems, last)
            _copy_runs(ring, flat, pos, n, cap, last, into_ring=True)
        heads[slot] = ((pos + n) % cap) << HEAD_SHIFT
    state.copy_(torch.tensor(heads, dtype=state.dtype))


def ring_read(arena, meta, out, *, rows: int, frame_elems: int, last: bool) -> None:
    """Copy each row's ring span starting at POS into ``out`` at LIN_OFF (contiguous per row)."""
    for row in meta[:rows].tolist():
        if row[N]:
            ring, flat = _views(arena, out, row, frame_elems, last)
            _copy_runs(ring, flat, row[POS], row[N], row[CAP], last, into_ring=False)


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
