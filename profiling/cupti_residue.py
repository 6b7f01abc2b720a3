"""What a finished ``torch.profiler`` session costs every later launch of the process.

Kineto leaves CUPTI attached to the process when a profiler session with CUDA activities ends; it
finalizes CUPTI only when ``TEARDOWN_CUPTI=1`` is set at that moment (it reads the variable each
time). This script measures, in one process, the host time of one small torch op (the floor) and
of the compiled gather's eager launch calls (``host_cost_gather.Scenario``) in three states:
never profiled, after a session that left CUPTI attached, and after a session that tore it down.
The attached and torn-down states alternate ``--cycles`` times, so host drift falls on both.

The benchmarks of ``profiling/`` that use the profiler (``bench_gather.py`` counting device ops,
``bench_ring.py --trace``, ``eager_device_time.py``, ``profile_append.py``) therefore run it after
all their host timings.

Usage: python profiling/cupti_residue.py [--batches 256] [--kinds mtp,mixed] [--steps 1000] [--cycles 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from cuda_timing import host_floor_us, profiler_session  # noqa: E402
from host_cost_gather import Scenario  # noqa: E402


def measure(scenarios: list[Scenario], steps: int) -> dict[str, float]:
    """Host microseconds per call: the floor, and one launch call of each scenario."""
    out = {"floor (tiny.zero_())": host_floor_us(steps)}
    for sc in scenarios:
        n = steps if sc.kind != "mixed" else max(1, steps // 4)
        spent = sum(sc.step() for _ in range(n))
        torch.cuda.synchronize()
        out[f"{sc.kind} B={sc.B} launch call"] = spent / (n * sc.launches) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="256")
    ap.add_argument("--kinds", default="mtp,mixed")
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--cycles", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cupti_residue needs a CUDA device")
    scenarios = [Scenario(kind, int(B), args.H, "cuda") for B in args.batches.split(",")
                 for kind in args.kinds.split(",")]
    measure(scenarios, args.steps // 4)  # warm-up (binds the compiled steps)
    states: dict[str, list[dict]] = {"never profiled": [], "CUPTI left attached": [], "CUPTI torn down": []}
    for _ in range(args.cycles):
        states["never profiled"].append(measure(scenarios, args.steps))
    for _ in range(args.cycles):
        profiler_session(teardown=False)
        states["CUPTI left attached"].append(measure(scenarios, args.steps))
        profiler_session(teardown=True)
        states["CUPTI torn down"].append(measure(scenarios, args.steps))
    for state, rounds in states.items():
        print(f"{state}:")
        for key in rounds[0]:
            runs = [r[key] for r in rounds]
            print(f"  {key:28s} {statistics.median(runs):6.2f} us (median of {len(runs)}, "
                  f"{min(runs):.2f} to {max(runs):.2f})", flush=True)


if __name__ == "__main__":
    main()
