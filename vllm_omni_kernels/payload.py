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
    """

    tensors: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def primary_tensor(self) -> torch.Tensor | None:
        for value in self.tensors.values():
            if isinstance(value, torch.Tensor):
                return value
        return None

    def __bool__(self) -> bool:
        return bool(self.tensors) or bool(self.metadata)

    def get(self, key: str, default: Any = None) -> Any:
        """A tensor by key, else a metadata value by key, else ``default``."""
        if key in self.tensors:
            return self.tensors[key]
        return self.metadata.get(key, default)
