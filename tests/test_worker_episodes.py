"""Random ``WorkerAccumulator`` episodes against ``torch.cat`` of what was sent.

Each episode: requests of every output kind arrive at rows the caller picks (a freed row is often
reused in the same step); steps append ``PaddedBatch`` or list chunks (lengths from 0 to past a
slot's capacity, so slots grow and rings wrap), rows given or looked up; some requests are aborted
in the middle of a step (after their append, before the collect), some finish, and some end on a
stop token seen a step late (the worker's protocol: that step's packed data leaves out the
request's newest frames with ``drop_newest``, and the request closes at the next step with
``collect(ends=...)``). Every piece a request receives is kept as the view it is (no clone) until
the end of the episode, and the previous step's ``PackedStep`` stays alive while the next one is
made: a host buffer handed out again while a view of it lives would show as altered data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_kernels.accumulator import EmitPolicy
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch
from vllm_omni_kernels.serving.worker_accumulator import OutputKey, WorkerAccumulator

BIG = np.iinfo(np.int64).max
EMITS = (EmitPolicy.DELTA, EmitPolicy.CUMULATIVE, EmitPolicy.FINAL_ONLY)


def keys(cadence):
    return [OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=cadence, initial_frames=8),
            OutputKey("codes", S.CONCAT_DIM0, torch.int64, (3,), cadence=None, initial_frames=2),
            OutputKey("lat", S.CONCAT_DIM0, torch.float32, (2,), cadence=2, initial_frames=4),
            OutputKey("stereo", S.CONCAT_LAST, torch.float32, (2,), cadence=None, initial_frames=4)]


def chunk(key, n, gen):
    if key.strategy is S.CONCAT_LAST:
        return torch.randn(*key.frame_shape, n, generator=gen)
    if key.dtype is torch.int64:
        return torch.randint(-(2**40), 2**40, (n, *key.frame_shape), generator=gen)
    return torch.randn(n, *key.frame_shape, generator=gen)


def cat(key, pieces):
    dim = -1 if key.strategy is S.CONCAT_LAST else 0
    empty = torch.empty((*key.frame_shape, 0) if dim == -1 else (0, *key.frame_shape), dtype=key.dtype)
    return torch.cat([empty, *pieces], dim=dim)


def run_episode(seed, max_requests=6, steps=14, device="cpu"):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    ks = keys(int(rng.choice([0, 3, 10])))
    acc = WorkerAccumulator(ks, device, budget_bytes=1 << 16, max_requests=max_requests)
    sent: dict[str, dict[str, list]] = {}
    ends: dict[str, dict[str, int]] = {}  # request -> per key the frames its output ends at
    got: dict[str, dict[str, list]] = {}
    emit_of: dict[str, EmitPolicy] = {}
    rows: dict[str, int] = {}
    live: list[str] = []
    stopping: dict[str, dict[str, int]] = {}  # seen "stop" last step: closes this step at these frames
    aborted: set[str] = set()
    nxt = 0
    previous = None
    for step in range(steps):
        # arrivals: at free rows (often a row freed just now)
        free = [r for r in range(max_requests) if r not in rows.values()]
        for _ in range(int(rng.integers(0, 3))):
            if not free:
                break
            rid = f"s{seed}-r{nxt}"
            nxt += 1
            row = free.pop(int(rng.integers(0, len(free))))
            emit = EMITS[int(rng.integers(0, 3))]
            acc.add_request(rid, emit, row=row)
            rows[rid], emit_of[rid] = row, emit
            sent[rid] = {k.name: [] for k in ks}
            got[rid] = {k.name: [] for k in ks}
            live.append(rid)
        appending = [r for r in live if r not in stopping and rng.random() < 0.9]
        appended_now: dict[str, dict[str, int]] = {r: {k.name: 0 for k in ks} for r in appending}
        if appending:
            outputs = {}
            for key in ks:
                if rng.random() < 0.15:
                    continue  # nothing of this key this step
                lengths = rng.integers(0, 12, size=len(appending)).astype(np.int64)
                if rng.random() < 0.5:
                    width = int(lengths.max()) + int(rng.integers(0, 3))
                    if key.strategy is S.CONCAT_LAST:
                        data = torch.randn(len(appending), *key.frame_shape, width, generator=gen)
                    elif key.dtype is torch.int64:
                        data = torch.randint(-(2**40), 2**40, (len(appending), width, *key.frame_shape), generator=gen)
                    else:
                        data = torch.randn(len(appending), width, *key.frame_shape, generator=gen)
                    outputs[key.name] = PaddedBatch(data.to(device), lengths)
                    for b, rid in enumerate(appending):
                        n = int(lengths[b])
                        piece = data[b][..., :n] if key.strategy is S.CONCAT_LAST else data[b][:n]
                        sent[rid][key.name].append(piece.clone())
                        appended_now[rid][key.name] = n
                else:
                    values = []
                    for b, rid in enumerate(appending):
                        if rng.random() < 0.15:
                            values.append(None)
                            continue
                        t = chunk(key, int(lengths[b]), gen)
                        values.append(t.to(device))
                        sent[rid][key.name].append(t.clone())
                        appended_now[rid][key.name] = int(lengths[b])
                    outputs[key.name] = values
            pass_rows = rng.random() < 0.5
            failed = acc.append(appending, outputs,
                                rows=np.array([rows[r] for r in appending], np.int64) if pass_rows else None)
            assert failed == {}, f"seed {seed}: {failed}"
        # aborts in the middle of a step (after the append, before the collect)
        for rid in list(live):
            if rid not in stopping and rng.random() < 0.05:
                acc.abort(rid)
                live.remove(rid)
                del rows[rid]
                aborted.add(rid)
        # this step's closes: the requests whose stop was seen (at their ends), and some finishing
        finishing = [r for r in live if r not in stopping and (step == steps - 1 or rng.random() < 0.1)]
        ends_arg = None
        if stopping:
            ends_arg = [np.full(max_requests, BIG, np.int64) for _ in ks]
            for rid, end in stopping.items():
                for e, key in zip(ends_arg, ks):
                    e[rows[rid]] = end[key.name]
        closing = list(stopping) + finishing
        packed = acc.collect(closing, ends=ends_arg)
        # a stop seen for some requests "now" (after this step ran: async scheduling): their frames of
        # this step lie past their end; the step's data leaves them out (drop_newest) before anyone
        # reads it, and they close at the next step at the frames before this step's
        new_stops = [r for r in live if r not in stopping and r not in finishing and r in appended_now
                     and rng.random() < 0.12]
        for rid in new_stops:
            total = {k.name: sum(p.shape[-1 if k.strategy is S.CONCAT_LAST else 0] for p in sent[rid][k.name])
                     for k in ks}
            extra = appended_now[rid]
            end = {name: total[name] - extra[name] for name in total}
            ends[rid] = end
            if packed is not None:
                packed.drop_newest(rid, {name: n for name, n in extra.items() if n})
        for rid in closing:
            live.remove(rid)
            del rows[rid]
        if packed is not None:
            packed.wait()
            assert packed.final == set(closing), f"seed {seed} step {step}"
            for rid in packed.requests():
                assert rid in got, f"seed {seed} step {step}: data for unknown {rid}"
                assert rid not in aborted, f"seed {seed} step {step}: data for aborted {rid}"
                for name, t in packed.tensors(rid).items():
                    got[rid][name].append(t)  # the view itself, kept until the end
        stopping = {rid: ends[rid] for rid in new_stops}
        previous = packed  # alive while the next step is packed
        del packed
    # the last step's stops: close them now
    if stopping:
        ends_arg = [np.full(max_requests, BIG, np.int64) for _ in ks]
        for rid, end in stopping.items():
            for e, key in zip(ends_arg, ks):
                e[rows[rid]] = end[key.name]
        packed = acc.collect(list(stopping), ends=ends_arg)
        if packed is not None:
            for rid in packed.requests():
                for name, t in packed.tensors(rid).items():
                    got[rid][name].append(t)
        for rid in stopping:
            live.remove(rid)
            del rows[rid]
        del packed
    del previous
    assert not live and len(acc) == 0
    # every view kept since its step must still hold exactly what was sent
    for rid in sent:
        if rid in aborted:
            continue
        for key in ks:
            want = cat(key, sent[rid][key.name])
            if rid in ends:
                n = ends[rid][key.name]
                want = want[..., :n] if key.strategy is S.CONCAT_LAST else want[:n]
            have = cat(key, got[rid][key.name])
            assert torch.equal(have, want), (f"seed {seed}: {rid} ({emit_of[rid].name}) key {key.name}: "
                                             f"got {tuple(have.shape)} want {tuple(want.shape)}")
    for pool in acc.pools:
        st = pool.stats()
        assert st.slots_used == 0 and st.unread_bytes == 0, f"seed {seed}: {pool.key} {st}"


@pytest.mark.parametrize("chunk_", range(4))
def test_worker_accumulator_random_episodes_torch(chunk_, use_backend):
    use_backend("torch")
    for seed in range(chunk_ * 100, (chunk_ + 1) * 100):
        run_episode(seed)


def test_worker_accumulator_random_episodes_triton(use_backend):
    use_backend("triton")
    for seed in range(1000, 1015):
        run_episode(seed, steps=8)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["auto", "triton", "torch"])
def test_worker_accumulator_random_episodes_cuda(name, use_backend):
    use_backend(name)
    for seed in range(2000, 2300):
        run_episode(seed, device="cuda")
    torch.cuda.synchronize()
