"""Block-shape sweep of the CUDA C++ fused gather (threads x bytes of a row per block) at bench_gather's
step shapes, against the shipped launch (the selected backend) and a copy of the same bytes, each step
captured ``STEPS`` times in one CUDA graph.

The kernel header is compiled through CuPy's NVRTC with ``-DVOK_GATHER_THREADS``/``-DVOK_GATHER_BLOCK_BYTES``
per variant and launched on the gathers' resident tables (``prepare_static``), as ``run_static`` does.

Usage: python profiling/sweep_gather_cuda.py [--shapes 128x4096,256x8192] [--cases mtp:256,mtp:64]
       [--H 4096] [--source other.cuh ...]
(``--source`` adds kernel sources to compare at every shape, e.g. an earlier revision's header from
``git show REV:kernels/vok_kernels.cuh``)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gather import Scenario  # noqa: E402
from cuda_timing import graph_us_per_step  # noqa: E402

STEPS = 20
SHAPES = "128x4096,256x4096,128x8192,256x8192,512x8192,64x2048,128x2048"
CASES = "mtp:64,non_mtp:64,mtp:256,non_mtp:256,mixed:256,mtp:1024"
SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "vok_kernels.cuh"


def graph_us(step) -> float:
    """Median us per step of ``STEPS`` steps captured in one graph."""
    return statistics.median(graph_us_per_step(step, STEPS, 7))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--source", action="append", default=[])
    args = ap.parse_args()
    sources = {"": SOURCE.read_text()} | {f"{Path(p).name} ": Path(p).read_text() for p in args.source}
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    modules = {(label, shape): cupy.RawModule(code=code, options=(
        "-std=c++17", f"-DVOK_GATHER_THREADS={shape[0]}", f"-DVOK_GATHER_BLOCK_BYTES={shape[1]}"))
        for label, code in sources.items() for shape in shapes}
    for case in args.cases.split(","):
        kind, B = case.split(":")
        sc = Scenario(kind, int(B), args.H)
        shipped, jobs = sc.static_step()
        res = {"shipped": graph_us(shipped)}
        es = sc.inputs_embeds.element_size()
        for (label, (threads, block_bytes)), module in modules.items():
            launches = []
            for g, n in jobs:
                fn = module.get_function(f"vok_row_gather_e{es}_a{int(g.jobs.aligned)}")
                grid = (n, max(1, -(-args.H * es // block_bytes)))
                table = np.uint64(g.table.data_ptr())
                launches.append((fn, grid, (np.uint64(g._anchor.data_ptr()), table, table, np.int64(args.H),
                                            np.int64(g.capacity.int_off))))

            def variant(launches=launches, threads=threads):
                with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    for fn, grid, kargs in launches:
                        fn(grid, (threads,), kargs)

            res[f"{label}{threads}x{block_bytes}"] = graph_us(variant)
        src = torch.randn(sc.float_rows(), args.H, device="cuda").to(sc.inputs_embeds.dtype)
        dst = torch.empty_like(src)
        res["copy"] = graph_us(lambda: dst.copy_(src))
        print(f"{kind:8s} B={B:>5} H={args.H}: " + "  ".join(
            f"{name} {us:.2f}" + ("" if name == "copy" else f" ({100 * res['copy'] / us:.0f}%)")
            for name, us in res.items()), flush=True)


if __name__ == "__main__":
    main()
