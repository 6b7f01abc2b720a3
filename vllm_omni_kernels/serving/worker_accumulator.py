"""Accumulation in the worker: ``WorkerAccumulator``.

Once per step the model runner appends every request's chunks (one launch per key, into that key's
``RingPool``) and collects what is due: read out of the rings into one persistent device buffer (one
launch per key) and copied to the host in one asynchronous copy on a side stream; nothing crosses to
the host on a step where nothing is due. The step's ``PackedStep`` carries the host buffer, the event
that says it is filled, and per key a ``Region`` (the requests whose data it holds, back to back).

What is due, by the request's output kind (from its sampling parameters): DELTA and CUMULATIVE get
the unread data of every key as soon as the first chunk is there, then whenever some key has at least
its ``cadence`` frames unread (0: every step), and the rest when the request finishes (the frontend
concatenates for CUMULATIVE); FINAL_ONLY gets nothing until it finishes, then everything at once.

A chunk that does not fit its key (dtype, frame shape, device, an overflow that cannot grow) fails
its request alone: ``append`` returns its ``TensorAccumulationError`` and frees its slots.

Nothing on the step's path reads the device: lengths, offsets and due-ness come from host mirrors.
On a CPU device the pack is the host buffer itself (``_HostBuffers``) and there is no copy.
"""

from __future__ import annotations

import logging
import math
import queue
import weakref
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat

import numpy as np
import torch

from .. import backend
from ..accumulator import EmitPolicy
from ..errors import TensorAccumulationError
from ..modality import TensorAccumulationStrategy as Strategy
from ..profiling import nvtx_range
from ..ring import PaddedBatch, RingPool, host_lengths
from ..ring.pool import MAX_SLOTS, more_slots

_ALIGN = 16  # every span starts on a 16-byte boundary of the buffer (any dtype can view it)
_BUFFERS_WARNED = 64  # host buffers alive at once (in use or free): more means a caller keeps them

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutputKey:
    """A key the model produces every step, accumulated in the worker.

    ``strategy``: CONCAT_LAST (chunks ``[*frame_shape, n]``) or CONCAT_DIM0 (``[n, *frame_shape]``);
    ``cadence``: frames of this key a streaming request gets at a time (0: every step; None: this
    key does not set the pace, its data goes along when another key's does).
    ``initial_frames``: a new slot's capacity (it grows when needed).
    """

    name: str
    strategy: Strategy
    dtype: torch.dtype
    frame_shape: tuple[int, ...] = ()
    cadence: int | None = 0
    initial_frames: int = 4096


@dataclass(frozen=True)
class Region:
    """One key's due data of several requests, back to back in a ``PackedStep``'s buffer from byte
    ``offset`` on: request ``request_ids[i]`` has ``frames[i]`` frames, shaped ``[*frame, n]``
    (``axis`` -1, CONCAT_LAST) or ``[n, *frame]`` (``axis`` 0, CONCAT_DIM0) of ``dtype``."""

    key: str
    dtype: torch.dtype
    frame: tuple[int, ...]
    axis: int
    offset: int
    request_ids: list[str]
    frames: np.ndarray  # int64, one per request


def split_region(buffer: torch.Tensor, dtype: torch.dtype, frame: Sequence[int], axis: int, offset: int,
                 frames: list[int]) -> list[torch.Tensor]:
    """A ``Region``'s pieces (its fields given one by one) as views into the uint8 ``buffer``, cut with
    one split. The caller has checked that the region fits the buffer."""
    per_frame = math.prod(frame)
    data = buffer[offset:offset + sum(frames) * per_frame * dtype.itemsize].view(dtype)
    if axis == 0:
        return list(data.view(-1, *frame).split(frames))
    if not frame:  # mono audio: the pieces are the views
        return list(data.split(frames))
    return [p.view(*frame, n) for p, n in zip(data.split([n * per_frame for n in frames]), frames)]


