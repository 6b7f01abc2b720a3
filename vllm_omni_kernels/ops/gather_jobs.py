"""One launch's worth of row copies for the fused decode gather: ``GatherJobs`` and its table.

A gather step is a set of *jobs*, each copying one row into one row of another tensor:

* float rows: ``width`` elements of one float dtype (embeddings, hidden states, text steps);
* int rows: any width, int32 or int64 on either side, converted exactly (token ids, codes);
* values: host-known int32 values written into an int tensor (validity flags).

Sources and destinations may be any tensors on the launch's device; the kernels address them by
element offsets from one base pointer per class (flat device address space), so one launch covers
any number of hook outputs and runner buffers. The torch reference copies the same jobs directly.

Table (int64, flat; capacities fixed per ``TableLayout``)::

    [0] n_float  [1] n_int
    [2 + 2j, 3 + 2j]                      float job j: src, dst element offsets from the float base
    [i_off + 2j, i_off + 2j + 1]          int job j: src | flags << 48, dst | count << 48
    [p_off ..]                            payload: int32 values that value jobs copy from

An int record's src and dst are int32-word offsets from the int base in the low 48 bits (signed:
they are differences of addresses below 2**48, which the encoders check); the top 16 bits of the
first word hold its flags (1: src is int64, 2: dst is int64, 4: src is in this table, offset from
its start), those of the second its element count (at most ``INT_COUNT_MAX``). Two words instead of
four: a mixed step's per-row ids halve, and a launch whose table travels in its parameters copies
less.

An int block whose source and destination rows are both consecutive, over rows that lie end to end
in memory (a batch's token ids or codes at consecutive offsets), is one run of elements: it is
encoded as records of at most ``int_run_cap`` elements (what the kernel's blocks of one int job copy
in one pass) instead of a record per row. Value records follow the int records and the payload
follows them (``p_off`` is where the encoder put it), so a table uses ``encode``'s returned words,
at most ``TableLayout.words``.

The int base is the table's own device address, except for the compiled eager launch, which passes
its table in the kernel's parameters (``kernels/vok_launch.h``): the host cannot know where those
live, so its int words are offsets from the float base (the launcher's anchor), and payload sources
(flag 4) from the table. It does so for a larger table staged in pinned memory too, so that the
records ``check_each`` makes of a many-source block while it is recorded (for that anchor:
``GatherJobs.record_base``; ``each_records``) fit either table and are copied, not made again.
The numpy encoder copies them too, shifted to its int base.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import cuda_ext
from .each_records import ADDRESS_LIMIT, INT_COUNT_MAX, LOW48, check_each_numpy, noted_records

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
_INTS = (int, np.integer)
_ARANGE = np.arange(4096, dtype=np.int64)  # source rows 0..n-1 of a block, shared read-only
_ARANGE.flags.writeable = False


@dataclass(frozen=True)
class TableLayout:
    """Where each section of the job table starts, for fixed capacities."""

    float_cap: int
    int_cap: int
    payload_cap: int  # int32 values

    @property
    def int_off(self) -> int:
        return 2 + 2 * self.float_cap

    @property
    def payload_off(self) -> int:
        return self.int_off + 2 * self.int_cap

    @property
    def words(self) -> int:
        return self.payload_off + (self.payload_cap + 1) // 2


# INT_COUNT_MAX (elements of one int record), LOW48 and ADDRESS_LIMIT (every address an int record
# is made from lies below it) come from each_records, which makes a many-source block's records.


# The CUDA kernels' gather blocks (kernels/vok_kernels.cuh: kGatherThreads, kGatherBlockBytes; the
# CuPy launcher sizes its grid from these): an int job's elements are shared by its blocks along the
# row axis, THREADS elements each per pass.
GATHER_THREADS, GATHER_BLOCK_BYTES = 128, 4096


def gather_row_blocks(width: int, elem_size: int) -> int:
    """Blocks per float row of ``width`` elements (grid.y of a CUDA gather launch)."""
    return max(1, -(-width * elem_size // GATHER_BLOCK_BYTES))


def int_run_cap(width: int, elem_size: int) -> int:
    """Elements the blocks of one int job copy in one pass: the most a record of a run of int rows
    takes (within ``INT_COUNT_MAX``)."""
    return min(GATHER_THREADS * gather_row_blocks(width, elem_size), INT_COUNT_MAX // GATHER_THREADS * GATHER_THREADS)


def _consecutive(rows) -> bool:
    """Whether int64 ``rows`` (at least one) are r, r + 1, r + 2, ..."""
    return rows.size == 1 or bool((rows[1:] - rows[:-1] == 1).all())


def _put_ints(out: np.ndarray, pos: int, end: int, src, dst, count, flags) -> None:
    """Write int records (two words each: the module docstring) from ``out[pos]`` up to ``end``;
    arguments are int64 arrays or ints, one per record."""
    out[pos:end:2] = (np.asarray(src) & LOW48) | (np.asarray(flags) << 48)
    out[pos + 1:end:2] = (np.asarray(dst) & LOW48) | (np.asarray(count) << 48)


def _run_records(out: np.ndarray, pos: int, src: int, dst: int, elems: int, flags: int, cap: int) -> int:
    """Write a run of ``elems`` int elements from word ``src`` to word ``dst`` as records of at most
    ``cap`` elements from ``out[pos]`` on; returns the position after them."""
    n = -(-elems // cap)
    first = _arange(n) * cap
    end = pos + 2 * n
    _put_ints(out, pos, end, src + first * (1 + (flags & 1)), dst + first * (1 + (flags >> 1)),
              np.minimum(cap, elems - first), flags)
    return end


def decode_table(table: np.ndarray, int_off: int) -> tuple[np.ndarray, np.ndarray]:
    """The records of an encoded table (``int_off`` as encoded), the encoders' inverse for tests and
    debugging: float jobs as int64 rows (src, dst), int jobs as (src, dst, count, flags)."""
    t = np.asarray(table, dtype=np.int64)
    floats = t[2:2 + 2 * int(t[0])].reshape(-1, 2)
    ints = t[int_off:int_off + 2 * int(t[1])].reshape(-1, 2)
    offsets = (ints << 16) >> 16
    top = (ints >> 48) & 0xFFFF
    return floats.copy(), np.stack([offsets[:, 0], offsets[:, 1], top[:, 1], top[:, 0]], axis=1)


def _arange(n: int) -> np.ndarray:
    """0..n-1 as int64 (a read-only view of a shared array when short)."""
    return _ARANGE[:n] if n <= _ARANGE.size else np.arange(n, dtype=np.int64)


def _check_each(srcs, starts, dst, floating: bool, base: int):
    """A ``rows_each``/``ints_each`` call's sources checked and their records made in one pass:
    (rows, aligned, notes), or a negative first value when a source is not plain
    (``each_records``). The compiled extension's ``check_each`` when it is loaded (by the compiled
    backend, or by tests), else its numpy twin. ``notes`` (bytes: ``base``, then the block's table
    records for offsets counted from it) go into the block, and both encoders copy them (shifted
    for other bases), so a mixed step's per-row sources are read once."""
    module = cuda_ext._module
    check = check_each_numpy if module is None else module.check_each
    return check(srcs, starts, dst, floating, base)


