"""The table records of a many-source gather block (``GatherJobs.rows_each``/``ints_each``).

``check_each`` checks a block's sources against its destination and makes their records in one
pass, for a table whose offsets count from ``base`` (the launching ``RowGather``'s anchor). The
compiled extension's ``check_each`` (``kernels/vok_python.cpp``) does it in C++; ``check_each_numpy``
here is its twin for installs without the build (the Triton and CuPy backends): the same result,
with one Python pass over the sources for what only a tensor can say (dtype, device, shape,
strides, address) and numpy for the rest. ``noted_records`` reads the records back for an encoder
whose bases may differ from the one they were made for.

Notes (bytes, int64 words): ``base``, then two words a row: float rows (src, dst) element offsets
from ``base``; int rows the two-word records of ``gather_jobs`` (offsets in int32 words from
``base`` in the low 48 bits, flags / element count in the top 16).
"""

from __future__ import annotations

import numpy as np
import torch

INT_COUNT_MAX = 32767  # elements of one int record (the top 16 bits of a word; an int row's width)
LOW48 = (1 << 48) - 1
ADDRESS_LIMIT = 1 << 48  # every address an int record is made from lies below this


def check_each_numpy(srcs: list, starts: np.ndarray, dst: torch.Tensor, floating: bool, base: int):
    """The compiled ``check_each``'s twin: ``(rows, aligned, notes)`` when every source is plain
    (float: ``dst``'s device and dtype, 2-D of its width with contiguous rows; int: int32/int64,
    1-D for a 1-D ``dst``, else 2-D of its width with contiguous rows, at an address below 2**48;
    float and int: its rows inside ``dst`` from ``starts[k]`` on), else ``(-(k + 1), False, None)``
    for the first source k that is not (the caller records source by source, which raises the typed
    error naming it). ``starts`` is int64 with one entry per source; ``aligned`` says whether every
    float row starts on a 16-byte boundary (for ints: whether ``dst``'s rows do, as the compiled
    twin says; callers ignore it there)."""
    device, dtype = dst.get_device(), dst.dtype
    dst_1d = dst.dim() == 1
    width = 1 if dst_1d else dst.shape[1]
    if not floating and width > INT_COUNT_MAX:
        return -1, False, None
    address, stride, rows, sizes = [], [], [], []
    for s in srcs:  # up to the first source that is not plain
        try:
            if s.get_device() != device:
                break
            st, sh, t = s.stride(), s.shape, s.dtype
        except AttributeError:  # not a tensor
            break
        if floating:
            plain = t is dtype and len(st) == 2 and st[1] == 1 and sh[1] == width
        else:
            plain = (t is torch.int32 or t is torch.int64) and (
                len(st) == 1 if dst_1d else len(st) == 2 and st[1] == 1 and sh[1] == width)
        if not plain:
            break
        address.append(s.data_ptr())
        stride.append(st[0])
        rows.append(sh[0])
        if not floating:
            sizes.append(t.itemsize)
    n = len(rows)
    address = np.array(address, dtype=np.uint64).astype(np.int64)  # below 2**63 on every platform
    stride, rows = np.array(stride, dtype=np.int64), np.array(rows, dtype=np.int64)
    bad = (starts[:n] < 0) | (starts[:n] + rows > dst.shape[0])
    if not floating:
        bad |= address >= ADDRESS_LIMIT
    if bad.any() or n < len(srcs):  # the first source that fails any check, as the compiled twin
        return -(int(np.argmax(bad)) + 1 if bad.any() else n + 1), False, None
    total = int(rows.sum())
    dst_aligned = dst.data_ptr() % 16 == 0 and dst.stride(0) * dst.element_size() % 16 == 0
    # row j of source k: its index among the block's rows, and k
    first = np.repeat(np.cumsum(rows) - rows, rows)
    j = np.arange(total, dtype=np.int64) - first
    src_k = np.repeat(np.arange(len(rows)), rows)
    records = np.empty((total, 2), dtype=np.int64)
    if floating:
        shift = 1 if dst.element_size() == 2 else 2
        dst_off, dst_stride = (dst.data_ptr() - base) >> shift, dst.stride(0)
        records[:, 0] = ((address - base) >> shift)[src_k] + j * stride[src_k]
        records[:, 1] = dst_off + (starts[src_k] + j) * dst_stride
        aligned = bool(dst_aligned) and not (address % 16).any() and not (stride * dst.element_size() % 16).any()
    else:
        dw = dst.element_size() // 4
        sw = np.array(sizes, dtype=np.int64) // 4
        dst_off, dst_stride = (dst.data_ptr() - base) >> 2, dst.stride(0) * dw
        src = ((address - base) >> 2)[src_k] + j * (stride * sw)[src_k]
        flags = (sw == 2).astype(np.int64)[src_k] | ((dw == 2) << 1)
        records[:, 0] = (src & LOW48) | (flags << 48)
        records[:, 1] = ((dst_off + (starts[src_k] + j) * dst_stride) & LOW48) | (width << 48)
        aligned = dst_aligned
    notes = np.empty(1 + 2 * total, dtype=np.int64)
    notes[0] = base
    notes[1:] = records.reshape(-1)
    return total, aligned, notes.tobytes()


def noted_records(notes: bytes | None, base: int, unit: int, ints: bool) -> np.ndarray | None:
    """A many-source block's records from its notes, for a table whose offsets count from ``base``
    in units of ``unit`` bytes: the notes' own records when they were made for it, else shifted to
    it; None without notes or when the two bases are not a whole number of units apart (the caller
    then makes the records from the sources)."""
    if notes is None:
        return None
    words = np.frombuffer(notes, dtype=np.int64)
    delta, rest = divmod(int(words[0]) - base, unit)
    records = words[1:]
    if delta == 0 or rest:
        return None if rest else records
    if not ints:  # float records are plain element offsets
        return records + delta
    # int records: a signed 48-bit offset under 16 bits of flags or count
    return ((((records << 16) >> 16) + delta) & LOW48) | (records & ~LOW48)
