"""``MultimodalAccumulator``: per-request accumulation of every output key, with emit policies.

A step is ``{key: chunks}`` for a list of request ids, chunks being a ``PaddedBatch`` (one tensor for
the batch, host lengths; concatenating keys only) or a per-request sequence (tensor, scalar or None).
A key's strategy is fixed per request by its first value (``modality.resolve_strategy``); a later
value of another strategy is a ``TensorAccumulationError`` for that request alone. CONCAT_DIM0 /
CONCAT_LAST keys go to ``RingPool`` slots (one launch per pool per step: the ring kernels on CUDA,
the torch reference on the CPU), APPEND_LIST keys to a host list, REPLACE values to the metadata.
Ring keys are copied; APPEND_LIST and REPLACE values are kept as given (no copy per step), so a
producer in the same process must not rewrite a tensor in place after handing it over (over vLLM's
wire every value arrives as a tensor of its own).

``collect`` emits for the requests whose output is due and those finished: DELTA drains what arrived
since the last emission, CUMULATIVE consolidates everything so far, FINAL_ONLY consolidates once, at
finish. Finished and aborted requests free their slots.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import backend
from .errors import TensorAccumulationError, TensorConsolidationError
from .modality import OutputModality, TensorAccumulationStrategy as Strategy, resolve_strategy
from .payload import MultimodalPayload
from .ring import PaddedBatch, PoolStats, RingPool, host_lengths
from .ops import not_plain
from .ring.pool import MAX_SLOTS, more_slots, uncopied

logger = logging.getLogger(__name__)

_IDLE_POOLS = 4  # pools of a key kept while they hold no request (``MultimodalAccumulator._note_idle``)


def _unfit(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` cannot be accumulated, or None: what the pools refuse (``ops.not_plain``),
    and a meta tensor, which has no data (refused before it is taken for metadata too)."""
    why = not_plain(t)
    if why is None and t.is_meta:
        why = "a tensor on the meta device has no data: values are plain strided tensors with data"
    return why


class EmitPolicy(enum.Enum):
    FINAL_ONLY = "final_only"
    DELTA = "delta"
    CUMULATIVE = "cumulative"


@dataclass
class AccumulatorConfig:
    """Sizing and strategy of an accumulator.

    ``pool_budget_bytes`` is preallocated per pool (one pool per key, dtype, frame shape, device) the
    first time such a combination appears; ``initial_frames`` is a new slot's capacity, one number
    for every key or ``{key: frames}`` (keys not named get 4096); ``max_slots`` the requests a pool
    holds at first (twice as many each time one more needs a slot, up to ``ring.pool.MAX_SLOTS``).
    """

    modality: OutputModality = OutputModality.AUDIO
    strategies: Mapping[str, Strategy] = field(default_factory=dict)
    pool_budget_bytes: int = 64 << 20
    initial_frames: int | Mapping[str, int] = 4096
    max_slots: int = 1024
    growth: bool = True


@dataclass
class _Request:
    emit: EmitPolicy
    pools: dict[str, RingPool] = field(default_factory=dict)
    lists: dict[str, list[Any]] = field(default_factory=dict)
    list_emitted: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    order: dict[str, None] = field(default_factory=dict)  # keys in first-seen order
    strategies: dict[str, Strategy] = field(default_factory=dict)  # fixed by each key's first value


