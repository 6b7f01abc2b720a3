"""Block-shape sweep of the CUDA C++ ring append (threads x elements per thread), against the Triton
kernel and a plain copy, each captured ``STEPS`` times in one CUDA graph.

The kernel header is compiled through CuPy's NVRTC with ``-DVOK_RING_THREADS``/``-DVOK_RING_PER_THREAD``
per variant and launched on the pool's resident metadata (``StaticAppend``), as the backends do.

Usage: python profiling/sweep_ring_cuda.py [--shapes 256x8,128x16] [--source other.cuh ...]
(prints us/step and % of the copy per workload and variant, and of the ``shipped`` launch: the selected
backend, for the compiled one its launch with programmatic dependent launch; ``--source`` adds kernel
sources to compare, e.g. an earlier revision's header from ``git show REV:kernels/vok_kernels.cuh``)
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

import cupy
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import event_ms  # noqa: E402
from vllm_omni_kernels.cuda_graphs import capture  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.ring import RingPool  # noqa: E402

STEPS = 200
SHAPES = "256x8,128x16,128x8,256x4,512x4,64x32"
SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "vok_kernels.cuh"


def graph_time(launch, rewind) -> float:
    """Median us per launch of ``STEPS`` launches captured in one graph (``rewind()`` before each replay)."""
    g = capture(launch, STEPS, warmup=lambda: (rewind(), launch()))
    return statistics.median(event_ms(g.replay, 6, setup=rewind)) * 1000 / STEPS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--source", action="append", default=[])
    args = ap.parse_args()
    sources = {"": SOURCE.read_text()} | {f"{Path(p).name} ": Path(p).read_text() for p in args.source}
    variants = [(label, code, *map(int, shape.split("x"))) for label, code in sources.items()
                for shape in args.shapes.split(",")]
    for B, T in [(64, 1920), (256, 1920), (64, 48000), (8, 48000)]:
        src = torch.randn(B, T, device="cuda")
        ids = [f"r{i}" for i in range(B)]
        frames = 1 << (T * (STEPS + 1) - 1).bit_length()
        pool = RingPool("a", torch.float32, (), "cuda", S.CONCAT_LAST, budget_bytes=B * frames * 4,
                        initial_frames=frames, max_slots=B, growth=False)
        for r in ids:
            pool.alloc(r)
        os.environ["VLLM_OMNI_KERNELS_BACKEND"] = "triton"
        sa = pool.static_append(ids, src, np.full(B, T))

        def rewind(steps=STEPS + 1):
            pool._size[sa.slots] = 0
            sa.prepare(steps)

        res = {"triton": graph_time(sa.launch, rewind)}
        os.environ["VLLM_OMNI_KERNELS_BACKEND"] = "auto"
        res["shipped"] = graph_time(sa.launch, rewind)  # the selected backend's launch (compiled: with PDL)
        os.environ["VLLM_OMNI_KERNELS_BACKEND"] = "triton"
        for label, code, threads, per in variants:
            mod = cupy.RawModule(code=code, options=("-std=c++17", f"-DVOK_RING_THREADS={threads}",
                                                      f"-DVOK_RING_PER_THREAD={per}"))
            fn = mod.get_function("vok_ring_write_e4_last")
            grid = (-(-T // (threads * per)), B)
            args = (np.uint64(pool.arena.data_ptr()), np.uint64(pool.state.data_ptr()), np.uint64(sa.meta.data_ptr()),
                    np.uint64(sa.src.data_ptr()), np.int64(1), np.int32(1))

            def launch(fn=fn, grid=grid, threads=threads, args=args):
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    fn(grid, (threads,), args)

            res[f"cuda {label}{threads}x{per}"] = graph_time(launch, rewind)
        dst = torch.empty(STEPS + 1, B, T, device="cuda")  # a fresh destination per step, as the ring writes
        k = [0]

        def copy():
            dst[k[0] % (STEPS + 1)].copy_(src)
            k[0] += 1

        res["copy"] = graph_time(copy, lambda: None)
        print(f"{B}x{T}: " + "  ".join(f"{n} {us:.2f} us ({100 * res['copy'] / us:.0f}%)" for n, us in res.items()),
              flush=True)
        del pool, sa
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
