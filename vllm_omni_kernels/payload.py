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