@dataclass
class PackedStep:
    """What one step delivers: ``host`` (uint8; valid once ``wait()`` returned), the caller's head
    data at its start (``head_bytes``), the due data as ``regions``, and the requests whose output
    this step closed (``final``)."""

    host: torch.Tensor
    head_bytes: int = 0
    regions: list[Region] = field(default_factory=list)
    final: set[str] = field(default_factory=set)
    event: torch.cuda.Event | None = None
    _requests: set[str] | None = field(default=None, repr=False)
    _landed: bool = field(default=False, repr=False)
    _compact: list[tuple[int, int, int, int]] = field(default_factory=list, repr=False)  # drop_newest's moves

    def wait(self) -> torch.Tensor:
        """Block until the copy has landed (at once on CPU); returns ``host``."""
        if not self._landed:
            if self.event is not None:
                self.event.synchronize()
            self._landed = True
            self._compact_pieces()
        return self.host

    def _compact_pieces(self) -> None:
        """Close up the pieces of ``[C, n]`` keys that ``drop_newest`` shortened to ``[C, keep]``: in
        host memory once the copy has landed (each channel's first ``keep`` frames moved after the
        channel before's; a piece's other requests' data does not move)."""
        if self._compact and self._landed:
            host = self.host.numpy()
            for start, channels, n, keep in self._compact:  # (first byte, channels, a channel's bytes)
                for c in range(1, channels):
                    host[start + c * keep:start + (c + 1) * keep] = host[start + c * n:start + c * n + keep]
            self._compact.clear()

    def requests(self) -> set[str]:
        """The requests with data in this step (made once: the scheduler asks for every client)."""
        if self._requests is None:
            self._requests = {rid for region in self.regions for rid in region.request_ids}
        return self._requests

    def drop_newest(self, request_id: str, frames: Mapping[str, int]) -> None:
        """Leave out the request's newest ``frames[key]`` frames of each key (data found, after the
        step was packed, to lie past the request's end); the other requests' data stays where it is
        (a region splits around the request's), and a request left without frames of a key leaves
        that key's region. A CONCAT_LAST key with channels (``[*frame, n]``: the older frames of its
        channels are not one span) has each channel's kept frames closed up in host memory once the
        copy has landed (``wait``). ValueError for a negative count."""
        if any(n < 0 for n in frames.values()):
            raise ValueError(f"request {request_id!r}: frames to leave out must not be negative, got {dict(frames)}")
        regions = []
        for region in self.regions:
            drop = frames.get(region.key, 0)
            if not drop or request_id not in region.request_ids:
                regions.append(region)
                continue
            ids, counts = region.request_ids, region.frames
            i = ids.index(request_id)
            per = math.prod(region.frame) * region.dtype.itemsize
            start = region.offset + int(counts[:i].sum()) * per
            keep = int(counts[i]) - drop
            if region.axis == -1 and region.frame and keep > 0:  # [C, n] becomes [C, keep]
                width = region.dtype.itemsize
                self._compact.append((start, per // width, int(counts[i]) * width, keep * width))
            if i:
                regions.append(replace(region, request_ids=ids[:i], frames=counts[:i]))
            if keep > 0:
                regions.append(replace(region, offset=start, request_ids=[request_id],
                                       frames=np.array([keep], np.int64)))
            if i + 1 < len(ids):
                regions.append(replace(region, offset=start + int(counts[i]) * per, request_ids=ids[i + 1:],
                                       frames=counts[i + 1:]))
        self.regions = regions
        self._requests = None
        self._compact_pieces()  # at once when the copy has landed already

    def split(self, owner: Mapping[str, Hashable]) -> dict[Hashable, PackedStep]:
        """The step's data by owner (``owner``: request id -> its owner; requests it does not name
        are left out), each owner's copied back to back into a buffer of its own (each key's region
        on a 16-byte boundary; no head), with its regions and the requests among them whose output
        this step closed: the messages to several clients (vLLM's API server processes), which
        would otherwise each receive every client's data. One pass over the requests, whatever the
        number of owners. Waits for the step's copy (``wait``: done already once the step's output
        resolved)."""
        host = self.wait().numpy()
        parts: dict[Hashable, list[np.ndarray]] = {}
        regions: dict[Hashable, list[Region]] = {}
        sizes: dict[Hashable, int] = {}
        for r in self.regions:
            per = math.prod(r.frame) * r.dtype.itemsize
            ends, frames = (r.offset + np.cumsum(r.frames) * per).tolist(), r.frames.tolist()
            rows: dict[Hashable, list[int]] = {}
            for i, rid in enumerate(r.request_ids):
                who = owner.get(rid)
                if who is not None:
                    rows.setdefault(who, []).append(i)
            for who, rows_of in rows.items():
                size = sizes.get(who, 0)
                start = _aligned(size)
                mine = parts.setdefault(who, [])
                if start > size:
                    mine.append(np.zeros(start - size, np.uint8))
                mine += [host[ends[i] - frames[i] * per:ends[i]] for i in rows_of]
                counts = r.frames[rows_of]
                regions.setdefault(who, []).append(
                    replace(r, offset=start, request_ids=[r.request_ids[i] for i in rows_of], frames=counts))
                sizes[who] = start + int(counts.sum()) * per
        return {who: PackedStep(host=_from_numpy(np.concatenate(mine)), regions=regions[who],
                                final={rid for rid in self.final if owner.get(rid) == who})
                for who, mine in parts.items()}

    def tensors(self, request_id: str) -> dict[str, torch.Tensor]:
        """The request's data as views into ``host`` (waits for the step's copy first: ``wait``)."""
        self.wait()
        out = {}
        for r in self.regions:
            if request_id in r.request_ids:
                pieces = split_region(self.host, r.dtype, r.frame, r.axis, r.offset, r.frames.tolist())
                out[r.key] = pieces[r.request_ids.index(request_id)]
        return out


class _HostBuffers:
    """Pinned host buffers for the steps' copies, each reused once every tensor made of it is gone.

    A step's host tensor is ``torch.frombuffer`` over a numpy view of a free buffer. Its storage holds
    that view until the last tensor, numpy array or memoryview sharing it goes (zmq holds a memoryview
    until it has sent the frame; the tensor object itself is no witness), and a ``weakref.finalize`` on
    the view then hands the buffer back, on whatever thread that was: through a thread-safe queue, so
    only ``take`` (the step's thread) touches the free list. ``cudaHostAlloc`` costs about a
    millisecond: it runs only while the buffers in flight outgrow those made before. A buffer leaves
    the free list only once its last copy has run, since torch's host allocator, which knows nothing
    of the ``frombuffer`` tensor, would hand the memory out again while the copy still writes it.
    """

    def __init__(self, keep: int = 16, pinned: bool = True):
        self._pinned = pinned  # (False: ordinary host memory, for tests without a GPU)
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # (buffer, its last copy)
        self._returned: queue.SimpleQueue = queue.SimpleQueue()  # given back on any thread
        self._keep = keep
        self.allocations = 0  # cudaHostAlloc calls so far (it should stop growing after the first steps)
        self.alive = 0  # buffers allocated and not yet dropped from the free list
        self._warned = False

    def take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[torch.cuda.Event], None]]:
        """A pinned uint8 host tensor of ``nbytes``, and the function that records its copy's event."""
        while not self._returned.empty():
            buffer, copied = self._returned.get_nowait()
            self._free.append((buffer, copied[0]))
        if len(self._free) > self._keep:  # keep the largest few, and every one a copy may still write
            self._free.sort(key=lambda item: item[0].numel())
            extra = len(self._free) - self._keep
            kept = [(buffer, event) for i, (buffer, event) in enumerate(self._free)
                    if i >= extra or not (event is None or event.query())]
            self.alive -= len(self._free) - len(kept)
            self._free = kept
        buffer = None
        for i, (candidate, event) in enumerate(self._free):
            if candidate.numel() >= nbytes and (event is None or event.query()):
                buffer = self._free.pop(i)[0]
                break
        if buffer is None:
            self.allocations += 1
            self.alive += 1
            if self.alive >= _BUFFERS_WARNED and not self._warned:
                self._warned = True
                logger.warning("%d host buffers of the steps' copies are alive: something keeps views of earlier "
                               "steps' buffers (a PackedStep's host tensor, or pieces of it); copy what is kept",
                               self.alive)
            buffer = torch.empty(max(1 << (max(nbytes, 1) - 1).bit_length(), 1 << 20), dtype=torch.uint8,
                                 pin_memory=self._pinned)
        copied: list[torch.cuda.Event | None] = [None]
        if not nbytes:  # nothing shares the buffer: it is free again at once
            self._returned.put((buffer, copied))
            return buffer[:0].clone(), lambda event: None
        window = buffer.numpy()[:nbytes]  # held by the storage of every tensor made of it (class docstring)
        host = torch.frombuffer(window, dtype=torch.uint8)
        weakref.finalize(window, self._returned.put, (buffer, copied))
        return host, lambda event: copied.__setitem__(0, event)


