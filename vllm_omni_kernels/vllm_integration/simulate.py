"""The main job: stream TTS through a real vLLM engine, this package's output path against the
upstream-style one, with the same requests.

Per path an engine core runs in its own process (ZMQ + msgpack; ``in_process``: in this one) and
serves the talker (``talker_model``) to this process, or to ``clients`` client processes that share
it as vLLM's API server processes do (``_serve_clients``); ``requests`` requests arrive staggered,
at most ``concurrency`` at a time, in DELTA, CUMULATIVE and FINAL_ONLY output kinds in turn. One in
``abort_every`` is aborted (a streaming one after its first audio, a FINAL_ONLY one a while after it
starts; one that finishes first is checked whole; the output kinds take their turn), and every
``stop_every``-th one ends on a codec token its talker emits half-way (``stop_token_ids``); with
``priorities``, vLLM schedules by priority and preempts running requests for those that outrank
them. Every request's codes are checked against its prompt's rollout, its audio sample for sample
against what its codes decode to, its codes against its tokens and, finished, its length and finish
reason; the worker path writes each finished request's WAV under ``out_dir`` and reads it back.

Reported per path (``summary.json``, one PNG): audio seconds per wall second; time to first audio
(p50/p99, from when the client sends the request, which first waits for one of ``concurrency``
senders) and the first chunk's delay from its production in the worker to the client, both over
the streaming requests, and that delay by stage (``STAGES``); the time to a FINAL_ONLY request's
file; how late the client's event loop runs and its longest garbage collection; engine step time;
the worker's output-path host time per step (this package's appends and collect, whose copy lands
off the step, against the upstream style's blocking ``.cpu()`` copies, which also wait for the
forward on a GPU: unlike spans, so no ratio of them is given; ``profiling/bench_output_path.py``
times both to the data in hand); the frontend's multimodal time per step; device-to-host copies
and bytes on the wire per step; the requests that ended on their stop token (``requests_stopped``;
``worker_stops_seen``: those the worker path's worker saw end, with which it closes their output);
and vLLM's resumptions of preempted requests (``resumptions``: e.g. with
``engine_args={"num_gpu_blocks_override": 16}``; their audio goes on where it stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import math
import multiprocessing
import pickle
import time
import traceback
from pathlib import Path
from queue import Empty

import numpy as np
import torch
from tqdm import tqdm
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor

from ..errors import TensorAccumulationError
from ..payload import GrowingTensor
from ..serving import talker as tk
from ..serving.wav import read_wav, write_wav_f32
from .llm import (TALKER_MAX_MODEL_LEN, OmniAsyncLLM, OmniLLM, omni_vllm_config, talker_engine_args,
                  talker_processor_options, warm_up, with_talker_options)
from .talker_model import check_seed

KINDS = ("delta", "cumulative", "final_only")
PATHS = ("worker", "upstream")
# the first chunk's way, by stage (``first_chunk_<stage>_ms_p50``/``_p99``): the worker's step to the engine
# core's output message; on to this process decoding the message (the output socket's reader task: ZMQ and
# the event loop); on to the output handler processing it (its queue); on to the client holding the audio
STAGES = ("engine_core", "to_decoder", "to_processor", "to_client")
# The async client freezes its heap (``gc.freeze``) each time this many more requests have finished:
# it holds every finished request's data for the check after the run, and a full collection (which
# stops the event loop that delivers every stream's output) then costs what the requests in flight
# cost, not what the run has served so far. The heap is unfrozen after the run.
_FREEZE_EVERY = 256
_FINAL_ONLY_ABORT_S = 0.05  # a FINAL_ONLY request planned to be aborted is aborted this long after it starts
_CLIENT_WAIT_S = 600.0  # the longest a client process waits for the others (start, end), and is waited for
_LONGEST_PROMPT = 39  # tokens of a request's prompt, at most (_plans)


@dataclasses.dataclass
class SimConfig:
    requests: int = 96
    concurrency: int = 32
    min_frames: int = 8  # request length in 80 ms codec frames
    max_frames: int = 40
    abort_every: int = 12  # one request in n is aborted (module docstring; 0: none)
    bad_every: int = 0  # every n-th request makes the talker emit a malformed chunk (0: none)
    stop_every: int = 0  # every n-th request ends on a token it produces half-way (0: none)
    priorities: int = 0  # n: vLLM's priority scheduling, request i at priority n - 1 - i % n: in each run of n
    #                      requests each outranks those before it (0: first come, first served)
    arrival_ms: float = 10.0  # mean gap between arrivals (exponential; 0: all at once)
    kinds: tuple[str, ...] = KINDS  # output kinds, taken in turn
    sync_check: bool = False  # run the worker's step under CUDA's sync-debug mode "error"
    cadence: int = tk.STREAM_CADENCE  # audio samples a streaming request gets at a time
    device: str = "auto"
    async_scheduling: bool | None = None  # None: on for a talker on CUDA, off on the CPU (llm.py)
    in_process: bool = False
    clients: int = 1  # client processes, each an OmniAsyncLLM on the one engine core (``_serve_clients``)
    paths: tuple[str, ...] = PATHS
    out_dir: str = "out/simulate"
    seed: int = 0
    progress: bool = True
    write_wavs: bool = True
    engine_args: dict = dataclasses.field(default_factory=dict)  # more of vLLM's engine arguments, over ours

    def __post_init__(self):
        """Output kinds and paths in any case (``DELTA`` as vLLM spells it); ValueError naming an
        unknown one, or a CUDA device where there is none."""
        self.kinds = tuple(k.strip().lower() for k in self.kinds)
        self.paths = tuple(p.strip().lower() for p in self.paths)
        for what, names, known in (("output kind", self.kinds, KINDS), ("path", self.paths, PATHS)):
            unknown = [n for n in names if n not in known]
            if unknown or not names:
                got = f"unknown {what} {unknown[0]!r}" if unknown else f"no {what} given"
                raise ValueError(f"{got} (one or more of {', '.join(known)})")
        for name, least in (("requests", 1), ("concurrency", 1), ("max_frames", 1), ("cadence", 0),
                            ("bad_every", 0), ("stop_every", 0), ("priorities", 0), ("arrival_ms", 0)):
            value = getattr(self, name)
            if not math.isfinite(value) or value < least:  # (NaN, inf: no gap)
                raise ValueError(f"{name} {value}: at least {least}, and finite")
        if self.clients < 1 or self.clients > 1 and self.in_process:
            raise ValueError(f"clients {self.clients}: at least 1, and 1 with the engine core in process")
        if self.clients > self.concurrency:
            raise ValueError(f"clients {self.clients}: more than the {self.concurrency} requests in flight")
        kind, _, index = self.device.partition(":")
        if kind not in ("auto", "cpu", "cuda") or index and not (kind == "cuda" and index.isdigit()):
            raise ValueError(f"device {self.device!r}: one of auto, cpu, cuda, cuda:N")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} but torch sees no CUDA device here (--device auto takes the CPU)")
        check_seed(self.seed)
        limit = self.engine_args.get("max_model_len", TALKER_MAX_MODEL_LEN)
        if self.max_frames + _LONGEST_PROMPT > limit:
            raise ValueError(f"max_frames {self.max_frames}: at most {limit - _LONGEST_PROMPT} (a request's prompt, up "
                             f"to {_LONGEST_PROMPT} tokens, and its frames fit the engine's max_model_len {limit})")
        if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ValueError(f"out {self.out_dir}: a file, not a directory")


@dataclasses.dataclass
class _Plan:
    rid: str
    prompt: list[int]
    frames: int
    kind: str
    abort: bool
    bad: bool
    arrival: float  # seconds after the start
    stop: int | None = None  # its stop token: it then ends after ``ends`` frames, not ``frames``
    ends: int = 0  # (0: ``frames``)
    priority: int = 0
    codes: torch.Tensor | None = None  # what its prompt makes the talker say (``_check``), made once

    def __post_init__(self):
        self.ends = self.ends or self.frames


@dataclasses.dataclass
class _Result:
    plan: _Plan
    audio: list[torch.Tensor] = dataclasses.field(default_factory=list)
    codes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    payloads: int = 0
    start: float = 0.0
    finish_reason: str | None = None
    first_audio: float | None = None  # perf_counter
    first_audio_at: float | None = None  # time.monotonic, to meet the worker's and the frontend's stamps
    error: str | None = None
    aborted: bool = False  # the client aborted it before it finished
    inconsistent: str | None = None  # a CUMULATIVE output not starting with the one before, or not its tokens
    seen: tuple | None = None  # CUMULATIVE: audio and codes as the outputs so far held them (GrowingTensors)
    # the message that brought its first data: (the engine core's timestamp, when its client process
    # decoded it, when the output handler began processing it), time.monotonic (``STAGES``)
    first_data: tuple[float, float, float] | None = None


def _plans(cfg: SimConfig) -> list[_Plan]:
    rng = np.random.default_rng(cfg.seed)
    plans, t, talker = [], 0.0, None
    for i in range(cfg.requests):
        n = int(rng.integers(4, _LONGEST_PROMPT + 1))
        prompt = [int(x) for x in rng.integers(4, 100, size=n)]
        bad = bool(cfg.bad_every) and i % cfg.bad_every == cfg.bad_every - 1
        # one request in abort_every, at a place that moves along by one each time, so that every
        # output kind is aborted in turn
        abort = bool(cfg.abort_every) and \
            i % cfg.abort_every == (cfg.abort_every // 2 + i // cfg.abort_every) % cfg.abort_every and not bad
        frames = int(rng.integers(min(cfg.min_frames, cfg.max_frames), cfg.max_frames + 1))
        plan = _Plan(f"req-{i:04d}", prompt, frames, cfg.kinds[i % len(cfg.kinds)], abort, bad, t,
                     priority=cfg.priorities - 1 - i % cfg.priorities if cfg.priorities else 0)
        # one request in stop_every, at a place that moves along as the abort's does: every output kind stops
        if cfg.stop_every and i % cfg.stop_every == (cfg.stop_every - 1 + i // cfg.stop_every) % cfg.stop_every \
                and not (bad or abort):
            talker = talker or tk.ToyTalker(cfg.seed)
            tokens = (tk.rollout(talker, prompt, frames)[:, 0] + tk.TEXT_VOCAB).tolist()
            plan.stop = tokens[frames // 2]
            plan.ends = tokens.index(plan.stop) + 1  # where the token first comes
        plans.append(plan)
        t += float(rng.exponential(cfg.arrival_ms / 1e3)) if cfg.arrival_ms > 0 else 0.0
    return plans


def run(cfg: SimConfig) -> dict:
    """Serve ``cfg.requests`` on each path of ``cfg.paths``; returns (and writes) the summary."""
    from .talker_model import make_model_dir

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # this run's results alone: an earlier run's summary, plot or WAVs would pass for this one's when
    # it stops before writing its own (a signal, an error)
    for old in [*out.glob("wav/*.wav"), out / "summary.json", out / "simulate.png"]:
        old.unlink(missing_ok=True)
    model = make_model_dir(out / "model", seed=cfg.seed)
    plans = _plans(cfg)
    summary: dict = {"config": dataclasses.asdict(cfg), "paths": {}}
    for path in cfg.paths:
        summary["paths"][path] = _serve(cfg, path, model, plans, out)
    if set(PATHS) <= set(summary["paths"]):
        ours, theirs = summary["paths"]["worker"], summary["paths"]["upstream"]
        # per audio second: the paths' steps carry different numbers of streams (a client that falls
        # behind has its streams served in more steps of fewer), so per step they would compare
        # different work; copies are per step by design (one against one per key)
        summary["ratios"] = {k: theirs[k] / ours[k] if ours[k] else None for k in
                             ("frontend_multimodal_us_per_audio_second", "wire_bytes_per_audio_second",
                              "d2h_copies_per_step")}
    (out / "summary.json").write_text(json.dumps(_without_nan(summary), indent=2, allow_nan=False))
    _plot(summary, out / "simulate.png")
    return summary


def _engine_args(cfg: SimConfig, path: str, model: Path):
    omni = {"sync_debug": cfg.sync_check}
    if cfg.bad_every:
        omni["bad_prompt_token"] = 1  # "<s>", in no other prompt
    kwargs = {"max_num_seqs": max(cfg.concurrency, 8), "disable_log_stats": True,
              "async_scheduling": cfg.async_scheduling, **cfg.engine_args}
    extra = with_talker_options(kwargs.pop("additional_config", None), omni)
    if cfg.priorities:
        kwargs.setdefault("scheduling_policy", "priority")
    return talker_engine_args(model, device=cfg.device, cadence=cfg.cadence, output_path=path,
                              args_cls=EngineArgs if cfg.in_process else AsyncEngineArgs,
                              additional_config=extra, **kwargs)


def _serve(cfg: SimConfig, path: str, model: Path, plans: list[_Plan], out: Path) -> dict:
    t_start = time.perf_counter()
    if cfg.in_process:
        results, engine_stats, client, wall = _serve_in_process(cfg, path, model, plans)
    elif cfg.clients > 1:
        results, engine_stats, client, wall = _serve_clients(cfg, path, model, plans)
    else:
        results, engine_stats, client, (t0, t1) = asyncio.run(_serve_async(cfg, path, model, plans))
        wall = t1 - t0
        gc.collect()  # the shut-down engine, if a cycle holds it, goes while the interpreter is whole
    checked = _check(results, out / "wav" if (path == "worker" and cfg.write_wavs) else None,
                     bad_error=_BAD_ERRORS[path], talker=tk.ToyTalker(cfg.seed))
    audio_seconds = sum(sum(a.numel() for a in r.audio) for r in results) / tk.SAMPLE_RATE
    # A streaming request's first audio is its first chunk; a FINAL_ONLY one's is its whole file, at
    # its end: that is its own figure, never mixed into the time to first audio.
    streaming = [r for r in results if r.plan.kind != "final_only" and r.first_audio is not None]
    ttfa = [r.first_audio - r.start for r in streaming]
    whole = [r.first_audio - r.start for r in results
             if r.plan.kind == "final_only" and r.first_audio is not None]
    first_chunk = engine_stats.pop("first_chunk_at", {})
    delays = [r.first_audio_at - first_chunk[r.plan.rid] for r in streaming if r.plan.rid in first_chunk]
    stages = [(core - first_chunk[r.plan.rid], decoded - core, processed - decoded, r.first_audio_at - processed)
              for r in streaming if r.plan.rid in first_chunk and r.first_data is not None
              for core, decoded, processed in (r.first_data,)]  # (STAGES)
    stages = np.array(stages).reshape(-1, len(STAGES))
    steps = max(engine_stats["output_steps"], 1)  # the worker's steps with requests (the frontend's: all clients')
    return {
        "path": path, "device": engine_stats["device"], "async_scheduling": engine_stats["async_scheduling"],
        "requests": len(results), **checked,
        "audio_seconds": audio_seconds, "wall_seconds": wall, "audio_seconds_per_wall_second": audio_seconds / wall,
        "streaming_requests": len(streaming), "stage_split_requests": len(stages),  # (every one of them, if all's well)
        "ttfa_ms_p50": _ms(ttfa, 50), "ttfa_ms_p99": _ms(ttfa, 99),
        "first_chunk_delay_ms_p50": _ms(delays, 50), "first_chunk_delay_ms_p99": _ms(delays, 99),
        **{f"first_chunk_{stage}_ms_{q}": _ms(stages[:, i].tolist(), int(q[1:]))
           for i, stage in enumerate(STAGES) for q in ("p50", "p99")},
        "final_only_ms_p50": _ms(whole, 50), "final_only_ms_p99": _ms(whole, 99),
        "client_loop_lag_ms_p50": client["loop_lag_ms_p50"], "client_loop_lag_ms_p99": client["loop_lag_ms_p99"],
        "client_loop_lag_ms_max": client["loop_lag_ms_max"], "client_gc_ms_max": client["gc_ms_max"],
        "step_ms_median": engine_stats["step_us_median"] / 1e3,
        "worker_output_path_us_median": engine_stats["output_path_us_median"],
        "worker_output_path_us_p99": engine_stats["output_path_us_p99"],
        "frontend_multimodal_us_per_step": client["multimodal_seconds"] / steps * 1e6,
        "frontend_decode_us_per_step": client["decode_seconds"] / steps * 1e6,
        "frontend_multimodal_us_per_audio_second": client["multimodal_seconds"] / max(audio_seconds, 1e-9) * 1e6,
        "d2h_copies_per_step": engine_stats["copies"] / steps,
        "wire_bytes_per_step": client["bytes"] / steps,
        "wire_bytes_per_audio_second": client["bytes"] / max(audio_seconds, 1e-9), "client_processes": cfg.clients,
        "output_steps": engine_stats["output_steps"],
        "streams_per_step": engine_stats["samples"] / tk.FRAME_SAMPLES / max(engine_stats["steps"], 1),
        "engine_steps": engine_stats["steps"], "resumptions": engine_stats["resumed"],
        "requests_stopped": sum(r.finish_reason == "stop" for r in results),  # (checked: _check)
        "worker_stops_seen": engine_stats["stopped"], "worker_rows": engine_stats["rows"],
        "pools_after": engine_stats["accumulator"]["pools"],
        "host_buffers_allocated": engine_stats["accumulator"]["pinned_allocations"],
        "slots_held_after": sum(p["slots_used"] for p in engine_stats["accumulator"]["pools"].values()),
        "seconds_total": time.perf_counter() - t_start,
    }


def _ms(seconds: list[float], q: float) -> float:
    """The ``q``-th percentile of ``seconds``, in ms (NaN if there are none)."""
    return float(np.percentile(seconds, q)) * 1e3 if seconds else float("nan")


async def _serve_async(cfg: SimConfig, path: str, model: Path, plans: list[_Plan], share: _Share | None = None):
    """Serve ``plans`` through an ``OmniAsyncLLM`` in this process: its own engine core, or with
    ``share`` one of several clients of one (``_serve_clients``). Returns the results, the worker's
    statistics (None for a client other than the first of several), the client's figures and the
    run's (start, end) in ``time.perf_counter``."""
    if share is None:
        engine = OmniAsyncLLM.from_engine_args(_engine_args(cfg, path, model),
                                               processor_options=talker_processor_options(path))
    else:
        config = omni_vllm_config(_engine_args(cfg, path, model), UsageContext.ENGINE_CONTEXT,
                                  api_process=(share.count, share.index))
        engine = OmniAsyncLLM(config, Executor.get_class(config), log_stats=False,
                              client_addresses=share.addresses, client_count=share.count, client_index=share.index,
                              processor_options=talker_processor_options(path))
    first = share is None or share.index == 0
    pauses: list[float] = []
    note_pause = _gc_pauses(pauses)
    try:
        # (several clients: each warms its share of the largest batch the run makes, together one; then all
        # start at once)
        index, count = (0, 1) if share is None else (share.index, share.count)
        most = min(engine.vllm_config.scheduler_config.max_num_seqs, cfg.requests)
        await warm_up(engine, math.ceil(most / count), (index, count))
        if share is not None:
            await asyncio.to_thread(share.barrier.wait)
        if first:
            await engine.collective_rpc("reset_output_path_stats")
        if share is not None:
            await asyncio.to_thread(share.barrier.wait)
        freeze_gc_heap()  # as vLLM's API server does once it is up: no collection walks the static heap
        gc.callbacks.append(note_pause)
        decoder, processor = engine.engine_core.decoder, engine.output_processor
        d0 = (decoder.bytes, decoder.seconds, decoder.multimodal_seconds)
        processor.stopwatch.seconds = 0.0
        bar = _bar(cfg, path)
        lags: list[float] = []
        ticker = asyncio.create_task(_loop_lag(lags))
        t0 = time.perf_counter()
        held = [0]  # finished requests held since the heap was last frozen

        async def one(plan: _Plan) -> _Result:
            res = _Result(plan, start=time.perf_counter())
            prompt, params = _request(plan)
            timer = None
            if plan.abort and plan.kind == "final_only":  # no audio before its end: aborted a while after it starts
                timer = asyncio.get_running_loop().call_later(
                    _FINAL_ONLY_ABORT_S, lambda: asyncio.ensure_future(engine.abort(plan.rid)))
            try:
                # closed when left early: its frame (and the engine it holds) goes now, not at exit
                stream = engine.generate(prompt, params, request_id=plan.rid, priority=plan.priority)
                async with contextlib.aclosing(stream) as stream:
                    async for out in stream:
                        _take(res, out)
                        if _abort_now(res, out):
                            await engine.abort(plan.rid)
                            res.aborted = True
                            break
            except TensorAccumulationError as exc:
                res.error = str(exc)
            finally:
                if timer is not None:
                    timer.cancel()
            res.aborted = res.aborted or res.finish_reason == "abort"
            _settle(res)
            held[0] += 1
            if held[0] == _FREEZE_EVERY:
                gc.freeze()  # what the client holds for the check (the comment at _FREEZE_EVERY)
                held[0] = 0
            bar.update(1)
            return res

        concurrency = cfg.concurrency if share is None else \
            cfg.concurrency // share.count + (share.index < cfg.concurrency % share.count)
        results = await _send(plans, one, concurrency)
        t1 = time.perf_counter()
        ticker.cancel()
        bar.close()
        _note_first_data(results, processor.first_data_at, dict(decoder.decoded_at))
        if share is not None:
            await asyncio.to_thread(share.barrier.wait)  # every client is done
        stats = None
        if first:
            await asyncio.sleep(0.2)  # aborts reach the engine core
            stats = (await engine.collective_rpc("output_path_stats", kwargs={"first_chunks": True}))[0]
        client = {"bytes": decoder.bytes - d0[0], "decode_seconds": decoder.seconds - d0[1],
                  "multimodal_seconds": processor.stopwatch.seconds + decoder.multimodal_seconds - d0[2],
                  "loop_lag_ms_p50": _ms(lags, 50), "loop_lag_ms_p99": _ms(lags, 99),
                  "loop_lag_ms_max": _ms(lags, 100), "gc_ms_max": max(pauses, default=0.0) * 1e3}
        return results, stats, client, (t0, t1)
    finally:
        if note_pause in gc.callbacks:
            gc.callbacks.remove(note_pause)
        engine.shutdown()
        engine = None  # nothing that keeps this frame (a traceback) keeps the engine past its run
        gc.unfreeze()


