"""One launch's worth of row copies for the fused decode gather: ``GatherJobs`` and its table.

A gather step is a set of *jobs*, each copying rows of one tensor into rows of another:

* float rows: ``width`` elements of one float dtype (embeddings, hidden states, text steps);
* int rows: any width, int32 or int64 on either side, converted exactly (token ids, codes);
* values: host-known int32 values written into an int tensor (validity flags).

Sources and destinations may be any tensors on the launch's device: the kernels address them by
offsets from one base pointer (flat device address space), so one launch covers any number of hook
outputs and runner buffers. The torch reference copies the recorded blocks directly.

``encode`` is the one planner every kernel backend launches from: one ``layout.GATHER_ROW`` record
per row, written a recorded block at a time: one broadcast of what its rows share and its two row
lists as given, the offsets computed on the device (``layout.py`` has the table; a block of many
sources lists each row's own source offset). Consecutive int rows
that lie end to end on both sides (a batch's token ids or codes at consecutive offsets) go as runs of
up to ``RUN_ELEMS`` elements, one record each.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import backend, ops
from ..ops.layout import (GATHER_BLOCK_BYTES, INT_DST64, INT_SRC64, JOB_FLOAT, JOB_INT, R_DST_ROW, R_SRC_ROW,
                          R_WORD, ROW_WORDS, RUN_ELEMS, gather_row_blocks)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
_INTS = (int, np.integer)
_INT32 = np.iinfo(np.int32)
_MAX_ROW_BLOCKS = 65535  # a float row's blocks are a launch's grid.y (CUDA's limit)


@dataclass(frozen=True)
class TableLayout:
    """The largest table a gather encodes: ``jobs`` rows (float rows, int rows and value rows) and
    ``values`` int32 values."""

    jobs: int
    values: int = 0

    @property
    def values_at(self) -> int:
        return 1 + ROW_WORDS * self.jobs

    @property
    def words(self) -> int:
        return self.values_at + (self.values + 1) // 2


# A recorded block is a tuple (src, src_rows, dst, dst_rows): rows src[src_rows] to dst[dst_rows].
# Rows are int64 ndarrays, or ints for a single row; ``src_rows`` None means the source's leading rows
# 0..len(dst_rows)-1. A ``rows_each``/``ints_each`` block is (list of sources, Sources, dst, start
# rows): every row of source k goes to dst rows starts[k], starts[k] + 1, ... Sources keep their
# storage and shape until the launch, as every recorded source must keep its data.
Block = tuple


@dataclass(frozen=True, slots=True)
class Sources:
    """What the encoder needs of a many-source block's sources, read once when it is recorded:
    address, row stride (elements; never read for a one-row source), rows and int32 words per
    element (int sources; 1 for float)."""

    ptr: np.ndarray
    stride: np.ndarray
    rows: np.ndarray
    words: np.ndarray


_DTYPE_OF, _SHAPE_OF = operator.attrgetter("dtype"), operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")


def _read_sources(srcs: list[torch.Tensor], floating: bool) -> Sources:
    """``Sources`` of checked sources of any layout, read source by source."""
    n = len(srcs)
    words = np.ones(n, np.int64) if floating else np.fromiter((t.element_size() // 4 for t in srcs), np.int64, n)
    return Sources(np.fromiter((t.data_ptr() for t in srcs), np.int64, n),
                   np.fromiter((t.stride(0) for t in srcs), np.int64, n),
                   np.fromiter((t.shape[0] for t in srcs), np.int64, n), words)


def _resolved(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``src`` with its values in memory: a lazily negated view resolved (the kernels copy memory,
    which holds the values before the negation). TypeError for a destination that is such a view
    (what the kernels write there would read back negated)."""
    if dst.is_neg():
        raise TypeError("destination is a lazily negated view: the kernels write its memory, which reads back "
                        "negated (resolve_neg() it first)")
    return src.resolve_neg() if src.is_neg() else src


def _as_rows(rows) -> np.ndarray:
    """Row indices as int64; TypeError for anything but integers (2.7 is no row, and a mask is not
    a list of rows)."""
    r = np.asarray(rows)
    if r.size and r.dtype.kind not in "iu":
        raise TypeError(f"rows must be integers, got {r.dtype}")
    return r.astype(np.int64, copy=False).reshape(-1)


def _rows(rows, count: int, what: str) -> np.ndarray:
    r = _as_rows(rows)
    if r.size and (r.min() < 0 or r.max() >= count):
        raise IndexError(f"{what} rows {r.tolist()} out of range for {count} rows")
    return r


