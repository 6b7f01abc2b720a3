"""The output path of a TTS engine step at a fixed load, this package's against the upstream style,
in one process: B streams, each producing one codec frame (1920 float32 samples and its codes) per
step, DELTA, CUMULATIVE and FINAL_ONLY in turn (``--kinds``), every request ``--frames`` frames long
and started in turn so that the batch stays full and ``B / frames`` requests finish and start every
step.

Per step and path it times, on the host:

* worker: this package's ``WorkerAccumulator.append`` + ``collect`` (one launch per key, what is due
  packed, one asynchronous copy) and the wait for that copy, or the upstream style's per-key
  ``.cpu()`` and per-request slices: the step's output in hand; and its host part alone (until
  ``collect`` returns; the upstream style's blocking copies are all host time);
* wire: the scheduler's message (this package's: ``HeldTokens.thin`` and
  ``scheduler.outputs_with_channel``) and vLLM's ``MsgpackEncoder`` (the engine core's side);
* floor (CUDA): the step's launches and copy alone, from resident metadata (``launch_floor_us``);
* frontend: this package's ``OmniMsgpackDecoder`` and ``MultimodalOutputProcessor.process_outputs``
  (or ``UpstreamStyleOutputProcessor``'s): the whole, and its multimodal share (what ``simulate``
  reports).

The client's processor runs with vLLM's ``stream_interval`` at the cadence in frames, as the
talker's engine does (``llm.talker_stream_interval``). Every finished request's audio is checked
sample for sample against what its frames decode to, its codes and tokens against those its steps
sampled, and each CUMULATIVE output against the one before it.
Prints one line per path and a ratio line; ``--out`` writes JSON (``plot.py`` draws it).

Usage: python profiling/bench_output_path.py [--streams 64,256] [--frames 40] [--steps 200] [--device cuda]
       [--kinds delta,cumulative,final_only] [--profile worker|frontend]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.serial_utils import MsgpackEncoder  # noqa: E402

from vllm_omni_kernels import ops  # noqa: E402
from vllm_omni_kernels.accumulator import EmitPolicy  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as Strategy  # noqa: E402
from vllm_omni_kernels.ring import PaddedBatch, RingPool  # noqa: E402
from vllm_omni_kernels.ring.graph import StaticAppend  # noqa: E402
from vllm_omni_kernels.ring.planner import plan_read  # noqa: E402
from vllm_omni_kernels.serving import talker as tk  # noqa: E402
from vllm_omni_kernels.vllm_integration.llm import talker_processor_options, talker_stream_interval  # noqa: E402
from vllm_omni_kernels.vllm_integration.scheduler import HeldTokens, outputs_with_channel  # noqa: E402
from vllm_omni_kernels.vllm_integration.upstream_style import upstream_worker_outputs  # noqa: E402
from vllm_omni_kernels.vllm_integration.wire import OmniMsgpackDecoder  # noqa: E402
from vllm_omni_kernels.vllm_integration.worker import talker_output_keys  # noqa: E402
from vllm_omni_kernels.serving.worker_accumulator import WorkerAccumulator  # noqa: E402

KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


class _Stream:
    """One request: its row, kind, frames produced, and the audio its outputs carried."""

    def __init__(self, rid: str, row: int, kind: RequestOutputKind, frames: int):
        self.rid, self.row, self.kind, self.frames, self.produced = rid, row, kind, frames, 0
        self.first = 0  # the frame it starts at (streams of the first batch start mid-way)
        # (numpy arrays, which Python's garbage collector does not track: the checker's own copies
        # add nothing to the collections that the timed sections pay for)
        self.audio: list[np.ndarray] = []
        self.codes: list[np.ndarray] = []
        self.sent: list[np.ndarray] = []  # the codes its steps produced
        self.tokens: list[int] = []  # the token ids its outputs carried


def bench(path: str, B: int, frames: int, steps: int, device: torch.device, cadence: int,
          profile: cProfile.Profile | None = None, profiled: str = "worker", kinds=KINDS) -> dict:
    options = talker_processor_options(path)
    processor = options.processor_cls(None, log_stats=False, stream_interval=talker_stream_interval(cadence),
                                      output_modality=options.output_modality,
                                      strategies=options.strategies)
    acc = WorkerAccumulator(talker_output_keys(cadence), device, max_requests=B) if path == "worker" else None
    encoder, decoder = MsgpackEncoder(), OmniMsgpackDecoder()
    held = HeldTokens()  # this package's scheduler: a paced stream's tokens go with its data
    free_rows = list(range(B - 1, -1, -1))
    live: list[_Stream] = []
    born = [0]
    checked = [0]

    def start() -> None:
        i = born[0]
        born[0] += 1
        s = _Stream(f"req-{i}", free_rows.pop(), kinds[i % len(kinds)], frames)
        params = SamplingParams(max_tokens=frames, output_kind=s.kind, detokenize=False)
        processor.add_request(EngineCoreRequest(
            request_id=s.rid, prompt_token_ids=[5, 6, 7], mm_features=None, sampling_params=params,
            pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
            data_parallel_rank=None, external_req_id=s.rid), prompt=None)
        if acc is not None:
            final_only = s.kind == RequestOutputKind.FINAL_ONLY
            held = {"audio": frames * tk.FRAME_SAMPLES, "codes": frames} if final_only else None
            acc.add_request(s.rid, EmitPolicy[s.kind.name], row=s.row, frames=held)  # as the talker's worker does
        live.append(s)

    for k in range(B):  # staggered: request k has produced k * frames / B frames when timing starts
        start()
        live[-1].produced = live[-1].first = live[-1].frames - 1 - (k * frames) // B
    gen = torch.Generator(device=device).manual_seed(0)
    times = {"worker": [], "worker_host": [], "wire": [], "frontend": [], "frontend_multimodal": []}
    wire_bytes = []
    for step in range(steps + 20):
        n = len(live)
        ids = [s.rid for s in live]
        rows = np.fromiter((s.row for s in live), np.int64, n)
        frame_index = torch.tensor([s.produced for s in live], device=device)
        codes = torch.randint(0, tk.CODEBOOK_SIZE, (n, tk.CODEBOOKS), device=device, generator=gen)
        audio = tk.decode_frames(codes, frame_index)
        finishing = [s.rid for s in live if s.produced + 1 == s.frames]
        if device.type == "cuda":
            torch.cuda.synchronize()
        if profile is not None and profiled == "worker" and step >= 20:
            profile.enable()
        t0 = time.perf_counter()
        if acc is not None:
            tokens = acc.head(n, torch.int64)
            tokens.copy_(codes[:, 0])
            acc.append(ids, {"audio": PaddedBatch(audio, np.full(n, tk.FRAME_SAMPLES, np.int64)),
                             "codes": PaddedBatch(codes.unsqueeze(1), np.ones(n, np.int64))}, rows)
            packed, plain = acc.collect(finishing, head_bytes=8 * n), {}
            t_host = time.perf_counter()  # the step's copy is on its way: the host's part ends here
            sampled = packed.wait()[:8 * n].view(torch.int64).tolist()
        else:
            packed, plain = None, upstream_worker_outputs(ids, {"audio": audio, "codes": codes.unsqueeze(1)})
            sampled = codes[:, 0].cpu().tolist()
            t_host = None  # (blocking copies: its host time is all of it)
        t1 = time.perf_counter()
        if profile is not None:
            profile.disable()
        ecos = [EngineCoreOutput(request_id=rid, new_token_ids=[sampled[b] + tk.TEXT_VOCAB],
                                 finish_reason=FinishReason.LENGTH if rid in finishing else None)
                for b, rid in enumerate(ids)]
        if packed is not None:  # what the scheduler does: the worker's open requests are paced
            ecos = held.thin(ecos, set(ids) - packed.final, packed.requests())
        message = outputs_with_channel(EngineCoreOutputs(outputs=ecos), packed, plain, {})
        frames_out = encoder.encode(message)
        t2 = time.perf_counter()
        mm0 = processor.stopwatch.seconds + decoder.multimodal_seconds
        if profile is not None and profiled == "frontend" and step >= 20:
            profile.enable()
        decoded = decoder.decode(frames_out)
        result = processor.process_outputs(decoded.outputs)
        t3 = time.perf_counter()
        if profile is not None and profiled == "frontend":
            profile.disable()
        mm1 = processor.stopwatch.seconds + decoder.multimodal_seconds
        by_id = {s.rid: s for s in live}
        for out in result.request_outputs:
            s = by_id[out.request_id]
            delta = s.kind == RequestOutputKind.DELTA
            if delta:
                s.tokens.extend(out.outputs[0].token_ids)
            else:
                s.tokens = list(out.outputs[0].token_ids)
            payload = getattr(out.outputs[0], "multimodal_output", None)
            if payload is not None:
                got_audio, got_codes = (payload.tensors[k].numpy(force=True).copy() for k in ("audio", "codes"))
                if delta:
                    s.audio.append(got_audio)
                    s.codes.append(got_codes)
                else:  # each CUMULATIVE output holds the one before it (the last alone could hide a wrong one)
                    if s.audio and not (np.array_equal(got_audio[:s.audio[0].size], s.audio[0])
                                        and np.array_equal(got_codes[:len(s.codes[0])], s.codes[0])):
                        raise AssertionError(f"{s.rid} ({s.kind.name}): an output does not start with the one before")
                    s.audio, s.codes = [got_audio], [got_codes]
        if step >= 20:
            times["worker"].append(t1 - t0)
            times["worker_host"].append((t1 if t_host is None else t_host) - t0)
            times["wire"].append(t2 - t1)
            times["frontend"].append(t3 - t2)
            times["frontend_multimodal"].append(mm1 - mm0)
            wire_bytes.append(sum(memoryview(f).nbytes for f in frames_out))
        for s, sent in zip(live, codes.cpu().numpy()):
            s.sent.append(sent)
            s.produced += 1
        for s in [s for s in live if s.produced == s.frames]:
            live.remove(s)
            free_rows.append(s.row)
            _check(s)
            checked[0] += 1
            start()
    us = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    return {"path": path, "streams": B, "frames": frames, "device": str(device), "checked_exact": checked[0],
            **{f"{k}_us_median": v for k, v in us.items()}, "wire_bytes_per_step": float(np.median(wire_bytes))}


def floor_launches(B: int, cadence_frames: int, device: torch.device):
    """The worker step's four ring launches with nothing planned, as one callable: for each of the
    talker's keys (``talker_output_keys``), a ``StaticAppend`` of B requests' chunks (its rows
    resident on the device) and a read of the B / cadence requests due, a cadence interval each,
    from rows the read planner made once. Returns (the callable, the bytes the reads write)."""
    due = max(1, B // cadence_frames)
    ids = [f"r{i}" for i in range(B)]
    launches, nbytes = [], 0
    for key in talker_output_keys(cadence_frames * tk.FRAME_SAMPLES):
        n = tk.FRAME_SAMPLES if key.strategy is Strategy.CONCAT_LAST else 1  # a frame's chunk, in ring frames
        frames = 1 << (4 * cadence_frames * n - 1).bit_length()  # a slot: four cadence intervals, a power of two
        pool = RingPool(key.name, key.dtype, key.frame_shape, device, key.strategy,
                        budget_bytes=B * frames * math.prod(key.frame_shape) * key.dtype.itemsize,
                        initial_frames=frames, max_slots=B, growth=False)
        for rid in ids:
            pool.alloc(rid)
        shape = (B, *key.frame_shape, n) if pool.last else (B, n, *key.frame_shape)
        append = StaticAppend(pool, ids, torch.zeros(shape, dtype=key.dtype, device=device), np.full(B, n))
        append.prepare(1)
        slots = pool.slots(ids[:due])
        pool.advance(slots, np.full(due, (cadence_frames - 1) * n))  # a cadence interval unread in each
        rows = np.zeros((due, pool.table.shape[1]), np.int64)
        starts, frames = plan_read(pool.table, slots, np.zeros(due, np.int64), pool.frame_elems, pool.last, rows)
        out = torch.empty(int(frames.sum()) * pool.frame_elems, dtype=key.dtype, device=device)
        launches.append((append, pool, torch.from_numpy(rows).to(device), out, int(frames.max()) * pool.frame_elems))
        nbytes += out.numel() * out.element_size()

    def launch_all() -> None:
        for append, pool, read, out, max_elems in launches:
            append.launch()
            ops.ring_read(pool.arena, read, out, rows=due, frame_elems=pool.frame_elems, last=pool.last,
                          max_elems=max_elems)

    return launch_all, nbytes


def launch_floor_us(B: int, cadence_frames: int, steps: int = 2000) -> float:
    """Host microseconds per step of the worker path's device work alone, with nothing planned
    (``floor_launches``), and the side-stream copy of the reads' bytes to pinned memory with its
    event. No implementation that makes these launches from Python costs less on this host; the
    worker's own figure is this plus its planning."""
    dev = torch.device("cuda")
    launch_all, nbytes = floor_launches(B, cadence_frames, dev)
    pack = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    side, mark = torch.cuda.Stream(dev), torch.cuda.Event()

    def step():
        launch_all()
        mark.record()
        side.wait_event(mark)
        with torch.cuda.stream(side):
            host.copy_(pack, non_blocking=True)
        side.record_event()

    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps // 5):
            step()
        runs.append((time.perf_counter() - t0) * 1e6 / (steps // 5))
        torch.cuda.synchronize()
    return float(np.median(runs))


def _check(s: _Stream) -> None:
    """The stream's codes and tokens against those its steps produced, and its audio against what
    they decode to (streams that started mid-way too: their frames count from ``first``)."""
    codes = torch.from_numpy(np.concatenate(s.codes)) if s.codes else torch.zeros(0, tk.CODEBOOKS, dtype=torch.int64)
    audio = torch.from_numpy(np.concatenate(s.audio)) if s.audio else torch.zeros(0)
    if not torch.equal(codes, torch.from_numpy(np.stack(s.sent))):
        raise AssertionError(f"{s.rid} ({s.kind.name}): {codes.shape[0]} frames arrived, not the {len(s.sent)} sent")
    if s.tokens != [int(c[0]) + tk.TEXT_VOCAB for c in s.sent]:
        raise AssertionError(f"{s.rid} ({s.kind.name}): its outputs' {len(s.tokens)} tokens are not the "
                             f"{len(s.sent)} its steps sampled")
    want = tk.decode_frames(codes, torch.arange(s.first, s.frames)).reshape(-1)
    if not torch.equal(audio, want):
        raise AssertionError(f"{s.rid} ({s.kind.name}): audio differs from what its codes decode to")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--frames", type=int, default=40, help="frames per request (80 ms each)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cadence", type=int, default=tk.STREAM_CADENCE)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--kinds", default="delta,cumulative,final_only", help="output kinds, taken in turn")
    ap.add_argument("--profile", choices=("worker", "frontend"), default=None,
                    help="cProfile of this package's worker step or frontend, after the run")
    args = ap.parse_args()
    kinds = tuple(RequestOutputKind[k.strip().upper()] for k in args.kinds.split(","))
    results = []
    for B in (int(b) for b in args.streams.split(",")):
        pair = {}
        for path in ("worker", "upstream"):
            r = pair[path] = bench(path, B, args.frames, args.steps, torch.device(args.device), args.cadence,
                                   kinds=kinds)
            results.append(r)
            print(f"{path:>8} B={B}: worker {r['worker_us_median']:.0f} us (host {r['worker_host_us_median']:.0f}), "
                  f"wire {r['wire_us_median']:.0f} us, "
                  f"frontend {r['frontend_us_median']:.0f} us (multimodal {r['frontend_multimodal_us_median']:.0f}), "
                  f"{r['wire_bytes_per_step'] / 1024:.0f} KiB on the wire per step; {r['checked_exact']} streams exact",
                  flush=True)
        if args.profile:
            prof = cProfile.Profile()
            bench("worker", B, args.frames, min(args.steps, 100), torch.device(args.device), args.cadence, prof,
                  args.profile, kinds)
            for order in ("tottime", "cumulative"):
                pstats.Stats(prof).sort_stats(order).print_stats(30)
        w, u = pair["worker"], pair["upstream"]
        if args.device == "cuda":
            w["worker_launch_floor_us"] = launch_floor_us(B, args.cadence // tk.FRAME_SAMPLES)
            print(f"   floor B={B}: the worker step's launches and copy alone, from resident metadata: "
                  f"{w['worker_launch_floor_us']:.0f} us", flush=True)
        print(f"   ratio B={B}: upstream / this package: worker {u['worker_us_median'] / w['worker_us_median']:.2f}x, "
              f"frontend {u['frontend_us_median'] / w['frontend_us_median']:.2f}x, frontend multimodal "
              f"{u['frontend_multimodal_us_median'] / max(w['frontend_multimodal_us_median'], 1e-9):.2f}x", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"bench": "output_path", "results": results}, indent=2))


if __name__ == "__main__":
    main()
