"""Command line: ``simulate`` (the main job), ``info`` (backends and versions)."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-omni-kernels")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sim = sub.add_parser("simulate", help="streaming TTS accumulation run on the default device")
    sim.add_argument("--requests", type=int, default=96)
    sim.add_argument("--concurrency", type=int, default=48)
    sim.add_argument("--max-frames", type=int, default=60, help="longest request, in 80 ms codec frames")
    sim.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda")
    sim.add_argument("--out", default="out/simulate", help="where WAVs and summary.json go")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--no-progress", action="store_true")
    sub.add_parser("info", help="versions and which backend each op uses, and why")
    args = parser.parse_args(argv)

    if args.cmd == "info":
        import torch

        from . import backend

        info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                "backends": backend.describe()}
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
        print(json.dumps(info, indent=2))
        return 0

    from .simulate import SimConfig, run

    summary = run(SimConfig(requests=args.requests, concurrency=args.concurrency, max_frames=args.max_frames,
                            device=args.device, out_dir=args.out, seed=args.seed, progress=not args.no_progress))
    pool = summary["pool"]
    print(f"device {summary['device']} (backend {summary['backend']}): {summary['finished_exact']}/"
          f"{summary['requests']} requests sample-exact, {summary['steps']} steps")
    print(f"accumulated {summary['audio_seconds']:.1f} s of audio in {summary['wall_seconds']:.2f} s wall: "
          f"{summary['audio_seconds_per_wall_second']:.1f} audio s / wall s")
    print(f"pools: high-water {pool['high_water_bytes'] / 2**20:.2f} MiB of {pool['bytes_reserved'] / 2**20:.0f} MiB "
          f"reserved, in use now {pool['bytes_used']} B, accumulation errors {pool['accumulation_errors']}")
    for name, st in summary["pools"].items():
        print(f"  {name}: slots used {st['slots_used']}/{st['slots_capacity']}, high-water "
              f"{st['high_water_bytes'] / 2**20:.2f} MiB, growths {st['growths']}")
    print(f"WAVs and summary.json in {summary['wav_dir']}")
    return 0 if summary["finished_exact"] == summary["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
