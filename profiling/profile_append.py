"""Where the host time of an eager ``RingPool.append`` goes (cProfile over many steps).

Usage: python profiling/profile_append.py [--requests 64] [--samples 1920] [--steps 2000]
Prints the mean wall time per append (host-bound: the GPU work is far shorter) and the top entries.
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.ring import PaddedBatch, RingPool  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--requests", type=int, default=64)
ap.add_argument("--samples", type=int, default=1920)
ap.add_argument("--steps", type=int, default=2000)
args = ap.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"
B, T = args.requests, args.samples
pool = RingPool("audio", torch.float32, (), dev, S.CONCAT_LAST, budget_bytes=B * 65536 * 4, initial_frames=65536)
ids = [f"r{i}" for i in range(B)]
for r in ids:
    pool.alloc(r)
src = torch.randn(B, T, device=dev)
lens = np.full(B, T)


def steps(n):
    for _ in range(n):
        pool.append(ids, PaddedBatch(src, lens))
        pool._size[:] = 0  # keep the rings from filling; content is irrelevant here


steps(20)
if dev == "cuda":
    torch.cuda.synchronize()
t0 = time.perf_counter()
steps(args.steps)
if dev == "cuda":
    torch.cuda.synchronize()
print(f"{B}x{T}: {(time.perf_counter() - t0) / args.steps * 1e6:.1f} us per append (wall, host-bound)")
prof = cProfile.Profile()
prof.enable()
steps(args.steps // 4)
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
