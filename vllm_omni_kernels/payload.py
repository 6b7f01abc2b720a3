"""``MultimodalPayload``: a request's multimodal output, tensors and metadata apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .ops import ELEMENT_BITS


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
    _growing: dict[str, GrowingTensor] = field(default_factory=dict, repr=False, compare=False)  # merge()'s

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
        metadata winning. Returns a new payload; ``self`` and ``later`` are unchanged.

        A chain of merges (AsyncLLM merges every unread output into the first) copies each piece
        once: the tensors grow in a ``GrowingTensor`` that the result carries on. Concatenating at
        every merge would be quadratic, so a consumer that falls behind would fall further behind."""
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
                # the one an earlier merge grew ``first`` in, when nothing was appended to it since
                growing = self._growing.get(key)
                if growing is None or not growing.ends_with(first):
                    growing = GrowingTensor(first, merged.axes.get(key, 0))
                growing.append(value)
                merged._growing[key] = growing
                merged.tensors[key] = growing.view()
        return merged

    def get(self, key: str, default: Any = None) -> Any:
        """A tensor by key, else a metadata value by key, else ``default``."""
        if key in self.tensors:
            return self.tensors[key]
        return self.metadata.get(key, default)


class GrowingTensor:
    """A tensor that grows along ``axis`` by ``append``: capacity doubles, so each element is copied
    O(1) times, and ``view()`` is everything so far without a copy. A view handed out stays valid
    and unchanged: growth moves the data to new storage, appends write past every earlier view.

    ``capacity``: the length to allocate at once when the caller can tell (fresh memory costs more
    on the host than the copies). CPU data is copied through numpy views, of its bits where numpy
    lacks the dtype (bfloat16, float8): a torch copy costs several microseconds of dispatch, numpy's
    one, and a large one starts torch's intra-op threads, which on a host whose cores the engine
    keeps busy wait milliseconds, holding up the frontend's event loop."""

    def __init__(self, first: torch.Tensor, axis: int, capacity: int = 0):
        self.axis = axis % first.dim()
        self._n = first.shape[axis]
        self._frame = first.shape[:self.axis] + first.shape[self.axis + 1:]
        self._lead = (slice(None),) * self.axis
        shape = list(first.shape)
        shape[self.axis] = max(2 * self._n, capacity, 16)
        self._allocate(first.new_empty(shape))
        self._write(0, first)

    def _allocate(self, data: torch.Tensor) -> None:
        self._data = data
        self._cap = data.shape[self.axis]
        self._np = _numpy(data) if data.is_cpu else None

    def _write(self, at: int, piece: torch.Tensor) -> None:
        k = piece.shape[self.axis]
        if (self._np is not None and piece.dtype == self._data.dtype and piece.is_cpu
                and not (piece.requires_grad or piece.is_conj() or piece.is_neg())):  # (numpy takes no lazy conjugate)
            if self.axis:
                self._np[(*self._lead, slice(at, at + k))] = _numpy(piece)
            else:
                self._np[at:at + k] = _numpy(piece)
        else:  # (torch's copy between float16 and float32 drops a lazy negation: resolved first)
            self._data.narrow(self.axis, at, k).copy_(piece.resolve_neg())

    def append(self, piece: torch.Tensor) -> None:
        """Copy ``piece`` in after the data so far; its other dimensions must be the data's
        (ValueError otherwise: a copy would broadcast where a concatenation refuses). A piece of
        another dtype promotes the data as ``torch.cat`` does (int64 then float32: float32)."""
        shape, axis = piece.shape, self.axis
        if len(shape) <= axis or (shape[1:] if axis == 0 else shape[:axis] + shape[axis + 1:]) != self._frame:
            raise ValueError(f"cannot append a piece of shape {tuple(shape)} along axis {axis} to data "
                             f"of shape {tuple(self.view().shape)}")
        if piece.dtype != self._data.dtype:
            dtype = torch.promote_types(self._data.dtype, piece.dtype)
            if dtype != self._data.dtype:  # rare: the data so far moves to the wider type
                old = self.view()
                self._allocate(self._data.new_empty(self._data.shape, dtype=dtype))
                self._write(0, old)
        k = shape[axis]
        if self._n + k > self._cap:
            old = self.view()
            grown = list(self._data.shape)
            grown[axis] = max(2 * self._cap, self._n + k)
            self._allocate(self._data.new_empty(grown))
            self._write(0, old)
        self._write(self._n, piece)
        self._n += k

    def view(self) -> torch.Tensor:
        return self._data[:self._n] if self.axis == 0 else self._data.narrow(self.axis, 0, self._n)

    def ends_with(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is ``view()`` as it is now (nothing was appended since it was taken)."""
        return (tensor.shape == self.view().shape and tensor.data_ptr() == self._data.data_ptr()
                and tensor.stride() == self._data.stride())


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of CPU tensor ``t`` (of its bits for a dtype numpy lacks; None for one that has no
    such view)."""
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy()
    bits = ELEMENT_BITS.get(t.dtype.itemsize)  # (a dtype numpy lacks, as its bits)
    return None if bits is None or t.dtype.is_complex or t.is_quantized else t.view(bits).numpy()
