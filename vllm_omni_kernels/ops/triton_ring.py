"""Triton ring copies: one launch moves every request's chunk of a step (see ``layout.py``).

Grid: ``(blocks, rows)``, as the CUDA kernels' (a row's programs on the first axis, which may hold
2**31 - 1 of them; the second holds 65535); program ``(b, r)`` copies elements
``[b*BLOCK, (b+1)*BLOCK)`` of row r's ``N*F`` elements. All rows get the same number of programs
(from the largest row) so the grid is fixed for a fixed step shape, which is what CUDA-graph replay
needs.

The write kernel publishes the new head itself (``layout.py`` has the head word). With one program
per row (rows of up to ``SINGLE_MAX`` elements: the usual decode-step chunk) that program reads the
head and stores ``(head + N) % CAP``. With several programs per row, each takes its ticket and reads
the head in one atomic add, and the program that takes the last ticket stores the new head. Source
loads are issued before the head is read, so the two round trips overlap. Nothing else reads the
head in that launch, so a captured graph can be replayed step after step with the head advancing on
the device.

With programmatic dependent launch (``pdl.py``; ``PDL``) a program first waits for the kernel ahead
of it, and lets the next kernel be scheduled once it has issued its loads (as the CUDA kernels do).
Launches go through ``triton_launch.Launcher`` (the compiled kernel, without Triton's per-call dispatch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import layout
from . import pdl
from .triton_launch import Launcher, launch_dependents, wait_previous_grid

# Rows of more than SINGLE_MAX elements: BLOCK elements per program, MULTI_WARPS warps, doubled for a
# launch of at most SMALL_GRID programs (latency-bound: more threads issue the loads sooner).
# Measured on the H200: 1024 x 4 warps best at 64x48000, 1024 x 8 at 8x48000.
BLOCK = 1024
SINGLE_MAX = 4096  # rows up to this many elements are copied by one program each
MULTI_WARPS = 4
SMALL_GRID = 1024
HEAD_SHIFT = tl.constexpr(layout.HEAD_SHIFT)
TICKET_MASK = tl.constexpr((1 << layout.HEAD_SHIFT) - 1)
COLS = tl.constexpr(layout.META_COLS)
SLOT, LIN_OFF, N, BASE, CAP, POS, LIN_STRIDE = (tl.constexpr(getattr(layout, c)) for c in
                                                ("SLOT", "LIN_OFF", "N", "BASE", "CAP", "POS", "LIN_STRIDE"))


@triton.jit
def _lin_offsets(meta_row, e, F, LAST: tl.constexpr, MONO: tl.constexpr):
    """(outer, inner) coordinates of elements ``e`` of a row, their linear-tensor offsets, and the mask;
    none of it depends on the head."""
    n = tl.load(meta_row + N)
    lin_off = tl.load(meta_row + LIN_OFF)
    lin_stride = tl.load(meta_row + LIN_STRIDE)
    mask = e < n * F
    if LAST:
        if MONO:
            outer = tl.zeros_like(e)
            inner = e
        else:
            n_safe = tl.maximum(n, 1).to(tl.int32)
            outer = e // n_safe
            inner = e - outer * n_safe
    else:
        outer = e // F
        inner = e - outer * F
    lin = lin_off + outer.to(tl.int64) * lin_stride + inner
    return outer, inner, lin, mask


@triton.jit
def _ring_index(meta_row, outer, inner, pos, F, LAST: tl.constexpr):
    """Ring-region offsets of (outer, inner) for a span starting at ring frame ``pos``."""
    base = tl.load(meta_row + BASE)
    cap = tl.load(meta_row + CAP)
    if LAST:
        t = pos + inner
        t = tl.where(t >= cap, t - cap, t)
        return base + outer.to(tl.int64) * cap + t
    t = pos + outer
    t = tl.where(t >= cap, t - cap, t)
    return base + t * F + inner


@triton.jit
def _next_head_word(pos, n, cap):
    """The slot's head word after ``n`` frames written from ring frame ``pos`` (ticket 0)."""
    head = pos + n
    return tl.where(head >= cap, head - cap, head) << HEAD_SHIFT


