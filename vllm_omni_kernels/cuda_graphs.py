"""Capturing the package's static launches in a CUDA graph: ``capture``.

A launch that goes into a graph must have run once outside the capture first (Triton compiles on
its first call; lazy state must not be created while capturing), on a side stream as torch's graph
recipe does. ``StaticAppend.capture_graph`` and the gather's ``run_static`` callers use this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], times: int = 1,
            warmup: Callable[[], object] | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding ``times`` calls of ``fn``, on the current device.

    ``warmup`` (default ``fn``) runs once first, on a side stream, outside the capture; its effects
    stay (a ring append's warm-up appends one step). The current stream waits for it.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (fn if warmup is None else warmup)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(times):
            fn()
    return graph
