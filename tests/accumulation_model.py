"""Random accumulation episodes checked against a plain model: per-request lists and ``torch.cat``.

An episode drives one ``MultimodalAccumulator`` through staggered arrivals, steps with several keys
(every strategy; float32, bfloat16 and int64; chunk lengths from 0 to past a slot's capacity, so
slots grow and rings wrap), ``PaddedBatch`` views with storage offsets and strides, lengths as lists,
numpy arrays or CPU tensors, per-request lists with gaps, DELTA / CUMULATIVE / FINAL_ONLY requests
with stream intervals, aborts, and slot reuse by later requests. Every payload ``collect`` returns
is compared bit for bit with what the model says is due; at the end every pool must be empty and
its allocator merged back to its initial blocks.

``run_episode(seed, device)`` is deterministic in ``seed`` (numpy and torch generators, no hash()).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_omni_kernels.accumulator import AccumulatorConfig, EmitPolicy, MultimodalAccumulator
from vllm_omni_kernels.modality import OutputModality, TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch

# key -> (strategy, dtype, frame shape); "stereo" is not declared (the AUDIO default: CONCAT_LAST),
# "sr" is metadata (REPLACE: Python ints and 0-d tensors).
KEYS = {
    "audio": (S.CONCAT_LAST, torch.float32, ()),
    "stereo": (S.CONCAT_LAST, torch.bfloat16, (2,)),
    "codes": (S.CONCAT_DIM0, torch.int64, (4,)),
    "latent": (S.CONCAT_DIM0, torch.bfloat16, (3,)),
    "tags": (S.APPEND_LIST, torch.int64, (2,)),
}
DECLARED = {"audio": S.CONCAT_LAST, "codes": S.CONCAT_DIM0, "latent": S.CONCAT_DIM0, "tags": S.APPEND_LIST}
EMITS = (EmitPolicy.DELTA, EmitPolicy.CUMULATIVE, EmitPolicy.FINAL_ONLY)


@dataclass
class _Model:
    emit: EmitPolicy
    interval: int
    steps: int = 0
    chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # every value, in order
    sent: dict[str, int] = field(default_factory=dict)  # DELTA: values already emitted
    metadata: dict[str, object] = field(default_factory=dict)

    def due_tensors(self, key: str):
        strategy = KEYS[key][0]
        values = self.chunks[key]
        start = self.sent.get(key, 0) if self.emit is EmitPolicy.DELTA else 0
        self.sent[key] = len(values)
        if strategy is S.APPEND_LIST:
            return values[start:]
        dim = -1 if strategy is S.CONCAT_LAST else 0
        _, dtype, frame = KEYS[key]
        empty = torch.empty((*frame, 0) if dim == -1 else (0, *frame), dtype=dtype)
        return torch.cat([empty, *values[start:]], dim=dim)


def _chunk(key: str, n: int, gen: torch.Generator) -> torch.Tensor:
    strategy, dtype, frame = KEYS[key]
    shape = (*frame, n) if strategy is S.CONCAT_LAST else (n, *frame)
    return _values(shape, dtype, gen)


def _values(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64).to(dtype)


def _padded(key: str, lengths: np.ndarray, rng: np.random.Generator, gen: torch.Generator) -> torch.Tensor:
    """A ``[B, ...]`` batch with room for the longest length, often a view with a storage offset and
    strides (a slice of a larger tensor), so nothing may assume a fresh contiguous tensor."""
    strategy, dtype, frame = KEYS[key]
    B, axis = len(lengths), int(lengths.max(initial=0)) + int(rng.integers(0, 3))
    pad_b, pad_a = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    if strategy is S.CONCAT_LAST:
        big = _values((B + pad_b, *frame, axis + pad_a), dtype, gen)
        data = big[pad_b:, ..., pad_a:]
    else:
        big = _values((B + pad_b, axis + pad_a, *frame), dtype, gen)
        data = big[pad_b:, pad_a:]
    if rng.random() < 0.2:
        data = data.contiguous()
    return data


def _lengths_as(lengths: np.ndarray, rng: np.random.Generator):
    form = int(rng.integers(0, 3))
    return lengths.tolist() if form == 0 else lengths if form == 1 else torch.from_numpy(lengths.copy())


def run_episode(seed: int, device: str | torch.device = "cpu", *, max_requests: int = 12, steps: int = 10,
                big_batch: bool = False) -> dict[str, int]:
    """One episode; raises AssertionError (with the seed) on any difference. Returns counts."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    initial = int(rng.choice([1, 2, 4, 8, 16]))
    cfg = AccumulatorConfig(modality=OutputModality.AUDIO, strategies=DECLARED, pool_budget_bytes=4 << 20,
                            initial_frames=initial, max_slots=512, growth=True)
    acc = MultimodalAccumulator(cfg, device)
    n_requests = int(rng.integers(257, 300)) if big_batch else int(rng.integers(1, max_requests + 1))
    arrivals = [f"s{seed}-r{i}" for i in range(n_requests)]
    model: dict[str, _Model] = {}
    live: list[str] = []
    counts = {"steps": 0, "payloads": 0, "aborts": 0}
    prev = None  # (requests, rng state) of the last step
    longest = int(rng.choice([3, 2 * initial + 3, 40]))
    while arrivals or live:
        for _ in range(len(arrivals) if big_batch else int(rng.integers(0, 4))):
            if arrivals:
                rid = arrivals.pop(0)
                emit = EMITS[int(rng.integers(0, 3))]
                interval = int(rng.integers(1, 4))
                acc.add_request(rid, emit=emit)
                model[rid] = _Model(emit, interval)
                live.append(rid)
        if not live:
            continue
        if prev is not None and set(prev[0]) <= set(live) and rng.random() < 0.3:
            # the last step's requests, keys, lengths and layouts again (new values): the pools'
            # repeated-step launch
            active, state = prev
            step_rng = np.random.default_rng()
            step_rng.bit_generator.state = state
        else:
            active = list(rng.permutation(live)) if not big_batch else list(live)
            if not big_batch and rng.random() < 0.3:
                active = active[: int(rng.integers(1, len(active) + 1))]
            step_rng = np.random.default_rng(rng.integers(2**63))
            prev = (active, step_rng.bit_generator.state)
        outputs = _step_outputs(active, model, step_rng, gen, device, longest)
        errors = acc.append_step(active, outputs)
        assert errors == [], f"seed {seed}: unexpected errors {errors}"
        for rid in active:
            model[rid].steps += 1
        counts["steps"] += 1
        for rid in list(live):
            if rng.random() < 0.04:
                acc.abort(rid)
                live.remove(rid)
                del model[rid]
                counts["aborts"] += 1
        last_step = counts["steps"] >= steps
        finished = [r for r in live if last_step or rng.random() < 0.12]
        counts["payloads"] += _check_collect(acc, model, finished, seed, device)
        live = [r for r in live if r not in finished]
        for rid in finished:
            del model[rid]
    for pool in acc.pools():
        st = pool.stats()
        assert st.slots_used == 0 and st.bytes_used == 0 and st.unread_bytes == 0, f"seed {seed}: {pool.key} {st}"
        assert pool.allocator.is_merged(), f"seed {seed}: {pool.key} allocator not merged back"
        counts["repeated_launches"] = counts.get("repeated_launches", 0) + st.repeated_launches
    return counts


