"""The worker's output path alone: ``WorkerAccumulator.append`` + ``collect`` per engine step for B
streaming requests (audio CONCAT_LAST, codes CONCAT_DIM0, a quarter of them due each step), each
step's packed host buffer kept alive for three steps (as the engine's output thread holds it) and
then dropped. With ``--churn`` C > 0, C requests finish and C new ones start every step (a serving
batch that changes every step; with 0 the batch repeats, the steady decode step). Reports host
microseconds per step (median, p90) and the pinned host buffers allocated while timing (0 once the
buffers are reused); ``--profile`` adds cProfile's top functions.

Usage: python profiling/bench_worker.py [--streams 64,256] [--churn 0,2] [--steps 300] [--device cuda] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_omni_kernels.accumulator import EmitPolicy  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.ring import PaddedBatch  # noqa: E402
from vllm_omni_kernels.serving.worker_accumulator import OutputKey, WorkerAccumulator  # noqa: E402

FRAME = 1920


def bench(B: int, steps: int, device: str, profile: bool, churn: int = 0) -> dict:
    dev = torch.device(device)
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=4 * FRAME,
                                       initial_frames=16 * FRAME),
                             OutputKey("codes", S.CONCAT_DIM0, torch.int64, (8,), cadence=None, initial_frames=16)],
                            dev, max_requests=max(B, 8))
    ids = [f"r{i}" for i in range(B)]
    for r in ids:
        acc.add_request(r, EmitPolicy.DELTA)
    audio = torch.randn(B, FRAME, device=dev)
    codes = torch.zeros(B, 1, 8, dtype=torch.int64, device=dev)
    n_audio, n_codes = np.full(B, FRAME, np.int64), np.ones(B, np.int64)
    for k in range(4):  # stagger the requests: about a quarter due each step
        m = B * (k + 1) // 4
        acc.append(ids[:m], {"audio": PaddedBatch(audio[:m], n_audio[:m]), "codes": PaddedBatch(codes[:m], n_codes[:m])})
    acc.collect()
    held = collections.deque(maxlen=3)
    born = [B]

    def step():
        acc.head(B, torch.int64)
        acc.append(ids, {"audio": PaddedBatch(audio, n_audio), "codes": PaddedBatch(codes, n_codes)})
        finishing = ids[:churn]
        held.append(acc.collect(finishing, head_bytes=8 * B))
        for _ in finishing:  # as many new requests take their places
            ids.pop(0)
            ids.append(f"r{born[0]}")
            born[0] += 1
            acc.add_request(ids[-1], EmitPolicy.DELTA)

    for _ in range(50):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    allocated = acc.stats()["pinned_allocations"]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    res = {"streams": B, "churn": churn, "us_median": float(np.median(times)), "us_p90": float(np.percentile(times, 90)),
           "pinned_allocations": acc.stats()["pinned_allocations"] - allocated}
    print(f"B={B}, {churn} requests replaced per step: output path {res['us_median']:.0f} us/step median "
          f"(p90 {res['us_p90']:.0f}); pinned host buffers allocated while timing: {res['pinned_allocations']}",
          flush=True)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            step()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print(out.getvalue())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--churn", default="0,2", help="requests replaced per step, one run per value")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    for B in (int(b) for b in args.streams.split(",")):
        for churn in (int(c) for c in args.churn.split(",")):
            bench(B, args.steps, args.device, args.profile, churn)


if __name__ == "__main__":
    main()