class WorkerAccumulator:
    """Per-request rings of every output key in the worker; see the module docstring.

    A request holds one row, the same slot index in every key's pool, so a step is planned from
    integer rows with numpy: the caller that keeps rows of its own (the model runner's persistent
    batch) passes them to ``add_request`` and ``append`` and nothing is looked up by id.

    Args:
        keys: what the model produces each step.
        device: where the chunks are (and the rings).
        budget_bytes: each key's ring arena (preallocated, never exceeded), or per key name.
        max_requests: rows to start with (``0 .. max_requests - 1``); a request that needs another
            row makes more (``grow_rows``).
    """

    def __init__(self, keys: Sequence[OutputKey], device: torch.device | str, *,
                 budget_bytes: int | Mapping[str, int] = 256 << 20, max_requests: int = 1024):
        self.device = backend.resolve_device(device)
        self.keys = list(keys)
        self._names = {k.name for k in self.keys}
        budgets = budget_bytes if isinstance(budget_bytes, Mapping) else \
            dict.fromkeys((k.name for k in keys), budget_bytes)
        self.pools = [RingPool(k.name, k.dtype, k.frame_shape, self.device, k.strategy, budget_bytes=budgets[k.name],
                               initial_frames=k.initial_frames, max_slots=max_requests)
                      for k in self.keys]
        # (index, cadence) of the keys that set the pace
        self._paced = [(i, k.cadence) for i, k in enumerate(self.keys) if k.cadence is not None]
        self._row: dict[str, int] = {}
        self._id_of: list[str | None] = [None] * max_requests
        self._held = np.zeros(max_requests, bool)
        self._streaming = np.zeros(max_requests, bool)  # DELTA or CUMULATIVE
        self._delivered = np.zeros(max_requests, bool)
        self._pack = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._head_bytes = 0  # of this step's pack, handed out by head()
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._step_mark = torch.cuda.Event() if self._side is not None else None  # re-recorded every step
        self._host = _HostBuffers(pinned=self.device.type == "cuda")
        self._last_copy: torch.cuda.Event | None = None  # the pack is rewritten only after it ran
        self.copies = 0  # device-to-host copies so far (one per step with anything due)
        self.failed = 0

    # ------------------------------------------------------------------ lifecycle

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

    def __len__(self) -> int:
        return len(self._row)

    def row_of(self, request_id: str) -> int:
        """The request's row (KeyError for one not held)."""
        return self._row[request_id]

    @property
    def rows(self) -> int:
        """Rows there are now (held or free): what per-row arrays, such as ``collect``'s ``ends``, cover."""
        return len(self._id_of)

    def grow_rows(self, rows: int) -> None:
        """Make ``rows`` rows (more than now; the requests held keep theirs), and as many slots in
        every pool (``RingPool.grow_slots``). Rare: when more requests hold data than ever before."""
        more = rows - len(self._id_of)
        if more <= 0:
            return
        for pool in self.pools:
            pool.grow_slots(rows)
        self._id_of += [None] * more
        self._held, self._streaming, self._delivered = (np.concatenate((a, np.zeros(more, bool))) for a in
                                                        (self._held, self._streaming, self._delivered))

    def add_request(self, request_id: str, emit: EmitPolicy, row: int | None = None,
                    frames: Mapping[str, int] | None = None) -> int:
        """Give the request a row (``row``, which must be free, or the lowest free one) and a slot of
        every key there; returns the row. ``frames``: per key, what the request will produce, when
        known (a FINAL_ONLY request holds all of it until it finishes: its slots are sized for it at
        once where the pool has room, instead of growing on the way).

        Raises:
            TensorAccumulationError: it already holds slots, the row is taken, or no budget (or, past
                ``MAX_SLOTS`` requests, no row) is left (nothing is held then).
        """
        if request_id in self._row:
            raise TensorAccumulationError("request added twice", request_id=request_id)
        if row is None:
            if self._held.all():
                if self.rows == MAX_SLOTS:
                    raise TensorAccumulationError(f"all {self.rows} request rows are in use", request_id=request_id)
                self.grow_rows(more_slots(self.rows))
            row = int(self._held.argmin())
        elif not 0 <= row < MAX_SLOTS or row < self.rows and self._held[row]:
            raise TensorAccumulationError(f"row {row} is not free", request_id=request_id)
        elif row >= self.rows:
            self.grow_rows(max(more_slots(self.rows), row + 1))
        taken = []
        try:
            for pool in self.pools:
                pool.alloc(request_id, slot=row, frames=(frames or {}).get(pool.key, 0))
                taken.append(pool)
        except BaseException:  # (whatever it was: the slots taken so far are given back)
            for pool in taken:
                pool.free(request_id)
            raise
        self._row[request_id] = row
        self._id_of[row] = request_id
        self._held[row] = True
        self._streaming[row] = emit is not EmitPolicy.FINAL_ONLY
        self._delivered[row] = False
        return row

    def abort(self, request_id: str) -> None:
        """Free the request's slots; its unread data is dropped. Unknown ids are ignored (a request
        that failed or finished here is gone already)."""
        if request_id in self._row:
            self._release([request_id])

    def _release(self, request_ids: list[str]) -> None:
        """Free the slots of requests that hold them, every pool's at once."""
        rows = [self._row.pop(rid) for rid in request_ids]
        for pool in self.pools:
            pool.free_many(request_ids)
        for row in rows:
            self._id_of[row] = None
        self._held[rows] = False

    # ------------------------------------------------------------------ the step

    def head(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A device view of ``count`` elements of ``dtype`` at the start of this step's buffer, for
        the caller's own per-step data (the sampled token ids): it reaches the host in the same
        copy (``collect(head_bytes=...)``, ``PackedStep.host[:head_bytes]``)."""
        nbytes = count * dtype.itemsize
        self._reserve(_aligned(nbytes))
        self._head_bytes = nbytes
        return self._pack[:nbytes].view(dtype)

    def append(self, request_ids: Sequence[str], outputs: Mapping[str, PaddedBatch | Sequence],
               rows: np.ndarray | None = None,
               keep: Callable[[str], bool] | None = None) -> dict[str, TensorAccumulationError]:
        """Append one step: ``outputs[key]`` is a ``PaddedBatch`` aligned with ``request_ids`` or a
        per-request list (None: nothing this step). ``rows``: the requests' rows (int64, as
        ``add_request`` gave them, each request once), else looked up. One launch per key. Returns
        the requests that failed (their slots are freed; every other request's chunk was
        appended), a request that holds no row, or is named twice, among them. A failed request for
        which ``keep`` is true keeps its slots and the data it had (this step's chunk of a key may
        be there or not): the caller reads it up to an end of its own (``collect``'s ``hold`` and
        ``ends``) or aborts it.

        Raises:
            ValueError: a key the accumulator does not hold, or a key's batch or list not aligned
                with ``request_ids``; TypeError: a batch's lengths not host integers (both checked
                for every key before any is appended: nothing is).
        """
        self._check_step(request_ids, outputs)
        failed: dict[str, TensorAccumulationError] = {}
        with nvtx_range("worker.append"):
            if rows is None:
                rows = np.fromiter(map(self._row.get, request_ids, repeat(-1)), np.int64, len(request_ids))
                if len(set(request_ids)) != len(request_ids):
                    rows = None  # a request named twice: the pools look every request up and name it
            if rows is not None and len(rows) and (rows.min() < 0 or not self._held[rows].all()
                                                   or len(rows) > 1 and not np.diff(np.sort(rows)).all()):
                rows = None  # a request without a row, or a row named twice: likewise
            for key, pool in zip(self.keys, self.pools):
                chunks = outputs.get(key.name)
                if chunks is not None:
                    for err in pool.append(request_ids, chunks, slots=rows).errors:
                        failed.setdefault(err.request_id, err)
            if failed:
                self._release([rid for rid in failed if rid in self._row and not (keep is not None and keep(rid))])
        self.failed += len(failed)
        return failed

    def _check_step(self, request_ids: Sequence[str], outputs: Mapping[str, PaddedBatch | Sequence]) -> None:
        """``append``'s ValueErrors, before anything is appended."""
        for name, chunks in outputs.items():
            if name not in self._names:
                raise ValueError(f"key {name!r} is not one of the accumulator's keys {sorted(self._names)}")
            if chunks is None:
                continue
            if isinstance(chunks, PaddedBatch):
                rows = chunks.data.shape[0] if chunks.data.dim() else 0
                lengths = host_lengths(chunks.lengths).shape[0]  # (TypeError for lengths that are not host integers)
                if rows != len(request_ids) or lengths != len(request_ids):
                    raise ValueError(f"key {name!r}: a PaddedBatch of {rows} rows and {lengths} lengths "
                                     f"for {len(request_ids)} requests")
            elif len(chunks) != len(request_ids):
                raise ValueError(f"key {name!r}: {len(chunks)} chunks for {len(request_ids)} requests")

    def collect(self, finishing: Collection[str] = (), head_bytes: int = 0,
                ends: Sequence[np.ndarray] | None = None, hold: Collection[str] = ()) -> PackedStep | None:
        """Read what is due into the step's buffer and start its one copy to the host.

        ``finishing``: requests whose output ends here (their rest is read, then their slots are
        freed). ``head_bytes``: bytes of ``head()`` data to carry along. ``ends``: per key (in
        ``keys`` order), by row, the frames each request's output ends at (int64; a request found
        to have ended steps ago: what it appended after that is never read, and goes with its
        slots); rows with no end hold any larger number. ``hold``: requests none of whose data is
        read this step, however due, finishing included (their end is not known yet); they keep
        their slots. Returns None when nothing is due and there is no head.
        """
        with nvtx_range("worker.collect"):
            unreads = [pool.unread() for pool in self.pools]
            if ends is not None:
                unreads = [np.minimum(unread, np.maximum(end - pool.drained(), 0))
                           for unread, end, pool in zip(unreads, ends, self.pools)]
            pending = unreads[0] > 0
            for unread in unreads[1:]:
                pending |= unread > 0
            paced = ~self._delivered  # a request's first data goes at once, then at its cadence
            for i, cadence in self._paced:
                paced |= unreads[i] >= cadence
            due = self._streaming & pending & paced  # (rows not held have nothing unread)
            if hold:
                due[[self._row[r] for r in hold if r in self._row]] = False
            ending = [r for r in dict.fromkeys(finishing) if r in self._row and r not in hold]
            if ending:
                due[[self._row[r] for r in ending]] = True  # everything left, whatever the output kind
            rows = np.flatnonzero(due)
            if not len(rows) and not head_bytes:
                return None
            ids = [self._id_of[r] for r in rows.tolist()]
            step = PackedStep(host=self._pack, head_bytes=head_bytes, final=set(ending))
            counts = [unread[rows] for unread in unreads]  # frames read per key and request
            offset = _aligned(head_bytes)
            starts = []
            for pool, count in zip(self.pools, counts):
                starts.append(offset)
                offset += _aligned(int(count.sum()) * pool.frame_bytes)
            self._reserve(offset)
            if len(rows):
                for key, pool, count, start, end in zip(self.keys, self.pools, counts, starts, starts[1:] + [offset]):
                    _, frames = pool.read_into(ids, self._pack[start:end].view(pool.dtype), drain=True, slots=rows,
                                               frames=count)
                    step.regions.append(Region(key.name, pool.dtype, key.frame_shape,
                                               -1 if key.strategy is Strategy.CONCAT_LAST else 0, start, ids, frames))
                self._delivered[rows] = True
            self._copy_to_host(step, offset)
            self._head_bytes = 0
            if ending:
                self._release(ending)
        return step

    def _copy_to_host(self, step: PackedStep, nbytes: int) -> None:
        if self._side is None:  # CPU: the buffer is the host memory; the next step takes another one
            step.host = self._pack[:nbytes]
            self._pack = self._host.take(self._pack.numel())[0]
            return
        host, note_copy = self._host.take(nbytes)
        step_stream = torch.cuda.current_stream(self.device)
        self._step_mark.record(step_stream)
        self._side.wait_event(self._step_mark)  # the copy runs after the step's reads into the pack
        torch.cuda.set_stream(self._side)
        try:
            host.copy_(self._pack[:nbytes], non_blocking=True)
        finally:
            torch.cuda.set_stream(step_stream)
        done = self._side.record_event()
        note_copy(done)
        step.host, step.event = host, done
        self._last_copy = done
        self.copies += 1

    def _reserve(self, nbytes: int) -> None:
        """Make the pack hold ``nbytes`` and order this step's writes after the last copy read it."""
        if self._last_copy is not None:
            if not self._last_copy.query():  # usually long done: then no stream needs to wait for it
                torch.cuda.current_stream(self.device).wait_event(self._last_copy)
            self._last_copy = None  # the step's stream is ordered after it from now on
        if self._pack.numel() < nbytes:  # rare: grows to the largest step seen, keeping the head
            old, size = self._pack, max(nbytes, 2 * self._pack.numel(), 1 << 16)
            self._pack = torch.empty(size, dtype=torch.uint8, device=self.device) if self._side is not None else \
                self._host.take(size)[0]
            if self._head_bytes:
                self._pack[:self._head_bytes].copy_(old[:self._head_bytes])

    def stats(self) -> dict:
        """Requests held, copies made, failures, and every pool's statistics, as plain values (they
        cross vLLM's RPC as msgpack)."""
        return {"requests": len(self._row), "copies": self.copies, "failed": self.failed,
                "pinned_allocations": self._host.allocations,
                "pools": {p.key: vars(p.stats()) for p in self.pools}}


def _from_numpy(data: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of a 1-D uint8 array, of stride 1 when it is empty too (torch gives an
    empty array's tensor stride 0, which no view as another dtype takes)."""
    return torch.from_numpy(data) if len(data) else torch.empty(0, dtype=torch.uint8)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
