"""The metadata row layout shared by every backend of the ring copy ops.

A step's metadata is an int64 tensor ``[rows, META_COLS]`` in device memory; one row per request.
Element offsets (never byte offsets) are int64 so pools larger than 2**31 elements work.

Columns:
    SLOT        slot index into the ``state`` table (one head word per slot)
    LIN_OFF     element offset of the request's first element in the linear tensor
    N           frames to copy (0 allowed)
    BASE        element offset of the slot's region in the arena
    CAP         the region's capacity in frames
    POS         first ring frame; for writes, -1 means "the device head of SLOT"
    LIN_STRIDE  elements between consecutive lead rows (CONCAT_LAST) or frames (CONCAT_DIM0)
                in the linear tensor

Region layout in the arena, F = elements per frame:
    CONCAT_DIM0: ``[CAP, F]`` row-major; frame t of the ring at ``BASE + t*F``.
    CONCAT_LAST: ``[F, CAP]`` row-major (channel-major audio); sample t of channel c at ``BASE + c*CAP + t``.
Linear layout of a request's chunk:
    CONCAT_DIM0: frame j, element f at ``LIN_OFF + j*LIN_STRIDE + f``.
    CONCAT_LAST: channel c, sample j at ``LIN_OFF + c*LIN_STRIDE + j``.

``state`` is int64 ``[slots]``, one word per slot: ``head << HEAD_SHIFT | ticket``. The head is the
next frame to write; the ticket counts the programs of a write launch that have read the head: each
program takes its ticket and reads the head in one atomic add, and the program that takes the last
ticket stores the new head with ticket 0 (so the word is ``head << HEAD_SHIFT`` between launches).
No program can read the head after it moved, and nobody waits for the update.
"""

META_COLS = 8
SLOT, LIN_OFF, N, BASE, CAP, POS, LIN_STRIDE = range(7)  # column 7: not read by kernels
HEAD_SHIFT = 24  # ticket bits: a row has at most 2**31 / 2048 programs; heads up to 2**39 frames