@dataclass
class GatherJobs:
    """The jobs of one launch. Build with ``rows``/``ints``/``values`` (and ``*_each``); ``clear`` to reuse.

    Args:
        dtype: the float dtype of every float row (fp32, bf16, fp16).
        width: the element count of every float row (hidden size, up to 16384 and beyond).
        device: where every tensor lives.
        check_rows: validate row ranges and that no two jobs write one row (``check_disjoint``);
            off for callers whose rows are valid and disjoint by construction (the runner's plan).

    No source row may be a row the launch writes, but a job's own destination row: each row is
    copied by its own program, in no set order.

    Every method validates on the host (device, dtype, width, last-dim contiguity and, with
    ``check_rows``, row ranges) and raises ``TypeError``/``ValueError``/``IndexError`` before anything
    is recorded. A float source of another dtype is converted first (one extra copy, outside the
    fused launch). ``aligned`` stays true while every float row starts on a 16-byte boundary and the
    width is a multiple of 16 bytes; the kernels then use vector accesses.
    """

    dtype: torch.dtype
    width: int
    device: torch.device
    check_rows: bool = True
    float_blocks: list[Block] = field(default_factory=list)
    int_blocks: list[Block] = field(default_factory=list)
    value_blocks: list[tuple[torch.Tensor, np.ndarray]] = field(default_factory=list)
    n_float: int = 0
    n_int: int = 0
    n_values: int = 0
    aligned: bool = True

    def __post_init__(self):
        if self.dtype not in FLOAT_DTYPES:
            raise TypeError(f"float rows must be one of {FLOAT_DTYPES}, got {self.dtype}")
        self.device = backend.resolve_device(self.device)
        self.is_cuda = self.device.type == "cuda"
        self._on_device = backend.on_device(self.device)
        self._device_index = self.device.index if self.is_cuda else -1  # Tensor.get_device()'s (-1: CPU or meta)
        self.elem_size = self.dtype.itemsize
        if gather_row_blocks(self.width, self.elem_size) > _MAX_ROW_BLOCKS:
            raise ValueError(f"float rows of {self.width} {self.dtype} elements are past what one launch copies: "
                             f"{_MAX_ROW_BLOCKS} blocks of {GATHER_BLOCK_BYTES} bytes a row")
        self._vector = 16 // self.elem_size
        self._width_aligned = self.width % self._vector == 0
        self._outputs: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.float_blocks.clear()
        self.int_blocks.clear()
        self.value_blocks.clear()
        self._outputs.clear()
        self.n_float = self.n_int = self.n_values = 0
        self.aligned = True

    def outputs(self) -> list[torch.Tensor]:
        """The tensors the recorded jobs write (what the launch's schema names as written)."""
        return list(self._outputs.values())

    # ------------------------------------------------------------------ recording

    def _check(self, t, what: str, dtypes, dims=(2,)) -> torch.Tensor:
        why = ops.not_plain(t)
        if why:
            raise TypeError(f"{what}: {why}")
        if not self._on_device(t):
            raise ValueError(f"{what} is on {t.device}, the launch is on {self.device}")
        if t.dtype not in dtypes:
            raise TypeError(f"{what} has dtype {t.dtype}, expected one of {dtypes}")
        if t.dim() not in dims:
            raise ValueError(f"{what} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
        return t

    def _float_source(self, dst, src) -> torch.Tensor:
        self._check(dst, "destination", FLOAT_DTYPES)
        self._check(src, "source", FLOAT_DTYPES)
        if dst.dtype != self.dtype:
            raise TypeError(f"destination dtype {dst.dtype} differs from the launch's {self.dtype}")
        if dst.shape[1] != self.width or src.shape[1] != self.width:
            raise ValueError(f"rows of width {self.width} expected, got source {tuple(src.shape)} and destination "
                             f"{tuple(dst.shape)}")
        if dst.stride(1) != 1:
            raise ValueError("destination rows must be contiguous")
        src = _resolved(dst, src)
        return src.to(self.dtype).contiguous() if src.dtype != self.dtype or src.stride(1) != 1 else src

    def _int_source(self, dst, src) -> torch.Tensor:
        self._check(dst, "destination", INT_DTYPES, (1, 2))
        self._check(src, "source", INT_DTYPES, (1, 2))
        width = dst.shape[1] if dst.dim() == 2 else 1
        if width != (src.shape[1] if src.dim() == 2 else 1):
            raise ValueError(f"int rows of different widths: source {tuple(src.shape)}, destination {tuple(dst.shape)}")
        if width > _INT32.max:  # (a record's count field)
            raise ValueError(f"int rows of {width} elements; one record copies at most {_INT32.max}")
        if dst.dim() == 2 and dst.stride(1) != 1:
            raise ValueError("destination rows must be contiguous")
        src = _resolved(dst, src)
        if dst.dim() != src.dim():  # rows of one element either way
            return src.reshape(-1) if dst.dim() == 1 else src.reshape(-1, 1)
        return src if src.dim() == 1 or src.stride(1) == 1 else src.contiguous()

    def _aligned(self, *tensors) -> bool:
        """Whether every float row of these tensors starts on a 16-byte boundary."""
        if not self._width_aligned:
            return False
        for t in tensors:
            if t.data_ptr() % 16 or t.stride(0) % self._vector:
                return False
        return True

    def rows(self, dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows=None) -> None:
        """Copy ``src[src_rows[k]]`` into ``dst[dst_rows[k]]`` (float rows of ``width``). Rows are int
        arrays, or ints for one row; without ``src_rows`` the source's leading rows are read."""
        src = self._float_source(dst, src)
        aligned = self._aligned(dst, src)
        self.n_float += self._add(self.float_blocks, dst, dst_rows, src, src_rows)
        self.aligned = self.aligned and aligned  # after the job is recorded: a failed one changes nothing

    def ints(self, dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows=None) -> None:
        """Copy int rows ``src[src_rows[k]]`` into ``dst[dst_rows[k]]`` (same width; int32/int64 on
        either side). 1-D tensors are rows of one element (token ids). Rows as in ``rows``."""
        src = self._int_source(dst, src)
        self.n_int += self._add(self.int_blocks, dst, dst_rows, src, src_rows)

    def rows_each(self, dst: torch.Tensor, dst_starts, srcs: list[torch.Tensor]) -> None:
        """For every k, copy all rows of ``srcs[k]`` (``[n_k, width]``) into ``dst`` rows
        ``dst_starts[k]``, ``dst_starts[k] + 1``, ...: the outputs of many small hook calls recorded
        with one call. Errors name the element (``srcs[k]: ...``; their ``index`` attribute is k) and
        record nothing."""
        self._record_each(dst, dst_starts, srcs, floating=True)

    def ints_each(self, dst: torch.Tensor, dst_starts, srcs: list[torch.Tensor]) -> None:
        """``rows_each`` for int rows (``ints``): ``srcs[k]`` is ``[n_k]`` or ``[n_k, w]``."""
        self._record_each(dst, dst_starts, srcs, floating=False)

    def _record_each(self, dst, dst_starts, srcs, floating: bool) -> None:
        starts = _as_rows(dst_starts)
        srcs = list(srcs)
        if len(starts) != len(srcs):
            raise ValueError(f"{len(starts)} destination starts for {len(srcs)} sources")
        # The common block (contiguous tensors of the block's kind) is read attribute by attribute
        # over all sources at once; any other goes through the per-source checks, which convert a
        # source or raise naming it, and is then read source by source.
        self._float_source(dst, dst) if floating else self._int_source(dst, dst)  # the destination's checks
        try:
            info = self._contiguous_sources(dst, srcs, floating)
        except TypeError:  # a source that is not a tensor
            info = None
        if info is None:
            srcs = self._checked_each(dst, starts, srcs, floating)
            info = _read_sources(srcs, floating)
        if len(starts) and (starts.min() < 0 or (starts + info.rows).max() > dst.shape[0]):
            self._checked_each(dst, starts, srcs, floating)  # raises, naming the source
        total = int(info.rows.sum())
        if not total:
            return
        self._outputs.setdefault(id(dst), dst)
        block = (srcs, info, dst, starts)
        if floating:
            self.float_blocks.append(block)
            self.n_float += total
            live = info.rows > 0
            self.aligned = (self.aligned and self._aligned(dst) and self._width_aligned
                            and not (info.ptr[live] % 16).any() and not (info.stride[live] % self._vector).any())
        else:
            self.int_blocks.append(block)
            self.n_int += total

    def _contiguous_sources(self, dst, srcs: list, floating: bool) -> Sources | None:
        """``Sources`` of a block whose sources are all contiguous tensors on the launch's device with
        the destination's rank and row width (float: the launch's dtype; int: int32 or int64), read
        one attribute at a time over all sources; None for any other block (``TypeError`` when a
        source is not a tensor)."""
        n, T = len(srcs), torch.Tensor
        # by index, one attribute over all sources; a CPU launch also by type (a meta tensor's index is
        # a CPU tensor's -1; a CUDA index is no other device's in a CUDA build)
        if set(map(T.get_device, srcs)) != {self._device_index} or not all(map(T.is_contiguous, srcs)) \
                or (not self.is_cuda and not all(map(_IS_CPU, srcs))) or any(map(T.is_neg, srcs)):
            return None
        shapes = set(map(_SHAPE_OF, srcs))
        width = self.width if floating else (dst.shape[1] if dst.dim() == 2 else 1)
        if ({len(s) for s in shapes} != {dst.dim()} or not width
                or (dst.dim() == 2 and {s[1] for s in shapes} != {width})):
            return None  # another rank or row width (the per-source checks name it), or rows of no elements
        dtypes = set(map(_DTYPE_OF, srcs))
        if floating:
            if dtypes != {self.dtype}:
                return None
            words = np.ones(n, np.int64)
        else:
            if not dtypes <= set(INT_DTYPES):
                return None
            words = (np.full(n, dtypes.pop().itemsize // 4, np.int64) if len(dtypes) == 1
                     else np.fromiter(map(T.element_size, srcs), np.int64, n) // 4)
        rows = np.fromiter(map(T.numel, srcs), np.int64, n) // width
        # contiguous rows lie ``width`` apart (a one-row source's own stride is never used)
        return Sources(np.fromiter(map(T.data_ptr, srcs), np.int64, n), np.full(n, width, np.int64), rows, words)

    def _checked_each(self, dst, starts, srcs, floating: bool) -> list[torch.Tensor]:
        """Every source through the one-source checks (converted where they convert); the first that
        fails raises with its position (``srcs[k]: ...``, ``index`` k)."""
        checked = []
        for k, (start, src) in enumerate(zip(starts.tolist(), srcs)):
            try:
                src = self._float_source(dst, src) if floating else self._int_source(dst, src)
                n = src.shape[0]
                if start < 0 or start + n > dst.shape[0]:
                    raise IndexError(f"rows {start}..{start + n - 1} out of range for a destination of "
                                     f"{dst.shape[0]} rows")
            except (TypeError, ValueError, IndexError, AttributeError) as exc:
                err = (TypeError if isinstance(exc, AttributeError) else type(exc))(f"srcs[{k}]: {exc}")
                err.index = k  # which source: a caller maps it back to its request
                raise err from exc
            checked.append(src)
        return checked

    def values(self, dst: torch.Tensor, values) -> None:
        """Write host int32 ``values`` into the 1-D contiguous int tensor ``dst`` (same length).
        ``TypeError`` for values that are not integers, ``ValueError`` for one outside int32's range
        (nothing is wrapped)."""
        if not isinstance(dst, torch.Tensor) or dst.dim() != 1 or not dst.is_contiguous():
            raise ValueError("values go into a 1-D contiguous tensor")
        self._check(dst, "destination", INT_DTYPES, (1,))
        v = np.asarray(values).reshape(-1)
        if v.size > _INT32.max:  # (a record's count field)
            raise ValueError(f"{v.size} values; one record writes at most {_INT32.max}")
        if v.size and v.dtype.kind not in "iub":
            raise TypeError(f"values must be integers, got {v.dtype}")
        if v.size and (v.min() < _INT32.min or v.max() > _INT32.max):
            raise ValueError(f"values outside int32's range [{_INT32.min}, {_INT32.max}]")
        v = np.ascontiguousarray(v, dtype=np.int32)
        if v.size != dst.numel():
            raise ValueError(f"{v.size} values for a destination of {dst.numel()}")
        if v.size:
            self.value_blocks.append((dst, v))
            self._outputs.setdefault(id(dst), dst)
            self.n_int += 1
            self.n_values += v.size

    def _add(self, blocks, dst, dst_rows, src, src_rows) -> int:
        if isinstance(dst_rows, _INTS) and (src_rows is None or isinstance(src_rows, _INTS)):
            d, s = int(dst_rows), 0 if src_rows is None else int(src_rows)
            if not (0 <= d < dst.shape[0] and 0 <= s < src.shape[0]):
                raise IndexError(f"row {s} -> {d} out of range for source {tuple(src.shape)} and destination "
                                 f"{tuple(dst.shape)}")
            blocks.append((src, s, dst, d))
            self._outputs.setdefault(id(dst), dst)
            return 1
        if self.check_rows:
            d = _rows(dst_rows, dst.shape[0], "destination")
            s = None if src_rows is None else _rows(src_rows, src.shape[0], "source")
        else:
            d = _as_rows(dst_rows)
            s = None if src_rows is None else _as_rows(src_rows)
        if s is None and len(d) > src.shape[0]:
            raise IndexError(f"{len(d)} destination rows but the source has {src.shape[0]}")
        if s is not None and len(s) != len(d):
            raise ValueError(f"{len(s)} source rows for {len(d)} destination rows")
        if len(d):
            blocks.append((src, s, dst, d))
            self._outputs.setdefault(id(dst), dst)
        return len(d)

    def check_disjoint(self) -> None:
        """Raise ``ValueError`` if two jobs write overlapping destination bytes (the same row, or rows
        of two views of one buffer that overlap in part: a race in one launch). A no-op with
        ``check_rows=False``."""
        if not self.check_rows:
            return
        starts, ends = [], []
        for src, src_rows, dst, dst_rows in self.float_blocks + self.int_blocks:
            first = dst.data_ptr() + np.atleast_1d(_destination_rows(src, src_rows, dst_rows)) * dst.stride(0) \
                * dst.element_size()
            starts.append(first)
            ends.append(first + (dst.shape[1] if dst.dim() == 2 else 1) * dst.element_size())
        for dst, _ in self.value_blocks:  # one-element rows, as an int job's into a 1-D tensor
            first = dst.data_ptr() + np.arange(dst.numel(), dtype=np.int64) * dst.element_size()
            starts.append(first)
            ends.append(first + dst.element_size())
        if starts:
            start, end = np.concatenate(starts), np.concatenate(ends)
            order = np.argsort(start, kind="stable")
            if (start[order][1:] < end[order][:-1]).any():
                raise ValueError("two jobs of one launch write the same destination row")

    # ------------------------------------------------------------------ the table

    def encode(self, out: np.ndarray, layout: TableLayout, base: int, table: int) -> int:
        """Write this launch's table into the flat int64 ``out`` (``layout.py``: the record count, the
        records, the values) and return the record count (at most the recorded rows: a run of int
        rows is one record). ``base``: the address every offset counts
        from (the launch's anchor, 16-byte aligned); ``table``: the address the kernel reads ``out``
        at (where value rows find their values).

        Raises ``ValueError`` when the records or values exceed ``layout``.
        """
        if self.n_values > layout.values:
            raise ValueError(f"{self.n_values} values exceed the table's {layout.values}")
        records = out[1:layout.values_at].reshape(-1, ROW_WORDS)
        n = 0
        for block in self.float_blocks:
            n = self._float_rows(records, n, block, base)
        for block in self.int_blocks:
            n = self._int_rows(records, n, block, base)
        payload = out[layout.values_at:layout.values_at + (self.n_values + 1) // 2].view(np.int32)
        first = 0
        for dst, v in self.value_blocks:  # one row of v.size elements, read from the table
            payload[first:first + v.size] = v
            n = _put(records, n, v.size | (JOB_INT | (INT_DST64 if dst.element_size() == 8 else 0)) << 32,
                     (table + 8 * layout.values_at - base) // 4 + first, 0, 0, (dst.data_ptr() - base) // 4, 0, 0)
            first += v.size
        out[0] = n
        return n

    def _float_rows(self, records: np.ndarray, n: int, block: Block, base: int) -> int:
        """Write a float block's records (offsets in elements) from row ``n``; returns the next row."""
        src, src_rows, dst, dst_rows = block
        es, word = self.elem_size, self.width | JOB_FLOAT << 32
        d0 = (dst.data_ptr() - base) // es
        if type(src) is list:  # each row's source has its own offset
            s_off, d = _each_rows(src_rows, dst_rows, base, es)
            return _put(records, n, word, 0, 1, s_off, d0, dst.stride(0), d)
        return _put(records, n, word, (src.data_ptr() - base) // es, src.stride(0), src_rows, d0, dst.stride(0),
                    dst_rows)

    def _int_rows(self, records: np.ndarray, n: int, block: Block, base: int) -> int:
        """Write an int block's records (offsets in int32 words) from row ``n``; returns the next row.
        Rows that lie end to end on both sides go as runs of up to ``RUN_ELEMS`` elements."""
        src, src_rows, dst, dst_rows = block
        dw, width = dst.element_size() // 4, (dst.shape[1] if dst.dim() == 2 else 1)
        d0, d_stride = (dst.data_ptr() - base) // 4, dst.stride(0) * dw
        kind = JOB_INT | (INT_DST64 if dw == 2 else 0)
        if type(src) is list:  # each row's source has its own offset; a record holds one source width
            s_off, d = _each_rows(src_rows, dst_rows, base, 4)
            live = src_rows.rows > 0
            wide = np.repeat(src_rows.words[live], src_rows.rows[live]) == 2
            if wide.all() or not wide.any():
                return _put(records, n, width | (kind | (INT_SRC64 if wide[0] else 0)) << 32, 0, 1, s_off, d0,
                            d_stride, d)
            for part, k in ((wide, kind | INT_SRC64), (~wide, kind)):  # int64 and int32 sources
                n = _put(records, n, width | k << 32, 0, 1, s_off[part], d0, d_stride, d[part])
            return n
        sw = src.element_size() // 4
        kind |= INT_SRC64 if sw == 2 else 0
        s0, s_stride = (src.data_ptr() - base) // 4, src.stride(0) * sw
        d_run = (-1 if type(dst_rows) is int or src.stride(0) != width or dst.stride(0) != width
                 else _run_start(dst_rows))
        s_run = 0 if src_rows is None or d_run < 0 else _run_start(src_rows)
        if d_run < 0 or s_run < 0:
            return _put(records, n, width | kind << 32, s0, s_stride, src_rows, d0, d_stride, dst_rows)
        # End to end on both sides: runs of whole rows from their first rows (one record per row at
        # most, so the grid's rows cover them).
        rows, per = len(dst_rows), max(1, RUN_ELEMS // width)
        if rows <= per:
            return _put(records, n, rows * width | kind << 32, s0, s_stride, s_run, d0, d_stride, d_run)
        first = np.arange(-(-rows // per), dtype=np.int64) * per
        n = _put(records, n, 0, s0, s_stride, s_run + first, d0, d_stride, d_run + first)
        records[n - len(first):n, R_WORD] = np.minimum(per, rows - first) * width | kind << 32
        return n


def _put(records: np.ndarray, n: int, word: int, src: int, src_stride: int, src_rows, dst: int, dst_stride: int,
         dst_rows) -> int:
    """Write a block's records at row ``n`` of ``records``; returns the next row. Rows are int
    arrays, None (the leading rows) or ints (one row)."""
    k = 1 if type(dst_rows) is int else len(dst_rows)
    if n + k > len(records):
        raise ValueError(f"{n + k} rows exceed the table's {len(records)}")
    rec = records[n:n + k]
    rec[:] = (src, src_stride, 0, dst, dst_stride, 0, word)  # GATHER_ROW's words
    if k > 1 or type(src_rows) is not int:
        rec[:, R_SRC_ROW] = np.arange(k, dtype=np.int64) if src_rows is None else src_rows
        rec[:, R_DST_ROW] = dst_rows
    else:
        rec[0, R_SRC_ROW], rec[0, R_DST_ROW] = src_rows, dst_rows
    return n + k


def _run_start(rows: np.ndarray) -> int:
    """The first of ``rows`` when there are several, consecutive and increasing; else -1."""
    first = int(rows[0])
    if rows.size < 2 or int(rows[-1]) - first != rows.size - 1 or not (rows[1:] > rows[:-1]).all():
        return -1
    return first


def _each_rows(info: Sources, starts: np.ndarray, base: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """For every row of a many-source block: its source offset from ``base`` in units of ``unit``
    bytes, and its destination row."""
    live = info.rows > 0
    ptr, stride, rows, words, first = info.ptr[live], info.stride[live], info.rows[live], info.words[live], starts[live]
    s0 = (ptr - base) // unit
    if (rows == 1).all():  # one row per source (decode rows): no repeats
        return s0, first
    j = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)  # row within its source
    return np.repeat(s0, rows) + j * np.repeat(stride * words, rows), np.repeat(first, rows) + j


def _destination_rows(src, src_rows, dst_rows):
    """A block's destination rows (an array, or an int for one row)."""
    return _each_rows(src_rows, dst_rows, 0, 1)[1] if type(src) is list else dst_rows
