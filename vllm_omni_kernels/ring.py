"""Per-request ring buffers in one preallocated arena: ``RingPool``.

A pool serves one (key, dtype, frame shape, device) and one concatenating strategy. Each request
owns a slot: a region of the arena (a buddy-allocator block) used as a ring of frames, plus a device
head. ``append`` writes every request's chunk of a step in one kernel launch; ``drain`` returns the
unread span and advances the tail (DELTA); ``consolidate`` returns everything retained without
advancing (FINAL_ONLY / CUMULATIVE); ``free`` returns the slot.

Frames: CONCAT_DIM0 chunks are ``[n, *frame_shape]`` (n frames); CONCAT_LAST chunks are
``[*frame_shape, n]`` (n samples of every channel). Capacity is in frames.

Host mirrors: every head, tail, unread size and capacity lives in numpy arrays on the host, so all
validation (dtype, shape, device, unknown slot, overflow) and growth decisions happen before a launch
and never read the device. A step costs one kernel launch and nothing else on the device. The
compiled backend's step passes the metadata rows in the launch's parameters (up to 511 rows; see
``kernels/vok_python.cpp``). Otherwise the kernel reads them in place from a ring of pinned host
buffers (device-addressable; a buffer is reused only after the work that read it has run), and a
step of long rows (more than ``UPLOAD_ELEMS`` elements: several programs per row, each of which
would read its row over the bus) copies its metadata to a device buffer first: one small copy, then
the kernel. The device heads are written by the kernel itself, so a ``StaticAppend`` (metadata
resident on the device) can be captured in a CUDA graph and replayed step after step.

Overflow: when a chunk would overwrite unread data the slot grows to the next size class that fits
(at least double), copying its unread span on the device; with growth off, or the budget spent, that
request gets a ``TensorAccumulationError`` and nothing of it is written, while the other requests of
the step go through.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from . import cuda_graphs, ops
from .allocator import BuddyAllocator
from .errors import TensorAccumulationError, TensorConsolidationError
from .modality import TensorAccumulationStrategy as Strategy
from .ops.layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, META_COLS, N, POS, SLOT
from .profiling import enabled as nvtx_enabled, nvtx_range
from .staging import PinnedStaging

_INT32_MAX = 2**31 - 1
# A launch whose rows are longer than this runs several programs per metadata row on every backend;
# its metadata is then copied to the device first rather than read over the bus by each program
# (kernels/vok_python.cpp has the same constant for the compiled step).
UPLOAD_ELEMS = 4096
_SIZE = META_COLS - 1  # the metadata column no kernel reads holds the host mirror of unread frames


@dataclass(slots=True)  # not frozen: a frozen dataclass costs a microsecond more to make, every step
class PaddedBatch:
    """One step's chunks for a batch of requests as one tensor, with per-request lengths.

    ``data``: CONCAT_DIM0 ``[B, n_max, *frame]``; CONCAT_LAST ``[B, *lead, T_max]``. Row ``b`` holds
    ``lengths[b]`` valid frames at the start of its append axis; the rest is padding and never read.
    ``lengths`` must be host values (list, numpy array or CPU tensor): reading device lengths would
    sync the host with the device every step.
    """

    data: torch.Tensor
    lengths: Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What an append did: rows launched, and one error per request that was skipped."""

    appended: int = 0
    errors: tuple[TensorAccumulationError, ...] = ()


@functools.lru_cache(maxsize=None)
def _appended(rows: int) -> AppendResult:
    """The result of a step that launched ``rows`` rows without errors (immutable: made once per count)."""
    return AppendResult(rows)


_UNSET = object()  # an _Eager.setting that no backend setting is


class _Eager(NamedTuple):
    """A pool's compiled append step and what it was bound under."""

    setting: object  # ops.setting() when last resolved: the step is used directly while it holds
    factory: object  # ops.ring_step's factory that made ``step``
    step: object
    call: object     # step.call: the step's per-call entry
    slots: np.ndarray | None  # the slots of the request list the step holds (set_slots)


@dataclass
class PoolStats:
    slots_used: int
    slots_capacity: int
    bytes_used: int
    bytes_reserved: int
    high_water_bytes: int
    unread_bytes: int
    growths: int
    rejected: int


