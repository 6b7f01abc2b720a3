"""``MultimodalAccumulator``: per-request accumulation of every output key, with emit policies.

A step is ``{key: chunks}`` for a list of request ids, where chunks is a ``PaddedBatch`` (one tensor
for the batch, host lengths) or a per-request sequence (tensor, scalar or None). Per key the strategy
is the declared one, else resolved from the first value seen (``modality.resolve_strategy``):
CONCAT_DIM0 / CONCAT_LAST keys go to ``RingPool`` slots (one launch per pool per step, GPU kernels on
CUDA, the torch reference on CPU), APPEND_LIST keys to a host list, REPLACE values (0-d tensors,
non-tensors such as ``sr``) to the payload's metadata.

Emission (``collect``): DELTA drains the unread data every ``stream_interval`` steps and at finish;
CUMULATIVE consolidates everything so far on the same schedule; FINAL_ONLY consolidates once, at
finish. Finished and aborted requests free their slots.

Errors: a bad value for one request (wrong type, dtype or frame shape for its slot, device, unknown
request, overflow that cannot grow) skips that request's value for that key with a
``TensorAccumulationError``; ``append_step`` returns them (and counts them) and the rest of the step
is accumulated. A ``TensorConsolidationError`` is raised by ``collect`` for the request concerned.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import TensorAccumulationError, TensorConsolidationError
from .modality import OutputModality, TensorAccumulationStrategy as Strategy, resolve_strategy
from .payload import MultimodalPayload
from .ring import PaddedBatch, PoolStats, RingPool

logger = logging.getLogger(__name__)


class EmitPolicy(enum.Enum):
    FINAL_ONLY = "final_only"
    DELTA = "delta"
    CUMULATIVE = "cumulative"


@dataclass
class AccumulatorConfig:
    """Sizing and strategy of an accumulator.

    ``pool_budget_bytes`` is preallocated per pool (one pool per key, dtype, frame shape, device) the
    first time such a combination appears; ``initial_frames`` is a new slot's capacity, one number
    for every key or ``{key: frames}`` (keys not named get 4096).
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
    interval: int
    steps: int = 0
    pools: dict[str, RingPool] = field(default_factory=dict)
    lists: dict[str, list[Any]] = field(default_factory=dict)
    list_emitted: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    order: dict[str, None] = field(default_factory=dict)  # keys in first-seen order


@dataclass
class Emission:
    """Payloads of one ``collect``; with ``to_cpu`` the copies are in flight until ``wait()``."""

    payloads: dict[str, MultimodalPayload]
    event: Any = None

    def wait(self) -> dict[str, MultimodalPayload]:
        if self.event is not None:
            self.event.synchronize()
        return self.payloads


