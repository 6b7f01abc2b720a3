"""PNG of bench_gather.py's JSON: median us/step per path, scenario and batch (log scale), one panel
per hidden size, and the fused kernels' bandwidth against a plain copy of the same bytes.

Usage: python profiling/plot_gather.py out/bench_gather.json [out/bench_gather.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PATHS = ["row_loop", "index_copy", "ours_eager", "ours_graph", "copy_graph"]


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench_gather.json")
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    data = json.loads(src.read_text())
    results, meta = data["results"], data["meta"]
    hiddens = sorted({r["H"] for r in results})
    fig, axes = plt.subplots(1, len(hiddens) + 1, figsize=(8 * len(hiddens) + 5, 5.5))
    for ax, h in zip(axes, hiddens):
        rs = [r for r in results if r["H"] == h]
        labels = [f"{r['kind']}\nB={r['B']}" for r in rs]
        width = 0.8 / len(PATHS)
        for k, path in enumerate(PATHS):
            xs = [i + (k - len(PATHS) / 2 + 0.5) * width for i in range(len(rs))]
            ax.bar(xs, [r["paths"][path]["us_per_step_median"] for r in rs], width, label=path)
        ax.set_yscale("log")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("median us per step (log)")
        ax.set_title(f"H={h}, {meta['dtype']} — {meta['device']}, torch {meta['torch']}, triton {meta['triton']}",
                     fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
    bx = axes[-1]
    rs = [r for r in results if r["B"] == max(x["B"] for x in results)]
    labels = [f"{r['kind']}\nH={r['H']}" for r in rs]
    bx.bar([i - 0.2 for i in range(len(rs))], [r["ours_GBps"] for r in rs], 0.4, label="fused gather (graph)")
    bx.bar([i + 0.2 for i in range(len(rs))], [r["copy_GBps"] for r in rs], 0.4, label="copy_ of the same bytes")
    bx.set_xticks(range(len(rs)), labels, fontsize=7)
    bx.set_ylabel(f"GB/s (read + write) at B={rs[0]['B']}")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
