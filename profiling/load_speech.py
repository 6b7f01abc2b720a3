"""Concurrent streaming clients against the speech server (``python -m vllm_omni_kernels serve``).

For each output path (``worker``: this package; ``upstream``: per-request host copies and per-step
concatenation) a server starts on 127.0.0.1 with the talker on ``--device``, and ``--clients``
clients each stream ``--requests`` speech requests back to back (seeded texts, float32 PCM so every
sample can be checked against the talker's rollout), spread over ``--client-procs`` processes so
that no client's event loop sets what it measures. The clients are ``aiohttp``'s on uvloop: the
load generator shares the server's cores (on the 2-core CPU machine 16 simultaneous ``GET /health``
took 20 to 70 ms with ``httpx``, 2 to 12 with ``aiohttp`` and under 10 from raw sockets). Bounded in
count and in time (``--time-limit`` per path). Reported per path (JSON + PNG under ``--out``):

- time to first audio byte (from sending the request), p50 / p99, against the engine step;
- audio seconds delivered per wall second;
- gaps: each wait between two chunks against the audio the chunk before covered (worst ratio), and
  underruns: chunks that came after a player started at the first byte would have run dry;
- samples lost, altered or extra (against ``talker.expected_audio`` of the stream's rollout), and
  streams cut; any of them, or an answer other than 200 and 503, makes the exit status 1;
- 503 answers, and an overload probe: ``max_inflight + 8`` simultaneous requests (the extra ones must
  get 503 with Retry-After);
- where the server says the time to first audio went (``speech.FirstAudio``), p50 / p99 (with
  ``--api-servers`` above 1: of the API server process that answers);
- server memory before and after each of ``--rounds`` repetitions of the load (resident set of the
  server and its engine process, the worker's pool bytes and slots in use): it must not grow.

Usage: python profiling/load_speech.py [--clients 64] [--requests 4] [--rounds 2] [--device auto]
       [--paths worker,upstream] [--client-procs 4] [--api-servers 1]
       [--url http://127.0.0.1:8000]   (an already running server: one path)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import torch
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_omni_kernels.serving import talker as tk  # noqa: E402
from vllm_omni_kernels.serving.server_process import speech_server, wait_ready  # noqa: E402

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?"


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its descendants (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def memory(url: str, pid: int | None) -> dict:
    s = httpx.get(f"{url}/v1/audio/speech/stats", timeout=30).json()
    pools = s["worker"]["accumulator"]["pools"]
    return {"rss_bytes": rss_bytes(pid) if pid else None,
            "pool_bytes_used": sum(p["bytes_used"] for p in pools.values()),
            "pool_slots_used": sum(p["slots_used"] for p in pools.values()),
            "requests_held": s["worker"]["requests_held"], "inflight": s["inflight"],
            "step_ms": s["worker"]["step_us_median"] / 1e3, "rejected": s["rejected"],
            "output_path_us": s["worker"]["output_path_us_median"],
            "pinned_allocations": s["worker"]["accumulator"]["pinned_allocations"]}


class Stream:
    def __init__(self, text: str, voice: str):
        self.text, self.voice = text, voice
        self.status = None
        self.t_send = self.t_first = None
        self.arrivals: list[tuple[float, int]] = []  # (time, bytes) per chunk
        self.data = bytearray()
        self.cut = False  # its response ended before its end (the samples it lacks count as lost)
        self.nbytes = self.lost = self.altered = self.extra = 0  # after check()


def _session(url: str, connections: int, timeout: float) -> aiohttp.ClientSession:
    """An HTTP client for ``url`` with up to ``connections`` connections, each kept alive."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout))


async def _health(client: aiohttp.ClientSession) -> None:
    async with client.get("/health") as r:
        await r.read()


async def one_stream(client: aiohttp.ClientSession, s: Stream) -> None:
    s.t_send = time.perf_counter()
    body = {"input": s.text, "voice": s.voice, "response_format": "pcm", "sample_format": "f32", "stream": True}
    async with client.post("/v1/audio/speech", json=body) as r:
        s.status = r.status
        if r.status != 200:
            await r.read()
            return
        try:
            async for chunk in r.content.iter_any():  # as the bytes arrive
                now = time.perf_counter()
                s.t_first = s.t_first or now
                s.arrivals.append((now, len(chunk)))
                s.data += chunk
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):  # (a stream the server cut)
            s.cut = True