class MultimodalAccumulator:
    """Accumulates every request's multimodal outputs on ``device``; see the module docstring."""

    def __init__(self, config: AccumulatorConfig | None = None, device: torch.device | str = "cpu"):
        self.config = config or AccumulatorConfig()
        self.device = torch.device(device)
        self._pools: dict[tuple, RingPool] = {}
        self._strategy: dict[str, Strategy] = dict(self.config.strategies)
        self._requests: dict[str, _Request] = {}
        self.accumulation_errors = 0

    # --------------------------------------------------------------- lifecycle

    def add_request(self, request_id: str, emit: EmitPolicy = EmitPolicy.FINAL_ONLY, stream_interval: int = 1) -> None:
        if request_id in self._requests:
            raise TensorAccumulationError("request added twice", request_id=request_id)
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._requests[request_id] = _Request(emit=emit, interval=stream_interval)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort(self, request_id: str) -> None:
        """Drop a request and free its slots; its data is discarded."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise TensorAccumulationError("abort of an unknown or finished request", request_id=request_id)
        for pool in req.pools.values():
            pool.free(request_id)

    # --------------------------------------------------------------- append

    def append_step(self, request_ids: Sequence[str], outputs: Mapping[str, Any]) -> list[TensorAccumulationError]:
        """Accumulate one step. ``outputs[key]`` is a ``PaddedBatch`` or a sequence aligned with ids.

        Returns the per-request errors (already logged and counted); nothing else is raised for bad
        values. ValueError for a structurally wrong call (misaligned lengths).
        """
        errors: list[TensorAccumulationError] = []
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is not None:
                req.steps += 1
        for key, chunks in outputs.items():
            if isinstance(chunks, PaddedBatch):
                self._append_batch(key, request_ids, chunks, errors)
            else:
                if isinstance(chunks, (torch.Tensor, str, bytes)) or not isinstance(chunks, Sequence):
                    raise ValueError(f"outputs[{key!r}] must be a PaddedBatch or a per-request sequence, "
                                     f"got {type(chunks).__name__}")
                if len(chunks) != len(request_ids):
                    raise ValueError(f"outputs[{key!r}] has {len(chunks)} values for {len(request_ids)} requests")
                self._append_values(key, request_ids, chunks, errors)
        for exc in errors:
            logger.warning("skipping one step's tensor: %s", exc)
        self.accumulation_errors += len(errors)
        return errors

    def _strategy_for(self, key: str, value: Any) -> Strategy:
        strategy = self._strategy.get(key)
        if strategy is None:
            strategy = self._strategy[key] = resolve_strategy(key, value, self.config.modality)
        return strategy

    def _pool(self, key: str, strategy: Strategy, dtype: torch.dtype, frame: tuple, device: torch.device) -> RingPool:
        ident = (key, dtype, frame, device)
        pool = self._pools.get(ident)
        if pool is None:
            if 0 in frame:
                raise TensorAccumulationError(f"frame shape {frame} has no elements", key=key)
            cfg = self.config
            frames = cfg.initial_frames.get(key, 4096) if isinstance(cfg.initial_frames, Mapping) \
                else cfg.initial_frames
            pool = self._pools[ident] = RingPool(
                key, dtype, frame, device, strategy, budget_bytes=cfg.pool_budget_bytes,
                initial_frames=frames, max_slots=cfg.max_slots, growth=cfg.growth)
        return pool

    def _attach(self, key: str, rid: str, pool: RingPool, errors: list) -> bool:
        """Make sure ``rid`` holds a slot of ``pool`` for ``key``; False (error recorded) if not."""
        req = self._requests.get(rid)
        if req is None:
            errors.append(TensorAccumulationError("unknown request (never added, or already finished)",
                                                  request_id=rid, key=key))
            return False
        held = req.pools.get(key)
        if held is pool:
            return True
        if held is not None:
            errors.append(TensorAccumulationError(
                f"dtype/frame shape changed mid-stream: slot holds {held.dtype} frames {held.frame_shape}, "
                f"got {pool.dtype} frames {pool.frame_shape}", request_id=rid, key=key))
            return False
        try:
            pool.alloc(rid)
        except TensorAccumulationError as exc:
            errors.append(exc)
            return False
        req.pools[key] = pool
        req.order[key] = None
        return True

    def _append_batch(self, key: str, request_ids: Sequence[str], batch: PaddedBatch, errors: list) -> None:
        data = batch.data
        strategy = self._strategy_for(key, data[0] if data.dim() > 1 else data)
        if not strategy.uses_ring:
            raise ValueError(f"key {key!r} uses {strategy.value}; PaddedBatch is only for concatenating keys")
        frame = tuple(data.shape[1:-1]) if strategy is Strategy.CONCAT_LAST else tuple(data.shape[2:])
        try:
            pool = self._pool(key, strategy, data.dtype, frame, data.device)
        except TensorAccumulationError as exc:
            errors.extend(exc.for_request(rid, key) for rid in request_ids)
            return
        keep = [self._attach(key, rid, pool, errors) for rid in request_ids]
        if all(keep):
            errors.extend(pool.append(request_ids, batch).errors)
            return
        idx = [i for i, k in enumerate(keep) if k]
        lengths = [int(batch.lengths[i]) for i in idx]
        sub = PaddedBatch(data[idx], lengths)  # rare path (some request rejected): gathers rows
        errors.extend(pool.append([request_ids[i] for i in idx], sub).errors)

    def _append_values(self, key: str, request_ids: Sequence[str], values: Sequence[Any], errors: list) -> None:
        first = next((v for v in values if v is not None), None)
        if first is None:
            return
        strategy = self._strategy_for(key, first)
        if not strategy.uses_ring:
            for rid, value in zip(request_ids, values):
                if value is None:
                    continue
                req = self._requests.get(rid)
                if req is None:
                    errors.append(TensorAccumulationError("unknown request (never added, or already finished)",
                                                          request_id=rid, key=key))
                elif strategy is Strategy.REPLACE:
                    req.metadata[key] = value
                else:
                    req.lists.setdefault(key, []).append(value)
                    req.order[key] = None
            return
        groups: dict[int, tuple[RingPool, list[str], list[torch.Tensor]]] = {}
        for rid, value in zip(request_ids, values):
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                errors.append(TensorAccumulationError(
                    f"expected a tensor with a {strategy.value} axis, got "
                    f"{type(value).__name__ if not isinstance(value, torch.Tensor) else '0-d tensor'}",
                    request_id=rid, key=key))
                continue
            req = self._requests.get(rid)
            pool = req.pools.get(key) if req is not None else None
            if pool is None:
                frame = tuple(value.shape[:-1]) if strategy is Strategy.CONCAT_LAST else tuple(value.shape[1:])
                try:
                    pool = self._pool(key, strategy, value.dtype, frame, value.device)
                except TensorAccumulationError as exc:
                    errors.append(exc.for_request(rid, key))
                    continue
                if not self._attach(key, rid, pool, errors):
                    continue
            group = groups.setdefault(id(pool), (pool, [], []))
            group[1].append(rid)
            group[2].append(value)
        for pool, rids, chunks in groups.values():
            errors.extend(pool.append(rids, chunks).errors)

    # --------------------------------------------------------------- emit

    def collect(self, finished: Iterable[str] = (), *, to_cpu: bool = False,
                request_ids: Iterable[str] | None = None) -> Emission:
        """Payloads due this step per the requests' emit policies; finished requests are emitted
        (if anything is due) and then freed. With ``to_cpu`` each pool's output is copied to pinned
        host memory in one non-blocking copy; call ``Emission.wait()`` before reading.

        ``request_ids``: emit exactly these requests now (plus ``finished``), whatever their step
        counters: for a caller that decides itself when a request's output is due (vLLM's output
        processor emits when it builds a completion output).

        Raises:
            TensorConsolidationError: for a request whose output cannot be produced; that request
                is freed, every other request is left as it was (call ``collect`` again for them).
        """
        finished = set(finished)
        if request_ids is not None:
            wanted = set(request_ids) | finished
            due = [(rid, self._requests[rid], rid in finished) for rid in wanted if rid in self._requests]
        else:
            due = [(rid, req, rid in finished) for rid, req in self._requests.items()
                   if rid in finished or (req.emit is not EmitPolicy.FINAL_ONLY and req.steps >= req.interval)]
        for rid in finished:
            if rid not in self._requests:
                raise TensorAccumulationError("finish of an unknown or already finished request", request_id=rid)
        by_pool: dict[int, tuple[RingPool, list[str], list[str]]] = {}
        for rid, req, _ in due:
            for key, pool in req.pools.items():
                group = by_pool.setdefault(id(pool), (pool, [], []))
                (group[1] if req.emit is EmitPolicy.DELTA else group[2]).append(rid)
        tensors: dict[str, dict[str, torch.Tensor]] = {rid: {} for rid, _, _ in due}
        event = None
        for pool, drain_ids, cons_ids in by_pool.values():
            for ids, read in ((drain_ids, pool.drain), (cons_ids, pool.consolidate)):
                if not ids:
                    continue
                try:
                    outs = read(ids)
                except TensorConsolidationError as exc:
                    if exc.request_id in self._requests:
                        self.abort(exc.request_id)
                    raise
                if to_cpu and pool.device.type != "cpu" and outs:
                    outs, event = _to_pinned(outs)
                for rid, out in zip(ids, outs):
                    tensors[rid][pool.key] = out
        payloads: dict[str, MultimodalPayload] = {}
        for rid, req, done in due:
            payload = MultimodalPayload(metadata=dict(req.metadata))
            for key in req.order:
                if key in tensors[rid]:
                    payload.tensors[key] = tensors[rid][key]
                elif key in req.lists:
                    items = req.lists[key]
                    start = req.list_emitted.get(key, 0) if req.emit is EmitPolicy.DELTA else 0
                    payload.tensors[key] = list(items[start:])
                    req.list_emitted[key] = len(items)
            req.steps = 0
            payloads[rid] = payload
            if done:
                del self._requests[rid]
                for pool in req.pools.values():
                    pool.free(rid)
        return Emission(payloads, event)

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


def _to_pinned(outs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """One non-blocking D2H of the buffer behind ``outs`` (views of one tensor); views into the copy."""
    base = outs[0]._base if outs[0]._base is not None else outs[0]
    host = torch.empty(base.shape, dtype=base.dtype, pin_memory=True)
    host.copy_(base, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    views = [torch.as_strided(host, o.shape, o.stride(), o.storage_offset()) for o in outs]
    return views, event
