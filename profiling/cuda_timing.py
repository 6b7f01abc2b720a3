"""Timing shared by ``bench_ring.py`` and ``bench_gather.py``: CUDA events, CUDA graphs, the host floor,
the CUDA profiler's device events and the backend variants."""

from __future__ import annotations

import contextlib
import os
import time

import torch


def event_ms(fn, repeats: int, setup=None) -> list[float]:
    """Milliseconds of each of ``repeats`` runs of ``fn()``, timed with CUDA events from a synchronized
    start, after one untimed warm-up run. ``setup()`` runs before every run, outside the timed span."""
    if setup is not None:
        setup()
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def us_per_call(fn, calls: int, repeats: int) -> list[float]:
    """Microseconds per call of ``fn()``: ``calls`` calls per timed run (``event_ms``)."""

    def run():
        for _ in range(calls):
            fn()

    return [ms * 1000 / calls for ms in event_ms(run, repeats)]


def graph_us_per_step(fn, steps: int, repeats: int, check=None) -> list[float]:
    """Microseconds per call of ``fn`` captured ``steps`` times in one CUDA graph, one figure per
    timed run of 3 replays. ``fn`` runs once first, outside the capture (``ring.graph.capture``);
    ``check(replay)``, if given, verifies the graph before it is timed."""
    from vllm_omni_kernels.ring.graph import capture

    graph = capture(fn, steps)
    if check is not None:
        check(graph.replay)
    runs = [t / steps for t in us_per_call(graph.replay, 3, repeats)]
    del graph
    return runs


def host_floor_us(calls: int) -> float:
    """Host microseconds per call of one small torch op (``tiny.zero_()``): this host's floor for any
    eager launch from Python at this moment, to quote next to host timings on a drifting machine."""
    tiny = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        tiny.zero_()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def cuda_events(fn, runs: int = 1) -> list | None:
    """The CUDA profiler's device events of ``runs`` runs of ``fn()`` (None if the profiler is
    unavailable on this image).

    The session leaves CUPTI attached to the process when it ends (Kineto finalizes it only under
    ``TEARDOWN_CUPTI=1``), and every later kernel launch pays for its callbacks: call this after
    the process's host-time measurements, never between them."""
    torch.cuda.synchronize()
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            for _ in range(runs):
                fn()
            torch.cuda.synchronize()
    except (RuntimeError, AssertionError, ImportError) as exc:  # no CUPTI (or profiler) on this image
        print(f"  (profiler unavailable: {exc})", flush=True)
        return None
    return [e for e in trace.events() if e.device_type.name == "CUDA"]


def kernel_device_us(fn, name_part: str) -> list[float]:
    """Device microseconds of every kernel whose name contains ``name_part`` launched by one run of
    ``fn()`` (sorted; empty if the profiler is unavailable). See ``cuda_events``."""
    events = cuda_events(fn) or []
    return sorted(getattr(e, "device_time", None) or e.cuda_time for e in events if name_part in e.name)


def count_device_ops(fn, steps: int = 5) -> dict | None:
    """Kernels and memcpys per run of ``fn()`` (None if the profiler is unavailable). See ``cuda_events``."""
    fn()
    events = cuda_events(fn, steps)
    if events is None:
        return None
    memcpys = sum("memcpy" in e.name.lower() for e in events)
    kernels = sum("memcpy" not in e.name.lower() and "memset" not in e.name.lower() for e in events)
    return {"kernels": kernels / steps, "memcpys": memcpys / steps}


def copy_in_graph_ms(src: torch.Tensor, steps: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` replays of one CUDA graph holding ``steps`` copies of
    ``src``, each to a fresh destination (as the ring kernels write new memory every step)."""
    dst = torch.empty(steps, *src.shape, dtype=src.dtype, device=src.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in range(steps):
            dst[s].copy_(src)
    runs = event_ms(graph.replay, repeats)
    del graph, dst
    return runs


NO_PDL = "_no_pdl"  # label suffix: the backend launching without programmatic dependent launch


def backend_variants(kernel_backends: list[str]) -> list[str]:
    """Every kernel backend available here, and for those that launch with programmatic dependent
    launch (the compiled one and Triton) also ``<name>_no_pdl``."""
    return list(kernel_backends) + [name + NO_PDL for name in kernel_backends if name in ("cuda", "triton")]


@contextlib.contextmanager
def backend_variant(label: str):
    """Run the block on the backend ``label`` names (``backend_variants``); restores auto and the
    default launch setting after."""
    from vllm_omni_kernels import ops

    no_pdl = label.endswith(NO_PDL)
    os.environ["VLLM_OMNI_KERNELS_BACKEND"] = label.removesuffix(NO_PDL)
    if no_pdl:
        ops.set_programmatic_launch(False)
    try:
        yield
    finally:
        os.environ["VLLM_OMNI_KERNELS_BACKEND"] = "auto"
        if no_pdl:
            ops.set_programmatic_launch(True)
