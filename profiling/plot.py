"""PNG of a benchmark's JSON: ``bench_ring.py`` or ``bench_gather.py`` (told apart by their fields):
median µs per step of every path (log scale) and the kernels' bandwidth beside a plain copy of the
same bytes; ``bench_output_path.py``: µs per step of each part of the output path.

Usage: python profiling/plot.py out/bench_ring.json [out/bench_ring.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RING = ["upstream", "gpu_list", "cat_step", "ours_eager", "ours_graph", "ours_ingraph", "ours_kernel_ingraph",
        "copy_ingraph"]
GATHER = ["row_loop", "index_copy", "ours_eager", "ours_graph", "copy_graph"]


def panels(results: list[dict]) -> tuple[list[str], list[str], list[tuple[float, float]]]:
    """The path names, one label per result and its (ours, copy) bandwidth."""
    if "samples" in results[0]:
        return (RING, [f"{r['requests']}x{r['samples']}" for r in results],
                [(r["kernel_GBps"], r["copy_GBps"]) for r in results])
    return (GATHER, [f"{r['kind']}\nB={r['B']} H={r['H']}" for r in results],
            [(r["ours_GBps"], r["copy_GBps"]) for r in results])


def output_path(data: dict, src: Path, dst: Path) -> None:
    """``bench_output_path.py``: µs per step of each part of the output path, per path and load."""
    results = data["results"]
    parts = ["worker_us_median", "wire_us_median", "frontend_us_median", "frontend_multimodal_us_median"]
    labels = [f"{r['path']}\nB={r['streams']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels) + 3), 5))
    width = 0.8 / len(parts)
    for k, part in enumerate(parts):
        ax.bar([i + (k - len(parts) / 2 + 0.5) * width for i in range(len(results))],
               [r[part] for r in results], width, label=part.removesuffix("_us_median"))
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("median µs per step (log)")
    ax.set_title(f"{src.stem} — {results[0]['device']}", fontsize=9)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)
    print(f"wrote {dst}")


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench_ring.json")
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    if data.get("bench") == "output_path":
        output_path(data, src, dst)
        return
    results, meta = data["results"], data["meta"]
    paths, labels, gbps = panels(results)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(10, 0.9 * len(labels) + 4), 10))
    width = 0.8 / len(paths)
    for k, path in enumerate(paths):
        xs = [i + (k - len(paths) / 2 + 0.5) * width for i, r in enumerate(results) if path in r["paths"]]
        ys = [r["paths"][path]["us_per_step_median"] for r in results if path in r["paths"]]
        ax.bar(xs, ys, width, label=path)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("median µs per step (log)")
    ax.set_title(f"{src.stem} — {meta['device']}, torch {meta['torch']}, triton {meta['triton']}", fontsize=9)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    bx.bar([i - 0.2 for i in range(len(labels))], [o for o, _ in gbps], 0.4, label="ours, in a CUDA graph")
    bx.bar([i + 0.2 for i in range(len(labels))], [c for _, c in gbps], 0.4, label="copy_ of the same bytes")
    if "peak_copy_GBps" in meta:
        bx.axhline(meta["peak_copy_GBps"], color="k", ls="--", lw=1, label="1 GiB copy")
    bx.set_xticks(range(len(labels)), labels, fontsize=7)
    bx.set_ylabel("GB/s (read + write)")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
