"""Block-size sweep of the multi-program ring append (in a CUDA graph of 200 appends).

Usage: VLLM_OMNI_KERNELS_BACKEND=triton python profiling/sweep_block.py [--blocks 512,1024,2048]
       [--warps 4,8] [--workloads 64x48000,8x48000]   (prints us/step and GB/s per BLOCK x warps x workload)
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import copy_in_graph_us, event_ms  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.ops import triton_ring  # noqa: E402
from vllm_omni_kernels.ring import RingPool  # noqa: E402

STEPS = 200
ap = argparse.ArgumentParser()
ap.add_argument("--blocks", default="1024,2048,4096")
ap.add_argument("--warps", default="4,8,16")
ap.add_argument("--workloads", default="64x48000,8x48000")
args = ap.parse_args()
for B, T in [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]:
    src = torch.randn(B, T, device="cuda")
    ids = [f"r{i}" for i in range(B)]
    frames = 1 << (T * STEPS - 1).bit_length()
    pool = RingPool("a", torch.float32, (), "cuda", S.CONCAT_LAST, budget_bytes=B * frames * 4, initial_frames=frames,
                    max_slots=B, growth=False)
    for r in ids:
        pool.alloc(r)
    sa = pool.static_append(ids, src, np.full(B, T))

    def rewind():  # the ring wraps; content is not checked here
        pool._size[sa.slots] = 0
        sa.prepare(STEPS)

    for block in [int(b) for b in args.blocks.split(",")]:
        for warps in [int(w) for w in args.warps.split(",")]:
            triton_ring.BLOCK, triton_ring.MULTI_WARPS, triton_ring.SMALL_GRID = block, warps, 0
            g = sa.capture_graph(STEPS)
            us = statistics.median(event_ms(g.replay, 6, setup=rewind)) * 1000 / STEPS
            print(f"{B}x{T} BLOCK={block} warps={warps}: {us:6.2f} us/step {2 * B * T * 4 / us / 1e3:7.0f} GB/s", flush=True)
            pool._size[sa.slots] = 0
    us = copy_in_graph_us(src, STEPS, 6)  # the same bytes to a fresh destination per step: the reference
    print(f"{B}x{T} copy: {us:6.2f} us/step {2 * B * T * 4 / us / 1e3:7.0f} GB/s", flush=True)
    del pool, sa
    torch.cuda.empty_cache()
