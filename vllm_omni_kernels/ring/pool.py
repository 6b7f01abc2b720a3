"""Per-request ring buffers in one preallocated arena: ``RingPool``.

A pool serves one (key, dtype, frame shape, device) and one concatenating strategy. Each request
owns a slot: a region of the arena (a buddy-allocator block) used as a ring of frames, plus a device
head. ``append`` writes every request's chunk of a step in one kernel launch; ``drain`` returns the
unread span and advances the tail (DELTA); ``consolidate`` returns everything retained without
advancing (FINAL_ONLY / CUMULATIVE); ``read_into`` copies either into a caller's buffer; ``free``
returns the slot.

Frames: CONCAT_DIM0 chunks are ``[n, *frame_shape]`` (n frames); CONCAT_LAST chunks are
``[*frame_shape, n]`` (n samples of every channel). Capacity is in frames.

Host mirrors: every head, tail, unread size and capacity lives in numpy arrays on the host, so all
validation (dtype, shape, device, unknown slot, overflow) and growth decisions happen before a launch
and never read the device. A launch's metadata rows (``planner.py``) go into a ring of pinned host
buffers that the kernel reads in place (pinned memory is device-addressable; a buffer is reused only
after the work that read it has run); a launch of long rows (more than ``UPLOAD_ELEMS`` elements:
several programs per row, each of which would read its row over the bus) copies its rows to the
device first. The device heads are written by the kernel itself, so an append with its metadata
resident on the device (``graph.StaticAppend``) can be captured in a CUDA graph and replayed.

Repeated steps: a step whose requests, source shape and strides and lengths are those of the last
planned step (the steady decode step: every request one chunk of the same size) launches from that
step's rows, kept on the device (``_RepeatPlan``) when a step first repeats it: no planning, no upload,
and the kernel reads device memory. Its frames are counted in the host table when something reads it (``_settle``).

Overflow: when a chunk would overwrite unread data the slot grows to the next size class that fits
(at least double), copying its unread span on the device; with growth off that request gets a
``TensorAccumulationError``, with the budget spent an ``OutputMemoryError`` (a retry can succeed once
other requests free theirs; a request that needs more than the budget could ever give it gets a
``TensorAccumulationError``), and nothing of it is written, while the other requests of the step go
through.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence
from itertools import repeat
from dataclasses import dataclass

import numpy as np
import torch

from .. import backend, ops
from ..errors import OutputMemoryError, OutputTooLargeError, TensorAccumulationError, TensorConsolidationError
from ..modality import TensorAccumulationStrategy as Strategy
from ..ops.layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, META_COLS, POS, SLOT, UNREAD
from ..profiling import nvtx_range
from .allocator import BuddyAllocator
from .planner import plan_read, plan_write
from .staging import PinnedStaging

_INT32_MAX = 2**31 - 1
MAX_SLOTS = 65535  # slots of a pool: the rows one launch takes (the grid's second axis)
_MAX_FRAMES = (1 << (63 - HEAD_SHIFT)) - 1  # the frames of an arena: a head word's position field is signed
UPLOAD_ELEMS = 4096  # rows longer than this: several programs per row, metadata copied to the device first

# The pool's public steps plan on the host (numpy over the host mirrors) and launch: a caller that
# torch.compile compiles runs them as they are, not traced (the compiler failed on the planning's
# arrays, and would take the host mirrors for graph constants).
_host_side = torch.compiler.disable


def more_slots(slots: int) -> int:
    """The slots a pool of ``slots`` grows to when it needs one more: twice as many (at least one),
    at most ``MAX_SLOTS``."""
    return min(max(2 * slots, 1), MAX_SLOTS)


@dataclass(slots=True)
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


@dataclass(slots=True)
class _RepeatPlan:
    """The last step's launch, kept while nothing it depends on changes: a step with the same
    requests, source shape, strides and lengths (the steady decode step) launches from these rows,
    resident on the device, without planning again. ``room``: frames every slot can still take
    (a lower bound while ``writes`` is the pool's); ``pending``: launches whose frames are not yet
    counted in the table's UNREAD."""

    ids: tuple
    version: int
    shape: tuple
    stride: tuple
    n_bytes: bytes
    n: np.ndarray | None = None  # the rest is filled when a step repeats this one: its rows are kept
    slots: np.ndarray | None = None
    meta: torch.Tensor | None = None
    max_elems: int = 0
    room: int = 0
    writes: int = -1
    pending: int = 0
    wanted: bool = False  # a step repeated this one: the planning path keeps its rows
    result: AppendResult | None = None  # what a repeated append returns (every request appended)


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
    repeated_launches: int  # appends launched from the kept rows of the step they repeat


class RingPool:
    """Slots of ring buffers for one key/dtype/frame shape/device; see the module docstring.

    Args:
        key: the output key this pool serves (used in error messages).
        dtype, frame_shape, device: what every chunk must match.
        strategy: CONCAT_DIM0 or CONCAT_LAST.
        budget_bytes: the arena size; preallocated at construction, never exceeded.
        initial_frames: capacity of a new slot (rounded up to a power of two, and at most what the
            budget holds); also the smallest block.
        max_slots: how many requests may hold a slot at once (``grow_slots`` makes room for more).
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
        if self.frame_elems == 0 or min(self.frame_shape, default=1) < 0:
            raise ValueError(f"pool {key!r}: a frame of shape {self.frame_shape} holds no element")
        self.device = backend.resolve_device(device)
        why = uncopied(dtype, self.device)
        if why:
            raise ValueError(f"pool {key!r}: {why}")
        self._on_device = backend.on_device(self.device)
        self.strategy = strategy
        self.last = strategy is Strategy.CONCAT_LAST
        self.unit = "samples" if self.last else "frames"  # what its frames are, in error messages
        self.growth = growth
        self.max_slots = max_slots
        self.frame_bytes = self.frame_elems * dtype.itemsize
        self.max_unread_frames = _INT32_MAX // self.frame_elems  # what one launch copies of a slot
        if max_slots > MAX_SLOTS:
            raise ValueError(f"pool {key!r}: {max_slots} slots; a launch takes at most {MAX_SLOTS} rows")
        if budget_bytes < self.frame_bytes:  # (no frame: budget_frames would be 0)
            raise ValueError(f"pool {key!r}: a budget of {budget_bytes} bytes holds no frame of {self.frame_bytes}")
        # a new slot's frames: initial_frames rounded up to a power of two, as many as the budget holds
        budget_frames = budget_bytes // self.frame_bytes
        if budget_frames > _MAX_FRAMES:
            raise ValueError(f"pool {key!r}: a budget of {budget_frames} frames; a head word holds positions below "
                             f"{_MAX_FRAMES + 1}")
        min_frames = min(1 << max(0, int(initial_frames) - 1).bit_length(), 1 << (budget_frames.bit_length() - 1))
        self.allocator = BuddyAllocator(budget_frames, min_frames)
        self.arena = torch.empty(self.allocator.total_frames * self.frame_elems, dtype=dtype, device=self.device)
        self.state = torch.zeros(max_slots, dtype=torch.int64, device=self.device)  # layout.py: head words
        self.table = np.zeros((max_slots, META_COLS), np.int64)  # planner.py: one row per slot
        self.table[:, SLOT] = np.arange(max_slots)
        self.table[:, POS] = -1
        self._tail = np.zeros(max_slots, np.int64)   # next frame to read
        self._drained = np.zeros(max_slots, np.int64)
        self.layout = np.zeros(max_slots, np.int64)  # bumped when a slot's region or head moves outside a kernel
        self._owner: dict[str, int] = {}
        self._slot_free = np.ones(max_slots, bool)
        self._overrides = 0  # slots whose POS holds a head override (new or grown slots)
        self._staging = PinnedStaging(max_rows, META_COLS, self.device, device_copy=True)
        self._scratch = torch.empty(0, dtype=dtype, device=self.device)  # packs list inputs
        self._ids_cache: tuple = ((), np.zeros(0, np.int64), -1)  # (ids, slots, version) of the last step
        self._repeat: _RepeatPlan | None = None
        self._rows = np.zeros(0, np.int64)
        self._resident = torch.empty(max_rows, META_COLS, dtype=torch.int64, device=self.device)
        self._nvtx_append = f"ring.append[{key}]"
        self.growths = 0
        self.rejected = 0
        self.repeated_launches = 0
        self.writes = 0  # write launches and advances so far: a room bound stays valid while it is unchanged
        self.high_water_bytes = 0
        self.version = 0  # bumped by alloc/free/growth: cached slot lookups are stale after it moves
        self._pins: weakref.WeakSet = weakref.WeakSet()  # what reads ``state`` in place (pin_state)

    def pin_state(self, owner: object) -> None:
        """Keep the device's head words (``state``) where they are while ``owner`` lives: a
        ``StaticAppend``, whose captured graph reads them in place. ``grow_slots`` refuses until then."""
        self._pins.add(owner)

    def grow_slots(self, max_slots: int) -> None:
        """Let ``max_slots`` requests hold a slot at once (more than now): the slots held keep their
        indices, regions and data. The device's head words move to a larger tensor, ordered on the
        current stream after every launch before.

        Raises:
            ValueError: more than ``MAX_SLOTS``.
            RuntimeError: something reads the head words in place (``pin_state``).
        """
        old = self.max_slots
        if max_slots <= old:
            return
        if max_slots > MAX_SLOTS:
            raise ValueError(f"pool {self.key!r}: {max_slots} slots; a launch takes at most {MAX_SLOTS} rows")
        if self._pins:
            raise RuntimeError(f"pool {self.key!r} cannot grow to {max_slots} slots while a StaticAppend reads its "
                               "head words in place (its graph would write the old ones)")
        self._settle()
        state = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        state[:old].copy_(self.state)
        table = np.zeros((max_slots, META_COLS), np.int64)
        table[:old] = self.table
        table[old:, SLOT] = np.arange(old, max_slots)
        table[old:, POS] = -1
        more = np.zeros(max_slots - old, np.int64)
        self.state, self.table, self.max_slots = state, table, max_slots
        self._tail, self._drained = np.concatenate((self._tail, more)), np.concatenate((self._drained, more))
        self.layout = np.concatenate((self.layout, more))
        self._slot_free = np.concatenate((self._slot_free, np.ones(max_slots - old, bool)))
        self._repeat = None
        self.version += 1

    # ----------------------------------------------------------------- lifecycle

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    @_host_side
    def alloc(self, request_id: str, slot: int | None = None, frames: int = 0) -> int:
        """Give ``request_id`` a slot with ``initial_frames`` of capacity (or room for ``frames``, when
        the caller knows how much the request will hold and a sixteenth of the arena covers it);
        returns the slot index (``slot``: that one, which must be free; a caller that keeps rows of
        its own, such as the worker accumulator, uses the same index in every pool and passes it to
        ``append``/``read_into``). A request whose ``frames`` no slot of the budget could ever hold
        (growing, a slot keeps its old region until its data has moved) is refused at once with a
        ``TensorAccumulationError``; ``OutputMemoryError`` when the budget is spent now."""
        if request_id in self._owner:
            raise TensorAccumulationError("already holds a slot in this pool", request_id=request_id, key=self.key)
        if len(self._owner) >= self.max_slots:
            raise TensorAccumulationError(f"all {self.max_slots} slots of the pool are in use",
                                          request_id=request_id, key=self.key)
        if slot is None:
            slot = int(self._slot_free.argmax())
        elif not (0 <= slot < self.max_slots and self._slot_free[slot]):
            raise TensorAccumulationError(f"slot {slot} is not free", request_id=request_id, key=self.key)
        try:
            frames = operator.index(frames)  # (a numpy integer too)
        except TypeError:
            raise TensorAccumulationError(f"a frames hint of type {type(frames).__name__}, not an integer",
                                          request_id=request_id, key=self.key) from None
        reserve = self._reserves(frames)
        if not self._ever_holds(frames):
            # (not an OutputMemoryError: no retry holds it; the growth that would find out comes late,
            # and, with other requests growing at once, as an OutputMemoryError)
            raise OutputTooLargeError(
                f"the request will hold {frames} {self.unit}, more than one request can hold in this pool's budget "
                f"of {self.arena_bytes} bytes; raise the budget", request_id=request_id, key=self.key)
        region = self.allocator.alloc(frames) if reserve else None  # none free: the smallest one, grown when needed
        region = region or self.allocator.alloc(self.allocator.min_frames)
        if region is None:
            raise OutputMemoryError(f"pool budget of {self.arena_bytes} bytes is spent", request_id=request_id,
                                    key=self.key)
        self._slot_free[slot] = False
        self._owner[request_id] = slot
        offset, capacity = region
        self.table[slot, BASE], self.table[slot, CAP], self.table[slot, UNREAD] = offset * self.frame_elems, capacity, 0
        self._override_head(slot, 0)
        self._tail[slot] = self._drained[slot] = 0
        self.layout[slot] += 1
        self.version += 1
        self._note_usage()
        return slot

    def _reserves(self, frames: int) -> bool:
        """Whether ``alloc(frames=frames)`` takes a region for all of it at once (else the smallest)."""
        return frames > self.allocator.min_frames and 16 * frames <= self.allocator.total_frames

    def _ever_holds(self, frames: int) -> bool:
        """Whether a slot of the budget could ever hold ``frames`` (``alloc``'s hint): taken at once,
        or grown to it (a slot keeps its old region until its data has moved: ``grows_to``)."""
        return frames <= self.allocator.min_frames or \
            (self.allocator.ever_fits(frames) if self._reserves(frames) else self.allocator.grows_to(frames))

    def most_frames(self) -> int:
        """The most frames ``alloc(frames=...)`` takes: what one request of this pool can ever hold."""
        low, high = self.allocator.min_frames, self.allocator.total_frames + 1  # holds low, not high
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self._ever_holds(mid) else (low, mid)
        return low

    @property
    def arena_bytes(self) -> int:
        """The pool's budget as allocated: its arena's size in bytes."""
        return self.arena.numel() * self.arena.element_size()

    def free(self, request_id: str) -> None:
        """Return the request's slot and region. Unknown or already freed → TensorAccumulationError."""
        self.free_many((request_id,))

    @_host_side
    def free_many(self, request_ids: Sequence[str]) -> None:
        """Return the slots and regions of all these requests at once (the requests a step
        finished). One that is unknown, already freed or named twice → TensorAccumulationError
        naming it, and nothing is freed."""
        owner = self._owner
        slots = [owner.get(r, -1) for r in request_ids]
        if -1 in slots or len(set(slots)) != len(slots):
            seen = set()
            for r, slot in zip(request_ids, slots):
                if slot < 0 or slot in seen:
                    raise TensorAccumulationError("free of a slot that is unknown or already freed" if slot < 0 else
                                                  "named twice in one release", request_id=r, key=self.key)
                seen.add(slot)
        if not slots:
            return
        for r in request_ids:
            del owner[r]
        self._settle()
        s = np.array(slots, np.int64)
        for base in (self.table[s, BASE] // self.frame_elems).tolist():
            self.allocator.free(base)
        self.table[s, CAP] = self.table[s, UNREAD] = 0
        self._overrides -= int(np.count_nonzero(self.table[s, POS] >= 0))
        self.table[s, POS] = -1
        self._slot_free[s] = True
        self.version += 1

    def slot_of(self, request_id: str) -> int:
        slot = self._owner.get(request_id)
        if slot is None:
            raise TensorAccumulationError("no slot: unknown or already freed", request_id=request_id, key=self.key)
        return slot

    def slots(self, request_ids: Sequence[str]) -> np.ndarray:
        """The requests' slots (TensorAccumulationError for one without, or named twice)."""
        errors: list[TensorAccumulationError] = []
        slots, _ = self._lookup(request_ids, errors)
        if errors:
            raise errors[0]
        return slots

    def room(self, slots: np.ndarray) -> int:
        """Frames every one of these slots can still take without growing (nor passing what one launch
        copies of a slot, ``max_unread_frames``)."""
        self._settle()
        cap = np.minimum(self.table[slots, CAP], self.max_unread_frames)
        return int((cap - self.table[slots, UNREAD]).min(initial=_INT32_MAX))

    def unread(self) -> np.ndarray:
        """Unread frames of every slot (a read-only view of the host mirror, indexed by slot)."""
        self._settle()
        view = self.table[:, UNREAD]
        view.flags.writeable = False
        return view

    def drained(self) -> np.ndarray:
        """Frames drained so far of every slot since it was taken (a read-only view, indexed by slot)."""
        view = self._drained.view()
        view.flags.writeable = False
        return view

    def unread_frames(self, request_id: str) -> int:
        self._settle()
        return int(self.table[self.slot_of(request_id), UNREAD])

    def capacity_frames(self, request_id: str) -> int:
        return int(self.table[self.slot_of(request_id), CAP])

    def stats(self) -> PoolStats:
        self._settle()
        return PoolStats(
            slots_used=len(self._owner), slots_capacity=self.max_slots,
            bytes_used=self.allocator.used_frames * self.frame_bytes,
            bytes_reserved=self.arena_bytes,
            high_water_bytes=self.high_water_bytes,
            unread_bytes=int(self.table[:, UNREAD].sum()) * self.frame_bytes,
            growths=self.growths, rejected=self.rejected, repeated_launches=self.repeated_launches)

    def _note_usage(self) -> None:
        self.high_water_bytes = max(self.high_water_bytes, self.allocator.used_frames * self.frame_bytes)

    def _override_head(self, slot: int, pos: int) -> None:
        """Set the slot's head override (``pos`` >= 0: a new or grown slot's head, which its next
        write uses instead of the device head; -1: none), counting the slots that have one."""
        self._overrides += (pos >= 0) - (int(self.table[slot, POS]) >= 0)
        self.table[slot, POS] = pos

    def _clear_overrides(self, slots: np.ndarray) -> None:
        """The head overrides of ``slots`` are used up (a write launched from them, or the device
        heads were written)."""
        if self._overrides:  # (callers check it first where it costs)
            used = slots[self.table[slots, POS] >= 0]
            self.table[used, POS] = -1
            self._overrides -= len(used)

    # ----------------------------------------------------------------- capacity

    def _chunk_frames(self, t: torch.Tensor, request_id: str, lead: int = 0) -> int:
        """Validate one chunk (``lead`` 1: a batch of chunks, ``[B, *chunk]``) against the pool;
        return its frame count (a batch: its padded length)."""
        why = ops.not_plain(t)
        if why:
            raise TensorAccumulationError(why, request_id=request_id, key=self.key)
        if t.device != self.device:
            raise TensorAccumulationError(f"tensor on {t.device} but the pool is on {self.device}",
                                          request_id=request_id, key=self.key)
        if t.dtype != self.dtype:
            raise TensorAccumulationError(f"dtype {t.dtype} but the slot holds {self.dtype}",
                                          request_id=request_id, key=self.key)
        shape = t.shape[lead:]
        frame = tuple(shape[1:]) if not self.last else tuple(shape[:-1])
        if len(shape) != len(self.frame_shape) + 1 or frame != self.frame_shape:
            axis, dims = "[*frame, n]" if self.last else "[n, *frame]", len(self.frame_shape) + 1
            why = f"does not match the slot's frame shape {self.frame_shape} (chunks are {axis})" \
                if len(shape) == dims else \
                f"of {len(shape)} dimension{'' if len(shape) == 1 else 's'}: chunks of this key have {dims} " \
                f"({axis}, frame shape {self.frame_shape})"
            raise TensorAccumulationError(f"shape {tuple(shape)} {why}", request_id=request_id, key=self.key)
        return int(shape[-1] if self.last else shape[0])

    def make_room(self, request_ids: Sequence[str], slots: np.ndarray, n: np.ndarray,
                  errors: list | None = None) -> np.ndarray:
        """Grow the slots that ``n`` more frames would overflow; returns a keep-mask. A request whose
        slot cannot grow (growth off, budget spent) or whose unread data would pass what one launch
        copies (2**31 - 1 elements: a read copies a request's unread span at once) gets a
        ``TensorAccumulationError``: appended to ``errors``, or raised when ``errors`` is None."""
        self._settle()
        keep = np.ones(len(slots), dtype=bool)
        rows = self.table[slots]
        total = rows[:, UNREAD] + n
        over = total > rows[:, CAP]
        too_big = total > self.max_unread_frames if len(n) and total.max() > self.max_unread_frames else ()
        if not (over.any() or len(too_big)):
            return keep
        over, too_big = np.flatnonzero(over), np.flatnonzero(too_big)
        failed = []
        for i in too_big:
            keep[i] = False
            failed.append(TensorAccumulationError(
                f"{int(total[i])} unread {self.unit} would pass the {self.max_unread_frames} one launch copies "
                "(2**31 - 1 elements): read the request's data more often", request_id=request_ids[i], key=self.key))
        grown: list[tuple[int, int, int]] = []  # (slot, new region's offset, its frames)
        for i in over:
            if keep[i]:
                slot = int(slots[i])
                region = self._region_for(slot, int(self.table[slot, UNREAD] + n[i]), request_ids[i])
                if isinstance(region, TensorAccumulationError):
                    keep[i] = False
                    failed.append(region)
                else:
                    grown.append((slot, *region))
        if grown:
            self._move(grown)
        if failed and errors is None:
            raise failed[0]
        if errors is not None:
            errors.extend(failed)
        return keep

    def _region_for(self, slot: int, needed: int, request_id: str) -> tuple[int, int] | TensorAccumulationError:
        """A new region of at least ``needed`` frames (and twice the slot's capacity) for the slot,
        or the error that says why there is none."""
        cap, unread = int(self.table[slot, CAP]), int(self.table[slot, UNREAD])
        if not self.growth:
            return TensorAccumulationError(f"append of {needed - unread} {self.unit} would overwrite unread data "
                                           f"(capacity {cap}, unread {unread}) and growth is off",
                                           request_id=request_id, key=self.key)
        region = self.allocator.alloc(max(needed, 2 * cap))
        if region is not None:
            return region
        if not self.allocator.grows_to(needed):  # (not an OutputMemoryError: a retry would fail the same way)
            return OutputTooLargeError(
                f"{needed} {self.unit} unread are more than one request can hold in this pool's budget of "
                f"{self.arena_bytes} bytes (a growing slot keeps its old region until its data has moved); raise "
                "the budget", request_id=request_id, key=self.key)
        return OutputMemoryError(f"cannot grow to {needed} {self.unit}: pool budget of {self.arena_bytes} bytes is "
                                 "spent", request_id=request_id, key=self.key)

    def _move(self, grown: list[tuple[int, int, int]]) -> None:
        """Move slots to their new regions: every unread span is copied, linearized, to the start of
        its new region in one launch (the new regions were all taken before any old one is given
        back, so none overlaps a span still to be copied); then the old regions are freed."""
        slots = np.array([g[0] for g in grown], np.int64)
        frames = np.array([g[2] for g in grown], np.int64)
        bases = np.array([g[1] for g in grown], np.int64) * self.frame_elems
        moving = self.table[slots, UNREAD] > 0
        if moving.any():
            self._launch_read(slots[moving], self.arena, lin_off=bases[moving],
                              lin_stride=frames[moving] if self.last else self.frame_elems)
        for slot, base, cap in zip(slots.tolist(), bases.tolist(), frames.tolist()):
            unread = int(self.table[slot, UNREAD])
            self.allocator.free(int(self.table[slot, BASE] // self.frame_elems))
            self.table[slot, BASE], self.table[slot, CAP] = base, cap
            self._override_head(slot, unread % cap)
            self._tail[slot] = 0
            self.layout[slot] += 1
        self.version += 1
        self.growths += len(grown)
        self._note_usage()

    # ----------------------------------------------------------------- append

    @_host_side
    def append(self, request_ids: Sequence[str], chunks: PaddedBatch | Sequence[torch.Tensor | None], *,
               slots: np.ndarray | None = None) -> AppendResult:
        """Append one step's chunks for ``request_ids`` (aligned; a None chunk skips that request).

        ``chunks`` is a ``PaddedBatch`` (no copy besides the kernel) or a list of per-request tensors
        (packed into a persistent scratch buffer with one ``torch.cat`` first). Requests must hold a
        slot (``alloc``). Invalid requests are skipped with a ``TensorAccumulationError`` each in the
        result; the valid ones are written by one launch. Chunks that require grad are appended as
        data (detached). ``slots``: the requests' slots (int64, aligned), from a caller that chose
        them at ``alloc``: no lookup, and the step is planned every time (no repeated launch).
        """
        with nvtx_range(self._nvtx_append):
            errors: list[TensorAccumulationError] = []
            if isinstance(chunks, PaddedBatch):
                ids = tuple(request_ids)  # once: the repeat check, the slot lookup and the kept plan use it
                data = chunks.data
                why = ops.not_plain(data)
                if why:
                    errors = [TensorAccumulationError(why, request_id=r, key=self.key) for r in ids]
                    self.rejected += len(errors)
                    return AppendResult(0, tuple(errors))
                if data.requires_grad:
                    data = data.detach()
                if data.is_neg() or data.is_conj():
                    data = data.resolve_conj().resolve_neg()  # a lazy view: the kernels read memory, not flags
                if slots is None and self._launch_repeat(ids, data, chunks.lengths):
                    return self._repeat.result
                rows = self._rows_from_batch(ids, data, chunks.lengths, errors, slots)
                keep = rows is not None and slots is None and not errors and rows[0].data_ptr() == data.data_ptr()
                repeat = (ids, data) if keep else None
            else:
                rows, repeat = self._rows_from_list(request_ids, chunks, errors, slots), None
            appended = self._launch_write(*rows, errors, repeat=repeat) if rows is not None else 0
            self.rejected += len(errors)
            return AppendResult(appended, tuple(errors))

    def _launch_repeat(self, ids: tuple, data: torch.Tensor, lengths) -> bool:
        """Launch a step that repeats the last planned one (``_RepeatPlan``) from its resident rows;
        False (nothing done) when anything differs or a slot may lack room."""
        plan = self._repeat
        if plan is not None:
            plan.wanted = False  # set again below when this step repeats it
        if plan is None or plan.version != self.version or ids != plan.ids or data.shape != plan.shape \
                or data.dtype != self.dtype or not self._on_device(data) or data.stride() != plan.stride:
            return False
        if host_lengths(lengths).tobytes() != plan.n_bytes:
            return False
        if plan.meta is None:
            plan.wanted = True
            return False
        frames = plan.max_elems // self.frame_elems
        if plan.room < frames or plan.writes != self.writes:
            plan.room = self.room(plan.slots)
            if plan.room < frames:
                return False  # the planning path grows the slots
        ops.ring_write(self.arena, self.state, plan.meta, data, rows=len(plan.slots), frame_elems=self.frame_elems,
                       last=self.last, max_elems=plan.max_elems)
        plan.room -= frames
        plan.pending += 1
        self.writes += 1
        plan.writes = self.writes
        self.repeated_launches += 1
        return True

    def _settle(self) -> None:
        """Count the frames of the repeated launches in the table's UNREAD column (every reader of
        UNREAD calls this first; the repeated step itself only counts its launches)."""
        plan = self._repeat
        if plan is not None and plan.pending:
            self.table[plan.slots, UNREAD] += plan.n * plan.pending
            plan.pending = 0

    def _lookup(self, request_ids: Sequence[str], errors: list) -> tuple[np.ndarray, np.ndarray]:
        """Slots of the requests (-1 where unknown) and a keep-mask; an error recorded for each
        unknown request and each second occurrence of one. A list of known, distinct requests is
        remembered while no slot is taken, freed or moved (the common step repeats its list)."""
        ids = tuple(request_ids)
        cached, slots, version = self._ids_cache
        if version == self.version and cached == ids:
            return slots, np.ones(len(ids), dtype=bool)
        slots = np.fromiter(map(self._owner.get, ids, repeat(-1)), np.int64, len(ids))
        keep = slots >= 0
        if not keep.all():
            for i in np.flatnonzero(~keep):
                errors.append(TensorAccumulationError("no slot: unknown or already freed request",
                                                      request_id=ids[i], key=self.key))
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            for i, r in enumerate(ids):
                if r in seen and keep[i]:
                    keep[i] = False
                    errors.append(TensorAccumulationError("named twice in one call",
                                                          request_id=r, key=self.key))
                seen.add(r)
        if keep.all():
            slots.flags.writeable = False  # shared with later steps (and ``slots()``' callers)
            self._ids_cache = (ids, slots, self.version)
        return slots, keep

    def _rows_from_batch(self, request_ids, data: torch.Tensor, lengths, errors: list, slots=None):
        B = len(request_ids)
        n = host_lengths(lengths)
        if data.dim() < 1 or data.shape[0] != B or n.shape[0] != B:
            raise ValueError(f"PaddedBatch for key {self.key!r}: data batch {tuple(data.shape[:1])}, "
                             f"{n.shape[0]} lengths, {B} request ids")
        if B == 0:
            return None
        keep = None  # all
        if slots is None:
            slots, keep = self._lookup(request_ids, errors)
            keep = None if keep.all() else keep
        try:
            axis_len = self._chunk_frames(data, "<batch>", lead=1)
        except TensorAccumulationError as exc:
            errors.extend(exc.for_request(request_ids[i]) for i in (range(B) if keep is None else np.flatnonzero(keep)))
            return None
        if n.min() < 0 or n.max() > axis_len:
            bad = (n < 0) | (n > axis_len)
            keep = ~bad if keep is None else keep & ~bad
            for i in np.flatnonzero(bad):
                errors.append(TensorAccumulationError(f"length {int(n[i])} outside [0, {axis_len}] of the padded "
                                                      "batch", request_id=request_ids[i], key=self.key))
        # Rows of the batch as [B, L, T] (CONCAT_LAST) or [B, n, F] (CONCAT_DIM0), without copying.
        view = data.reshape(B, self.frame_elems, axis_len) if self.last else data.reshape(B, axis_len, self.frame_elems)
        if view.stride(2) != 1 or view.data_ptr() != data.data_ptr():
            view = view.contiguous()
        rows = self._row_index(B)
        if keep is not None:
            rows, slots, n = rows[keep], slots[keep], n[keep]
            request_ids = [request_ids[i] for i in rows]
        return view, slots, n, rows * view.stride(0), view.stride(1), request_ids

    def _row_index(self, rows: int) -> np.ndarray:
        """0, 1, ..., rows - 1 (read-only; kept, grown when a larger batch arrives)."""
        if len(self._rows) < rows:
            self._rows = np.arange(1 << (rows - 1).bit_length(), dtype=np.int64)
            self._rows.flags.writeable = False
        return self._rows[:rows]

    def _rows_from_list(self, request_ids, chunks, errors: list, slots=None):
        if len(chunks) != len(request_ids):
            raise ValueError(f"{len(chunks)} chunks for {len(request_ids)} request ids (key {self.key!r})")
        slots, keep = self._lookup(request_ids, errors) if slots is None else (slots, np.ones(len(chunks), bool))
        n = np.zeros(len(chunks), np.int64)
        for i, t in enumerate(chunks):
            if t is None:
                keep[i] = False
            elif keep[i]:
                try:
                    n[i] = self._chunk_frames(t, request_ids[i])
                except TensorAccumulationError as exc:
                    keep[i] = False
                    errors.append(exc)
        idx = np.flatnonzero(keep)
        slots, n = slots[idx], n[idx]
        ids = [request_ids[i] for i in idx]
        fit = self.make_room(ids, slots, n, errors)  # before packing: only chunks that fit are packed
        if not fit.all():
            ids = [rid for rid, ok in zip(ids, fit) if ok]
        idx, slots, n = idx[fit], slots[fit], n[fit]
        if len(idx) == 0:
            return None
        total, F = int(n.sum()), self.frame_elems
        if self._scratch.numel() < total * F:
            self._scratch = torch.empty(max(total * F, 2 * self._scratch.numel()), dtype=self.dtype, device=self.device)
        parts = [chunks[i].detach() for i in idx]
        starts = np.zeros(len(idx), np.int64)
        np.cumsum(n[:-1], out=starts[1:])
        if self.last:
            packed = self._scratch[: total * F].view(F, total)
            torch.cat([p.reshape(F, -1) for p in parts], dim=1, out=packed)
            return packed, slots, n, starts, total, ids
        packed = self._scratch[: total * F].view(total, F)
        torch.cat([p.reshape(-1, F) for p in parts], dim=0, out=packed)
        return packed, slots, n, starts * F, F, ids

    def _staged(self, rows: int) -> tuple[int, np.ndarray]:
        """The next staging buffer with room for ``rows`` rows (grows, rarely, for a larger step)."""
        if rows > self._staging.rows:
            if self._staging.pinned:  # kernels may still be reading the old pinned rows in place
                torch.cuda.current_stream(self.device).synchronize()  # rare: only when a step outgrows the rows
            self._staging = PinnedStaging(1 << (rows - 1).bit_length(), META_COLS, self.device, device_copy=True)
            self._resident = torch.empty(self._staging.rows, META_COLS, dtype=torch.int64, device=self.device)
        return self._staging.host()

    def _launch_write(self, src, slots, n, lin_off, lin_stride, request_ids, errors: list, repeat=None) -> int:
        """One write launch; the host mirrors advance and head overrides are used up. Slots that
        the chunks would overflow grow first (``make_room``; one that cannot is left out with its
        error in ``errors``). ``repeat``: (request ids, source) of a step whose every request was
        launched from a view of the source: when no slot has a head override its rows are kept on
        the device for the steps that repeat it."""
        if len(slots) == 0:
            return 0
        self._settle()
        i, host = self._staged(len(slots))
        rows = len(slots)
        frames = plan_write(self.table, slots, n, lin_off, lin_stride, host)
        unread = host[:rows, UNREAD] + n
        if int(unread.max()) > self.max_unread_frames or (unread > host[:rows, CAP]).any():
            # Grow the slots (rare): their rows move, and a growth's copy takes a staging buffer.
            fit = self.make_room(request_ids, slots, n, errors)
            if not fit.all():
                slots, n, lin_off, repeat = slots[fit], n[fit], np.asarray(lin_off)[fit], None
                rows = len(slots)
                if not rows:
                    return 0
            i, host = self._staged(rows)
            frames = plan_write(self.table, slots, n, lin_off, lin_stride, host)
            unread = host[:rows, UNREAD] + n
        max_elems = frames * self.frame_elems
        plan = self._repeat
        if repeat is not None and plan is not None and plan.wanted and (host[:rows, POS] < 0).all():
            if self._staging.pinned:
                plan.meta = self._staging.upload(i, rows, self._resident)
            else:
                plan.meta = self._resident
                plan.meta[:rows].copy_(torch.from_numpy(host[:rows]))
            plan.n, plan.slots, plan.max_elems = n.copy(), slots.copy(), max_elems  # room: found by the first repeat
            plan.result = AppendResult(rows)
            meta = plan.meta
        else:
            meta = self._staging.for_kernel(i, rows, max_elems > UPLOAD_ELEMS)
            if repeat is not None:  # what the next step must match to have its rows kept
                ids, data = repeat
                self._repeat = _RepeatPlan(ids, self.version, data.shape, data.stride(), n.tobytes())
        ops.ring_write(self.arena, self.state, meta, src, rows=rows, frame_elems=self.frame_elems,
                       last=self.last, max_elems=max_elems)
        self.writes += 1
        self.table[slots, UNREAD] = unread
        if self._overrides:
            self._clear_overrides(slots)
        return rows

    # ----------------------------------------------------------------- read out

    @_host_side
    def drain(self, request_ids: Sequence[str]) -> list[torch.Tensor]:
        """The unread span of each request (DELTA), as views into one new tensor; advances the tails."""
        out = torch.empty(self.unread_elements(request_ids), dtype=self.dtype, device=self.device)
        return self._views(out, *self.read_into(request_ids, out, drain=True))

    @_host_side
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
        self._settle()
        return int(self.table[self.slots(request_ids), UNREAD].sum()) * self.frame_elems

    def check_consolidate(self, request_ids: Sequence[str]) -> None:
        """Raise what ``consolidate(request_ids)`` would raise, reading nothing (TensorAccumulationError
        for a request without a slot, TensorConsolidationError for one already drained)."""
        for r in request_ids:
            drained = int(self._drained[self.slot_of(r)])
            if drained:
                raise TensorConsolidationError(f"{drained} {self.unit} were already drained; cannot consolidate",
                                               request_id=r, key=self.key)

    @_host_side
    def read_into(self, request_ids: Sequence[str], out: torch.Tensor, *, drain: bool,
                  slots: np.ndarray | None = None, frames: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copy each request's unread span back to back into ``out`` (a contiguous 1-D tensor of the
        pool's dtype and device, at least ``unread_elements`` long) in one launch: with ``drain`` the
        tails advance (DELTA), else nothing moves and the spans must be everything appended
        (``check_consolidate``). Returns each request's element offset in ``out`` and its frames
        (int64 arrays). A request's span is laid out as its chunks are: ``[*frame, n]`` for
        CONCAT_LAST, ``[n, *frame]`` for CONCAT_DIM0. ``slots``: the requests' slots, as for ``append``.
        ``frames``: at most this many frames of each span, its oldest (int64, aligned; None: all);
        a drain leaves the rest unread."""
        if frames is not None and (not isinstance(frames, np.ndarray) or frames.dtype != np.int64
                                   or frames.shape != (len(request_ids),) or (len(frames) and frames.min() < 0)):
            raise ValueError(f"pool {self.key!r}: frames to read must be {len(request_ids)} int64 counts, none "
                             f"negative; got {frames!r}")
        if not drain:
            self.check_consolidate(request_ids)
        self._settle()
        if slots is None:
            slots = self.slots(request_ids)
        if out.dtype != self.dtype or out.device != self.device or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(f"pool {self.key!r}: out must be a contiguous 1-D {self.dtype} tensor on {self.device}")
        with nvtx_range(f"ring.{'drain' if drain else 'consolidate'}[{self.key}]"):
            starts, n, rows = self._launch_read(slots, out, frames=frames)
            if drain:  # the planned rows hold each slot's capacity and tail (POS)
                self._tail[slots] = (rows[:, POS] + n) % np.maximum(rows[:, CAP], 1)
                self._drained[slots] += n
                self.table[slots, UNREAD] = rows[:, UNREAD] - n
        return starts, n

    def _launch_read(self, slots: np.ndarray, out: torch.Tensor, lin_off=None, lin_stride=None, frames=None):
        """One read launch of every slot's unread span (at most ``frames`` of each) into ``out``, back
        to back (or, for a growth, each at its ``lin_off`` with its ``lin_stride``: into ring regions
        of their own shape); returns the spans' element offsets, their frames and the planned rows.
        ValueError (nothing launched) when ``out`` is too short for them."""
        self._settle()
        i, host = self._staged(len(slots))
        starts, n = plan_read(self.table, slots, self._tail[slots], self.frame_elems, self.last, host, frames)
        rows = host[:len(slots)]
        if lin_off is not None:
            rows[:, LIN_OFF], rows[:, LIN_STRIDE] = lin_off, lin_stride
            starts = rows[:, LIN_OFF].copy()
        elif len(slots) and starts[-1] + n[-1] * self.frame_elems > out.numel():
            raise ValueError(f"pool {self.key!r}: out of {out.numel()} elements has no room for every unread span "
                             f"({starts[-1] + n[-1] * self.frame_elems} elements)")
        max_elems = int(n.max(initial=0)) * self.frame_elems
        if max_elems:
            meta = self._staging.for_kernel(i, len(slots), max_elems > UPLOAD_ELEMS)
            ops.ring_read(self.arena, meta, out, rows=len(slots), frame_elems=self.frame_elems, last=self.last,
                          max_elems=max_elems)
        return starts, n, rows

    def _views(self, out: torch.Tensor, starts: np.ndarray, n: np.ndarray) -> list[torch.Tensor]:
        F = self.frame_elems
        return [out[s:s + k * F].view(*self.frame_shape, k) if self.last else out[s:s + k * F].view(k, *self.frame_shape)
                for s, k in zip(starts.tolist(), n.tolist())]

    # ----------------------------------------------------------------- CUDA graphs

    def static_rows(self, slots: np.ndarray, n: np.ndarray, lin_off: np.ndarray, lin_stride) -> np.ndarray:
        """Metadata rows of a write whose heads come from the device (POS -1): what a captured
        append keeps resident (``graph.StaticAppend``)."""
        self._settle()
        rows = np.zeros((len(slots), META_COLS), np.int64)
        plan_write(self.table, slots, n, lin_off, lin_stride, rows)
        rows[:, POS] = -1
        return rows

    def publish_heads(self, slots: np.ndarray) -> None:
        """Write the head overrides of these slots (new or grown slots) into the device state, so a
        launch with resident metadata reads them; the overrides are then used up."""
        pending = slots[self.table[slots, POS] >= 0]
        if len(pending):
            heads = torch.from_numpy(self.table[pending, POS] << HEAD_SHIFT).to(self.device)
            self.state[torch.from_numpy(pending).to(self.device)] = heads
            self._clear_overrides(pending)

    def advance(self, slots: np.ndarray, n: np.ndarray) -> None:
        """Count ``n`` more unread frames for each slot: what launches with resident metadata append."""
        self._settle()
        self.writes += 1
        self.table[slots, UNREAD] += n

    def static_append(self, request_ids: Sequence[str], src: torch.Tensor, lengths: Sequence[int]):
        """A fixed-shape append (same requests, source buffer and lengths every step) for graph capture."""
        from .graph import StaticAppend

        return StaticAppend(self, request_ids, src, lengths)

    def plan_static(self, request_ids: Sequence[str], src: torch.Tensor, lengths):
        """The source view, slots, frames, linear offsets and stride of a fixed-shape append of
        ``src`` (a ``PaddedBatch``'s data) for ``request_ids``. Raises its first error; ValueError
        for a source whose rows are not of unit stride (the view would be a copy taken now, and
        every launch would append that instead of what the source holds then)."""
        if src.is_neg() or src.is_conj():
            raise ValueError(f"pool {self.key!r}: a static append reads its source's memory at every launch, and a "
                             "lazily negated or conjugated view is not what its memory holds")
        errors: list[TensorAccumulationError] = []
        rows = self._rows_from_batch(list(request_ids), src, lengths, errors)
        if errors or rows is None:
            raise errors[0] if errors else ValueError("empty static append")
        if rows[0].data_ptr() != src.data_ptr():
            raise ValueError(f"pool {self.key!r}: a static append reads its source in place at every launch, and "
                             f"rows of shape {tuple(src.shape)} and strides {src.stride()} cannot be read so "
                             "(make it contiguous once, and write the step's chunks there)")
        return rows[:5]


def uncopied(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the ring ops on ``device``'s backend cannot copy elements of ``dtype``, or None (the
    kernels copy 1, 2, 4 or 8 bytes, a complex one as an integer of its size; the torch reference
    any)."""
    if dtype.itemsize in ops.ELEMENT_BITS or not ops.uses_kernel(device.type == "cuda"):
        return None
    return (f"{dtype} has elements of {dtype.itemsize} bytes; the ring kernels copy elements of "
            f"{', '.join(map(str, ops.ELEMENT_BITS))} bytes")


def host_lengths(lengths) -> np.ndarray:
    """A ``PaddedBatch``'s host lengths as a flat int64 array. TypeError for lengths on a device
    (reading them would sync the host every step) or that are not integers (2.7 frames is no
    length, and would be cut to 2)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.device.type != "cpu":
            raise TypeError("PaddedBatch.lengths must be host values; a device tensor would sync every step")
        lengths = lengths.numpy()
    n = np.asarray(lengths)
    if n.dtype.kind not in "iu" and n.size:
        raise TypeError(f"PaddedBatch.lengths must be integers, got {n.dtype}")
    return n.astype(np.int64, copy=False).reshape(-1)
