"""Ring accumulation vs the baselines, per engine step, in one process.

Workloads (requests x samples per step, float32 audio, 200 steps each): 64x1920, 256x1920, 64x48000,
8x48000. Every path runs whole episodes (200 appends, then the final concatenation per request), timed
with CUDA events after a warm-up episode; the figure is episode time / steps, median over repeats.

Paths:
  upstream     per request per step: non-blocking D2H (``.to('cpu', non_blocking=True)``), Python
               list; ``torch.cat`` per request at finish
  gpu_list     per request per step: keep the GPU slice in a list; ``torch.cat`` at finish
  cat_step     per request per step: ``acc = torch.cat([acc, chunk])`` (quadratic; 1920 workloads only)
  ours_eager   ``RingPool.append`` (one kernel per step, reading its metadata in place from pinned host
               memory; with the compiled backend the host planning and the launch are one call);
               ``consolidate`` at finish
  ours_graph   ``StaticAppend`` captured in a CUDA graph of one step, replayed per step
  ours_ingraph the same kernel captured ``steps`` times in one graph, as a whole episode (the slots
               taken anew, ``prepare``, the replay, ``consolidate``) divided by its steps;
               ``ours_kernel_ingraph`` is the replay alone: the per-step device cost when the
               append is part of the model's captured step, what ``copy_ingraph`` compares with
  ours_append[b], ours_kernel_ingraph[b]
               per kernel backend b (triton, cuda = the compiled extension, cupy = NVRTC; and
               cuda_no_pdl, triton_no_pdl: launched without programmatic dependent launch):
               eager appends only (slot reset before and finish after not timed), and the kernel
               alone in a graph
  copy_ingraph a plain device-to-device copy of the step's bytes, captured the same way (the copy
               bandwidth the kernel is compared with), plus one large copy for the peak

Each model step's output is a distinct tensor (a model allocates its output), so list baselines
keep views legitimately. Writes JSON (and a PNG with ``plot.py``).

Usage: python profiling/bench_ring.py [--steps 200] [--repeats 5] [--out out/bench_ring.json]
       [--workloads 64x1920,256x1920,64x48000,8x48000] [--trace]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import (backend_variant, backend_variants, copy_in_graph_ms, event_ms, host_floor_us,  # noqa: E402
                         kernel_device_us)
from vllm_omni_kernels import backend  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.profiling import nvtx_range  # noqa: E402
from vllm_omni_kernels.ring import PaddedBatch, RingPool  # noqa: E402

WORKLOADS = [(64, 1920), (256, 1920), (64, 48000), (8, 48000)]


def episode_pool(B: int, T: int, steps: int) -> RingPool:
    """A CUDA pool of B slots of float32 audio, each holding a whole episode of ``steps`` chunks of
    T samples without growing (size classes are 2**k)."""
    frames = 1 << (T * steps - 1).bit_length()
    return RingPool("audio", torch.float32, (), torch.device("cuda"), S.CONCAT_LAST, budget_bytes=B * frames * 4,
                    initial_frames=frames, max_slots=max(B, 8), growth=False)


def bench_workload(B: int, T: int, steps: int, repeats: int, trace: bool = False) -> dict:
    dev = torch.device("cuda")
    sources = [torch.randn(B, T, device=dev) for _ in range(steps)]
    lens = np.full(B, T, dtype=np.int64)
    ids = [f"r{i}" for i in range(B)]
    step_bytes = B * T * 4
    result: dict = {"requests": B, "samples": T, "steps": steps, "step_bytes": step_bytes, "paths": {}}

    def record(name, ms_runs, note=""):
        per_step = [m * 1000 / steps for m in ms_runs]
        result["paths"][name] = {"us_per_step_median": statistics.median(per_step), "us_per_step_all": per_step,
                                 "note": note}
        print(f"  {name:13s} {statistics.median(per_step):10.2f} us/step  {note}", flush=True)

    def upstream():
        lists = [[] for _ in range(B)]
        for s in range(steps):
            out = sources[s]
            for b in range(B):
                lists[b].append(out[b, : T].to("cpu", non_blocking=True))
        torch.cuda.synchronize()
        return [torch.cat(chunks) for chunks in lists]

    def gpu_list():
        lists = [[] for _ in range(B)]
        for s in range(steps):
            out = sources[s]
            for b in range(B):
                lists[b].append(out[b, : T])
        return [torch.cat(chunks) for chunks in lists]

    def cat_step():
        accs = [sources[0][b, :0] for b in range(B)]
        for s in range(steps):
            out = sources[s]
            for b in range(B):
                accs[b] = torch.cat([accs[b], out[b, : T]])
        return accs

    pool = episode_pool(B, T, steps)

    def reset():
        for r in ids:
            if r in pool:
                pool.free(r)
        for r in ids:
            pool.alloc(r)

    def ours_eager():
        reset()
        for s in range(steps):
            with nvtx_range("step"):
                pool.append(ids, PaddedBatch(sources[s], lens))
        return pool.consolidate(ids)

    with nvtx_range("upstream"):
        record("upstream", event_ms(upstream, max(1, repeats // 2)))
    with nvtx_range("gpu_list"):
        record("gpu_list", event_ms(gpu_list, repeats))
    if T <= 1920:
        with nvtx_range("cat_step"):
            record("cat_step", event_ms(cat_step, max(1, repeats // 2)))
    with nvtx_range("ours_eager"):
        record("ours_eager", event_ms(ours_eager, repeats), f"backend {backend.select(dev)[0]}")

    # Check ours against the reference concatenation once (outside timing).
    got = ours_eager()
    torch.cuda.synchronize()
    for b in (0, B - 1):
        expect = torch.cat([sources[s][b] for s in range(steps)])
        assert torch.equal(got[b], expect), f"ours_eager wrong for request {b}"
    del got

    # Graph paths: a static source (the model's captured output buffer).
    reset()
    sa = pool.static_append(ids, sources[0], lens)
    g1 = sa.capture_graph(1)
    gN = sa.capture_graph(steps)

    def ours_graph():
        reset()
        for _ in range(steps):
            sa.prepare(1)
            g1.replay()
        return pool.consolidate(ids)

    def ours_ingraph():
        reset()
        sa.prepare(steps)
        gN.replay()
        return pool.consolidate(ids)

    with nvtx_range("ours_graph"):
        record("ours_graph", event_ms(ours_graph, repeats), "1-step graph replayed per step, host prepare included")
    with nvtx_range("ours_ingraph"):
        record("ours_ingraph", event_ms(ours_ingraph, repeats), f"{steps} appends in one graph")
    got = ours_ingraph()
    torch.cuda.synchronize()
    assert torch.equal(got[B - 1], sources[0][B - 1].repeat(steps)), "graph path wrong"
    del got

    # Kernel-only timings (no consolidate) to compare with a plain copy of the same bytes.
    def rewind():  # fresh slots and the host's preparation, outside the timed span
        reset()
        sa.prepare(steps)

    record("ours_kernel_ingraph", event_ms(gN.replay, repeats, setup=rewind), "append kernels only, in one graph")

    # Every kernel backend available here, in the same process: eager appends only (metadata upload
    # included; the slot reset before and the finish after are not timed) and the append kernel
    # alone in a graph.
    def appends_only():
        for s in range(steps):
            pool.append(ids, PaddedBatch(sources[s], lens))

    for name in backend_variants(backend.kernel_backends()):
        with backend_variant(name):
            record(f"ours_append[{name}]", event_ms(appends_only, repeats, setup=reset),
                   "eager appends only (slot reset and finish not timed)")
            got = ours_eager()
            torch.cuda.synchronize()
            assert torch.equal(got[B - 1], torch.cat([sources[s][B - 1] for s in range(steps)])), name
            reset()
            sb = pool.static_append(ids, sources[0], lens)
            gb = sb.capture_graph(steps)

            def rewind_b(sb=sb):
                reset()
                sb.prepare(steps)

            record(f"ours_kernel_ingraph[{name}]", event_ms(gb.replay, repeats, setup=rewind_b), "append kernels only")
            del gb, sb
    if trace:  # the host's share of an eager step (the kernel's share: trace_kernels, at the end)
        eager_host_us(result, appends_only, reset, steps, repeats)
    # The copy reference moves the same bytes the same way: one static source, a fresh destination
    # every step (as the ring writes new arena memory every step), so neither is served from L2.
    pool = sa = g1 = gN = None  # (freed before the cache is emptied)
    for name in backend_variants(backend.kernel_backends()):
        k_b = result["paths"][f"ours_kernel_ingraph[{name}]"]["us_per_step_median"]
        result.setdefault("kernel_GBps_by_backend", {})[name] = 2 * step_bytes / (k_b * 1e3)
    record("copy_ingraph", copy_in_graph_ms(sources[0], steps, repeats),
           "same bytes to a fresh destination per step, in one graph")
    k = result["paths"]["ours_kernel_ingraph"]["us_per_step_median"]
    c = result["paths"]["copy_ingraph"]["us_per_step_median"]
    result["kernel_GBps"] = 2 * step_bytes / (k * 1e3)
    result["copy_GBps"] = 2 * step_bytes / (c * 1e3)
    result["kernel_vs_copy"] = c / k
    up = result["paths"]["upstream"]["us_per_step_median"]
    result["speedup_vs_upstream"] = {p: up / v["us_per_step_median"] for p, v in result["paths"].items()}
    sources = None
    torch.cuda.empty_cache()
    return result


def eager_host_us(result: dict, appends, reset, steps: int, repeats: int) -> None:
    """Host microseconds per eager append call of every backend, into ``result["eager_trace"]``:
    ``max(repeats, 5)`` rounds, each timing ``steps`` appends of every backend in turn and then the
    host's floor (``host_floor_us``), so that a shared host's drift reaches every backend alike;
    medians over the rounds."""
    names = backend_variants(backend.kernel_backends())
    runs: dict[str, list[float]] = {name: [] for name in names + ["floor"]}
    for _ in range(max(repeats, 5)):
        for name in names:
            with backend_variant(name):
                reset()
                appends()  # binds the backend's step
                torch.cuda.synchronize()
                reset()
                t0 = time.perf_counter()
                appends()
                runs[name].append((time.perf_counter() - t0) * 1e6 / steps)
                torch.cuda.synchronize()
        runs["floor"].append(host_floor_us(steps))
    floor = statistics.median(runs["floor"])
    for name in names:
        host = statistics.median(runs[name])
        result.setdefault("eager_trace", {})[name] = {"host_us_per_append": host, "host_us_runs": runs[name],
                                                      "host_floor_us": floor}
        print(f"  eager [{name}]: {host:.2f} us of host per append call, median of {len(runs[name])} rounds "
              f"(floor: tiny.zero_() {floor:.2f} us)", flush=True)


def trace_kernels(result: dict, steps: int) -> None:
    """The append kernel's device time per backend, from the CUDA profiler, into
    ``result["eager_trace"]``. Run after every timing of the process: a profiler session leaves CUPTI
    attached when it ends, and each later launch pays for its callbacks (a few µs of host time per
    launch: profiling/NSIGHT.md), which would inflate the eager figures."""
    B, T = result["requests"], result["samples"]
    sources = [torch.randn(B, T, device="cuda") for _ in range(steps)]
    lens = np.full(B, T, dtype=np.int64)
    ids = [f"r{i}" for i in range(B)]
    pool = episode_pool(B, T, steps)
    for name in result.get("eager_trace", {}):
        with backend_variant(name):
            for r in ids:
                pool.alloc(r)
            pool.append(ids, PaddedBatch(sources[0], lens))  # binds the backend's step outside the trace
            us = kernel_device_us(lambda: [pool.append(ids, PaddedBatch(src, lens)) for src in sources[1:]],
                                  "ring_write")
            for r in ids:
                pool.free(r)
        if us:
            result["eager_trace"][name]["kernel_device_us_median"] = statistics.median(us)
            print(f"  {B}x{T} eager [{name}]: the kernel {statistics.median(us):.2f} us on the device "
                  f"(median of {len(us)})", flush=True)
    pool = sources = None
    torch.cuda.empty_cache()


def peak_copy_GBps() -> float:
    n = 1 << 28  # 1 GiB of float32
    a, b = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    ms = statistics.median(event_ms(lambda: b.copy_(a), 20))
    return 2 * n * 4 / (ms * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="out/bench_ring.json")
    ap.add_argument("--workloads", default=",".join(f"{b}x{t}" for b, t in WORKLOADS))
    ap.add_argument("--trace", action="store_true",
                    help="also time each backend's eager append call on the host and (after all other "
                         "timings) its kernel on the device")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_ring needs a CUDA device")
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "steps": args.steps, "repeats": args.repeats, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    meta["peak_copy_GBps"] = peak_copy_GBps()
    print(json.dumps(meta), flush=True)
    results = []
    for w in args.workloads.split(","):
        B, T = (int(x) for x in w.split("x"))
        print(f"{B} requests x {T} samples:", flush=True)
        results.append(bench_workload(B, T, args.steps, args.repeats, args.trace))
    if args.trace:  # the profiler last: it leaves CUPTI attached, which slows every later launch
        print("kernels on the device (CUDA profiler):", flush=True)
        for r in results:
            trace_kernels(r, args.steps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print("\nsummary (median us/step; speedup vs upstream):")
    for r in results:
        p = r["paths"]
        print(f"{r['requests']:4d}x{r['samples']:<6d} upstream {p['upstream']['us_per_step_median']:9.1f}  "
              f"eager {p['ours_eager']['us_per_step_median']:7.2f} ({r['speedup_vs_upstream']['ours_eager']:6.1f}x)  "
              f"graph {p['ours_graph']['us_per_step_median']:6.2f}  in-graph {p['ours_ingraph']['us_per_step_median']:6.2f} "
              f"({r['speedup_vs_upstream']['ours_ingraph']:7.1f}x)  kernel {r['kernel_GBps']:7.0f} GB/s = "
              f"{100 * r['kernel_vs_copy']:5.1f}% of same-size copy ({r['copy_GBps']:.0f} GB/s), "
              f"{100 * r['kernel_GBps'] / meta['peak_copy_GBps']:5.1f}% of peak copy")
        for name, gbps in r.get("kernel_GBps_by_backend", {}).items():
            print(f"          {name:6s}: eager appends {p[f'ours_append[{name}]']['us_per_step_median']:7.2f} us/step, "
                  f"kernel in graph {p[f'ours_kernel_ingraph[{name}]']['us_per_step_median']:7.2f} us/step "
                  f"= {gbps:6.0f} GB/s ({100 * gbps / r['copy_GBps']:5.1f}% of copy)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
