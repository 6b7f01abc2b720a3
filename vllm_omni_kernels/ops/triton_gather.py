"""Triton row gather: every job of a ``GatherJobs`` table in one launch (see ``gather_jobs.py``).

Float rows whose starts the host has checked to be 16-byte aligned (``GatherJobs.aligned``) are
copied with vector accesses (``ALIGN``); others element by element.

Grid ``(jobs, blocks)``: program ``(j, b)`` copies columns ``[b*BLOCK_F, (b+1)*BLOCK_F)`` of float
job ``j``, or a strided share of int job ``j``'s elements. The job counts are read from the table on
the device, so a grid sized for more jobs (a captured graph replayed with fewer) is correct: the
extra programs exit.

With programmatic dependent launch (``pdl.py``; ``PDL``) a program first waits for the kernel ahead
of it; the gather lets the next kernel start as its programs exit (as the CUDA kernel does).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import pdl
from .triton_gdc import wait_previous_grid

# Elements of a float row per program and warps per program: 2048 and 4 were the best or within 5%
# of it for MTP and non-MTP steps at B=1024, H=4096, bf16 on the H200 (sweep_gather.py); 8 or 16
# warps lose 10-40%. Smaller blocks keep about 16 elements per thread.
MAX_BLOCK_F = 2048
ELEMS_PER_WARP = 512
MAX_WARPS = 4
BLOCK_I = 128


@triton.jit
def _row_gather_kernel(fbase, ibase, table, W, I_OFF, BLOCK_F: tl.constexpr, BLOCK_I: tl.constexpr,
                       ALIGN: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        wait_previous_grid()
    job = tl.program_id(0)
    blk = tl.program_id(1)
    n_float = tl.load(table)
    n_int = tl.load(table + 1)
    if job < n_float:
        src = tl.load(table + 2 + 2 * job)
        dst = tl.load(table + 3 + 2 * job)
        if ALIGN > 1:  # the host checked every row start: lets the compiler use 16-byte accesses
            src = tl.multiple_of(src, ALIGN)
            dst = tl.multiple_of(dst, ALIGN)
        cols = blk * BLOCK_F + tl.arange(0, BLOCK_F)
        m = cols < W
        tl.store(fbase + dst + cols, tl.load(fbase + src + cols, mask=m), mask=m)
    elif job < n_float + n_int:
        # two words: offsets in the low 48 bits (signed), flags and count in the top 16
        rec = table + I_OFF + 2 * (job - n_float)
        w0 = tl.load(rec)
        w1 = tl.load(rec + 1)
        src = (w0 << 16) >> 16
        dst = (w1 << 16) >> 16
        flags = (w0 >> 48) & 7
        n = (w1 >> 48) & 0xFFFF
        # flag 4 (a payload in the table) needs nothing here: this kernel's int base is the table
        s_wide = (flags & 1) != 0
        d_wide = (flags & 2) != 0
        s_step = 1 + (flags & 1)
        d_step = 1 + ((flags >> 1) & 1)
        for start in range(blk * BLOCK_I, n, tl.num_programs(1) * BLOCK_I):
            e = start + tl.arange(0, BLOCK_I)
            m = e < n
            lo = tl.load(ibase + src + e * s_step, mask=m, other=0)
            hi = tl.load(ibase + src + 2 * e + 1, mask=m & s_wide, other=0)
            hi = tl.where(s_wide, hi, lo >> 31)  # int32 source: sign-extend
            tl.store(ibase + dst + e * d_step, lo, mask=m)
            tl.store(ibase + dst + 2 * e + 1, hi, mask=m & d_wide)


def block_f(width: int) -> int:
    return min(MAX_BLOCK_F, triton.next_power_of_2(max(int(width), 16)))


def row_gather(fbase, ibase, table, *, width: int, int_off: int, grid_rows: int, align: int) -> None:
    """Launch the gather over ``grid_rows`` jobs (>= the table's job count). ``align``: every float
    offset is a multiple of it (1: no promise)."""
    bf = block_f(width)
    blocks = triton.cdiv(max(int(width), 1), bf)
    warps = max(1, min(MAX_WARPS, bf // ELEMS_PER_WARP))
    on = pdl.for_tensor(fbase)
    _row_gather_kernel[(grid_rows, blocks)](fbase, ibase, table, width, int_off, BLOCK_F=bf, BLOCK_I=BLOCK_I,
                                            ALIGN=align, PDL=on, num_warps=warps, launch_pdl=on)