@triton.jit
def _ring_write_kernel(arena_ptr, state_ptr, meta_ptr, src_ptr, F, LAST: tl.constexpr, MONO: tl.constexpr,
                       BLOCK: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        wait_previous_grid()
    blk = tl.program_id(0)
    row = tl.program_id(1)
    meta_row = meta_ptr + row * COLS
    e = blk * BLOCK + tl.arange(0, BLOCK)
    outer, inner, lin, mask = _lin_offsets(meta_row, e, F, LAST, MONO)
    vals = tl.load(src_ptr + lin, mask=mask)  # issued before the head is read: the round trips overlap
    if PDL:
        launch_dependents()
    slot = tl.load(meta_row + SLOT)
    pos = tl.load(meta_row + POS)
    n = tl.load(meta_row + N)
    cap = tl.load(meta_row + CAP)
    if SINGLE:
        if pos < 0:
            pos = tl.load(state_ptr + slot) >> HEAD_SHIFT
        tl.store(arena_ptr + _ring_index(meta_row, outer, inner, pos, F, LAST), vals, mask=mask)
        tl.debug_barrier()  # every warp has used the head (its stores' addresses) before it moves
        tl.store(state_ptr + slot, _next_head_word(pos, n, cap))
    else:
        # One atomic takes the ticket and reads the head word; the program with the last ticket
        # publishes the new head at once (every program of the row has read it by then).
        word = tl.atomic_add(state_ptr + slot, 1, sem="relaxed")
        if pos < 0:
            pos = word >> HEAD_SHIFT
        if (word & TICKET_MASK) == tl.num_programs(0) - 1:
            tl.store(state_ptr + slot, _next_head_word(pos, n, cap))
        tl.store(arena_ptr + _ring_index(meta_row, outer, inner, pos, F, LAST), vals, mask=mask)


@triton.jit
def _ring_read_kernel(arena_ptr, meta_ptr, out_ptr, F,
                      LAST: tl.constexpr, MONO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        wait_previous_grid()
    blk = tl.program_id(0)
    row = tl.program_id(1)
    meta_row = meta_ptr + row * COLS
    pos = tl.load(meta_row + POS)
    e = blk * BLOCK + tl.arange(0, BLOCK)
    outer, inner, lin, mask = _lin_offsets(meta_row, e, F, LAST, MONO)
    vals = tl.load(arena_ptr + _ring_index(meta_row, outer, inner, pos, F, LAST), mask=mask)
    if PDL:
        launch_dependents()
    tl.store(out_ptr + lin, vals, mask=mask)


_write = Launcher(_ring_write_kernel)
_read = Launcher(_ring_read_kernel)


def _shape(max_elems: int, rows: int) -> tuple[int, int, int]:
    """(programs per row, elements per program, warps) for a launch of ``rows`` rows of at most
    ``max_elems`` elements."""
    if max_elems <= SINGLE_MAX:
        block = max(128, triton.next_power_of_2(max_elems))
        return 1, block, 4 if block <= 2048 else 8
    blocks = triton.cdiv(max_elems, BLOCK)
    return blocks, BLOCK, 2 * MULTI_WARPS if rows * blocks <= SMALL_GRID else MULTI_WARPS


def ring_write(arena, state, meta, src, *, rows, frame_elems, last, max_elems) -> None:
    """Launch the write kernel over ``rows`` rows; see ``reference.ring_write`` for the semantics."""
    if rows == 0:
        return
    blocks, block, warps = _shape(max_elems, rows)
    on = pdl.for_tensor(arena)
    _write((blocks, rows), arena, state, meta, src, frame_elems, LAST=last, MONO=last and frame_elems == 1,
           BLOCK=block, SINGLE=blocks == 1, PDL=on, num_warps=warps, launch_pdl=on)


def ring_read(arena, meta, out, *, rows, frame_elems, last, max_elems) -> None:
    """Launch the read kernel over ``rows`` rows; see ``reference.ring_read`` for the semantics."""
    if rows == 0:
        return
    blocks, block, warps = _shape(max_elems, rows)
    on = pdl.for_tensor(arena)
    _read((blocks, rows), arena, meta, out, frame_elems, LAST=last, MONO=last and frame_elems == 1, BLOCK=block,
          PDL=on, num_warps=warps, launch_pdl=on)
