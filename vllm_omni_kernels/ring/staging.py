"""Pinned host buffers for per-step metadata uploads: ``PinnedStaging``.

Every kernel op of the package reads its per-step metadata (offsets, slots, heads) from a persistent
device buffer that the host fills with one non-blocking copy per step. The host side of that copy
must be pinned (else the copy is synchronous) and must not be rewritten while an earlier copy from it
may still be pending; this module owns that.
"""

from __future__ import annotations

import numpy as np
import torch

_DEPTH = 64
_EVENT_EVERY = 16
# The least depth at which a buffer's reuse always finds an event recorded after its last use that
# is at least _EVENT_EVERY hand-outs old (17 would find one, but it could be the newest: a wait on
# almost all queued work, a sync on the step's path whenever the device is a step behind).
MIN_DEPTH = 2 * _EVENT_EVERY


class PinnedStaging:
    """A ring of pinned int64 host buffers ``[rows, cols]``, each reused once its copy has run.

    Work is stream-ordered. Every ``_EVENT_EVERY``-th hand-out of a buffer first records a CUDA event,
    which follows all work queued with the buffers handed out before it (a kernel that reads a
    buffer in place is launched after the hand-out, so the event recorded at a hand-out never covers
    that buffer's own reader). A buffer is reused ``depth`` hand-outs later, after waiting on the
    first event recorded after its last use (``_free_after``; normally long complete: no per-step
    sync, and one event record per ``_EVENT_EVERY`` steps on the host). One owner, one stream at a
    time.

    For a CPU device there is one unpinned buffer and ``upload`` returns it (it is the metadata).
    ``depth``: buffers in the ring (at least ``MIN_DEPTH``; fewer pinned bytes for large tables).
    """

    def __init__(self, rows: int, cols: int, device: torch.device, device_copy: bool = False, depth: int = _DEPTH):
        if depth < MIN_DEPTH:
            raise ValueError(f"a staging ring of {depth} buffers; at least {MIN_DEPTH}")
        self.device = device
        self.rows = rows
        self.cols = cols
        self.pinned = device.type == "cuda"
        depth = depth if self.pinned else 1
        self._host = [torch.zeros(rows, cols, dtype=torch.int64, pin_memory=self.pinned) for _ in range(depth)]
        self._np = [h.numpy() for h in self._host]
        self._rows0 = [h[0] for h in self._host]  # row 0 of each buffer (a flat table), made once
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._count = 0  # hand-outs so far
        self._events: list[tuple[int, torch.cuda.Event]] = []  # (k, event after the work of hand-outs < k)
        self._done = 0  # the work of hand-outs before this index is known to have run
        # for_kernel's device copy target, made now: a step must not allocate
        self._device_copy = torch.empty(rows, cols, dtype=torch.int64, device=device) if device_copy and self.pinned else None

    def __del__(self):
        # Kernels that read these buffers in place may still be queued: wait for them before the
        # pinned memory goes back to torch's host allocator, which can hand it out again at once.
        # Not during a graph capture (a sync would break it); at interpreter exit CUDA may be gone.
        if not (getattr(self, "pinned", False) and getattr(self, "_count", 0)):
            return
        try:
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(self.device)
        except (RuntimeError, AttributeError, TypeError):
            pass

    def host(self) -> tuple[int, np.ndarray]:
        """(index, host buffer) of the next buffer to fill; waits only if the GPU is far behind."""
        depth = len(self._host)
        i = self._count % depth
        if self.pinned and self._count - depth >= self._done:
            found = _free_after(self._events, self._count - depth)
            if found is not None:
                k, ev = found
                ev.synchronize()  # at once unless the GPU is far behind (back-pressure); once per event
                self._done = k
        return i, self._np[i]

    def _queued(self) -> None:
        """Count one buffer handed to work about to be queued; every ``_EVENT_EVERY``-th hand-out
        first records an event (after the work of every earlier hand-out, not this one's)."""
        if self.pinned and self._count and self._count % _EVENT_EVERY == 0:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # the ring's device, whichever is current
            self._events.append((self._count, ev))
        self._count += 1

    def read_in_place(self, i: int, row0: bool = False) -> torch.Tensor:
        """Hand host buffer ``i`` to a kernel that reads it directly (pinned memory is addressable
        from the device): no copy; the buffer is reused only after work queued now has run.
        Returns the buffer (``row0``: its first row, for flat tables)."""
        self._queued()
        return self._rows0[i] if row0 else self._host[i]

    def for_kernel(self, i: int, rows: int, many_programs: bool) -> torch.Tensor:
        """Hand host buffer ``i`` to the next kernel: read in place (``read_in_place``), or, when
        ``many_programs`` (the kernel runs several programs per metadata row, each of which would read
        its row over the bus), first copied into the device copy of this ring (made with ``device_copy=True``;
        one small copy, then every program reads device memory). Returns what the kernel reads (its
        first ``rows`` rows)."""
        if not (many_programs and self._device_copy is not None):
            return self.read_in_place(i)
        return self.upload(i, rows, self._device_copy)  # reused every step: ordered on the one stream

    def upload(self, i: int, rows: int, dst: torch.Tensor, cols: int | None = None) -> torch.Tensor:
        """Copy the first ``rows`` rows (and ``cols`` columns) of host buffer ``i`` into ``dst`` (device).
        The copy spans the next power of two of each (within both tensors): what lies past ``rows``
        and ``cols`` in ``dst`` is left undefined, and a few views serve every step's count.

        Returns ``dst``, or on a CPU device the host buffer itself.
        """
        if not self.pinned:
            self._queued()
            return self._host[i]
        cols = self.cols if cols is None else cols
        key = (i, min(_pow2(rows), self.rows, dst.shape[0]), min(_pow2(cols), self.cols, dst.shape[1]))
        views = self._views.get(key)
        if views is None or views[0].data_ptr() != dst.data_ptr() or views[0].dtype != dst.dtype \
                or views[0].stride() != dst.stride():  # another tensor at the same address
            if len(self._views) > 4096:
                self._views.clear()
            views = self._views[key] = (dst[:key[1], :key[2]], self._host[i][:key[1], :key[2]])
        views[0].copy_(views[1], non_blocking=True)
        self._queued()
        return dst


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _free_after(events: list, last_use: int):
    """The first (k, event) whose completion frees the buffer of hand-out ``last_use``: recorded at
    a later hand-out (k > last_use), so after the work queued with that buffer. Drops the events
    before it from ``events`` (oldest first) and it too; None when there is none yet."""
    while events and events[0][0] <= last_use:
        events.pop(0)
    return events.pop(0) if events else None
