"""``MultimodalPayload``: a request's multimodal output, tensors and metadata apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class MultimodalPayload:
    """Tensors (``{key: tensor}`` or ``{key: [tensor, ...]}`` for APPEND_LIST keys) and metadata.

    Metadata holds REPLACE values: 0-d tensors and non-tensor values such as the sample rate ``sr``.
    ``primary_tensor`` is the first tensor in insertion order: producers put their main output first.
    ``axes``: the axis each concatenated tensor grows along (-1: CONCAT_LAST, 0: CONCAT_DIM0), which
    ``merge`` follows.
    """

    tensors: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    axes: dict[str, int] = field(default_factory=dict)

    @property
    def primary_tensor(self) -> torch.Tensor | None:
        for value in self.tensors.values():
            if isinstance(value, torch.Tensor):
                return value
        return None

    def __bool__(self) -> bool:
        return bool(self.tensors) or bool(self.metadata)

    def merge(self, later: MultimodalPayload | None) -> MultimodalPayload:
        """This payload followed by ``later`` (two DELTA payloads of one request as one, when a
        consumer falls behind): tensors concatenated along their axis, lists extended, the later
        metadata winning. Returns a new payload; ``self`` and ``later`` are unchanged."""
        if not later:
            return self
        merged = MultimodalPayload(dict(self.tensors), {**self.metadata, **later.metadata}, {**self.axes, **later.axes})
        for key, value in later.tensors.items():
            first = merged.tensors.get(key)
            if first is None:
                merged.tensors[key] = value
            elif isinstance(first, list):
                merged.tensors[key] = [*first, *value]
            else:
                merged.tensors[key] = torch.cat([first, value], dim=merged.axes.get(key, 0))
        return merged

    def get(self, key: str, default: Any = None) -> Any:
        """A tensor by key, else a metadata value by key, else ``default``."""
        if key in self.tensors:
            return self.tensors[key]
        return self.metadata.get(key, default)


class GrowingTensor:
    """A tensor that grows along ``axis`` (0, or -1 for the last) by ``append``: capacity doubles, so
    each element is copied O(1) times, and ``view()`` is everything so far without a copy (a strided
    view when the axis is the last of a multi-dimensional frame). A view handed out stays valid and
    unchanged: growth moves the data to new storage, appends write past every earlier view's end."""

    def __init__(self, first: torch.Tensor, axis: int):
        self.axis = axis
        self._n = first.shape[axis]
        shape = list(first.shape)
        shape[axis] = max(2 * self._n, 16)
        self._data = first.new_empty(shape)
        self._span(0, self._n).copy_(first)

    def _span(self, start: int, stop: int) -> torch.Tensor:
        if self.axis == 0 or self._data.dim() == 1:
            return self._data[start:stop]
        return self._data.narrow(self.axis, start, stop - start)

    def append(self, piece: torch.Tensor) -> None:
        k = piece.shape[self.axis]
        cap = self._data.shape[self.axis]
        if self._n + k > cap:
            old, shape = self._span(0, self._n), list(self._data.shape)
            shape[self.axis] = max(2 * cap, self._n + k)
            self._data = self._data.new_empty(shape)
            self._span(0, self._n).copy_(old)
        self._span(self._n, self._n + k).copy_(piece)
        self._n += k

    def view(self) -> torch.Tensor:
        return self._span(0, self._n)