def _as_rows(rows) -> np.ndarray:
    """``rows`` as a 1-D int64 array: the caller's own array when it already is one (no new view)."""
    if type(rows) is np.ndarray and rows.dtype == np.int64 and rows.ndim == 1:
        return rows
    return np.asarray(rows, dtype=np.int64).reshape(-1)


def _rows(rows, count: int, what: str) -> np.ndarray:
    r = _as_rows(rows)
    if r.size and (r.min() < 0 or r.max() >= count):
        raise IndexError(f"{what} rows {r.tolist()} out of range for {count} rows")
    return r


# A recorded block of jobs is a plain tuple (making one costs far less than a NamedTuple's):
#   (src, src_rows, dst, dst_rows): rows src[src_rows] to dst[dst_rows]
# Rows are int64 ndarrays, or ints for a single row (the common one-row-per-hook case skips numpy
# entirely); ``src_rows`` None with a ``dst_rows`` array means the source's leading rows
# 0..len(dst_rows)-1 (a hook's batched output). A block of ``rows_each``/``ints_each`` is
# (list of sources, notes, dst, start rows): ``notes`` is what ``check_each`` made of the sources
# (bytes: the block's records, ``each_records``; None: read them again), so the sources must keep their
# storage and shape until the launch, as every recorded source must keep its data. The compiled
# encoder (``kernels/vok_python.cpp``) reads the same positions.
Block = tuple["torch.Tensor | list[torch.Tensor]", "np.ndarray | int | bytes | None", torch.Tensor,
              "np.ndarray | int"]