@dataclasses.dataclass
class _Share:
    """A client process's place among ``count`` clients of one engine core: its index, vLLM's client
    addresses (its engine sockets), and the barrier at which they all start and end."""

    index: int
    count: int
    addresses: dict
    barrier: object  # a multiprocessing Barrier of the spawn context


def _serve_clients(cfg: SimConfig, path: str, model: Path, plans: list[_Plan]):
    """``_serve_async`` in ``cfg.clients`` processes of their own, on one engine core that vLLM's
    launcher starts, as ``vllm serve --api-server-count N`` spreads a server's streams over N event
    loops (and so does ``serve``): the plans are dealt round robin, and the requests in flight split
    evenly. Returns the results, the worker's statistics (from the first client), the clients'
    figures (summed; their event loops': the worst) and the wall time from the first start to the
    last end."""
    n = cfg.clients
    config = omni_vllm_config(_engine_args(cfg, path, model), UsageContext.ENGINE_CONTEXT, api_process=(n, -1))
    listeners = bind_engine_zmq_listeners(config, n)
    ctx = multiprocessing.get_context("spawn")  # (as vLLM starts its API server processes)
    queue, barrier = ctx.Queue(), ctx.Barrier(n, timeout=_CLIENT_WAIT_S)
    procs, launch, failed, done = [], None, True, {}
    quiet = dataclasses.replace(cfg, progress=False)
    try:  # (the start-up too: the engine's or a client's failure there stops the others at once)
        with launch_core_engines(config, Executor.get_class(config), False, listeners.addresses) as launch:
            for i, (inp, outp) in enumerate(zip(listeners.inputs, listeners.outputs)):
                addresses = {"input_address": inp.address, "output_address": outp.address,
                             "input_listener": inp.socket, "output_listener": outp.socket}
                proc = ctx.Process(target=_client_process, name=f"SimulateClient_{i}",
                                   args=(quiet, path, model, plans[i::n], i, n, addresses, barrier, queue))
                proc.start()
                procs.append(proc)
                inp.close()
                outp.close()
            launch.watched_frontend_processes = procs
        while len(done) < n:
            try:
                index, payload = queue.get(timeout=1.0)
            except Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if not dead:
                    continue
                try:  # a failed client's traceback may have come meanwhile: it says more
                    index, payload = queue.get(timeout=1.0)
                except Empty:
                    raise RuntimeError(f"client processes {dead} exited without their results") from None
            if isinstance(payload, str):
                raise RuntimeError(f"client process {index} failed:\n{payload}")
            done[index] = pickle.loads(payload)
        failed = False
    finally:
        for proc in procs:  # (after a failure the others are stopped at once)
            proc.join(timeout=0 if failed else _CLIENT_WAIT_S)
            if proc.is_alive():
                proc.kill()
        if launch is not None and launch.engine_manager is not None:
            launch.engine_manager.shutdown()
    parts = [done[i] for i in range(n)]
    results = sorted((r for part in parts for r in part[0]), key=lambda r: r.plan.rid)
    clients = [part[2] for part in parts]
    client = {key: (max if key.startswith(("loop_", "gc_")) else sum)(c[key] for c in clients) for key in clients[0]}
    wall = max(part[3][1] for part in parts) - min(part[3][0] for part in parts)
    return results, parts[0][1], client, wall