def _step_outputs(active, model, rng, gen, device, longest) -> dict:
    outputs: dict[str, object] = {}
    keys = [k for k in KEYS if rng.random() < 0.7] + (["sr"] if rng.random() < 0.5 else [])
    for key in keys:
        if key == "sr":
            values = [int(rng.integers(8000, 48000)) if rng.random() < 0.5 else torch.tensor(float(rng.integers(99)))
                      for _ in active]
            outputs[key] = values
            for rid, v in zip(active, values):
                model[rid].metadata[key] = v
            continue
        strategy = KEYS[key][0]
        lengths = rng.integers(0, longest + 1, size=len(active)).astype(np.int64)
        if strategy.uses_ring and rng.random() < 0.5:
            data = _padded(key, lengths, rng, gen)
            outputs[key] = PaddedBatch(data.to(device), _lengths_as(lengths, rng))
            for b, rid in enumerate(active):
                row = data[b][..., : lengths[b]] if strategy is S.CONCAT_LAST else data[b][: lengths[b]]
                model[rid].chunks.setdefault(key, []).append(row.clone())
            continue
        values = []
        for rid, n in zip(active, lengths):
            if rng.random() < 0.15:
                values.append(None)  # this request has nothing for the key this step
                continue
            chunk = _chunk(key, int(n), gen)
            values.append(chunk.to(device))
            model[rid].chunks.setdefault(key, []).append(chunk)
        outputs[key] = values
    return outputs


def _check_collect(acc, model, finished, seed, device) -> int:
    due = {r for r, m in model.items() if r in finished or (m.emit is not EmitPolicy.FINAL_ONLY and m.steps >= m.interval)}
    # a streaming request's output is due every ``interval`` of its steps (the caller's pacing, as
    # vLLM's stream_interval paces the output processor)
    payloads = acc.collect(finished, request_ids=[r for r, m in model.items() if m.steps >= m.interval])
    assert set(payloads) == due, f"seed {seed}: payloads for {sorted(payloads)}, due {sorted(due)}"
    for rid, payload in payloads.items():
        m = model[rid]
        m.steps = 0
        assert list(payload.tensors) == list(m.chunks), f"seed {seed} {rid}: keys {list(payload.tensors)}"
        for key in m.chunks:
            want, got = m.due_tensors(key), payload.tensors[key]
            if isinstance(want, list):
                assert len(got) == len(want) and all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), \
                    f"seed {seed} {rid} {key}: list differs"
            else:
                assert got.dtype == want.dtype and torch.equal(got.cpu(), want), \
                    f"seed {seed} {rid} {key}: {tuple(got.shape)} vs {tuple(want.shape)}"
        assert payload.metadata.keys() == m.metadata.keys(), f"seed {seed} {rid}: metadata keys"
        for key, want in m.metadata.items():
            got = payload.metadata[key]
            assert type(got) is type(want) and (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want)
    return len(payloads)
