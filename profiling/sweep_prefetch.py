"""Experiment: does loading a step's source before its metadata shorten the ring append?

The write kernel's chain is metadata -> (source loads, head read) -> stores. When the source row
pitch is known on the host (a PaddedBatch: row b starts at b * pitch), the source loads need no
metadata and can be issued first; only the head read and the stores wait for it. This compares the
shipped Triton kernel with such a variant (mono audio / CONCAT_DIM0 mapping), in a CUDA graph of
200 appends, against the same-size copy. Content is checked once per variant.

Usage: python profiling/sweep_prefetch.py [--workloads 64x1920,256x1920,64x48000,8x48000]
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import copy_in_graph_us, event_ms  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.ops import triton_ring as tr  # noqa: E402
from vllm_omni_kernels.ring import RingPool  # noqa: E402

STEPS = 200


@triton.jit
def _write_prefetch(arena_ptr, state_ptr, meta_ptr, src_ptr, F, PITCH,
                    LAST: tl.constexpr, MONO: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    e = blk * BLOCK + tl.arange(0, BLOCK)
    vals = tl.load(src_ptr + row.to(tl.int64) * PITCH + e, mask=e < PITCH)  # before any metadata
    meta_row = meta_ptr + row * 8
    n = tl.load(meta_row + 2)
    slot = tl.load(meta_row + 0)
    pos = tl.load(meta_row + 5)
    cap = tl.load(meta_row + 4)
    mask = e < n * F
    if MONO:
        outer = tl.zeros_like(e)
        inner = e
    else:
        outer = e // F
        inner = e - outer * F
    if SINGLE:
        if pos < 0:
            pos = tl.load(state_ptr + slot) >> tr.HEAD_SHIFT
        tl.store(arena_ptr + tr._ring_index(meta_row, outer, inner, pos, F, LAST), vals, mask=mask)
        tl.debug_barrier()
        tl.store(state_ptr + slot, tr._next_head_word(pos, n, cap))
    else:
        word = tl.atomic_add(state_ptr + slot, 1, sem="relaxed")
        if pos < 0:
            pos = word >> tr.HEAD_SHIFT
        if (word & tr.TICKET_MASK) == tl.num_programs(1) - 1:
            tl.store(state_ptr + slot, tr._next_head_word(pos, n, cap))
        tl.store(arena_ptr + tr._ring_index(meta_row, outer, inner, pos, F, LAST), vals, mask=mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="64x1920,256x1920,64x48000,8x48000")
    args = ap.parse_args()
    shipped = tr.ring_write
    for B, T in [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]:
        src = torch.randn(B, T, device="cuda")
        ids = [f"r{i}" for i in range(B)]
        frames = 1 << (T * STEPS - 1).bit_length()

        def prefetching(arena, state, meta, s, *, rows, frame_elems, last, max_elems):
            blocks, block, warps = tr._shape(max_elems, rows)
            _write_prefetch[(rows, blocks)](arena, state, meta, s, frame_elems, s[0].numel(), LAST=last,
                                            MONO=last and frame_elems == 1, BLOCK=block, SINGLE=blocks == 1,
                                            num_warps=warps)

        results = {}
        for name, fn in (("shipped", shipped), ("prefetch", prefetching), ("shipped again", shipped)):
            tr.ring_write = fn
            pool = RingPool("a", torch.float32, (), "cuda", S.CONCAT_LAST, budget_bytes=B * frames * 4,
                            initial_frames=frames, max_slots=B, growth=False)
            for r in ids:
                pool.alloc(r)
            sa = pool.static_append(ids, src, np.full(B, T))
            g1 = sa.capture_graph(1)  # its warm-up appends once
            for _ in range(2):
                out = pool.drain(ids)
                assert all(torch.equal(o, src[i]) for i, o in enumerate(out)), name  # exact
                sa.prepare(1)
                g1.replay()

            def rewind():
                pool._size[sa.slots] = 0
                sa.prepare(STEPS)

            rewind()
            g = sa.capture_graph(STEPS)
            us = statistics.median(event_ms(g.replay, 7, setup=rewind)) * 1000 / STEPS
            results[name] = us
            del g, g1, sa, pool
        tr.ring_write = shipped
        copy = copy_in_graph_us(src, STEPS, 7)
        print(f"{B}x{T}: copy {copy:5.2f} us | " + " | ".join(
            f"{k} {v:5.2f} us = {100 * copy / v:5.1f}% of copy" for k, v in results.items()), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