def _client_process(cfg: SimConfig, path: str, model: Path, plans: list[_Plan], index: int, count: int,
                    addresses: dict, barrier, queue) -> None:
    """One client process of ``_serve_clients``: its share of the plans through ``_serve_async``;
    puts (index, its return value pickled) on ``queue``, or (index, the traceback) if it failed."""
    try:
        got = asyncio.run(_serve_async(cfg, path, model, plans, _Share(index, count, addresses, barrier)))
        payload = pickle.dumps(got)  # (pickled here: tensors through the queue itself would go as shared memory)
    except BaseException:  # it goes to the parent, which raises it: nothing is swallowed
        barrier.abort()  # the other clients stop waiting for this one
        queue.put((index, traceback.format_exc()))
        raise
    queue.put((index, payload))


def _note_first_data(results: list[_Result], first_data_at: dict, decoded_at: dict | None) -> None:
    """Each result's ``first_data`` from its client's processor and decoder (in process, where
    nothing is decoded, the message's own timestamp stands for its decoding)."""
    for r in results:
        core, processed = first_data_at.get(r.plan.rid, (None, None))
        got = core if decoded_at is None else decoded_at.get(core)  # (None: a message older than the decoder keeps)
        if core is not None and got is not None:
            r.first_data = (core, got, processed)


