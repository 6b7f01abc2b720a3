"""Ring appends in CUDA graphs: ``StaticAppend`` and ``capture``.

A ``StaticAppend`` is the append of a fixed step shape (the same requests, source buffer and
lengths every step) with its metadata rows resident on the device: ``launch()`` is one kernel that
reads the heads from the device and advances them, so it can be captured and replayed step after
step. It uses the pool's public methods only.

A launch that goes into a graph must have run once outside the capture first (Triton compiles on
its first call; lazy state must not be created while capturing), on a side stream as torch's graph
recipe does: ``capture``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .. import ops
from .pool import PaddedBatch, RingPool


class StaticAppend:
    """The append of a fixed step shape; see the module docstring. ``prepare(steps)`` must run on
    the host before each launch, or before each replay of a graph holding ``steps`` launches."""

    def __init__(self, pool: RingPool, request_ids: Sequence[str], src: PaddedBatch | torch.Tensor,
                 lengths: Sequence[int] | None = None):
        if isinstance(src, PaddedBatch):
            src, lengths = src.data, src.lengths
        self.pool = pool
        self.request_ids = list(request_ids)
        self.src, self.slots, self.n, self.lin_off, self.lin_stride = pool.plan_static(self.request_ids, src, lengths)
        self.meta = torch.zeros(len(self.slots), pool.table.shape[1], dtype=torch.int64, device=pool.device)
        self._layout_seen: np.ndarray | None = None
        self._frames = int(self.n.max())
        self.max_elems = self._frames * pool.frame_elems
        self._room = 0  # frames every slot can still take: a lower bound while the pool is as last seen
        self._seen = (-1, -1)  # the pool's (version, writes) after the last prepare
        pool.pin_state(self)  # a captured launch reads the pool's head words in place

    def prepare(self, steps: int = 1) -> None:
        """Host work before ``steps`` launches: room for them (growing slots), the resident rows
        refreshed if a slot moved, head overrides written to the device, the host mirrors advanced.

        Raises:
            TensorAccumulationError: a request no longer holds a slot, or a slot cannot grow.
        """
        pool = self.pool
        need = self._frames * steps
        if self._seen != (pool.version, pool.writes) or self._room < need:
            # Something else moved, took, freed or wrote slots since the last prepare (or room ran
            # out): look everything up again.
            self.slots = pool.slots(self.request_ids)
            pool.make_room(self.request_ids, self.slots, self.n * steps)
            layout = np.concatenate((self.slots, pool.layout[self.slots]))
            if self._layout_seen is None or not np.array_equal(layout, self._layout_seen):
                rows = pool.static_rows(self.slots, self.n, self.lin_off, self.lin_stride)
                self.meta.copy_(torch.from_numpy(rows))
                self._layout_seen = layout
            pool.publish_heads(self.slots)
            self._room = pool.room(self.slots)
        pool.advance(self.slots, self.n * steps)
        self._room -= need
        self._seen = (pool.version, pool.writes)

    def launch(self) -> None:
        """One kernel: append every request's chunk at its device head and advance the head."""
        p = self.pool
        ops.ring_write(p.arena, p.state, self.meta, self.src, rows=len(self.slots), frame_elems=p.frame_elems,
                       last=p.last, max_elems=self.max_elems)

    def capture_graph(self, launches: int = 1) -> torch.cuda.CUDAGraph:
        """A CUDA graph of ``launches`` appends. Its warm-up (``prepare(1)`` and one launch, outside
        the capture) appends the current source once; call ``prepare(launches)`` before each replay."""
        return capture(self.launch, launches, warmup=self._warm_up)

    def _warm_up(self) -> None:
        self.prepare(1)
        self.launch()


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