class RingPool:
    """Slots of ring buffers for one key/dtype/frame shape/device; see the module docstring.

    Args:
        key: the output key this pool serves (used in error messages).
        dtype, frame_shape, device: what every chunk must match.
        strategy: CONCAT_DIM0 or CONCAT_LAST.
        budget_bytes: the arena size; preallocated at construction, never exceeded.
        initial_frames: capacity of a new slot (rounded up to a power of two); also the smallest block.
        max_slots: how many requests may hold a slot at once.
        growth: grow a slot on overflow (else raise for that request).
        max_rows: initial metadata rows (grows, rarely, when a larger step arrives).
    """

    def __init__(self, key: str, dtype: torch.dtype, frame_shape: Sequence[int], device: torch.device | str,
                 strategy: Strategy, *, budget_bytes: int, initial_frames: int = 4096, max_slots: int = 1024,
                 growth: bool = True, max_rows: int = 256):
        if not strategy.uses_ring:
            raise ValueError(f"RingPool serves CONCAT_DIM0/CONCAT_LAST, not {strategy}")
        self.key = key
        self.dtype = dtype
        self.frame_shape = tuple(int(s) for s in frame_shape)
        self.frame_elems = math.prod(self.frame_shape)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.strategy = strategy
        self.last = strategy is Strategy.CONCAT_LAST
        self.growth = growth
        self.max_slots = max_slots
        self.frame_bytes = self.frame_elems * torch.empty((), dtype=dtype).element_size()
        min_frames = 1 << max(0, int(initial_frames) - 1).bit_length()
        self.allocator = BuddyAllocator(max(budget_bytes // self.frame_bytes, min_frames), min_frames)
        self.arena = torch.empty(self.allocator.total_frames * self.frame_elems, dtype=dtype, device=self.device)
        self.state = torch.zeros(max_slots, dtype=torch.int64, device=self.device)  # layout.py: head words

        # Host mirrors, one entry per slot. ``_table`` is laid out like a metadata row (SLOT, BASE,
        # CAP, POS) so a step's metadata starts as one gather of it. POS is -1 ("the kernel reads the
        # device head") except for slots in ``_stale`` whose device head must be overridden once
        # (new slot: 0; grown slot: its unread size); the head itself is (tail + size) % cap.
        self._table = np.zeros((max_slots, META_COLS), np.int64)
        self._table[:, SLOT] = np.arange(max_slots)
        self._base = self._table[:, BASE]  # element offset of the region (a view: writes go to _table)
        self._cap = self._table[:, CAP]    # frames
        self._table[:, POS] = -1
        self._table_t = torch.from_numpy(self._table)  # the same memory, for the compiled step
        self._stale: set[int] = set()
        self._size = self._table[:, _SIZE]  # unread frames (the kernels ignore this column)
        self._tail = np.zeros(max_slots, np.int64)   # next frame to read
        self._drained = np.zeros(max_slots, np.int64)
        self._layout = np.zeros(max_slots, np.int64)  # bumped when base/cap/head move outside a kernel
        self._owner: dict[str, int] = {}
        self._slot_owner: list[str | None] = [None] * max_slots
        self._free_slots = list(range(max_slots - 1, -1, -1))

        self._staging = PinnedStaging(max_rows, META_COLS, self.device, twin=True)
        self._scratch = torch.empty(0, dtype=dtype, device=self.device)  # packs list inputs
        self._ids_cache: tuple | None = None  # (ids, slots, version) of the last fast step
        self._eager = _Eager(_UNSET, None, None, None, None)  # the compiled step (ops.ring_step), once bound
        self._arange = np.arange(max_rows, dtype=np.int64)
        self._device_index = self.device.index if self.device.type == "cuda" else -1  # Tensor.get_device()
        self.growths = 0
        self.rejected = 0
        self.high_water_bytes = 0
        self.version = 0  # bumped by alloc/free/growth: cached slot lookups are stale after it moves

    # ----------------------------------------------------------------- lifecycle

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def alloc(self, request_id: str) -> int:
        """Give ``request_id`` a slot with ``initial_frames`` of capacity; returns the slot index."""
        if request_id in self._owner:
            raise TensorAccumulationError("already holds a slot in this pool", request_id=request_id, key=self.key)
        if not self._free_slots:
            raise TensorAccumulationError(f"all {self.max_slots} slots of the pool are in use",
                                          request_id=request_id, key=self.key)
        region = self.allocator.alloc(self.allocator.min_frames)
        if region is None:
            raise TensorAccumulationError(f"pool budget of {self.arena.numel() * self.arena.element_size()} "
                                          "bytes is spent", request_id=request_id, key=self.key)
        slot = self._free_slots.pop()
        self._owner[request_id] = slot
        self._slot_owner[slot] = request_id
        offset, frames = region
        self._base[slot] = offset * self.frame_elems
        self._cap[slot] = frames
        self._tail[slot] = self._size[slot] = self._drained[slot] = 0
        self._table[slot, POS] = 0
        self._stale.add(slot)
        self._layout[slot] += 1
        self.version += 1
        self._note_usage()
        return slot

    def free(self, request_id: str) -> None:
        """Return the request's slot and region. Unknown or already freed → TensorAccumulationError."""
        slot = self._owner.pop(request_id, None)
        if slot is None:
            raise TensorAccumulationError("free of a slot that is unknown or already freed",
                                          request_id=request_id, key=self.key)
        self.allocator.free(int(self._base[slot] // self.frame_elems))
        self._slot_owner[slot] = None
        self._cap[slot] = self._size[slot] = 0
        self._free_slots.append(slot)
        self.version += 1

    def slot_of(self, request_id: str) -> int:
        slot = self._owner.get(request_id)
        if slot is None:
            raise TensorAccumulationError("no slot: unknown or already freed", request_id=request_id, key=self.key)
        return slot

    def unread_frames(self, request_id: str) -> int:
        return int(self._size[self.slot_of(request_id)])

    def capacity_frames(self, request_id: str) -> int:
        return int(self._cap[self.slot_of(request_id)])

    def stats(self) -> PoolStats:
        return PoolStats(
            slots_used=len(self._owner), slots_capacity=self.max_slots,
            bytes_used=self.allocator.used_frames * self.frame_bytes,
            bytes_reserved=self.arena.numel() * self.arena.element_size(),
            high_water_bytes=self.high_water_bytes,
            unread_bytes=int(self._size.sum()) * self.frame_bytes,
            growths=self.growths, rejected=self.rejected)

    def _note_usage(self) -> None:
        self.high_water_bytes = max(self.high_water_bytes, self.allocator.used_frames * self.frame_bytes)

    # ----------------------------------------------------------------- validation

    def _chunk_frames(self, t: torch.Tensor, request_id: str) -> int:
        """Validate one chunk against the pool; return its frame count."""
        if not isinstance(t, torch.Tensor):
            raise TensorAccumulationError(f"expected a tensor, got {type(t).__name__}",
                                          request_id=request_id, key=self.key)
        if t.device != self.device:
            raise TensorAccumulationError(f"tensor on {t.device} but the pool is on {self.device}",
                                          request_id=request_id, key=self.key)
        if t.dtype != self.dtype:
            raise TensorAccumulationError(f"dtype {t.dtype} but the slot holds {self.dtype}",
                                          request_id=request_id, key=self.key)
        frame = tuple(t.shape[1:]) if not self.last else tuple(t.shape[:-1])
        if t.dim() != len(self.frame_shape) + 1 or frame != self.frame_shape:
            axis = "[*frame, n]" if self.last else "[n, *frame]"
            raise TensorAccumulationError(
                f"shape {tuple(t.shape)} does not match the slot's frame shape {self.frame_shape} (chunks are {axis})",
                request_id=request_id, key=self.key)
        return int(t.shape[-1] if self.last else t.shape[0])

    def _check_fit(self, slots: np.ndarray, n: np.ndarray, ids: Sequence[str]) -> np.ndarray:
        """Grow slots that would overflow; return a keep-mask (False rows got an error recorded)."""
        keep = np.ones(len(slots), dtype=bool)
        over = np.flatnonzero(self._size[slots] + n > self._cap[slots])
        too_big = np.flatnonzero(n * self.frame_elems > _INT32_MAX)
        for i in too_big:
            keep[i] = False
            self._errors.append(TensorAccumulationError(
                f"chunk of {int(n[i])} frames exceeds the per-step limit of {_INT32_MAX // self.frame_elems}",
                request_id=ids[i], key=self.key))
        for i in over:
            if keep[i]:
                keep[i] = self._grow(int(slots[i]), int(self._size[slots[i]] + n[i]), ids[i])
        return keep

    def _grow(self, slot: int, needed: int, request_id: str) -> bool:
        cap = int(self._cap[slot])
        if not self.growth:
            self._errors.append(TensorAccumulationError(
                f"append of {needed - int(self._size[slot])} frames would overwrite unread data "
                f"(capacity {cap}, unread {int(self._size[slot])}) and growth is off",
                request_id=request_id, key=self.key))
            return False
        region = self.allocator.alloc(max(needed, 2 * cap))
        if region is None:
            self._errors.append(TensorAccumulationError(
                f"cannot grow to {needed} frames: pool budget of "
                f"{self.arena.numel() * self.arena.element_size()} bytes is spent",
                request_id=request_id, key=self.key))
            return False
        offset, frames = region
        new_base = offset * self.frame_elems
        size = int(self._size[slot])
        if size:  # copy the unread span, linearized, to the start of the new region
            i, _ = self._stage(np.array([slot]), new_base, size, frames if self.last else self.frame_elems,
                               pos=self._tail[slot])
            meta = self._meta_for(i, 1, size * self.frame_elems)
            ops.ring_read(self.arena, meta, self.arena, rows=1, frame_elems=self.frame_elems, last=self.last,
                          max_elems=size * self.frame_elems)
        self.allocator.free(int(self._base[slot] // self.frame_elems))
        self._base[slot], self._cap[slot] = new_base, frames
        self._tail[slot] = 0
        self._table[slot, POS] = size % frames
        self._stale.add(slot)
        self._layout[slot] += 1
        self.version += 1
        self.growths += 1
        self._note_usage()
        return True

    # ----------------------------------------------------------------- append

    def append(self, request_ids: Sequence[str], chunks: PaddedBatch | Sequence[torch.Tensor | None]) -> AppendResult:
        """Append one step's chunks for ``request_ids`` (aligned; a None chunk skips that request).

        ``chunks`` is a ``PaddedBatch`` (the fast path: no copy besides the kernel) or a list of
        per-request tensors (packed into a persistent scratch buffer with one ``torch.cat`` first).
        Requests must hold a slot (``alloc``). Invalid requests are skipped with a
        ``TensorAccumulationError`` each in the result; the valid ones are written by one launch.
        """
        if type(chunks) is PaddedBatch:
            if chunks.data.requires_grad:  # output data: its autograd history is not ours to keep
                chunks = PaddedBatch(chunks.data.detach(), chunks.lengths)
        elif any(isinstance(t, torch.Tensor) and t.requires_grad for t in chunks):
            chunks = [t.detach() if isinstance(t, torch.Tensor) else t for t in chunks]
        eager = self._eager
        # The common eager step with the compiled backend: one call into the extension, reached
        # in as few Python operations as possible (they cost as much as the step's C++ half).
        # ``eager.setting`` never matches with nvtx ranges on (_compiled_append).
        if eager.setting is ops.setting() and type(chunks) is PaddedBatch:
            rows = eager.call(request_ids, chunks.data, chunks.lengths, self.version)
            if rows > 0:
                if self._stale:
                    self._unstale(eager.slots)
                return _appended(rows)
            if rows < 0:  # declined: not the fast path's step
                return self._general_append(request_ids, chunks)
            done = self._compiled_append(eager.factory, request_ids, chunks, rows)  # a miss: give the slots
            return _appended(done) if done is not None else self._general_append(request_ids, chunks)
        if nvtx_enabled():
            with nvtx_range(f"ring.append[{self.key}]"):
                return self._append(request_ids, chunks)
        return self._append(request_ids, chunks)

    def _append(self, request_ids, chunks) -> AppendResult:
        if type(chunks) is PaddedBatch:  # the common step first: one launch, no per-request work
            make_step = ops.ring_step(self._device_index >= 0)
            if make_step is not None:
                done = self._compiled_append(make_step, request_ids, chunks)
            else:
                done = self._fast_append(request_ids, chunks)
            if done is not None:
                return _appended(done)
        return self._general_append(request_ids, chunks)

    def _general_append(self, request_ids, chunks) -> AppendResult:
        """Any step: per-request checks (errors recorded, those requests skipped), growth, one launch."""
        self._errors: list[TensorAccumulationError] = []
        if isinstance(chunks, PaddedBatch):
            rows = self._rows_from_batch(request_ids, chunks)
        else:
            rows = self._rows_from_list(request_ids, chunks)
        appended = self._launch_append(*rows) if rows is not None else 0
        self.rejected += len(self._errors)
        return AppendResult(appended, tuple(self._errors))

    def _fast_append(self, request_ids, batch: PaddedBatch) -> int | None:
        """The common step in few host operations: every request known and distinct, a contiguous
        batch of the pool's dtype and frame shape, lengths in range, no overflow. Returns the rows
        launched, or None (nothing done) to send the step to the general path, which finds and
        reports whatever is off. Slot lookups are cached while the request list and pool are unchanged.

        The step is planned by ``_plan_numpy`` and launched with ``ops.ring_write``; with the compiled
        backend ``_compiled_append`` does all of it in one call into the extension instead.
        """
        data = batch.data
        if data.dtype is not self.dtype or data.get_device() != self._device_index or not data.is_contiguous():
            return None
        shape = data.shape
        if len(shape) != len(self.frame_shape) + 2 or \
                (self.frame_shape and (shape[1:-1] if self.last else shape[2:]) != self.frame_shape):
            return None
        cached = self._slots_of(request_ids)
        if cached is None:
            return None
        slots = cached[1]
        B = len(slots)
        n = batch.lengths
        if not isinstance(n, np.ndarray) or n.dtype != np.int64:
            if isinstance(n, torch.Tensor):
                return None
            n = np.asarray(n, dtype=np.int64)
        axis_len = shape[-1] if self.last else shape[1]
        if shape[0] != B or n.shape != (B,) or B == 0 or axis_len * self.frame_elems > _INT32_MAX:
            return None
        if B > self._staging.rows:
            self._ensure_rows(B)
        i, host = self._staging.host()
        max_n = self._plan_numpy(host, slots, n, axis_len * self.frame_elems, axis_len,
                                 axis_len if self.last else self.frame_elems)
        if max_n < 0:
            return None  # nothing was planned
        max_elems = max_n * self.frame_elems
        ops.ring_write(self.arena, self.state, self._meta_for(i, B, max_elems), data, rows=B,
                       frame_elems=self.frame_elems, last=self.last, max_elems=max_elems)
        if self._stale:
            self._unstale(slots)
        return B

    def _slots_of(self, request_ids) -> tuple[tuple, np.ndarray] | None:
        """(ids as a tuple, their slots) when every request holds a slot and none repeats, else None.
        Cached for the last request list while the pool's version holds."""
        ids = tuple(request_ids)
        cached = self._ids_cache
        if cached is not None and cached[2] == self.version and cached[0] == ids:
            return cached[:2]
        owner = self._owner
        try:
            slots = np.array([owner[r] for r in ids], np.int64)
        except KeyError:
            return None
        if len(set(ids)) != len(ids):
            return None
        self._ids_cache = (ids, slots, self.version)
        return ids, slots

    def _compiled_append(self, make_step, request_ids, batch: PaddedBatch, rows: int | None = None) -> int | None:
        """``_fast_append`` as one call into the compiled extension (``ops.ring_step``: checks,
        planning, staging, launch); on a miss of its cached request list it is given the slots once
        and called again. ``append`` calls the bound step directly while the backend setting holds,
        and passes ``rows`` = 0 when that call missed."""
        eager = self._eager
        if eager.factory is not make_step:
            step = make_step(self.arena, self.state, self._table_t, self.frame_shape, self.last)
            eager = _Eager(_UNSET, make_step, step, step.call, None)
        if eager.setting is not ops.setting() and not nvtx_enabled():  # append may call it directly
            eager = eager._replace(setting=ops.setting())
        self._eager = eager
        if rows is None:
            rows = eager.call(request_ids, batch.data, batch.lengths, self.version)
        if rows == 0:
            cached = self._slots_of(request_ids)
            if cached is None:
                return None
            eager.step.set_slots(cached[0], cached[1], self.version)
            self._eager = eager = eager._replace(slots=cached[1])
            rows = eager.call(request_ids, batch.data, batch.lengths, self.version)
        if rows <= 0:  # declined (or, impossibly, a second miss): the general path decides
            return None
        if self._stale:
            self._unstale(eager.slots)
        return rows

    def _plan_numpy(self, staged: np.ndarray, slots: np.ndarray, n: np.ndarray, row_elems: int, axis_len: int,
                    lin_stride: int) -> int:
        """Plan one step into ``staged``: the numpy twin of the compiled step's planner
        (``plan_rows`` in ``kernels/vok_python.cpp``).

        ``slots`` are distinct; row b's chunk starts at element ``b * row_elems`` of the source. Every
        row is checked first (0 <= n <= axis_len, n fits in the slot's free frames); then the rows are
        staged, unread sizes advance and head overrides are cleared, and the largest n is returned.
        Else -(b + 1) for the first row b that does not fit, with nothing changed.
        """
        B = len(slots)
        # One reduction checks 0 <= n <= axis_len: negative lengths are huge as unsigned.
        if n.view(np.uint64).max() > axis_len:
            return -int(np.flatnonzero((n < 0) | (n > axis_len))[0]) - 1
        m = staged[:B]
        np.take(self._table, slots, axis=0, out=m)
        over = n > m[:, CAP] - m[:, _SIZE]
        if over.any():
            return -int(np.flatnonzero(over)[0]) - 1
        np.multiply(self._arange[:B], row_elems, out=m[:, LIN_OFF])
        m[:, N] = n
        m[:, LIN_STRIDE] = lin_stride
        self._size[slots] += n
        if self._stale:
            self._table[slots, POS] = -1
        return int(n.max())

    def _lookup(self, request_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Slots of the requests (-1 where unknown, with an error recorded) and a keep-mask."""
        owner = self._owner
        slots = np.fromiter((owner.get(r, -1) for r in request_ids), np.int64, len(request_ids))
        keep = slots >= 0
        for i in np.flatnonzero(~keep):
            self._errors.append(TensorAccumulationError("no slot: unknown or already freed request",
                                                        request_id=request_ids[i], key=self.key))
        if len(set(request_ids)) != len(request_ids):
            seen: set[str] = set()
            for i, r in enumerate(request_ids):
                if r in seen and keep[i]:
                    keep[i] = False
                    self._errors.append(TensorAccumulationError("appears twice in one step; second chunk skipped",
                                                                request_id=r, key=self.key))
                seen.add(r)
        return slots, keep

    def _rows_from_batch(self, request_ids, batch: PaddedBatch):
        data = batch.data
        B = len(request_ids)
        lengths = batch.lengths
        if isinstance(lengths, torch.Tensor):
            if lengths.device.type != "cpu":
                raise TypeError("PaddedBatch.lengths must be host values; a device tensor would sync every step")
            lengths = lengths.numpy()
        n = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if data.dim() < 1 or data.shape[0] != B or n.shape[0] != B:
            raise ValueError(f"PaddedBatch for key {self.key!r}: data batch {tuple(data.shape[:1])}, "
                             f"{n.shape[0]} lengths, {B} request ids")
        slots, keep = self._lookup(request_ids)
        try:
            axis_len = self._chunk_frames(data[0] if B else data.new_empty(()), "<batch>") if B else 0
        except TensorAccumulationError as exc:
            for i in np.flatnonzero(keep):
                self._errors.append(exc.for_request(request_ids[i]))
            return None
        bad = np.flatnonzero(keep & ((n < 0) | (n > axis_len)))
        for i in bad:
            keep[i] = False
            self._errors.append(TensorAccumulationError(
                f"length {int(n[i])} outside [0, {axis_len}] of the padded batch", request_id=request_ids[i],
                key=self.key))
        # Rows of the batch as [B, L, T] (CONCAT_LAST) or [B, n, F] (CONCAT_DIM0), without copying.
        if self.last:
            view = data.reshape(B, self.frame_elems, axis_len)
        else:
            view = data.reshape(B, axis_len, self.frame_elems)
        if view.stride(2) != 1 or (view.data_ptr() != data.data_ptr()):
            view = view.contiguous()
        if keep.all():
            idx = None
        else:
            idx = np.flatnonzero(keep)
            slots, n = slots[idx], n[idx]
            request_ids = [request_ids[i] for i in idx]
        fit = self._check_fit(slots, n, request_ids)
        if not fit.all():
            sel = np.flatnonzero(fit)
            idx = sel if idx is None else idx[sel]
            slots, n = slots[sel], n[sel]
        rows = np.arange(B, dtype=np.int64) if idx is None else idx
        lin_off = rows * view.stride(0)
        return view, slots, n, lin_off, np.full(len(slots), view.stride(1), np.int64)

    def _rows_from_list(self, request_ids, chunks):
        if len(chunks) != len(request_ids):
            raise ValueError(f"{len(chunks)} chunks for {len(request_ids)} request ids (key {self.key!r})")
        slots, keep = self._lookup(request_ids)
        n = np.zeros(len(chunks), np.int64)
        for i, t in enumerate(chunks):
            if t is None:
                keep[i] = False
            elif keep[i]:
                try:
                    n[i] = self._chunk_frames(t, request_ids[i])
                except TensorAccumulationError as exc:
                    keep[i] = False
                    self._errors.append(exc)
        idx = np.flatnonzero(keep)
        ids = [request_ids[i] for i in idx]
        slots, n = slots[idx], n[idx]
        fit = self._check_fit(slots, n, ids)
        idx, slots, n = idx[fit], slots[fit], n[fit]
        if len(idx) == 0:
            return None
        total = int(n.sum())
        F = self.frame_elems
        if self._scratch.numel() < total * F:
            self._scratch = torch.empty(max(total * F, 2 * self._scratch.numel()), dtype=self.dtype, device=self.device)
        parts = [chunks[i] for i in idx]
        starts = np.concatenate(([0], np.cumsum(n)[:-1])).astype(np.int64)
        if self.last:
            packed = self._scratch[: total * F].view(F, total)
            torch.cat([p.reshape(F, -1) for p in parts], dim=1, out=packed)
            return packed, slots, n, starts, np.full(len(idx), total, np.int64)
        packed = self._scratch[: total * F].view(total, F)
        torch.cat([p.reshape(-1, F) for p in parts], dim=0, out=packed)
        return packed, slots, n, starts * F, np.full(len(idx), F, np.int64)

    def _ensure_rows(self, rows: int) -> None:
        if rows > self._staging.rows:
            new = 1 << (rows - 1).bit_length()
            if self._staging.pinned:  # kernels may still be reading the old pinned rows in place
                torch.cuda.current_stream().synchronize()  # rare: only when a step outgrows the rows
            self._staging = PinnedStaging(new, META_COLS, self.device, twin=True)
            self._arange = np.arange(new, dtype=np.int64)

    def _stage(self, slots: np.ndarray, lin_off, n, lin_stride, pos=None) -> tuple[int, np.ndarray]:
        """Metadata rows for ``slots`` in the next staging buffer: one gather of the slot table
        (SLOT, BASE, CAP, POS, and the host-only SIZE column), then the step's own columns; ``pos``
        replaces POS (reads start at the tail). Returns the buffer index and the rows."""
        self._ensure_rows(len(slots))
        i, host = self._staging.host()
        m = host[: len(slots)]
        np.take(self._table, slots, axis=0, out=m)
        m[:, LIN_OFF] = lin_off
        m[:, N] = n
        m[:, LIN_STRIDE] = lin_stride
        if pos is not None:
            m[:, POS] = pos
        return i, m

    def _meta_for(self, i: int, rows: int, max_elems: int) -> torch.Tensor:
        """Staging buffer ``i`` (its first ``rows`` rows) for a launch whose longest row has
        ``max_elems`` elements: read in place, or copied to the device first for long rows."""
        return self._staging.for_kernel(i, rows, max_elems > UPLOAD_ELEMS)

    def _write_staged(self, i: int, m: np.ndarray, src, slots: np.ndarray, n: np.ndarray) -> int:
        """Upload staged rows, launch the write kernel, advance the host mirrors."""
        max_elems = int(n.max()) * self.frame_elems
        meta = self._meta_for(i, len(slots), max_elems)
        ops.ring_write(self.arena, self.state, meta, src, rows=len(slots), frame_elems=self.frame_elems,
                       last=self.last, max_elems=max_elems)
        self._size[slots] += n
        if self._stale:
            self._unstale(slots)
        return len(slots)

    def _launch_append(self, src, slots, n, lin_off, lin_stride) -> int:
        if len(slots) == 0:
            return 0
        i, m = self._stage(slots, lin_off, n, lin_stride)
        return self._write_staged(i, m, src, slots, n)

    def _unstale(self, slots: np.ndarray) -> None:
        """After a write launch, the device heads of these slots are current again."""
        hit = self._stale.intersection(slots.tolist())
        if hit:
            idx = list(hit)
            self._table[idx, POS] = -1
            self._stale.difference_update(hit)


    # ----------------------------------------------------------------- read out

    def drain(self, request_ids: Sequence[str]) -> list[torch.Tensor]:
        """The unread span of each request (DELTA), as views into one new tensor; advances the tails."""
        out = torch.empty(self.unread_elements(request_ids), dtype=self.dtype, device=self.device)
        return self._views(out, *self.read_into(request_ids, out, drain=True))

    def consolidate(self, request_ids: Sequence[str]) -> list[torch.Tensor]:
        """Everything each request appended, as views into one new tensor; nothing is advanced.

        Raises:
            TensorConsolidationError: part of a request's data was already drained, so "everything
                appended" no longer exists (the request mixed DELTA and FINAL_ONLY reads).
        """
        out = torch.empty(self.unread_elements(request_ids), dtype=self.dtype, device=self.device)
        return self._views(out, *self.read_into(request_ids, out, drain=False))

    def unread_elements(self, request_ids: Sequence[str]) -> int:
        """Elements a read of these requests copies (what ``read_into``'s ``out`` must hold)."""
        return int(self._size[[self.slot_of(r) for r in request_ids]].sum()) * self.frame_elems

    def check_consolidate(self, request_ids: Sequence[str]) -> None:
        """Raise what ``consolidate(request_ids)`` would raise, reading nothing (TensorAccumulationError
        for a request without a slot, TensorConsolidationError for one already drained)."""
        for r in request_ids:
            drained = int(self._drained[self.slot_of(r)])
            if drained:
                raise TensorConsolidationError(f"{drained} frames were already drained; cannot consolidate",
                                               request_id=r, key=self.key)

    def read_into(self, request_ids: Sequence[str], out: torch.Tensor, *, drain: bool) -> tuple[np.ndarray, np.ndarray]:
        """Copy each request's unread span back to back into ``out`` (a contiguous 1-D tensor of the
        pool's dtype and device, at least ``unread_elements`` long) in one launch: with ``drain`` the
        tails advance (DELTA), else nothing moves and the spans must be everything appended
        (``check_consolidate``). Returns each request's element offset in ``out`` and its frames
        (int64 arrays). Span j of a request is laid out as its chunks are: ``[*frame, n]`` for
        CONCAT_LAST, ``[n, *frame]`` for CONCAT_DIM0."""
        if not drain:
            self.check_consolidate(request_ids)
        slots = np.fromiter((self.slot_of(r) for r in request_ids), np.int64, len(request_ids))
        rows = len(slots)
        n = self._size[slots].copy()
        F = self.frame_elems
        starts = np.zeros(rows, np.int64)
        np.cumsum(n[:-1] * F, out=starts[1:])
        total = int(n.sum()) * F
        if out.dtype != self.dtype or out.device != self.device or out.dim() != 1 or out.numel() < total \
                or not out.is_contiguous():
            raise ValueError(f"pool {self.key!r}: out must be a contiguous 1-D {self.dtype} tensor on "
                             f"{self.device} of at least {total} elements")
        with nvtx_range(f"ring.{'drain' if drain else 'consolidate'}[{self.key}]"):
            if rows and total:
                i, _ = self._stage(slots, starts, n, n if self.last else F, pos=self._tail[slots])
                max_elems = int(n.max()) * F
                meta = self._meta_for(i, rows, max_elems)
                ops.ring_read(self.arena, meta, out, rows=rows, frame_elems=F, last=self.last, max_elems=max_elems)
            if drain:
                self._tail[slots] = (self._tail[slots] + n) % np.maximum(self._cap[slots], 1)
                self._drained[slots] += n
                self._size[slots] = 0
        return starts, n

    def _views(self, out: torch.Tensor, starts: np.ndarray, n: np.ndarray) -> list[torch.Tensor]:
        F = self.frame_elems
        views = []
        for s, k in zip(starts.tolist(), n.tolist()):
            flat = out[s : s + k * F]
            views.append(flat.view(*self.frame_shape, k) if self.last else flat.view(k, *self.frame_shape))
        return views

    # ----------------------------------------------------------------- CUDA graphs

    def static_append(self, request_ids: Sequence[str], src: torch.Tensor, lengths: Sequence[int]) -> "StaticAppend":
        """A fixed-shape append (same requests, source buffer and lengths every step) for graph capture."""
        return StaticAppend(self, request_ids, src, lengths)


class StaticAppend:
    """The append of a fixed step shape, with its metadata resident on the device.

    ``launch()`` is exactly one kernel that reads heads from the device and advances them, so it can
    be captured in a CUDA graph; ``prepare(steps)`` must run on the host before each launch or replay
    of a graph holding ``steps`` launches: it grows slots that would overflow, refreshes the resident
    metadata and device heads if a slot moved, and advances the host mirrors.
    """

    def __init__(self, pool: RingPool, request_ids: Sequence[str], src: PaddedBatch | torch.Tensor,
                 lengths: Sequence[int] | None = None):
        if isinstance(src, PaddedBatch):
            src, lengths = src.data, src.lengths
        self.pool = pool
        self.request_ids = list(request_ids)
        pool._errors = []
        rows = pool._rows_from_batch(self.request_ids, PaddedBatch(src, lengths))
        if pool._errors or rows is None:
            raise pool._errors[0] if pool._errors else ValueError("empty static append")
        self.src, self.slots, self.n, self.lin_off, self.lin_stride = rows
        self.meta = torch.zeros(len(self.slots), META_COLS, dtype=torch.int64, device=pool.device)
        self._layout_seen = None
        self._version_seen = -1
        self.max_elems = int(self.n.max()) * pool.frame_elems

    def prepare(self, steps: int = 1) -> None:
        """Host work before ``steps`` launches: capacity, resident metadata, heads, mirrors.

        Raises:
            TensorAccumulationError: a request no longer holds a slot, or a slot cannot grow.
        """
        pool = self.pool
        if pool.version != self._version_seen:
            self.slots = np.array([pool.slot_of(r) for r in self.request_ids], np.int64)
        grow = pool._size[self.slots] + self.n * steps > pool._cap[self.slots]
        if grow.any():
            pool._errors = []
            if not pool._check_fit(self.slots, self.n * steps, self.request_ids).all():
                raise pool._errors[0]
        if pool.version != self._version_seen:
            self._refresh()
        if pool._stale:
            self._write_stale_heads()
        pool._size[self.slots] += self.n * steps

    def _refresh(self) -> None:
        """Re-upload the resident metadata and device heads if any of our slots moved."""
        pool = self.pool
        self._version_seen = pool.version
        layout = np.concatenate((self.slots, pool._layout[self.slots]))
        if self._layout_seen is None or not np.array_equal(layout, self._layout_seen):
            m = np.zeros((len(self.slots), META_COLS), np.int64)
            m[:, SLOT], m[:, LIN_OFF], m[:, N] = self.slots, self.lin_off, self.n
            m[:, BASE], m[:, CAP], m[:, POS] = pool._base[self.slots], pool._cap[self.slots], -1
            m[:, LIN_STRIDE] = self.lin_stride
            self.meta.copy_(torch.from_numpy(m))
            self._layout_seen = layout.copy()

    def _write_stale_heads(self) -> None:
        """Set the device heads the kernel will read for our slots whose head is overridden."""
        pool = self.pool
        hit = pool._stale.intersection(self.slots.tolist())
        if hit:
            idx = np.array(sorted(hit), np.int64)
            heads = torch.from_numpy(pool._table[idx, POS].copy()).to(pool.device)
            pool.state[torch.from_numpy(idx).to(pool.device)] = heads << HEAD_SHIFT
            pool._unstale(idx)

    def capture_graph(self, launches: int = 1) -> torch.cuda.CUDAGraph:
        """A CUDA graph of ``launches`` appends. Its warm-up (``prepare(1)`` and one launch, outside
        the capture) appends the current source once; call ``prepare(launches)`` before each replay."""
        return cuda_graphs.capture(self.launch, launches, warmup=self._warm_up)

    def _warm_up(self) -> None:
        self.prepare(1)
        self.launch()

    def launch(self) -> None:
        """One kernel: append every request's chunk at its device head and advance the head."""
        p = self.pool
        ops.ring_write(p.arena, p.state, self.meta, self.src, rows=len(self.slots), frame_elems=p.frame_elems,
                       last=p.last, max_elems=self.max_elems)