async def _send(plans: list[_Plan], one, concurrency: int) -> list[_Result]:
    """Every plan's request through ``one``, in arrival order, by ``concurrency`` senders, each
    sending the next plan once its last request is done, at the plan's arrival (at once if that has
    passed). Waiting requests are plans in a list, not tasks and timers for the client's collections
    to walk."""
    t0 = time.perf_counter()
    queue = iter(plans)  # shared: each plan goes to the sender that takes it first

    async def sender() -> list[_Result]:
        done = []
        for plan in queue:
            wait = plan.arrival - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            done.append(await one(plan))
        return done

    per_sender = await asyncio.gather(*(sender() for _ in range(max(1, min(concurrency, len(plans))))))
    return sorted((r for done in per_sender for r in done), key=lambda r: r.plan.rid)


def _gc_pauses(pauses: list[float]):
    """A ``gc.callbacks`` hook that appends every collection's duration (seconds) to ``pauses``."""
    started = [0.0]

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])
    return note


async def _loop_lag(lags: list[float], period: float = 0.001) -> None:
    """How late the client's event loop runs a callback due every ``period`` seconds (appended to
    ``lags``): how long an output that arrived waits for the loop."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period
        await asyncio.sleep(period)
        lags.append(max(0.0, loop.time() - due))


def _serve_in_process(cfg: SimConfig, path: str, model: Path, plans: list[_Plan]):
    engine = OmniLLM.from_engine_args(_engine_args(cfg, path, model), enable_multiprocessing=False,
                                      processor_options=talker_processor_options(path))
    try:
        warm = SamplingParams(max_tokens=3, output_kind=_kind("final_only"), detokenize=False)
        engine.add_request("warm", tokens_input([5, 6, 7]), warm)
        while engine.has_unfinished_requests():
            engine.step()
        engine.collective_rpc("reset_output_path_stats")
        processor = engine.output_processor
        processor.stopwatch.seconds = engine.engine_core.multimodal_seconds = 0.0
        bar = _bar(cfg, path)
        pending, live, results = list(plans), {}, []
        t0 = time.perf_counter()
        while pending or live:
            while pending and len(live) < cfg.concurrency and pending[0].arrival <= time.perf_counter() - t0:
                plan = pending.pop(0)
                engine.add_request(plan.rid, *_request(plan), priority=plan.priority)
                live[plan.rid] = _Result(plan, start=time.perf_counter())
            if not live:
                time.sleep(min(0.01, max(0.0, pending[0].arrival - (time.perf_counter() - t0))))
                continue
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                res = live.get(out.request_id)
                if res is None:
                    continue  # an aborted request's last output
                _take(res, out)
                res.aborted = _abort_now(res, out)
                if res.aborted:
                    engine.abort_request([res.plan.rid])
                if out.finished or res.aborted or res.error is not None:
                    _settle(res)
                    results.append(live.pop(out.request_id))
                    bar.update(1)
            for res in [r for r in live.values() if r.plan.abort and r.plan.kind == "final_only"
                        and now - r.start > _FINAL_ONLY_ABORT_S]:  # (not one that finished in this step)
                engine.abort_request([res.plan.rid])  # (LLMEngine makes no output for it)
                res.aborted = True
                results.append(live.pop(res.plan.rid))
                bar.update(1)
        wall = time.perf_counter() - t0
        bar.close()
        stats = engine.collective_rpc("output_path_stats", kwargs={"first_chunks": True})[0]
        client = {"bytes": 0, "decode_seconds": 0.0,
                  "multimodal_seconds": processor.stopwatch.seconds + engine.engine_core.multimodal_seconds,
                  "loop_lag_ms_p50": float("nan"), "loop_lag_ms_p99": float("nan"),
                  "loop_lag_ms_max": float("nan"), "gc_ms_max": float("nan")}  # no event loop
        _note_first_data(results, processor.first_data_at, None)
        return sorted(results, key=lambda r: r.plan.rid), stats, client, wall
    finally:
        engine.shutdown()
        engine = None  # as in _serve_async: nothing that keeps this frame keeps the engine past its run


def _request(plan: _Plan):
    """The prompt and sampling parameters of a planned request (a malformed one ends its prompt with
    token 1, the worker's cue)."""
    params = SamplingParams(max_tokens=plan.frames, output_kind=_kind(plan.kind), detokenize=False,
                            stop_token_ids=None if plan.stop is None else [plan.stop], skip_clone=True)
    return tokens_input(plan.prompt + ([1] if plan.bad else [])), params


def _without_nan(value):
    """``value`` with every NaN (a figure with no sample: no FINAL_ONLY request, no event loop in
    process) or infinity made None, so that ``summary.json`` is JSON (null), not Python's ``NaN``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nan(v) for v in value]
    return value


def _kind(name: str) -> RequestOutputKind:
    return RequestOutputKind[name.upper()]


def _abort_now(res: _Result, out) -> bool:
    """Whether a request planned to be aborted is aborted after ``out`` (taken): at its first audio,
    unless that came with its end (a FINAL_ONLY one's first audio is its end: a timer aborts it)."""
    return res.plan.abort and res.first_audio is not None and not out.finished


def _take(res: _Result, out) -> None:
    """One request output into the request's result (DELTA pieces add up; CUMULATIVE and FINAL_ONLY
    carry everything so far)."""
    comp = out.outputs[0]
    if comp.finish_reason == "error":
        res.error = str(comp.stop_reason)
    res.finish_reason = comp.finish_reason
    payload = getattr(comp, "multimodal_output", None)
    if res.plan.kind == "delta":
        res.tokens.extend(comp.token_ids)
    else:
        res.tokens = list(comp.token_ids)
    if payload is not None and "audio" in payload.tensors:
        res.payloads += 1
        if res.first_audio is None and payload.tensors["audio"].numel():
            res.first_audio, res.first_audio_at = time.perf_counter(), time.monotonic()
        if res.plan.kind == "delta":
            res.audio.append(payload.tensors["audio"])
            res.codes.append(payload.tensors["codes"])
        else:  # CUMULATIVE: each output starts with the one before as it came (the worker path's share
            # one growing storage), so each was right when it came if the last is; and each holds the
            # codes of every token it reports (a stale one would pass the first test)
            audio, codes = payload.tensors["audio"], payload.tensors["codes"]
            if res.plan.kind == "cumulative" and res.inconsistent is None and not _follows(res, audio, codes):
                res.inconsistent = f"output {res.payloads} does not start with the output before it"
            if res.inconsistent is None and (codes[:, 0] + tk.TEXT_VOCAB).tolist() != res.tokens:
                held = f"{codes.shape[0]} frames of codes for" if codes.shape[0] != len(res.tokens) else \
                    "codes other than those of"
                res.inconsistent = f"output {res.payloads} holds {held} its {len(res.tokens)} tokens"
            res.audio, res.codes = [audio], [codes]


def _follows(res: _Result, audio: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether a CUMULATIVE output starts with what the request's outputs before it held when they
    came (``res.seen``: a copy that each output extends by its new part, sized for the request's
    frames at its first output, so the client copies every sample once, and compares without
    allocating a copy per output); then it extends the copy."""
    if res.seen is None:
        frames = res.plan.frames
        res.seen = (GrowingTensor(audio, 0, frames * tk.FRAME_SAMPLES), GrowingTensor(codes, 0, frames))
        return True
    kept_audio, kept_codes = (kept.view().numpy() for kept in res.seen)
    got_audio, got_codes = audio.numpy(), codes.numpy()
    n, m = len(kept_audio), len(kept_codes)
    if len(got_audio) < n or len(got_codes) < m or not (np.array_equal(got_audio[:n], kept_audio)
                                                        and np.array_equal(got_codes[:m], kept_codes)):
        return False
    res.seen[0].append(audio[n:])
    res.seen[1].append(codes[m:])
    return True


def _settle(res: _Result) -> None:
    """A finished request's DELTA pieces as one tensor per key: each piece is a view that keeps a
    step's received buffer alive, and an object every full collection of the client walks. A
    CUMULATIVE request's last output is checked as it came: its copy (``_follows``) replaces the
    output, which may have changed since (an aborted request's is checked by nothing else).

    The copies go through numpy: this runs on the event loop that delivers every stream's output,
    and torch's copies of this size start its intra-op threads, which wait for cores the engine core
    keeps busy (milliseconds a request, every other stream's first audio waiting behind them)."""
    if res.seen is not None:  # (copied: the copy's storage has room to grow)
        res.audio, res.codes = ([torch.from_numpy(kept.view().numpy().copy())] for kept in res.seen)
        res.seen = None
    if len(res.audio) > 1:
        res.audio, res.codes = ([torch.from_numpy(np.concatenate([p.numpy() for p in pieces]))]
                                for pieces in (res.audio, res.codes))


def _difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two sample sequences differ, in words (for the check's error)."""
    if got.shape != want.shape:
        return f"{got.numel()} samples where {want.numel()} were expected"
    bad = torch.nonzero(got != want).flatten()
    return (f"{bad.numel()} of {want.numel()} samples differ, from sample {int(bad[0])} to {int(bad[-1])} "
            f"(frame {int(bad[0]) // tk.FRAME_SAMPLES} to {int(bad[-1]) // tk.FRAME_SAMPLES})")


# What fails a request planned with a malformed output (``WorkerOptions.bad_prompt_token``), by path:
# the accumulator's error for its chunk of another dtype, the scheduler's for a value the wire cannot
# carry.
_BAD_ERRORS = {"worker": "dtype", "upstream": "wire cannot carry"}


def _check(results: list[_Result], wav_dir: Path | None, bad_error: str, talker: tk.ToyTalker) -> dict:
    """Every request's codes against its prompt's rollout by ``talker`` and every sample against
    what those codes decode to; an aborted request up to where it got, any other to its end (its
    length, finish reason, and for FINAL_ONLY one payload). Raises ``AssertionError`` on any
    difference. The requests planned with a malformed output must have failed with an error that
    says ``bad_error``."""
    exact = aborted = failed = 0
    if wav_dir is not None:
        wav_dir.mkdir(parents=True, exist_ok=True)
    for r in results:
        p = r.plan
        if p.bad:
            if r.error is None or bad_error not in r.error:
                raise AssertionError(f"{p.rid}: its malformed output should have failed it, got {r.error!r}")
            failed += 1
            continue
        if r.error is not None:
            raise AssertionError(f"{p.rid}: failed: {r.error}")
        if r.inconsistent is not None:
            raise AssertionError(f"{p.rid} ({p.kind}): {r.inconsistent}")
        codes = torch.cat(r.codes) if r.codes else torch.zeros(0, tk.CODEBOOKS, dtype=torch.int64)
        audio = torch.cat(r.audio) if r.audio else torch.zeros(0)
        if p.codes is None:  # (both paths check the same plans) what the engine got (_request)
            p.codes = tk.rollout(talker, p.prompt + ([1] if p.bad else []), p.ends)
        if codes.shape[0] > p.ends or not torch.equal(codes, p.codes[:codes.shape[0]]):
            raise AssertionError(f"{p.rid} ({p.kind}): its {codes.shape[0]} frames are not what its prompt says")
        expected = tk.expected_audio(codes)
        if not torch.equal(audio, expected):
            raise AssertionError(f"{p.rid} ({p.kind}): audio differs from what its {codes.shape[0]} frames decode "
                                 f"to: {_difference(audio, expected)}; {r.payloads} payloads")
        if r.tokens[:codes.shape[0]] != (codes[:, 0] + tk.TEXT_VOCAB).tolist():
            raise AssertionError(f"{p.rid}: codes do not match the request's sampled tokens")
        if r.aborted:
            aborted += 1
            continue
        if codes.shape[0] != p.ends or len(r.tokens) != p.ends:
            raise AssertionError(f"{p.rid} ({p.kind}): {codes.shape[0]} frames and {len(r.tokens)} tokens, "
                                 f"expected {p.ends}")
        if r.finish_reason != ("length" if p.stop is None else "stop"):
            raise AssertionError(f"{p.rid} ({p.kind}): finished by {r.finish_reason!r}")
        if p.kind == "final_only" and r.payloads != 1:
            raise AssertionError(f"{p.rid}: FINAL_ONLY got {r.payloads} payloads")
        if wav_dir is not None:
            wav = wav_dir / f"{p.rid}_{p.kind}.wav"
            write_wav_f32(wav, audio.numpy(), tk.SAMPLE_RATE)
            back, rate = read_wav(wav)
            if rate != tk.SAMPLE_RATE or not np.array_equal(back, audio.numpy()):
                raise AssertionError(f"{p.rid}: {wav} does not read back exactly")
        exact += 1
    return {"finished_exact": exact, "aborted_checked": aborted, "failed_as_expected": failed}


def _bar(cfg: SimConfig, path: str) -> tqdm:
    return tqdm(total=cfg.requests, desc=f"simulate[{path}]", unit="req", disable=not cfg.progress)


def _plot(summary: dict, png: Path) -> None:
    """Draw the summary's figures into ``png``; nothing without matplotlib (the ``bench`` extra:
    the figures are in summary.json)."""
    try:
        import matplotlib
    except ImportError:
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [(("audio_seconds_per_wall_second",), "audio s / wall s"),
               (("ttfa_ms_p50", "ttfa_ms_p99"), "time to first audio, streaming, p50 / p99 (ms)"),
               (("final_only_ms_p50", "final_only_ms_p99"), "FINAL_ONLY file, p50 / p99 (ms)"),
               (("client_loop_lag_ms_p50", "client_loop_lag_ms_p99"), "client event loop late, p50 / p99 (ms)"),
               (("worker_output_path_us_median",), "worker output path (us/step)"),
               (("frontend_multimodal_us_per_step",), "frontend multimodal (us/step)"),
               (("d2h_copies_per_step",), "device-to-host copies / step"),
               (("wire_bytes_per_step",), "wire bytes / step")]
    paths = list(summary["paths"])
    colors = ["tab:blue", "tab:gray"]
    fig, axes = plt.subplots(3, 3, figsize=(15, 9))
    for ax, (keys, title) in zip(axes.flat, metrics):
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            values = [summary["paths"][p][key] for p in paths]
            ax.bar([i + (j - (len(keys) - 1) / 2) * width for i in range(len(paths))], values, width,
                   color=colors[:len(paths)], alpha=1.0 if j == len(keys) - 1 else 0.5)
        ax.set_xticks(range(len(paths)), paths)
        ax.set_title(title, fontsize=9)
        shown = [summary["paths"][p][key] for p in paths for key in keys]
        empty = "no sample" if all(math.isnan(v) for v in shown) else None if any(shown) else "none on any path"
        if empty:
            ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", color="gray")
            ax.set_yticks([])
    ax = axes.flat[-1]  # the first chunk's delay by stage: bars p99, ticks p50, per path
    width = 0.8 / max(len(paths), 1)
    for j, p in enumerate(paths):
        x = [i + (j - (len(paths) - 1) / 2) * width for i in range(len(STAGES))]
        ax.bar(x, [summary["paths"][p][f"first_chunk_{stage}_ms_p99"] for stage in STAGES], width,
               color=colors[j % len(colors)], label=p)
        ax.scatter(x, [summary["paths"][p][f"first_chunk_{stage}_ms_p50"] for stage in STAGES], marker="_",
                   color="black", s=200, zorder=3)
    ax.set_xticks(range(len(STAGES)), [stage.replace("_", " ") for stage in STAGES], fontsize=8)
    ax.set_title("first chunk's delay by stage, p99 (bars) / p50 (ticks) (ms)", fontsize=9)
    ax.legend(fontsize=8)
    device = next(iter(summary["paths"].values()))["device"] if paths else ""
    fig.suptitle(f"TTS serving through a vLLM engine core, {summary['config']['requests']} requests, {device}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)

