"""Output modalities (``OutputModality``, a ``Flag``: text+audio is a plain union) and the tensor
accumulation strategies a key's values resolve to (``resolve_strategy``)."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any

import torch


class OutputModality(enum.Flag):
    """What a stage produces. ``from_string`` parses the free-text names stage configs use."""

    TEXT = enum.auto()
    IMAGE = enum.auto()
    AUDIO = enum.auto()
    LATENT = enum.auto()

    @classmethod
    def from_string(cls, text: "OutputModality | str | None") -> "OutputModality":
        """Parse ``"text+image"``, ``"image,text"``, ``"speech"``, ``"latents"``, ...

        Parts are separated by ``+`` or ``,``, case and surrounding blanks are ignored, and aliases
        (speech, images, latents, ...) map to their modality. Empty or None means TEXT; an
        ``OutputModality`` (or its int value) is taken as it is.

        Raises:
            ValueError: a part names no modality (the message lists the supported names), or a
                value that is neither a string nor a modality.
        """
        if text is not None and not isinstance(text, str):
            return cls(text)
        if text is None or not text.strip():
            return cls.TEXT
        result = cls(0)
        for raw in re.split(r"[+,]", text):
            part = raw.strip().lower()
            name = _ALIASES.get(part, part)
            member = cls.__members__.get(name.upper()) if name else None
            if member is None:
                supported = sorted({m.lower() for m in cls.__members__} | set(_ALIASES))
                raise ValueError(f"unknown output modality {part!r} in {text!r}; supported: {supported}")
            result |= member
        return result

    @property
    def has_text(self) -> bool:
        return OutputModality.TEXT in self

    @property
    def has_multimodal(self) -> bool:
        return bool(self & ~OutputModality.TEXT)


_ALIASES = {
    "speech": "audio",
    "audios": "audio",
    "wav": "audio",
    "images": "image",
    "img": "image",
    "latents": "latent",
}


class TensorAccumulationStrategy(enum.Enum):
    """How one key's per-step values combine into the request's output."""

    CONCAT_DIM0 = "concat_dim0"  # image/latent rows, codec codes [n, Q]
    CONCAT_LAST = "concat_last"  # audio [T] or [C, T]
    APPEND_LIST = "append_list"  # keep each step's value as a list element
    REPLACE = "replace"  # keep the latest value (metadata such as ``sr``)

    @property
    def uses_ring(self) -> bool:
        """True for strategies served by the GPU ring pools (the concatenating ones)."""
        return self in (TensorAccumulationStrategy.CONCAT_DIM0, TensorAccumulationStrategy.CONCAT_LAST)


def default_strategy(modality: OutputModality) -> TensorAccumulationStrategy:
    """The modality's default for tensors with a time/row axis: AUDIO concatenates along the last
    (time) axis, IMAGE/LATENT along dim 0; AUDIO wins in a compound modality."""
    if OutputModality.AUDIO in modality:
        return TensorAccumulationStrategy.CONCAT_LAST
    return TensorAccumulationStrategy.CONCAT_DIM0


def parse_strategy(value: "TensorAccumulationStrategy | str") -> TensorAccumulationStrategy:
    """Accept a strategy or its name/value ("concat_last", "CONCAT_LAST"); ValueError otherwise."""
    if isinstance(value, TensorAccumulationStrategy):
        return value
    for member in TensorAccumulationStrategy:
        if isinstance(value, str) and value.lower() in (member.value, member.name.lower()):
            return member
    raise ValueError(
        f"unknown accumulation strategy {value!r}; supported: {[m.value for m in TensorAccumulationStrategy]}"
    )


def resolve_strategy(
    key: str,
    value: Any,
    modality: OutputModality,
    declared: Mapping[str, TensorAccumulationStrategy] | None = None,
) -> TensorAccumulationStrategy:
    """The strategy for ``key`` given one of its values.

    A key declared APPEND_LIST collects any value (strings, scalars, tensors of any shape). Otherwise
    non-tensors and 0-d tensors are metadata (REPLACE) whatever is declared: a scalar has no axis to
    concatenate. Otherwise a declared strategy wins, then the modality default.
    """
    if declared and declared.get(key) is TensorAccumulationStrategy.APPEND_LIST:
        return TensorAccumulationStrategy.APPEND_LIST
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return TensorAccumulationStrategy.REPLACE
    if declared and key in declared:
        return declared[key]
    return default_strategy(modality)
