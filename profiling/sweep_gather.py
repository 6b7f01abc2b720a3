"""Sweep the fused gather's block size and warps at one step shape (kernels in a CUDA graph).

Usage: python profiling/sweep_gather.py [--kind mtp] [--B 1024] [--H 4096]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gather import Scenario  # noqa: E402
from cuda_timing import graph_us_per_step  # noqa: E402
from vllm_omni_kernels.ops import triton_gather  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="mtp")
    ap.add_argument("--B", type=int, default=1024)
    ap.add_argument("--H", type=int, default=4096)
    args = ap.parse_args()
    sc = Scenario(args.kind, args.B, args.H)
    rows = sc.float_rows()
    src = torch.randn(rows, args.H, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_us = statistics.median(graph_us_per_step(lambda: dst.copy_(src), 20, 7))
    print(f"{args.kind} B={args.B} H={args.H}: copy of the same bytes {copy_us:.2f} us")
    for block, warps in itertools.product((1024, 2048, 4096), (2, 4, 8, 16)):
        triton_gather.MAX_BLOCK_F, triton_gather.MAX_WARPS, triton_gather.ELEMS_PER_WARP = block, warps, 1
        us = statistics.median(graph_us_per_step(sc.static_step()[0], 20, 7))  # compiles outside the capture
        print(f"  block {block:5d} warps {warps:2d}: {us:7.2f} us/step = {100 * copy_us / us:5.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
