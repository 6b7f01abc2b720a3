"""Device time of the eager gather's kernels, and whether its launch calls wait on the device.

For the fused gather (``host_cost_gather.Scenario``: mtp / non_mtp at B rows, H=4096, bf16) it prints
the host time of one launch call back to back and with the device drained before each call (if
the drained call is much cheaper, the back-to-back call waits on queued work), the eager kernels'
device time from the CUDA profiler, and the whole step per step. (``profile_append.py`` prints the
same device time for the ring append.) This is how the pinned tables' cost was found: a kernel
that reads its table in place from pinned host memory crosses the bus once per warp
(``profiling/RESULTS.md``, seventh session).

Usage: python profiling/eager_device_time.py [--batches 64,256] [--kinds mtp,non_mtp] [--steps 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from cuda_timing import host_floor_us, kernel_device_us  # noqa: E402
from host_cost_gather import Scenario  # noqa: E402


def launch_call_us(sc: Scenario, steps: int, drain: bool) -> float:
    """Median host microseconds of one launch call over ``steps`` steps."""
    out = []
    for _ in range(steps):
        if drain:
            torch.cuda.synchronize()
        out.append(sc.step() / sc.launches * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--kinds", default="mtp,non_mtp")
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("eager_device_time needs a CUDA device")
    print(f"floor: tiny.zero_() {host_floor_us(2000):.2f} us", flush=True)
    scenarios = [Scenario(kind, int(B), 4096, "cuda") for B in args.batches.split(",")
                 for kind in args.kinds.split(",")]
    host = []
    for sc in scenarios:
        for _ in range(50):
            sc.step()
        busy = launch_call_us(sc, args.steps, drain=False)
        idle = launch_call_us(sc, args.steps // 3, drain=True)
        t0 = time.perf_counter()
        for _ in range(args.steps // 2):
            sc.step()
        torch.cuda.synchronize()
        host.append((busy, idle, (time.perf_counter() - t0) / (args.steps // 2) * 1e6))
    # The profiler last: it leaves CUPTI attached when its session ends, which slows every later launch.
    for sc, (busy, idle, step_us) in zip(scenarios, host):
        kernels = kernel_device_us(lambda sc=sc: [sc.step() for _ in range(20)], "gather")
        device = f"{statistics.median(kernels):6.2f} us (n={len(kernels)})" if kernels else "(no profiler)"
        print(f"gather {sc.kind:8s} B={sc.B:4d}: launch call back to back {busy:6.2f} us, device drained "
              f"{idle:6.2f} us; eager kernel on the device {device}; whole step {step_us:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
