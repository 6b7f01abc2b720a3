"""PNG of bench_ring.py's JSON: median us/step per path and workload (log scale), and the
append kernel's bandwidth against the copy reference.

Usage: python profiling/plot_ring.py out/bench_ring.json [out/bench_ring.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PATHS = ["upstream", "gpu_list", "cat_step", "ours_eager", "ours_graph", "ours_ingraph", "ours_kernel_ingraph",
         "copy_ingraph"]


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench_ring.json")
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    results, meta = data["results"], data["meta"]
    labels = [f"{r['requests']}x{r['samples']}" for r in results]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1.2]})
    width = 0.8 / len(PATHS)
    for k, path in enumerate(PATHS):
        xs, ys = [], []
        for i, r in enumerate(results):
            if path in r["paths"]:
                xs.append(i + (k - len(PATHS) / 2 + 0.5) * width)
                ys.append(r["paths"][path]["us_per_step_median"])
        ax.bar(xs, ys, width, label=path)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("median us per engine step (log)")
    ax.set_title(f"per-step accumulation, {meta['steps']} steps incl. finish — {meta['device']}, "
                 f"torch {meta['torch']}, triton {meta['triton']}", fontsize=9)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", which="both", alpha=0.3)
    bx.bar([i - 0.2 for i in range(len(labels))], [r["kernel_GBps"] for r in results], 0.4, label="ring append kernel")
    bx.bar([i + 0.2 for i in range(len(labels))], [r["copy_GBps"] for r in results], 0.4, label="copy_ (same bytes)")
    bx.axhline(meta["peak_copy_GBps"], color="k", ls="--", lw=1, label="1 GiB copy peak")
    bx.set_xticks(range(len(labels)), labels, fontsize=8)
    bx.set_ylabel("GB/s (read + write), in a CUDA graph")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
