"""Buddy allocator over a fixed arena, in units of frames.

Regions are powers of two times ``min_frames``; freeing merges buddies back, so a pool that served
many short requests can still hand one long request a large region. A freed region is kept aside
unmerged and handed out first to a request of its size: a serving pool that starts and finishes
requests of a few sizes every step (a new request's smallest region, a FINAL_ONLY request's region
sized for all it will hold) splits and merges nothing, and the kept regions are merged as soon as a
region cannot be found without them. Purely host-side bookkeeping: it never touches device memory.
"""

from __future__ import annotations

import heapq


class BuddyAllocator:
    """Hands out ``(offset, frames)`` regions of a ``total_frames`` arena.

    ``total_frames`` is rounded down to a multiple of ``min_frames``; the arena starts as a forest of
    power-of-two blocks (its blocks count in binary, largest first, each aligned to its size, so no
    merge can cross a tree). ``alloc`` returns None when no region of the requested class is free;
    ``free`` takes exactly what ``alloc`` returned.
    """

    def __init__(self, total_frames: int, min_frames: int):
        if min_frames <= 0 or min_frames & (min_frames - 1):
            raise ValueError(f"min_frames must be a positive power of two, got {min_frames}")
        if total_frames < min_frames:
            raise ValueError(f"arena of {total_frames} frames is smaller than one block ({min_frames})")
        self.min_frames = min_frames
        blocks = total_frames // min_frames
        self.max_order = blocks.bit_length() - 1
        self.total_frames = blocks * min_frames
        self._free: list[set[int]] = self._initial_blocks(blocks)
        self._heaps: list[list[int]] = [sorted(f) for f in self._free]  # the free offsets, lowest first
        # (lazily: an offset taken out of a set by a merge stays in its heap until popped)
        self._live: dict[int, int] = {}  # offset -> order
        self._kept: list[list[int]] = [[] for _ in range(self.max_order + 1)]  # freed regions by order, unmerged
        self._grows: dict[int, bool] = {}  # size class -> grows_to's answer
        self.used_frames = 0

    def _initial_blocks(self, blocks: int) -> list[set[int]]:
        free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        offset = 0
        for order in range(self.max_order, -1, -1):
            if blocks >> order & 1:
                free[order].add(offset)
                offset += self.min_frames << order
        return free

    def is_merged(self) -> bool:
        """Whether nothing is handed out and every freed region merges back into the initial blocks."""
        self._merge_kept()
        return not self._live and self._free == self._initial_blocks(self.total_frames // self.min_frames)

    def order_for(self, frames: int) -> int:
        """The smallest order whose region holds ``frames`` (may exceed max_order)."""
        blocks = max(1, -(-frames // self.min_frames))
        return (blocks - 1).bit_length()

    def frames_of(self, order: int) -> int:
        return self.min_frames << order

    def ever_fits(self, frames: int) -> bool:
        """Whether a region of ``frames`` could be had at all: an initial block of its class or larger."""
        return self.order_for(frames) <= self.max_order

    def grows_to(self, frames: int) -> bool:
        """Whether a holder that starts at the smallest region and doubles it, taking each larger
        region before it gives the one before back (as a growing slot does), can reach ``frames``
        with the arena otherwise empty: played out on an empty allocator of the same arena, since
        where its earlier regions lie decides it. Answered once per size class."""
        order = self.order_for(frames)
        if order not in self._grows:
            probe = BuddyAllocator(self.total_frames, self.min_frames)
            region = probe.alloc(self.min_frames)
            while region is not None and region[1] < self.frames_of(order):
                larger = probe.alloc(2 * region[1])
                if larger is not None:
                    probe.free(region[0])
                region = larger
            self._grows[order] = region is not None
        return self._grows[order]

    def alloc(self, frames: int) -> tuple[int, int] | None:
        order = self.order_for(frames)
        if order > self.max_order:
            return None
        kept = self._kept[order]
        if kept:
            offset = kept.pop()
            self._live[offset] = order
            self.used_frames += self.frames_of(order)
            return offset, self.frames_of(order)
        k = order
        while k <= self.max_order and not self._free[k]:
            k += 1
        if k > self.max_order:
            if not any(self._kept):
                return None
            self._merge_kept()
            return self.alloc(frames)
        offset = self._pop(k)  # lowest address first keeps the arena compact
        while k > order:  # split, keeping the lower half
            k -= 1
            self._push(k, offset + self.frames_of(k))
        self._live[offset] = order
        self.used_frames += self.frames_of(order)
        return offset, self.frames_of(order)

    def free(self, offset: int) -> None:
        order = self._live.pop(offset)  # KeyError on a region not handed out: a caller bug
        self.used_frames -= self.frames_of(order)
        self._kept[order].append(offset)

    def _merge_kept(self) -> None:
        for order, kept in enumerate(self._kept):
            for offset in kept:
                self._merge(offset, order)
            kept.clear()

    def _merge(self, offset: int, order: int) -> None:
        """Return a free region, merged with its free buddies."""
        while order < self.max_order:
            buddy = offset ^ self.frames_of(order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._push(order, offset)

    def _push(self, order: int, offset: int) -> None:
        free, heap = self._free[order], self._heaps[order]
        free.add(offset)
        heapq.heappush(heap, offset)
        if len(heap) > 2 * len(free) + 64:  # mostly offsets merged away since: rebuild
            heap[:] = sorted(free)

    def _pop(self, order: int) -> int:
        """The lowest free offset of ``order`` (there is one), taken."""
        free, heap = self._free[order], self._heaps[order]
        while True:
            offset = heapq.heappop(heap)
            if offset in free:
                free.remove(offset)
                return offset

    @property
    def live_regions(self) -> int:
        return len(self._live)