def _destination_rows(src, dst_rows):
    """A block's destination rows: one array or int; for a block of many sources (``rows_each``),
    one array per source."""
    if type(src) is not list:
        return (np.asarray(dst_rows),)
    return [d + _arange(n) for _, d, n in each_jobs(src, dst_rows)]


def each_jobs(srcs, starts):
    """(source, first destination row, rows) of every source of a ``rows_each`` block."""
    return ((s, d, s.shape[0]) for s, d in zip(srcs, starts.tolist()) if s.shape[0])


def source_rows(src_rows, dst_rows) -> np.ndarray | int:
    """A block's source rows with None spelled out."""
    return _arange(len(dst_rows)) if src_rows is None else src_rows


@dataclass
class GatherJobs:
    """The jobs of one launch. Build with ``rows``/``ints``/``values``; ``clear`` to reuse.

    Args:
        dtype: the float dtype of every float row (fp32, bf16, fp16).
        width: the element count of every float row (hidden size, up to 16384 and beyond).
        device: where every tensor lives.
        record_base: the address the compiled launch's offsets count from (the launching
            ``RowGather`` sets its anchor's): many-source blocks carry their records for it.

    Every method validates on the host (device, dtype, width, last-dim contiguity and, with
    ``check_rows``, row ranges) and raises ``TypeError``/``ValueError``/``IndexError`` before anything
    is recorded. A float source of another dtype is converted first (one extra copy, outside the fused
    launch). ``check_rows=False`` is for callers whose rows are valid and disjoint by construction
    (the runner's validated routing plan): it skips the range checks and ``check_disjoint``.

    ``aligned`` stays true while every float row starts on a 16-byte boundary and the width is a
    multiple of 16 bytes; the kernel then uses vector loads.
    """

    dtype: torch.dtype
    width: int
    device: torch.device
    check_rows: bool = True
    record_base: int = 0  # the address the compiled launch's offsets count from (RowGather's anchor)
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
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._device_index = -1 if self.device.type == "cpu" else self.device.index  # Tensor.get_device()
        self.is_cuda = self.device.type == "cuda"
        self.elem_size = self.dtype.itemsize
        self.vector = 16 // self.elem_size  # elements per 16-byte vector
        self._width_aligned = self.width % self.vector == 0

    def clear(self) -> None:
        self.float_blocks.clear()
        self.int_blocks.clear()
        self.value_blocks.clear()
        self.n_float = self.n_int = self.n_values = 0
        self.aligned = True

    def _check(self, t: torch.Tensor, what: str, dtypes, dims=(2,)) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(t).__name__}")
        if t.get_device() != self._device_index:
            raise ValueError(f"{what} is on {t.device}, the launch is on {self.device}")
        if t.dtype not in dtypes:
            raise TypeError(f"{what} has dtype {t.dtype}, expected one of {dtypes}")
        if t.dim() not in dims:
            raise ValueError(f"{what} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(t.shape)}")
        return t

    def rows(self, dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows=None) -> None:
        """Copy ``src[src_rows[k]]`` into ``dst[dst_rows[k]]`` (float rows of ``width``).

        Rows are int arrays, or Python ints for one row (a hook output of one row); without
        ``src_rows`` the source's leading rows are read.
        """
        aligned = self._plain_float(dst, src)
        if aligned is None:  # anything unusual: the checks that raise, or a conversion
            self._check(dst, "destination", FLOAT_DTYPES)
            self._check(src, "source", FLOAT_DTYPES)
            if dst.dtype != self.dtype:
                raise TypeError(f"destination dtype {dst.dtype} differs from the launch's {self.dtype}")
            if dst.shape[1] != self.width or src.shape[1] != self.width:
                raise ValueError(f"rows of width {self.width} expected, got source {tuple(src.shape)} "
                                 f"and destination {tuple(dst.shape)}")
            if dst.stride(1) != 1:
                raise ValueError("destination rows must be contiguous")
            src = src.to(self.dtype).contiguous()
            aligned = self._aligned(dst, src, src.stride(0), dst.stride(0))
        self.n_float += self._add(self.float_blocks, dst, dst_rows, src, src_rows)
        self.aligned = self.aligned and aligned  # after the job is recorded: a failed one changes nothing

    def ints(self, dst: torch.Tensor, dst_rows, src: torch.Tensor, src_rows=None) -> None:
        """Copy int rows ``src[src_rows[k]]`` into ``dst[dst_rows[k]]`` (same width, at most
        ``INT_COUNT_MAX`` elements; int32/int64).

        1-D tensors are rows of one element (token ids). Rows as in ``rows``."""
        if not self._plain_int(dst, src):
            self._check(dst, "destination", INT_DTYPES, (1, 2))
            self._check(src, "source", INT_DTYPES, (1, 2))
            dw = dst.shape[1] if dst.dim() == 2 else 1
            if dw != (src.shape[1] if src.dim() == 2 else 1):
                raise ValueError(f"int rows of different widths: source {tuple(src.shape)}, "
                                 f"destination {tuple(dst.shape)}")
            if dw > INT_COUNT_MAX:
                raise ValueError(f"int rows of at most {INT_COUNT_MAX} elements, got {dw}")
            if dst.dim() == 2 and dst.stride(1) != 1:
                raise ValueError("destination rows must be contiguous")
            src = src.contiguous()
        self.n_int += self._add(self.int_blocks, dst, dst_rows, src, src_rows)

    def rows_each(self, dst: torch.Tensor, dst_starts, srcs: list[torch.Tensor]) -> None:
        """For every k, copy all rows of ``srcs[k]`` (``[n_k, width]``) into ``dst`` rows
        ``dst_starts[k]``, ``dst_starts[k] + 1``, ...: the outputs of many small hook calls recorded
        with one call (a mixed batch's single-row runs and prefill chunks).

        The checks of ``rows``, and the destination rows are always range-checked; an error names the
        element (``srcs[k]: ...``; its ``index`` attribute is k) and records nothing. The sources are
        checked in one pass (the compiled extension's ``check_each`` when it is loaded, else its numpy
        twin) and recorded as one block, with the table records made of them for ``record_base`` (so
        each source keeps its storage and shape until the launch, as every recorded source keeps its
        data); when a source is not plain (it needs a conversion, or a check fails), element by element
        through ``rows``, which raises for the bad one.
        """
        self._record_each(dst, dst_starts, srcs, floating=True)

    def ints_each(self, dst: torch.Tensor, dst_starts, srcs: list[torch.Tensor]) -> None:
        """``rows_each`` for int rows (``ints``): ``srcs[k]`` is ``[n_k]`` or ``[n_k, w]``."""
        self._record_each(dst, dst_starts, srcs, floating=False)

    def _record_each(self, dst, dst_starts, srcs, floating: bool) -> None:
        starts = _as_rows(dst_starts)
        if type(srcs) is not list:
            srcs = list(srcs)
        if len(starts) != len(srcs):
            raise ValueError(f"{len(starts)} destination starts for {len(srcs)} sources")
        if not srcs:
            return
        checked = (_check_each(srcs, starts, dst, floating, self.record_base) if self._plain_dst(dst, floating)
                   else None)
        if checked is not None and checked[0] >= 0:  # every source plain: one block
            rows, aligned, notes = checked
            if rows:
                (self.float_blocks if floating else self.int_blocks).append((srcs, notes, dst, starts))
            if floating:
                self.n_float += rows
                self.aligned = self.aligned and self._width_aligned and aligned
            else:
                self.n_int += rows
            return
        state = (len(self.float_blocks), len(self.int_blocks), self.n_float, self.n_int, self.aligned)
        record = self.rows if floating else self.ints
        try:
            for k, (start, src) in enumerate(zip(starts.tolist(), srcs)):
                try:
                    n = src.shape[0] if isinstance(src, torch.Tensor) and src.dim() else 1
                    if start < 0 or start + n > dst.shape[0]:
                        raise IndexError(f"rows {start}..{start + n - 1} out of range for a destination of "
                                         f"{dst.shape[0]} rows")
                    if n:
                        record(dst, start if n == 1 else np.arange(start, start + n), src)
                except (TypeError, ValueError, IndexError, AttributeError) as exc:
                    err = (TypeError if isinstance(exc, AttributeError) else type(exc))(f"srcs[{k}]: {exc}")
                    err.index = k  # which source: a caller maps it back to its request
                    raise err from exc
        except BaseException:
            del self.float_blocks[state[0]:], self.int_blocks[state[1]:]
            self.n_float, self.n_int, self.aligned = state[2:]
            raise

    def _plain_dst(self, dst, floating: bool) -> bool:
        """Whether ``dst`` passes the checks of a plain destination (else the element path raises)."""
        if floating:
            return self._plain_float(dst, dst) is not None
        return self._plain_int(dst, dst)

    def values(self, dst: torch.Tensor, values) -> None:
        """Write host int32 ``values`` into the 1-D contiguous int tensor ``dst`` (same length)."""
        if not isinstance(dst, torch.Tensor) or dst.dim() != 1 or not dst.is_contiguous():
            raise ValueError("values go into a 1-D contiguous tensor")
        self._check(dst, "destination", INT_DTYPES, (1,))
        v = values
        if not (type(v) is np.ndarray and v.dtype == np.int32 and v.ndim == 1 and v.flags.c_contiguous):
            v = np.ascontiguousarray(values, dtype=np.int32).reshape(-1)
        if v.size != dst.numel():
            raise ValueError(f"{v.size} values for a destination of {dst.numel()}")
        if v.size > INT_COUNT_MAX:
            raise ValueError(f"at most {INT_COUNT_MAX} values per call, got {v.size}")
        if v.size:
            self.value_blocks.append((dst, v))
            self.n_int += 1
            self.n_values += v.size

    def _aligned(self, dst: torch.Tensor, src: torch.Tensor, src_stride: int, dst_stride: int) -> bool:
        """Whether every float row of these tensors starts on a 16-byte boundary."""
        return (self._width_aligned and (src.data_ptr() | dst.data_ptr()) % 16 == 0
                and (src_stride | dst_stride) % self.vector == 0)

    def _plain_float(self, dst, src) -> bool | None:
        """For float tensors needing none of the slow path's checks or conversions (2-D, the launch's
        device, dtype and width, contiguous rows): whether their rows are 16-byte aligned; else None.
        Few tensor attribute reads: from Python each costs a few hundred nanoseconds."""
        dtype = self.dtype
        try:
            if dst.dtype is not dtype or src.dtype is not dtype:
                return None
            if dst.get_device() != self._device_index or src.get_device() != self._device_index:
                return None
            ds, ss = dst.stride(), src.stride()
            if len(ds) != 2 or len(ss) != 2 or ds[1] != 1 or ss[1] != 1:
                return None
            if dst.shape[1] != self.width or src.shape[1] != self.width:
                return None
        except AttributeError:  # not a tensor: the slow path raises the typed error
            return None
        return self._aligned(dst, src, ss[0], ds[0])

    def _plain_int(self, dst, src) -> bool:
        """Whether int tensors need none of the slow path's checks or conversions: the launch's
        device, int32/int64, both 1-D, or both 2-D of one width with contiguous rows."""
        try:
            dt, st = dst.dtype, src.dtype
            if not ((dt is torch.int32 or dt is torch.int64) and (st is torch.int32 or st is torch.int64)):
                return False
            if dst.get_device() != self._device_index or src.get_device() != self._device_index:
                return False
            ds, ss = dst.stride(), src.stride()
        except AttributeError:
            return False
        if len(ds) == 1:
            return len(ss) == 1
        return (len(ds) == 2 and len(ss) == 2 and ds[1] == 1 and ss[1] == 1
                and dst.shape[1] == src.shape[1] <= INT_COUNT_MAX)

    @staticmethod
    def _single(blocks, dst, d: int, src, s: int) -> None:
        if not (0 <= d < dst.shape[0] and 0 <= s < src.shape[0]):
            raise IndexError(f"row {s} -> {d} out of range for source {tuple(src.shape)} and destination "
                             f"{tuple(dst.shape)}")
        blocks.append((src, s, dst, d))

    def _add(self, blocks, dst, dst_rows, src, src_rows) -> int:
        if isinstance(dst_rows, _INTS) and (src_rows is None or isinstance(src_rows, _INTS)):
            self._single(blocks, dst, int(dst_rows), src, 0 if src_rows is None else int(src_rows))
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
        return len(d)

    # ------------------------------------------------------------------ encoding

    def check_disjoint(self) -> None:
        """Raise ``ValueError`` if two jobs write the same destination row (a race in one launch).

        A no-op with ``check_rows=False``."""
        if not self.check_rows:
            return
        for blocks in (self.float_blocks, self.int_blocks):
            if not blocks:
                continue
            starts = np.concatenate([np.atleast_1d(dst.data_ptr() + rows * dst.stride(0) * dst.element_size())
                                     for src, _, dst, dst_rows in blocks for rows in _destination_rows(src, dst_rows)])
            if np.unique(starts).size != starts.size:
                raise ValueError("two jobs of one launch write the same destination row")

    def _check_capacity(self, layout: TableLayout) -> None:
        if self.n_float > layout.float_cap or self.n_int > layout.int_cap or self.n_values > layout.payload_cap:
            raise ValueError(f"{self.n_float} float / {self.n_int} int jobs / {self.n_values} values exceed "
                             f"the table's {layout.float_cap} / {layout.int_cap} / {layout.payload_cap}")

    def encode(self, out: np.ndarray, layout: TableLayout, float_base: int, int_base: int) -> int:
        """Fill the flat int64 ``out`` (>= ``layout.words``) with this launch's table (the compiled
        twin is ``encode_gather`` in ``kernels/vok_python.cpp``: same words, same order) and return
        the words it used: the kernel reads no further. ``out[0] + out[1]`` is then the launch's job
        count (a run of int rows takes fewer records than rows: the module docstring).

        ``float_base``/``int_base`` are the data pointers the kernel gets as its two bases (a float
        anchor tensor of the launcher, and the device table itself; see the module docstring).
        Raises ``ValueError`` for an int address at or above 2**48 (no such address on the 48-bit
        address spaces CUDA runs on).
        """
        self._check_capacity(layout)
        out[0], out[1] = self.n_float, self.n_int
        es = self.elem_size
        pos, single = 2, ([], [])
        for src, src_rows, dst, dst_rows in self.float_blocks:
            if type(src) is list:  # rows_each: every row of each source from its start row on
                records = noted_records(src_rows, float_base, es, ints=False)
                if records is not None:  # check_each made them while the block was recorded
                    out[pos:pos + records.size] = records
                    pos += records.size
                    continue
                dst_off, ds = (dst.data_ptr() - float_base) // es, dst.stride(0)
                for s, d, n in each_jobs(src, dst_rows):
                    end = pos + 2 * n
                    out[pos:end:2] = (s.data_ptr() - float_base) // es + _arange(n) * s.stride(0)
                    out[pos + 1:end:2] = dst_off + (d + _arange(n)) * ds
                    pos = end
                continue
            src_off, dst_off = (src.data_ptr() - float_base) // es, (dst.data_ptr() - float_base) // es
            if isinstance(dst_rows, int):
                single[0].append(src_off + src_rows * src.stride(0))
                single[1].append(dst_off + dst_rows * dst.stride(0))
                continue
            end = pos + 2 * len(dst_rows)
            np.multiply(source_rows(src_rows, dst_rows), src.stride(0), out=out[pos:end:2])
            out[pos:end:2] += src_off
            np.multiply(dst_rows, dst.stride(0), out=out[pos + 1:end:2])
            out[pos + 1:end:2] += dst_off
            pos = end
        if single[0]:  # jobs are independent: their order in the table does not matter
            end = pos + 2 * len(single[0])
            out[pos:end:2], out[pos + 1:end:2] = single
        pos, single, cap = layout.int_off, ([], [], [], []), int_run_cap(self.width, es)
        addresses = int_base  # or-ed with every address an int record is made from
        for src, src_rows, dst, dst_rows in self.int_blocks:
            addresses |= dst.data_ptr()
            if type(src) is list:  # ints_each
                records = noted_records(src_rows, int_base, 4, ints=True)
                if records is not None:  # made while recorded, from sources below 2**48 (check_each)
                    out[pos:pos + records.size] = records
                    pos += records.size
                    continue
                dw = dst.element_size() // 4
                dst_off, ds = (dst.data_ptr() - int_base) // 4, dst.stride(0) * dw
                width = dst.shape[1] if dst.dim() == 2 else 1
                for s, d, n in each_jobs(src, dst_rows):
                    addresses |= s.data_ptr()
                    sw = s.element_size() // 4
                    end = pos + 2 * n
                    _put_ints(out, pos, end, (s.data_ptr() - int_base) // 4 + _arange(n) * (s.stride(0) * sw),
                              dst_off + (d + _arange(n)) * ds, width, (sw == 2) | ((dw == 2) << 1))
                    pos = end
                continue
            addresses |= src.data_ptr()
            sw, dw = src.element_size() // 4, dst.element_size() // 4
            src_off, dst_off = (src.data_ptr() - int_base) // 4, (dst.data_ptr() - int_base) // 4
            width, flags = (dst.shape[1] if dst.dim() == 2 else 1), (sw == 2) | ((dw == 2) << 1)
            if isinstance(dst_rows, int):
                for col, v in zip(single, (src_off + src_rows * src.stride(0) * sw,
                                           dst_off + dst_rows * dst.stride(0) * dw, width, flags)):
                    col.append(v)
                continue
            if (src.stride(0) == width == dst.stride(0) and _consecutive(dst_rows)
                    and (src_rows is None or _consecutive(src_rows))):  # one run of elements
                s0 = 0 if src_rows is None else int(src_rows[0])
                pos = _run_records(out, pos, src_off + s0 * width * sw, dst_off + int(dst_rows[0]) * width * dw,
                                   len(dst_rows) * width, flags, cap)
                continue
            end = pos + 2 * len(dst_rows)
            _put_ints(out, pos, end, src_off + source_rows(src_rows, dst_rows) * (src.stride(0) * sw),
                      dst_off + dst_rows * (dst.stride(0) * dw), width, flags)
            pos = end
        if single[0]:
            end = pos + 2 * len(single[0])
            _put_ints(out, pos, end, *(np.array(col) for col in single))
            pos = end
        pos = (pos - layout.int_off) // 2
        out[1] = pos + len(self.value_blocks)
        payload_off = layout.int_off + 2 * out[1]
        payload = out[payload_off:payload_off + (self.n_values + 1) // 2].view(np.int32)
        p = 0
        for dst, v in self.value_blocks:
            addresses |= dst.data_ptr()
            rec = layout.int_off + 2 * pos
            payload[p:p + v.size] = v
            _put_ints(out, rec, rec + 2, 2 * payload_off + p, (dst.data_ptr() - int_base) // 4, v.size,
                      ((dst.element_size() == 8) << 1) | 4)
            pos += 1
            p += v.size
        if addresses >= ADDRESS_LIMIT:
            raise ValueError("an int address at or above 2**48: its offsets do not fit the job table")
        if p & 1:
            payload[p] = 0  # the rest of the last word, as the compiled twin
        return int(payload_off) + (p + 1) // 2
