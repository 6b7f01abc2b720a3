"""Host time of the fused gather's eager step: how much of ``ours_eager`` in bench_gather.py is
bookkeeping on this host. On CPU (default) the kernels are stubbed (the Triton backend's encoding
runs); with ``--device cuda`` everything runs on the selected backend, and the launch calls are
also timed alone (recording excluded).

Usage: python profiling/host_cost_gather.py [--B 64] [--H 2048] [--kind mtp|mixed] [--device cpu|cuda]
       [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_omni_kernels import ops  # noqa: E402
from vllm_omni_kernels.decode_gather import DecodeGather  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--kind", choices=("mtp", "mixed"), default="mtp",
                    help="mtp: one batched run of B rows; mixed: B single-row runs (each row its own hook output)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    dev = args.device
    if dev == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("VLLM_OMNI_KERNELS_BACKEND", "triton")
        ops.row_gather = lambda *a, **k: None  # the table is still encoded and "uploaded" (host buffer)
    B, H = args.B, args.H
    g = DecodeGather(hidden_size=H, dtype=torch.bfloat16, device=dev, max_rows=B, max_tokens=B, mtp=True)
    ids, emb = torch.arange(B, device=dev), torch.zeros(B, H, dtype=torch.bfloat16, device=dev)
    input_ids = torch.zeros(B, dtype=torch.int32, device=dev)
    inputs_embeds = torch.zeros(B, H, dtype=torch.bfloat16, device=dev)
    codes = torch.zeros(B, 16, dtype=torch.int64, device=dev)
    g.codes = torch.zeros(B, 16, dtype=torch.int64, device=dev)
    off, flags = np.arange(B), np.ones(B, np.int32)

    rows = [(ids[i:i + 1], emb[i:i + 1]) for i in range(B)]

    clock = time.perf_counter
    launch_time = [0.0]

    def launch(fn):
        t0 = clock()
        fn()
        launch_time[0] += clock() - t0

    def step():
        if args.kind == "mtp":
            g.add_ids(input_ids, off, ids)
            g.add_mtp_inputs(off, ids, emb, emb, emb)
        else:
            for i, (row_ids, row_emb) in enumerate(rows):
                g.add_ids(input_ids, i, row_ids)
                g.add_mtp_inputs(i, row_ids, row_emb, row_emb, row_emb)
        g.add_flags(flags)
        launch(g.launch_pre)
        g.add_mtp_outputs(inputs_embeds, off, emb, codes, off)
        launch(g.launch_post)

    for _ in range(20):
        step()
    launch_time[0] = 0.0
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    what = "kernels launched" if dev == "cuda" else "kernels stubbed"
    print(f"{args.kind} decode step, B={B}: {(time.perf_counter() - t) / args.steps * 1e6:.1f} us of host work "
          f"({what}); the two launch calls alone: {launch_time[0] / args.steps / 2 * 1e6:.1f} us each")
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(args.steps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
