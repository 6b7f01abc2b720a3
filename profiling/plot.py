"""PNG of a benchmark's JSON: ``bench_ring.py`` or ``bench_gather.py`` (told apart by their fields):
median µs per step of every path (log scale) and the kernels' bandwidth beside a plain copy of the
same bytes; ``bench_output_path.py``: µs per step of each part of the output path;
``load_speech.py``: the time to first audio byte of every stream and the audio per wall second.

Usage: python profiling/plot.py out/bench_ring.json [out/bench_ring.png]
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

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


def us_bars(ax, labels: list[str], series: dict[str, dict[int, float]], title: str, fontsize: int, ncol: int) -> None:
    """Grouped bars on a log scale: ``series`` maps a name to its value at each label's index."""
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + (k - len(series) / 2 + 0.5) * width for i in values], list(values.values()), width, label=name)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, fontsize=fontsize)
    ax.set_ylabel("median µs per step (log)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=ncol)


def output_path(data: dict, src: Path):
    """``bench_output_path.py``: µs per step of each part of the output path, per path and load."""
    results = data["results"]
    parts = ["worker_us_median", "wire_us_median", "frontend_us_median", "frontend_multimodal_us_median"]
    labels = [f"{r['path']}\nB={r['streams']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(labels) + 3), 5))
    us_bars(ax, labels, {p.removesuffix("_us_median"): {i: r[p] for i, r in enumerate(results)} for p in parts},
            f"{src.stem} — {results[0]['device']}", 8, 1)
    return fig


def load_speech(data: dict):
    """``load_speech.py``: the distribution of the time to first audio byte, and audio per wall second."""
    results = data["results"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        x = np.sort(r["ttfb_ms"])
        ax.plot(x, np.linspace(0, 1, len(x)), label=f"{r['path']} (p99 {r['ttfb_ms_p99']:.0f} ms)")
    ax.set_xlabel("time to first audio byte, ms")
    ax.set_ylabel("fraction of streams")
    ax.set_title(f"{results[0]['clients']} concurrent streaming clients")
    ax.legend()
    ax.grid(alpha=0.3)
    bx.bar([r["path"] for r in results], [r["audio_s_per_wall_s"] for r in results])
    bx.set_ylabel("audio seconds per wall second")
    return fig


def kernels(data: dict, src: Path):
    """``bench_ring.py``, ``bench_gather.py``: every path's µs per step, and bandwidth against a copy."""
    results, meta = data["results"], data["meta"]
    paths, labels, gbps = panels(results)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(10, 0.9 * len(labels) + 4), 10))
    us_bars(ax, labels, {p: {i: r["paths"][p]["us_per_step_median"] for i, r in enumerate(results) if p in r["paths"]}
                         for p in paths},
            f"{src.stem} — {meta['device']}, torch {meta['torch']}, triton {meta['triton']}", 7, 4)
    bx.bar([i - 0.2 for i in range(len(labels))], [o for o, _ in gbps], 0.4, label="ours, in a CUDA graph")
    bx.bar([i + 0.2 for i in range(len(labels))], [c for _, c in gbps], 0.4, label="copy_ of the same bytes")
    if "peak_copy_GBps" in meta:
        bx.axhline(meta["peak_copy_GBps"], color="k", ls="--", lw=1, label="1 GiB copy")
    bx.set_xticks(range(len(labels)), labels, fontsize=7)
    bx.set_ylabel("GB/s (read + write)")
    bx.legend(fontsize=8)
    return fig


def plot(src: Path, dst: Path | None = None) -> Path:
    """Draw the JSON at ``src`` into ``dst`` (default: ``src`` as ``.png``); returns ``dst``."""
    dst = dst or src.with_suffix(".png")
    data = json.loads(src.read_text())
    if data.get("bench") == "output_path":
        fig = output_path(data, src)
    elif "ttfb_ms" in data["results"][0]:
        fig = load_speech(data)
    else:
        fig = kernels(data, src)
    fig.tight_layout()
    fig.savefig(dst, dpi=100)
    plt.close(fig)
    return dst


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench_ring.json")
    print(f"wrote {plot(src, Path(sys.argv[2]) if len(sys.argv) > 2 else None)}")


if __name__ == "__main__":
    main()
