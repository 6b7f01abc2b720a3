"""What the host and every kernel agree on, written once: the ring's metadata row and head word, the
gather's row record, and the kernels' block shapes.

The Triton kernels and the host code import these names; the CUDA C++ kernels get them as
``-DVOK_...`` definitions (``cuda_defines()``): CMake asks ``python -m vllm_omni_kernels.ops.layout``
for them, CuPy passes them to NVRTC, and ``vllm_omni_kernels/kernels/vok_kernels.cuh`` refuses to compile without them.

Ring metadata: int64 ``[rows, META_COLS]``, one row per request of a launch (element offsets, never
bytes, so pools larger than 2**31 elements work):

    SLOT        the slot's index in ``state`` (one head word per slot)
    LIN_OFF     element offset of the request's first element in the linear tensor (source or output)
    N           frames to copy (0 allowed)
    BASE        element offset of the slot's region in the arena
    CAP         the region's capacity in frames
    POS         first ring frame; for writes -1 means "the device head of SLOT"
    LIN_STRIDE  elements between consecutive lead rows (CONCAT_LAST) or frames (CONCAT_DIM0) in the
                linear tensor
    (column 7 is the host's: the slot's unread frames in the pool's table; the kernels ignore it)

Region layout in the arena, F = elements per frame: CONCAT_DIM0 ``[CAP, F]`` row-major (frame t at
``BASE + t*F``); CONCAT_LAST ``[F, CAP]`` (channel c, sample t at ``BASE + c*CAP + t``). A request's
chunk in the linear tensor: CONCAT_DIM0 frame j, element f at ``LIN_OFF + j*LIN_STRIDE + f``;
CONCAT_LAST channel c, sample j at ``LIN_OFF + c*LIN_STRIDE + j``.

``state``: int64 ``[slots]``, one word per slot, ``head << HEAD_SHIFT | ticket``. The head is the next
frame to write; the ticket counts the programs of a write launch that have read the head: each takes
its ticket and reads the head in one atomic add, and the one with the last ticket stores the new
head with ticket 0. No program can read the head after it moved, and nobody waits for the update.

Gather table: int64 words. Word 0 is the record count R, one program's work each (a grid of more
programs than R: the extra ones exit); record r is the ``GATHER_ROW`` at words ``1 + 7*r .. 7 + 7*r``;
the int32 values that value rows copy follow the records. A record names one row copy: its source and
destination as a tensor's offset, row stride and row (``src + src_row * src_stride``; a row of many
sources has its own offset, stride 1), ``count`` elements and the ``kind``. Every offset counts
from the launch's one base pointer (the gather's anchor tensor): float rows in elements of the
launch's float dtype, int rows in int32 words (a value row's source is its values in the table,
whose address the encoder knows). A float row copies the launch's row width; an int row ``count``
elements, each int32 or int64 on either side (``INT_SRC64``, ``INT_DST64``), and int rows that lie
end to end on both sides go as runs: a record of up to ``RUN_ELEMS`` elements from its first rows.
A block of rows recorded with one call shares everything but the two rows, so the encoder writes a
block with one broadcast and its two row lists, and the device does the address arithmetic.
"""

from __future__ import annotations

import sys

import numpy as np

META_COLS = 8
SLOT, LIN_OFF, N, BASE, CAP, POS, LIN_STRIDE, UNREAD = range(META_COLS)
HEAD_SHIFT = 24  # ticket bits: a row has at most 2**31 / 2048 programs; heads up to 2**39 frames

GATHER_ROW = np.dtype([("src", "<i8"), ("src_stride", "<i8"), ("src_row", "<i8"), ("dst", "<i8"),
                       ("dst_stride", "<i8"), ("dst_row", "<i8"), ("count", "<i4"), ("kind", "<i4")])
ROW_WORDS = GATHER_ROW.itemsize // 8
R_SRC, R_SRC_STRIDE, R_SRC_ROW, R_DST, R_DST_STRIDE, R_DST_ROW, R_WORD = range(ROW_WORDS)  # R_WORD: count | kind << 32
JOB_FLOAT, JOB_INT = 0, 1  # kind, plus for int rows the flags below
INT_SRC64, INT_DST64 = 2, 4

# Block shapes of the CUDA kernels (the Triton ones choose theirs in triton_ring / triton_gather).
RING_THREADS, RING_PER_THREAD = 256, 8  # a ring block copies RING_THREADS * RING_PER_THREAD elements
GATHER_THREADS, GATHER_BLOCK_BYTES = 128, 4096  # a float row is copied in blocks of GATHER_BLOCK_BYTES
# int elements a gather thread loads before it stores (a run record: one round trip); 4 beat 2, 8 and 16
# by 2 to 30% for MTP and mixed steps at B = 256 and 1024 on the H200
GATHER_INT_PER_THREAD = 4
RUN_ELEMS = GATHER_THREADS * GATHER_INT_PER_THREAD  # int elements per record of a run of rows


def gather_row_blocks(width: int, elem_size: int) -> int:
    """Blocks per float row of ``width`` elements (grid.y of a CUDA gather launch)."""
    return max(1, -(-width * elem_size // GATHER_BLOCK_BYTES))


def cuda_defines() -> list[str]:
    """The ``-D`` definitions ``vllm_omni_kernels/kernels/vok_kernels.cuh`` is compiled with."""
    values = {"META_COLS": META_COLS, "SLOT": SLOT, "LIN_OFF": LIN_OFF, "N": N, "BASE": BASE, "CAP": CAP,
              "POS": POS, "LIN_STRIDE": LIN_STRIDE, "HEAD_SHIFT": HEAD_SHIFT, "ROW_WORDS": ROW_WORDS,
              "R_SRC": R_SRC, "R_SRC_STRIDE": R_SRC_STRIDE, "R_SRC_ROW": R_SRC_ROW, "R_DST": R_DST,
              "R_DST_STRIDE": R_DST_STRIDE, "R_DST_ROW": R_DST_ROW, "R_WORD": R_WORD, "JOB_INT": JOB_INT,
              "INT_SRC64": INT_SRC64, "INT_DST64": INT_DST64,
              "RING_THREADS": RING_THREADS, "RING_PER_THREAD": RING_PER_THREAD, "GATHER_THREADS": GATHER_THREADS,
              "GATHER_BLOCK_BYTES": GATHER_BLOCK_BYTES, "GATHER_INT_PER_THREAD": GATHER_INT_PER_THREAD}
    return [f"-DVOK_{k}={v}" for k, v in values.items()]


# the kernels read the record by word (count | kind << 32 in one): the names above are the dtype's words
assert [GATHER_ROW.fields[f][1] // 8 for f in ("src", "src_stride", "src_row", "dst", "dst_stride", "dst_row",
                                               "count")] == list(range(ROW_WORDS))

if __name__ == "__main__":  # CMake: the definitions, one per line
    sys.stdout.write("\n".join(cuda_defines()) + "\n")