class MultimodalAccumulator:
    """Accumulates every request's multimodal outputs on ``device``; see the module docstring."""

    def __init__(self, config: AccumulatorConfig | None = None, device: torch.device | str = "cpu"):
        self.config = config or AccumulatorConfig()
        self.device = backend.resolve_device(device)
        self._pools: dict[tuple, RingPool] = {}
        self._idle: dict[tuple, None] = {}  # pools that hold no request, the longest idle first
        self._requests: dict[str, _Request] = {}
        self.accumulation_errors = 0

    # --------------------------------------------------------------- lifecycle

    def add_request(self, request_id: str, emit: EmitPolicy = EmitPolicy.FINAL_ONLY) -> None:
        if request_id in self._requests:
            raise TensorAccumulationError("request added twice", request_id=request_id)
        self._requests[request_id] = _Request(emit=emit)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort(self, request_id: str) -> None:
        """Drop a request and free its slots; its data is discarded."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise TensorAccumulationError("abort of an unknown or finished request", request_id=request_id)
        self._free(request_id, req)

    def move(self, request_id: str, to: MultimodalAccumulator) -> bool:
        """Hand a request that holds no slot yet (metadata and list items at most) to accumulator
        ``to``, as it is: its first tensor came on ``to``'s device. False, nothing moved, once it
        holds a slot here."""
        req = self._requests.get(request_id)
        if req is None or req.pools or request_id in to._requests:  # (list items are kept as given, anywhere)
            return False
        to._requests[request_id] = self._requests.pop(request_id)
        return True

    def _free(self, request_id: str, req: _Request) -> None:
        """Free the request's slots. A pool left holding no request stays for the requests to come,
        up to ``_IDLE_POOLS`` of each key (each holds its arena): a stage whose frame shapes vary
        (images of many sizes) would otherwise keep an arena for every shape it ever saw."""
        for pool in req.pools.values():
            pool.free(request_id)
            if not len(pool):
                self._note_idle(pool)

    def _note_idle(self, pool: RingPool) -> None:
        """``pool`` holds no request (made, or left by its last): of its key's pools that hold
        none, the ``_IDLE_POOLS`` that became so last are kept. (Dropping a CUDA pool waits for
        the kernels queued with its staging buffers: rare, where a key's frame shapes vary.)"""
        ident = (pool.key, pool.dtype, pool.frame_shape)
        self._idle.pop(ident, None)
        self._idle[ident] = None
        same_key = [i for i in self._idle if i[0] == pool.key]
        if len(same_key) > _IDLE_POOLS:
            del self._idle[same_key[0]], self._pools[same_key[0]]

    # --------------------------------------------------------------- append

    def append_step(self, request_ids: Sequence[str], outputs: Mapping[str, Any]) -> list[TensorAccumulationError]:
        """Accumulate one step. ``outputs[key]`` is a ``PaddedBatch`` or a sequence aligned with ids.

        Returns the per-request errors (already logged and counted): a bad value (wrong type, dtype or
        frame shape for its slot, device, unknown request, overflow that cannot grow) costs only that
        request's value for that key. ValueError for a structurally wrong call (a value that is
        neither, misaligned lengths, a ``PaddedBatch`` whose rows or lengths are not one per request),
        raised before anything of the step is accumulated.
        """
        for key, chunks in outputs.items():
            if isinstance(chunks, PaddedBatch):
                _check_batch(key, chunks, len(request_ids))
                continue
            if isinstance(chunks, (torch.Tensor, str, bytes)) or not isinstance(chunks, Sequence):
                raise ValueError(f"outputs[{key!r}] must be a PaddedBatch or a per-request sequence, "
                                 f"got {type(chunks).__name__}")
            if len(chunks) != len(request_ids):
                raise ValueError(f"outputs[{key!r}] has {len(chunks)} values for {len(request_ids)} requests")
        errors: list[TensorAccumulationError] = []
        for key, chunks in outputs.items():
            if isinstance(chunks, PaddedBatch):
                self._append_batch(key, request_ids, chunks, errors)
            else:
                self._append_values(key, request_ids, chunks, errors)
        for exc in errors:
            logger.warning("skipping one step's tensor: %s", exc)
        self.accumulation_errors += len(errors)
        return errors

    def _holds(self, rid: str, key: str, strategy: Strategy, errors: list) -> _Request | None:
        """Request ``rid``, if ``strategy`` is its strategy for ``key`` (fixed by its first value);
        None, with an error recorded, for an unknown request or one that holds another strategy."""
        req = self._requests.get(rid)
        if req is None:
            errors.append(TensorAccumulationError("unknown request (never added, or already finished)",
                                                  request_id=rid, key=key))
            return None
        held = req.strategies.setdefault(key, strategy)
        if held is not strategy:
            errors.append(TensorAccumulationError(
                f"a value of strategy {strategy.value} for a key that holds {held.value} for this request",
                request_id=rid, key=key))
            return None
        return req

    def _pool(self, key: str, strategy: Strategy, dtype: torch.dtype, frame: tuple, device: torch.device) -> RingPool:
        """The pool for chunks of ``key`` of this dtype and frame shape, made on first use.
        ``TensorAccumulationError`` (the caller attributes it to its requests): chunks on another
        device than the accumulator, frames without elements or larger than the pool budget."""
        if device != self.device:
            raise TensorAccumulationError(f"tensor on {device} but the accumulator is on {self.device}", key=key)
        ident = (key, dtype, frame)
        pool = self._pools.get(ident)
        if pool is None:
            if 0 in frame:
                raise TensorAccumulationError(f"frame shape {frame} has no elements", key=key)
            cfg = self.config
            frames = cfg.initial_frames.get(key, 4096) if isinstance(cfg.initial_frames, Mapping) \
                else cfg.initial_frames
            frame_bytes = math.prod(frame) * dtype.itemsize
            why = uncopied(dtype, device)
            if why:
                raise TensorAccumulationError(why, key=key)
            if frame_bytes > cfg.pool_budget_bytes:
                raise TensorAccumulationError(f"a frame of {frame_bytes} bytes exceeds the pool budget of "
                                              f"{cfg.pool_budget_bytes} bytes", key=key)
            pool = self._pools[ident] = RingPool(
                key, dtype, frame, device, strategy, budget_bytes=cfg.pool_budget_bytes,
                initial_frames=frames, max_slots=cfg.max_slots, growth=cfg.growth)
            self._note_idle(pool)  # until a request holds a slot of it (it may never)
        return pool

    def _attach(self, key: str, rid: str, req: _Request, pool: RingPool, errors: list) -> bool:
        """Make sure request ``rid`` holds a slot of ``pool`` for ``key``; False (error recorded) if not."""
        held = req.pools.get(key)
        if held is pool:
            return True
        if held is not None:
            errors.append(TensorAccumulationError(
                f"dtype/frame shape changed mid-stream: slot holds {held.dtype} frames {held.frame_shape}, "
                f"got {pool.dtype} frames {pool.frame_shape}", request_id=rid, key=key))
            return False
        if len(pool) == pool.max_slots < MAX_SLOTS:  # more requests hold data than ever before
            pool.grow_slots(more_slots(pool.max_slots))
        try:
            pool.alloc(rid)
        except TensorAccumulationError as exc:
            errors.append(exc)
            return False
        req.pools[key] = pool
        req.order[key] = None
        self._idle.pop((pool.key, pool.dtype, pool.frame_shape), None)
        return True

    def _append_batch(self, key: str, request_ids: Sequence[str], batch: PaddedBatch, errors: list) -> None:
        data = batch.data
        why = _unfit(data) if isinstance(data, torch.Tensor) else \
            f"PaddedBatch.data must be a tensor, got {type(data).__name__}"
        if why or len(request_ids) == 0:
            errors.extend(TensorAccumulationError(why, request_id=rid, key=key) for rid in request_ids)
            return
        strategy = resolve_strategy(key, data[0] if data.dim() > 1 else data, self.config.modality,
                                    self.config.strategies)
        if not strategy.uses_ring:
            errors.extend(TensorAccumulationError(
                f"a PaddedBatch carries concatenating keys only; this key uses {strategy.value}",
                request_id=rid, key=key) for rid in request_ids)
            return
        frame = tuple(data.shape[1:-1]) if strategy is Strategy.CONCAT_LAST else tuple(data.shape[2:])
        try:
            pool = self._pool(key, strategy, data.dtype, frame, data.device)
        except TensorAccumulationError as exc:
            errors.extend(exc.for_request(rid, key) for rid in request_ids)
            return
        keep = []
        for rid in request_ids:
            req = self._holds(rid, key, strategy, errors)
            keep.append(req is not None and self._attach(key, rid, req, pool, errors))
        if all(keep):
            errors.extend(pool.append(request_ids, batch).errors)
            return
        idx = [i for i, k in enumerate(keep) if k]
        if not idx:
            return
        sub = PaddedBatch(data[idx], host_lengths(batch.lengths)[idx])  # rare (a request rejected): gathers rows
        errors.extend(pool.append([request_ids[i] for i in idx], sub).errors)

    def _append_values(self, key: str, request_ids: Sequence[str], values: Sequence[Any], errors: list) -> None:
        groups: dict[int, tuple[RingPool, list[str], list[torch.Tensor]]] = {}
        for rid, value in zip(request_ids, values):
            if value is None:
                continue
            why = _unfit(value) if isinstance(value, torch.Tensor) else None
            if why:
                errors.append(TensorAccumulationError(why, request_id=rid, key=key))
                continue
            strategy = resolve_strategy(key, value, self.config.modality, self.config.strategies)
            req = self._holds(rid, key, strategy, errors)
            if req is None:
                continue
            if strategy is Strategy.REPLACE:
                req.metadata[key] = value
                continue
            if strategy is Strategy.APPEND_LIST:
                req.lists.setdefault(key, []).append(value)
                req.order[key] = None
                continue
            pool = req.pools.get(key)
            if pool is None:
                frame = tuple(value.shape[:-1]) if strategy is Strategy.CONCAT_LAST else tuple(value.shape[1:])
                try:
                    pool = self._pool(key, strategy, value.dtype, frame, value.device)
                except TensorAccumulationError as exc:
                    errors.append(exc.for_request(rid, key))
                    continue
                if not self._attach(key, rid, req, pool, errors):
                    continue
            group = groups.setdefault(id(pool), (pool, [], []))
            group[1].append(rid)
            group[2].append(value)
        for pool, rids, chunks in groups.values():
            errors.extend(pool.append(rids, chunks).errors)

    # --------------------------------------------------------------- emit

    def collect(self, finished: Iterable[str] = (), *, request_ids: Iterable[str] = ()) -> dict[str, MultimodalPayload]:
        """The payloads of ``request_ids`` (whose output the caller builds now) and of ``finished``,
        per their emit policies (a FINAL_ONLY request has one only at finish); finished requests are
        then freed.

        Raises:
            TensorConsolidationError: for a request whose output cannot be produced; that request
                is freed, every other request is left as it was (call ``collect`` again for them).
        """
        finished = set(finished)
        requests = self._requests
        due = [(rid, requests[rid], rid in finished) for rid in set(request_ids) | finished
               if rid in requests and (rid in finished or requests[rid].emit is not EmitPolicy.FINAL_ONLY)]
        for rid in finished:
            if rid not in requests:
                raise TensorAccumulationError("finish of an unknown or already finished request", request_id=rid)
        by_pool: dict[int, tuple[RingPool, list[str], list[str]]] = {}
        for rid, req, _ in due:
            for key, pool in req.pools.items():
                group = by_pool.setdefault(id(pool), (pool, [], []))
                (group[1] if req.emit is EmitPolicy.DELTA else group[2]).append(rid)
        for pool, _, cons_ids in by_pool.values():  # before any drain: a failure leaves the others as they were
            try:
                pool.check_consolidate(cons_ids)
            except TensorConsolidationError as exc:
                if exc.request_id in self._requests:
                    self.abort(exc.request_id)
                raise
        tensors: dict[str, dict[str, torch.Tensor]] = {rid: {} for rid, _, _ in due}
        axes: dict[str, int] = {}
        for pool, drain_ids, cons_ids in by_pool.values():
            for ids, read in ((drain_ids, pool.drain), (cons_ids, pool.consolidate)):
                if not ids:
                    continue
                for rid, out in zip(ids, read(ids)):
                    tensors[rid][pool.key] = out
                    axes[pool.key] = -1 if pool.last else 0
        payloads: dict[str, MultimodalPayload] = {}
        for rid, req, done in due:
            payload = MultimodalPayload(metadata=dict(req.metadata))
            for key in req.order:
                if key in tensors[rid]:
                    payload.tensors[key] = tensors[rid][key]
                    payload.axes[key] = axes[key]
                elif key in req.lists:
                    items = req.lists[key]
                    start = req.list_emitted.get(key, 0) if req.emit is EmitPolicy.DELTA else 0
                    payload.tensors[key] = list(items[start:])
                    req.list_emitted[key] = len(items)
            payloads[rid] = payload
            if done:
                del self._requests[rid]
                self._free(rid, req)
        return payloads

    # --------------------------------------------------------------- introspection

    def pools(self) -> list[RingPool]:
        return list(self._pools.values())

    def stats(self) -> dict[str, Any]:
        """Per-pool statistics plus totals and the accumulation error count."""
        per_pool: dict[str, PoolStats] = {
            f"{p.key}:{str(p.dtype).removeprefix('torch.')}:{list(p.frame_shape)}:{p.device}": p.stats()
            for p in self._pools.values()}
        return {
            "requests": len(self._requests),
            "accumulation_errors": self.accumulation_errors,
            "bytes_used": sum(s.bytes_used for s in per_pool.values()),
            "bytes_reserved": sum(s.bytes_reserved for s in per_pool.values()),
            "high_water_bytes": sum(s.high_water_bytes for s in per_pool.values()),
            "pools": per_pool,
        }


def _check_batch(key: str, batch: PaddedBatch, requests: int) -> None:
    """ValueError unless ``batch`` has one row and one length per request (TypeError for lengths on
    a device or not integers); a batch whose data is no plain tensor is left to the per-request errors."""
    data, lengths = batch.data, batch.lengths
    if isinstance(data, torch.Tensor) and _unfit(data) is None and (data.dim() < 1 or data.shape[0] != requests):
        rows = data.shape[0] if data.dim() else 0
        raise ValueError(f"outputs[{key!r}] is a PaddedBatch of {rows} rows for {requests} requests")
    try:
        n = host_lengths(lengths)
    except TypeError as exc:
        raise TypeError(f"outputs[{key!r}]: {exc}") from None
    if n.size != requests:
        raise ValueError(f"outputs[{key!r}] is a PaddedBatch of {n.size} lengths for {requests} requests")
