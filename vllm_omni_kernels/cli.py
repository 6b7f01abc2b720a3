"""Command line: ``simulate`` (the main job), ``serve`` (the speech server: vLLM's API server and
``/v1/audio/speech``; every ``vllm serve`` option applies), ``make-model`` (the talker's model
directory), ``info`` (backends and versions)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import signal
import sys
from pathlib import Path


def exit_on_signals() -> None:
    """SIGTERM and SIGINT end the command as ``SystemExit(128 + signal)`` (143, 130), without a
    traceback; every ``finally`` runs on the way out, so the engine core's process is stopped (the
    default SIGTERM left it running, orphaned). Not a KeyboardInterrupt: vLLM swallows that while
    it starts an engine core (its ``zmq_socket_ctx``), abandoning the handshake, and the start then
    waits for an engine that never answers. A signal during that way out is ignored. The tasks of an
    event loop that the SystemExit ends (the one it interrupts, and those that await that one) are
    over with the program: the loop does not report them as tasks whose exception no one read (a
    traceback each, when they go: vLLM's output task is awaited by no one)."""
    stopping = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            exit_now = SystemExit(128 + signum)
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop runs in this thread
                loop = None
            if loop is not None:
                loop.set_exception_handler(_quiet_about(exit_now, loop.get_exception_handler()))
            raise exit_now

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def _quiet_about(exit_now: SystemExit, handler):
    """An event loop's exception handler that passes over what ``exit_now`` ended and hands anything
    else to ``handler`` (None: the loop's default)."""
    def handle(loop, context):
        if context.get("exception") is not exit_now:
            (handler or type(loop).default_exception_handler)(loop, context)
    return handle


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv`` None: the program's own, and its signals are handled: ``exit_on_signals``)."""
    if argv is None:
        exit_on_signals()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # vLLM's own parser takes the rest
        why = _without_vllm()
        if why:
            print(f"vllm-omni-kernels serve: {why}", file=sys.stderr)
            return 2
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's platform; the talker picks its device
        from .vllm_integration.server import main as serve

        serve(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="vllm-omni-kernels")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser("simulate", help="stream TTS through a real vLLM engine: this package's output path and "
                                          "the upstream-style one, side by side")
    sim.add_argument("--requests", type=int, default=96, help="requests per path (default: %(default)s)")
    sim.add_argument("--concurrency", type=int, default=32, help="requests in flight at most (default: %(default)s)")
    sim.add_argument("--max-frames", type=int, default=40,
                     help="longest request, in 80 ms codec frames (default: %(default)s)")
    sim.add_argument("--arrival-ms", type=float, default=10.0,
                     help="mean gap between request arrivals (0: all at once, up to --concurrency)")
    sim.add_argument("--kinds", default="delta,cumulative,final_only", help="output kinds, taken in turn")
    sim.add_argument("--sync-check", action="store_true",
                     help="run every worker step under CUDA's sync-debug mode 'error': a host sync fails the run")
    sim.add_argument("--cadence", type=int, default=None,
                     help="audio samples a streaming request receives at a time (the first chunk at once; "
                          "default: four codec frames)")
    sim.add_argument("--device", default="auto", help="where the talker and the rings run: auto (GPU if present), "
                                                      "cpu, cuda")
    sim.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="vLLM's async scheduling (default: on for a talker on CUDA, off on the CPU)")
    sim.add_argument("--in-process", action="store_true", help="the engine core in this process (default: its own)")
    sim.add_argument("--clients", type=int, default=1,
                     help="client processes sharing the engine core, as vLLM's API server processes do "
                          "(--api-server-count); the requests in flight are split among them")
    sim.add_argument("--paths", default="worker,upstream", help="output paths to run: worker, upstream")
    sim.add_argument("--out", default="out/simulate", help="where summary.json, the PNG and wav/ go")
    sim.add_argument("--no-wavs", action="store_true", help="check every sample but write no WAV files")
    sim.add_argument("--bad-every", type=int, default=0,
                     help="every n-th request makes the talker emit a malformed output (worker path: a chunk of "
                          "another dtype; upstream path: a value the wire cannot carry): it must fail alone")
    sim.add_argument("--stop-every", type=int, default=4,
                     help="every n-th request ends on a token its talker emits half-way (stop_token_ids), as a TTS "
                          "model ends on its end token; 0: none")
    sim.add_argument("--priorities", type=int, default=0,
                     help="n: vLLM's priority scheduling; in each run of n requests, each outranks those before it")
    sim.add_argument("--seed", type=int, default=0, help="seed of the talker's weights and the requests' plan")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub.add_parser("serve", help="the speech server (python -m vllm_omni_kernels serve MODEL_DIR --help)")
    mk = sub.add_parser("make-model", help="write the talker's model directory (config, tokenizer; seeded)")
    mk.add_argument("path")
    mk.add_argument("--seed", type=int, default=0)
    sub.add_parser("info", help="versions and which backend each op uses, and why")
    args = parser.parse_args(argv)
    why = None if args.cmd == "info" else _without_vllm()
    if why:
        parser.error(f"{args.cmd} {why}")

    if args.cmd == "info":
        import torch

        from . import backend

        versions = {"python": sys.version.split()[0], "torch": torch.__version__}
        for dist in ("vllm-omni-kernels", "vllm", "triton", "cupy-cuda13x", "cupy-cuda12x"):
            try:
                versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                versions[dist] = None
        info = {"versions": versions, "cuda_available": torch.cuda.is_available(), "backends": backend.describe()}
        print(json.dumps(info, indent=2))
        return 0

    if args.cmd == "make-model":
        from .vllm_integration.talker_model import make_model_dir

        if not args.path.strip():
            mk.error("give the directory to write the model to")
        try:
            print(make_model_dir(args.path, seed=args.seed))
        except (FileExistsError, ValueError) as exc:  # another model's directory, a seed out of range
            mk.error(str(exc))
        except OSError as exc:
            mk.error(f"cannot write the model directory {args.path}: {exc.strerror or exc}")
        return 0

    # vLLM's own platform: the talker's executor puts the model and the rings on --device itself.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from .vllm_integration.simulate import STAGES, SimConfig, run

    try:
        cfg = SimConfig(requests=args.requests, concurrency=args.concurrency, max_frames=args.max_frames,
                        arrival_ms=args.arrival_ms, kinds=_names(args.kinds), sync_check=args.sync_check,
                        cadence=SimConfig.cadence if args.cadence is None else args.cadence, device=args.device,
                        async_scheduling=args.async_scheduling, in_process=args.in_process, clients=args.clients,
                        paths=_names(args.paths), out_dir=args.out, seed=args.seed, progress=not args.no_progress,
                        write_wavs=not args.no_wavs, bad_every=args.bad_every, stop_every=args.stop_every,
                        priorities=args.priorities)
    except ValueError as exc:  # a usage error: a count out of range, --kinds, --paths, --device or --clients
        sim.error(str(exc))
    summary = run(cfg)
    for path, s in summary["paths"].items():
        print(f"[{path}] {s['device']}: {s['finished_exact']} finished sample-exact, {s['aborted_checked']} aborted "
              f"(checked up to the abort), {s['failed_as_expected']} failed as planned, of {s['requests']}; "
              f"{s['requests_stopped']} ended on their stop token, {s['resumptions']} resumed after "
              "preemption")
        print(f"  {s['audio_seconds']:.1f} s of audio in {s['wall_seconds']:.2f} s: "
              f"{s['audio_seconds_per_wall_second']:.1f} audio s / wall s; streaming: time to first audio p50 "
              f"{s['ttfa_ms_p50']:.1f} ms, p99 {s['ttfa_ms_p99']:.1f} ms, first chunk from the worker p50 "
              f"{s['first_chunk_delay_ms_p50']:.1f} ms, p99 {s['first_chunk_delay_ms_p99']:.1f} ms; "
              f"FINAL_ONLY file p50 {s['final_only_ms_p50']:.1f} ms, p99 {s['final_only_ms_p99']:.1f} ms; "
              f"client event loop late p50 {s['client_loop_lag_ms_p50']:.1f} ms, "
              f"p99 {s['client_loop_lag_ms_p99']:.1f}, max {s['client_loop_lag_ms_max']:.1f} ms, "
              f"longest garbage collection {s['client_gc_ms_max']:.1f} ms")
        print("  first chunk by stage, p50 / p99 ms: " + ", ".join(
            f"{stage.replace('_', ' ')} {s[f'first_chunk_{stage}_ms_p50']:.1f} / {s[f'first_chunk_{stage}_ms_p99']:.1f}"
            for stage in STAGES))
        print(f"  engine step {s['step_ms_median']:.2f} ms, {s['streams_per_step']:.0f} streams/step, async scheduling "
              f"{'on' if s['async_scheduling'] else 'off'}, {s['client_processes']} client process(es)")
        print(f"  output path: worker {s['worker_output_path_us_median']:.1f} us/step (p99 "
              f"{s['worker_output_path_us_p99']:.1f}), frontend {s['frontend_multimodal_us_per_step']:.1f} us/step, "
              f"{s['d2h_copies_per_step']:.2f} device-to-host copies/step, {s['wire_bytes_per_step'] / 1024:.1f} KiB "
              f"on the wire/step; slots held after: {s['slots_held_after']}")
    for key, ratio in summary.get("ratios", {}).items():
        if ratio is not None:
            print(f"upstream-style / this package, {key}: {ratio:.3g}x")
    wavs = "" if args.no_wavs or "worker" not in summary["paths"] else f", WAVs in {Path(args.out) / 'wav'}"
    if (Path(args.out) / "simulate.png").exists():
        print(f"summary.json and simulate.png in {args.out}{wavs}")
    else:
        print(f"summary.json in {args.out}{wavs} (no simulate.png: matplotlib is not installed; "
              "pip install 'vllm-omni-kernels[bench]')")
    ok = all(s["finished_exact"] + s["aborted_checked"] + s["failed_as_expected"] == s["requests"]
             and s["slots_held_after"] == 0 for s in summary["paths"].values())
    return 0 if ok else 1


def _without_vllm() -> str | None:
    """Why vLLM, on which ``simulate``, ``serve`` and ``make-model`` run, cannot be imported (the
    ``vllm`` extra is not installed), or None."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"needs vLLM 0.33 ({exc}): pip install 'vllm-omni-kernels[vllm]'"
    return None


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated option's names."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


if __name__ == "__main__":
    sys.exit(main())