def _ttfb_ms(streams: list[Stream]) -> np.ndarray:
    """Time to first audio byte of every stream that got audio, ms."""
    return np.array([(s.t_first - s.t_send) * 1e3 for s in streams if s.t_first is not None])


def gaps(s: Stream) -> tuple[float, int]:
    """(worst wait / audio of the chunk before it, underruns) of one stream; audio is float32."""
    worst, under, delivered = 0.0, 0, 0.0
    for (t0, n0), (t1, _) in zip(s.arrivals, s.arrivals[1:]):
        delivered += n0 / 4 / tk.SAMPLE_RATE
        worst = max(worst, (t1 - t0) / max(n0 / 4 / tk.SAMPLE_RATE, 1e-9))
        under += (t1 - s.t_first) > delivered  # a player started at the first byte has run dry
    return worst, under


def check(streams: list[Stream], model: Path) -> None:
    """Every finished stream against the talker's rollout: its samples lost, altered and extra (past
    the rollout's end) are noted on it (``lost``, ``altered``, ``extra``) and its data dropped (only
    its length is kept)."""
    from transformers import AutoTokenizer

    from vllm_omni_kernels.vllm_integration.speech import plan_request
    from vllm_omni_kernels.vllm_integration.talker_model import VOICES

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    talker = tk.ToyTalker(0)
    for s in streams:
        if s.status != 200:
            continue
        want = tk.expected_audio(tk.rollout(talker, *plan_request(tokenizer, VOICES[s.voice], s.text))).numpy()
        got = np.frombuffer(bytes(s.data[:len(s.data) // 4 * 4]), "<f4")  # (a cut stream may end mid-sample)
        n = min(want.size, got.size)
        s.altered = int((got[:n].view(np.uint32) != want[:n].view(np.uint32)).sum())
        s.lost = max(0, want.size - got.size)
        s.extra = max(0, got.size - want.size)
        s.nbytes, s.data = len(s.data), bytearray()


def checked(streams: list[Stream]) -> dict:
    ok = [s for s in streams if s.status == 200]
    return {"samples_lost": sum(s.lost for s in ok), "samples_altered": sum(s.altered for s in ok),
            "samples_extra": sum(s.extra for s in ok), "streams_cut": sum(s.cut for s in ok),
            "streams_exact": sum(s.lost == 0 and s.altered == 0 and s.extra == 0 and not s.cut for s in ok)}


async def overload_probe(url: str, limit: int) -> dict:
    """``limit + 8`` simultaneous long requests, each closed after its first chunk."""
    async with _session(url, limit + 16, 120) as c:
        async def one():
            body = {"input": "a" * 1500, "response_format": "pcm", "stream": True}
            async with c.post("/v1/audio/speech", json=body) as r:
                if r.status == 200:
                    async for _ in r.content.iter_any():
                        await asyncio.sleep(2.0)  # hold the slot while the others arrive
                        break
                else:
                    await r.read()
                return r.status, r.headers.get("retry-after")
        codes = await asyncio.gather(*(one() for _ in range(limit + 8)))
    return {"sent": limit + 8, "ok": sum(c == 200 for c, _ in codes), "rejected_503": sum(c == 503 for c, _ in codes),
            "retry_after_set": all(r is not None for c, r in codes if c == 503)}


async def drive(url: str, plans: list[list[Stream]], start_at: float, time_limit: float) -> tuple[float, float]:
    """Each plan is one client sending its streams back to back, from ``start_at`` (a
    ``time.perf_counter`` value, the same clock in every process) until ``time_limit`` seconds after
    it; returns when they started and when the last one ended. The process's heap so far is frozen
    first (as vLLM's API server does), and a second before the start (the server keeps an idle
    connection for 5 s) one kept-alive connection per client is opened with a ``/health`` request:
    a full collection stalling every client of the process, the HTTP client's first use and the
    connections' set-up are not the server's time to first byte."""
    gc.collect()
    gc.freeze()
    async with _session(url, len(plans) + 8, time_limit) as client:
        await asyncio.sleep(max(0.0, start_at - 1.0 - time.perf_counter()))
        await asyncio.gather(*(_health(client) for _ in plans))
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        started = time.perf_counter()
        deadline = started + time_limit

        async def client_run(streams: list[Stream]):
            for s in streams:
                if time.perf_counter() > deadline:
                    break
                await one_stream(client, s)

        await asyncio.gather(*(client_run(p) for p in plans))
    return started, time.perf_counter()


def drive_and_check(url: str, plans: list[list[Stream]], start_at: float, time_limit: float,
                    model: Path) -> tuple[list[list[Stream]], tuple[float, float]]:
    """``drive`` (in a process of its own), then its streams checked there, after the load (only
    their timings and verdicts come back). The check's rollouts run on one thread: several client
    processes beside the server would oversubscribe the cores many times over."""
    times = uvloop.run(drive(url, plans, start_at, time_limit))  # the event loop the server runs on too
    torch.set_num_threads(1)
    check([s for p in plans for s in p], model)
    return plans, times


def load(url: str, args, rng: np.random.Generator, model: Path) -> tuple[list[Stream], float]:
    """The clients, spread over ``--client-procs`` processes so that the clients' own event loops
    do not set the time to first byte they measure."""
    voices = ["alloy", "nova", "echo", "sage"]
    plans = [[Stream("".join(rng.choice(list(ALPHABET), int(rng.integers(args.min_chars, args.chars + 1)))),
                     voices[(c + k) % len(voices)]) for k in range(args.requests)] for c in range(args.clients)]
    procs = max(1, min(args.client_procs, args.clients))
    shares = [plans[i::procs] for i in range(procs)]
    if procs == 1:
        start = time.perf_counter()
        done = [drive_and_check(url, shares[0], start, args.time_limit, model)]
    else:
        start = time.perf_counter() + 10.0  # the processes' imports happen before it
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(drive_and_check, repeat(url), shares, repeat(start), repeat(args.time_limit),
                                 repeat(model)))
    wall = max(end for _, (_, end) in done) - min(begin for _, (begin, _) in done)
    return [s for share, _ in done for p in share for s in p if s.status is not None], wall


def run_path(path: str, args, model: Path, out: Path) -> dict:
    t_ready = time.perf_counter()
    if args.url:
        wait_ready(args.url, None, timeout=180.0)
        server = contextlib.nullcontext((args.url, None))
    else:
        server = speech_server(model, out / f"server_{path}.log", "--talker-device", args.device, "--output-path",
                               path, "--max-num-seqs", str(args.clients), "--disable-uvicorn-access-log",
                               "--api-server-count", str(args.api_servers), timeout=180.0)
    with server as (url, proc):
        print(f"[{path}] server ready in {time.perf_counter() - t_ready:.1f} s", flush=True)
        pid = proc.pid if proc is not None else None
        before = memory(url, pid)
        httpx.get(f"{url}/v1/audio/speech/stats", params={"reset": "1"}, timeout=30)
        streams, wall, rounds, per_round = [], 0.0, [], []
        for k in range(args.rounds):  # the same load again: memory must not grow with the streams served
            got, spent = load(url, args, np.random.default_rng(args.seed + k), model)
            streams += got
            per_round.append(got)
            wall += spent
            time.sleep(0.5)
            rounds.append(memory(url, pid))
        after_load = rounds[-1]
        phases = httpx.get(f"{url}/v1/audio/speech/stats", timeout=30).json()["first_audio"]
        probe = asyncio.run(overload_probe(url, args.clients)) if args.probe else None
        time.sleep(1.0)
        after = memory(url, pid)
        verdict = checked(streams)
    ok = [s for s in streams if s.t_first is not None]  # (answered 200, and audio came)
    ttfb = _ttfb_ms(ok)
    worst, under = zip(*(gaps(s) for s in ok)) if ok else ((0.0,), (0,))
    audio_s = sum(s.nbytes for s in ok) / 4 / tk.SAMPLE_RATE
    step_ms = after_load["step_ms"]
    res = {"path": path, "clients": args.clients, "api_servers": args.api_servers, "streams": len(streams),
           "ok": len(ok), "status_503": sum(s.status == 503 for s in streams),
           "status_other": sum(s.status not in (200, 503) for s in streams), "wall_s": wall, "audio_s": audio_s,
           "audio_s_per_wall_s": audio_s / wall, "ttfb_ms_p50": float(np.percentile(ttfb, 50)),
           "ttfb_ms_p99": float(np.percentile(ttfb, 99)), "step_ms": step_ms,
           "ttfb_p99_target_ms": 2 * step_ms + 50, "worst_gap_ratio": float(max(worst)),
           "underruns": int(sum(under)), **verdict, "server_first_audio": phases, "memory_before": before,
           "memory_after_load": after_load, "memory_after": after, "memory_after_rounds": rounds,
           "overload_probe": probe, "ttfb_ms": ttfb.tolist(),
           "ttfb_ms_p99_by_round": [float(np.percentile(t, 99)) for t in map(_ttfb_ms, per_round) if t.size]}
    print(f"[{path}] {len(ok)}/{len(streams)} streams, {audio_s:.1f} audio s in {wall:.1f} s "
          f"({res['audio_s_per_wall_s']:.1f}x real time); TTFB p50 {res['ttfb_ms_p50']:.1f} ms, p99 "
          f"{res['ttfb_ms_p99']:.1f} ms (by round {[round(v, 1) for v in res['ttfb_ms_p99_by_round']]}; "
          f"target {res['ttfb_p99_target_ms']:.1f}: 2 steps of {step_ms:.2f} ms + 50); "
          f"worst gap {res['worst_gap_ratio']:.2f}x the previous chunk, {res['underruns']} underruns; "
          f"{verdict['samples_lost']} samples lost, {verdict['samples_altered']} altered, {verdict['samples_extra']} "
          f"extra, {verdict['streams_cut']} streams cut; 503s {res['status_503']}, other errors "
          f"{res['status_other']}; probe {probe}; pool bytes {before['pool_bytes_used']} -> "
          f"{after['pool_bytes_used']}, slots {after['pool_slots_used']}, RSS {before['rss_bytes']} -> "
          f"{[m['rss_bytes'] for m in rounds]} after each round", flush=True)
    if phases.get("count"):  # (the API server process that answered the stats request: one of --api-servers)
        print(f"[{path}] in the server, p50 / p99 ms: " + ", ".join(
            f"{name} {phases[f'{name}_ms_p50']:.1f} / {phases[f'{name}_ms_p99']:.1f}"
            for name in ("admit", "engine", "deliver", "respond", "total")), flush=True)
    else:
        print(f"[{path}] in the server: no first audio timed by the API server process that answered", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, back to back")
    ap.add_argument("--rounds", type=int, default=2, help="the whole load this many times (memory after each)")
    ap.add_argument("--chars", type=int, default=160, help="longest input (one 80 ms frame per character)")
    ap.add_argument("--min-chars", type=int, default=40)
    ap.add_argument("--device", default="auto", help="the talker's device: auto, cuda, cpu")
    ap.add_argument("--paths", default="worker,upstream")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per path; later requests are not sent")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="skip the overload probe")
    ap.add_argument("--url", default=None, help="an already running server (then one path, named 'external')")
    ap.add_argument("--model", default=None, help="the model directory (default: written to a temporary one)")
    ap.add_argument("--client-procs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                    help="processes the clients are spread over (default: a quarter of the cores, at most 4)")
    ap.add_argument("--api-servers", type=int, default=1,
                    help="API server processes of the server it starts (vLLM's --api-server-count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/load_speech")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from vllm_omni_kernels.vllm_integration.talker_model import make_model_dir

        model = make_model_dir(Path(tempfile.mkdtemp(prefix="talker-")))
    paths = ["external"] if args.url else [p for p in args.paths.split(",") if p]
    results = [run_path(p, args, model, out) for p in paths]
    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device, "clients": args.clients,
            "requests_per_client": args.requests, "chars": [args.min_chars, args.chars]}
    (out / "load_speech.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    from plot import plot  # profiling/plot.py, beside this script

    plot(out / "load_speech.json")
    print(f"wrote {out / 'load_speech.json'} and load_speech.png")
    wrong = [r["path"] for r in results if r["samples_lost"] or r["samples_altered"] or r["samples_extra"]
             or r["streams_cut"] or r["status_other"]]
    if wrong:  # (503s are the server's bound at work, not a failure)
        raise SystemExit(f"samples lost, altered or extra, streams cut, or errors answered on {wrong}")


if __name__ == "__main__":
    main()
