"""Triton row gather: every record of a table in one launch (``layout.py`` has the table and its
records; ``gather/jobs.py`` makes them).

Grid ``(records, blocks)``: program ``(j, b)`` copies columns ``[b*BLOCK_F, (b+1)*BLOCK_F)`` of record
``j``'s float row, or a strided share of its int elements (a row, or a run of rows), addressed as
offset + row * stride on each side. The record count is read from the table on the device, so a grid
sized for more records (a captured graph replayed with fewer) is correct: the extra programs exit.
Float rows whose starts the host has checked to be 16-byte aligned are copied with vector accesses
(``ALIGN``).

With programmatic dependent launch (``pdl.py``; ``PDL``) a program first waits for the kernel ahead
of it; the gather lets the next kernel start as its programs exit (as the CUDA kernel does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import layout, pdl
from .triton_launch import Launcher, wait_previous_grid

# Elements of a float row per program and warps per program: 2048 and 4 were the best or within 5%
# of it for MTP and non-MTP steps at B=1024, H=4096, bf16 on the H200; 8 or 16 warps lose 10-40%.
MAX_BLOCK_F = 2048
ELEMS_PER_WARP = 512
MAX_WARPS = 4
BLOCK_I = layout.RUN_ELEMS  # int elements per program at once: a run record in one round trip
ROW_WORDS = tl.constexpr(layout.ROW_WORDS)
R_SRC = tl.constexpr(layout.R_SRC)
R_SRC_STRIDE = tl.constexpr(layout.R_SRC_STRIDE)
R_SRC_ROW = tl.constexpr(layout.R_SRC_ROW)
R_DST = tl.constexpr(layout.R_DST)
R_DST_STRIDE = tl.constexpr(layout.R_DST_STRIDE)
R_DST_ROW = tl.constexpr(layout.R_DST_ROW)
R_WORD = tl.constexpr(layout.R_WORD)
JOB_INT = tl.constexpr(layout.JOB_INT)
INT_SRC64 = tl.constexpr(layout.INT_SRC64)
INT_DST64 = tl.constexpr(layout.INT_DST64)


@triton.jit
def _row_gather_kernel(fbase, ibase, table, W, BLOCK_F: tl.constexpr, BLOCK_I: tl.constexpr,
                       ALIGN: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        wait_previous_grid()
    job = tl.program_id(0).to(tl.int64)  # (times ROW_WORDS: past 2^31 words at 3e8 records)
    blk = tl.program_id(1)
    if job < tl.load(table):
        rec = table + 1 + job * ROW_WORDS
        src = tl.load(rec + R_SRC) + tl.load(rec + R_SRC_ROW) * tl.load(rec + R_SRC_STRIDE)
        dst = tl.load(rec + R_DST) + tl.load(rec + R_DST_ROW) * tl.load(rec + R_DST_STRIDE)
        word = tl.load(rec + R_WORD)
        count = word & 0xFFFFFFFF
        kind = word >> 32
        if (kind & JOB_INT) == 0:
            if ALIGN > 1:  # the host checked every row start: lets the compiler use 16-byte accesses
                src = tl.multiple_of(src, ALIGN)
                dst = tl.multiple_of(dst, ALIGN)
            cols = blk * BLOCK_F + tl.arange(0, BLOCK_F)
            m = cols < W
            tl.store(fbase + dst + cols, tl.load(fbase + src + cols, mask=m), mask=m)
        else:
            s_wide = (kind & INT_SRC64) != 0
            d_wide = (kind & INT_DST64) != 0
            s_step = 1 + s_wide.to(tl.int64)
            d_step = 1 + d_wide.to(tl.int64)
            for start in range(blk * BLOCK_I, count, tl.num_programs(1) * BLOCK_I):
                e = start + tl.arange(0, BLOCK_I)
                m = e < count
                lo = tl.load(ibase + src + e * s_step, mask=m, other=0)
                hi = tl.load(ibase + src + 2 * e + 1, mask=m & s_wide, other=0)
                hi = tl.where(s_wide, hi, lo >> 31)  # int32 source: sign-extend
                tl.store(ibase + dst + e * d_step, lo, mask=m)
                tl.store(ibase + dst + 2 * e + 1, hi, mask=m & d_wide)


_gather = Launcher(_row_gather_kernel)


def block_f(width: int) -> int:
    return min(MAX_BLOCK_F, triton.next_power_of_2(max(int(width), 16)))


def row_gather(base, table, outputs, *, width: int, grid_rows: int, aligned: bool) -> None:
    """Launch the gather over ``grid_rows`` records (>= the table's count) from ``base`` (the
    anchor, at least 4 bytes: float offsets in its elements, int offsets in int32 words from its
    address). ``outputs`` (the tensors the records write) only document the launch here."""
    if grid_rows == 0:
        return
    bf = block_f(width)
    blocks = triton.cdiv(max(int(width), 1), bf)
    warps = max(1, min(MAX_WARPS, bf // ELEMS_PER_WARP))
    on = pdl.for_tensor(base)
    _gather((grid_rows, blocks), base, base.view(torch.int32), table, width, BLOCK_F=bf, BLOCK_I=BLOCK_I,
            ALIGN=16 // base.element_size() if aligned else 1, PDL=on, num_warps=warps, launch_pdl=on)
