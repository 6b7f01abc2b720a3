"""Where the host time of an eager ``RingPool.append`` goes (cProfile over many steps).

Usage: python profiling/profile_append.py [--requests 64] [--samples 1920] [--steps 2000] [--rounds 10]
       [--sources 1]
Prints the mean wall time per append (host-bound: the GPU work is far shorter), the same for the
compiled step called directly (no Python around it; through its plain entry and through pybind11)
and for one small torch op (a dispatcher call and a launch: this host's floor for any eager launch
from Python), and cProfile's top entries. ``launch_floor.cu`` measures the bare CUDA launch.
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import kernel_device_us  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.ring import PaddedBatch, RingPool  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--requests", type=int, default=64)
ap.add_argument("--samples", type=int, default=1920)
ap.add_argument("--steps", type=int, default=2000)
ap.add_argument("--rounds", type=int, default=10)
ap.add_argument("--sources", type=int, default=1, help="distinct source tensors, used in turn")
args = ap.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
B, T = args.requests, args.samples
FRAMES = 1 << 20
pool = RingPool("audio", torch.float32, (), dev, S.CONCAT_LAST, budget_bytes=B * FRAMES * 4, initial_frames=FRAMES)
ids = [f"r{i}" for i in range(B)]
for r in ids:
    pool.alloc(r)
sources = [torch.randn(B, T, device=dev) for _ in range(args.sources)]  # a model's output: a new tensor per step
lens = np.full(B, T)


RESET = FRAMES // T // 2  # steps between resets that keep the rings from filling (content is irrelevant)


def steps(n, append=lambda src: pool.append(ids, PaddedBatch(src, lens))):
    for i in range(n):
        append(sources[i % len(sources)])
        if i % RESET == RESET - 1:
            pool._size[:] = 0


def timed(run, n):
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(n)
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


# The host's speed drifts from second to second on a shared machine: the variants are timed in
# interleaved rounds and each reports its median round, so they are compared under the same drift.
variants = {"RingPool.append (wall, host-bound)": steps}
steps(20)  # binds the compiled step, if the backend has one
if pool._eager.step is not None:
    step, call, version = pool._eager.step, pool._eager.call, pool.version
    variants["the compiled step alone (step.call: the entry append uses)"] = \
        lambda n: steps(n, lambda src: call(ids, src, lens, version))
    variants["the compiled step alone through pybind11 (step(...))"] = \
        lambda n: steps(n, lambda src: step(ids, src, lens, version))
tiny = torch.zeros(1, device=dev)
variants["tiny.zero_() (one torch op: dispatcher + launch)"] = lambda n: [tiny.zero_() for _ in range(n)]
rounds = {name: [] for name in variants}
for r in range(args.rounds + 1):  # round 0 warms up
    for name, run in variants.items():
        us = timed(run, args.steps // args.rounds)
        if r:
            rounds[name].append(us)
for name, runs in rounds.items():
    print(f"{B}x{T}: {statistics.median(runs):6.2f} us per call (median of {len(runs)} rounds, "
          f"{min(runs):.2f} to {max(runs):.2f}): {name}")
if dev == "cuda":  # the append kernel's own time on the device (its metadata in the launch's parameters, or pinned)
    steps(20)
    us = kernel_device_us(lambda: steps(200), "ring_write")
    if us:
        print(f"{B}x{T}: the append kernel on the device, eager: median {statistics.median(us):.2f} us "
              f"({len(us)} launches, {us[0]:.2f} to {us[-1]:.2f}); {len(sources)} source tensor(s)")
prof = cProfile.Profile()
prof.enable()
steps(args.steps // 4)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
