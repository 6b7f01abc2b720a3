"""The multimodal channel on vLLM's engine-core wire (RFC part I.2) and the decoder that keeps it.

``OmniEngineCoreOutput`` appends to vLLM's ``EngineCoreOutput`` (an ``array_like`` msgspec struct):

* ``multimodal_output``: ``{key: tensor or metadata}`` a producer sends as plain per-step chunks
  (the frontend accumulates them);
* ``multimodal_spans``: the request's data accumulated in the worker and due now, as spans (key,
  dtype, shape, byte offset) of the step's one buffer, ``OmniEngineCoreOutputs.multimodal_buffer``:
  one tensor per message, a single zero-copy frame in vLLM's encoder, however many requests it
  serves;
* ``multimodal_error``: the worker failed the request's output (``MultimodalError``); the frontend
  fails the request visibly with a ``TensorAccumulationError``.

Absent fields cost nothing (trailing defaults are omitted), and frames without them (plain
``EngineCoreOutput``) decode as before.

vLLM's client decodes every frame as ``EngineCoreOutputs``: decoded that way the fields would be
dropped, and a tensor under ``Any`` arrives as its raw ``[dtype, shape, buffer index]`` triple whose
buffer is gone once ``decode`` returns. ``OmniMsgpackDecoder`` decodes into ``OmniEngineCoreOutputs``,
turns those triples back into tensors while the message's buffers are at hand (zero-copy, as vLLM
does) and resolves every span into a view of the step's buffer (``resolve_spans``; the in-process
client calls it on the scheduler's own objects). The client subclasses in ``client.py`` hold this
decoder from construction.

Bad data never costs another request its output: a triple that cannot be a tensor of this message
(data not a buffer of it, an index past its buffers, a size that does not match the shape) becomes
a ``TensorAccumulationError`` in place of the value, and a span outside its buffer or misaligned
becomes the request's ``multimodal_error``; the frame's other outputs are delivered.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, bytestr

from ..errors import TensorAccumulationError


class MultimodalSpan(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """One key's data of one request in its message's buffer: a ``dtype`` tensor of ``shape`` from
    byte ``offset`` on, whose pieces concatenate along ``axis`` (-1: CONCAT_LAST, 0: CONCAT_DIM0).
    ``tensor`` is that view, filled on the receiving side (never sent)."""

    key: str
    dtype: str
    shape: list[int]
    offset: int
    axis: int = 0
    tensor: torch.Tensor | None = None


class MultimodalError(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Why the worker failed a request's multimodal output (``key``: the key concerned, if one)."""

    message: str
    key: str | None = None

    def to_exception(self, request_id: str) -> TensorAccumulationError:
        return TensorAccumulationError(self.message, request_id=request_id, key=self.key)


class OmniEngineCoreOutput(EngineCoreOutput, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutput`` plus the dedicated multimodal channel (module docstring);
    ``pooling_output`` keeps vLLM's meaning (pooling tensors only)."""

    multimodal_output: dict[str, Any] | None = None
    multimodal_spans: list[MultimodalSpan] | None = None
    multimodal_error: MultimodalError | None = None

    @classmethod
    def from_base(cls, base: EngineCoreOutput, multimodal_output: dict[str, Any] | None = None,
                  spans: list[MultimodalSpan] | None = None,
                  error: MultimodalError | None = None) -> OmniEngineCoreOutput:
        """``base`` with the multimodal fields (every field of ``base`` carried over; empty ones as None)."""
        fields = {name: getattr(base, name) for name in base.__struct_fields__}
        return cls(**fields, multimodal_output=multimodal_output or None, multimodal_spans=spans or None,
                   multimodal_error=error)


class OmniEngineCoreOutputs(EngineCoreOutputs, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutputs`` whose outputs decode as ``OmniEngineCoreOutput``, with the step's buffer
    of worker-accumulated data (uint8, host memory) that their spans point into."""

    outputs: list[OmniEngineCoreOutput] = []
    multimodal_buffer: torch.Tensor | None = None


def resolve_spans(outputs: OmniEngineCoreOutputs) -> None:
    """Fill every span's ``tensor`` with its view of ``outputs.multimodal_buffer``. A span that does
    not lie inside the buffer, or whose offset does not suit its dtype, fails its request
    (``multimodal_error``) and the request's spans are dropped.

    The worker lays each key's spans out back to back, so the spans of a key are cut from the
    buffer with one ``split`` (one call for all of them); spans laid out otherwise are cut one by one.
    """
    buffer = outputs.multimodal_buffer
    if buffer is None:
        buffer = torch.empty(0, dtype=torch.uint8)
    runs: dict[tuple, list] = {}  # (dtype, frame shape, axis) -> [(span, eco), ...]
    for eco in outputs.outputs:
        for span in getattr(eco, "multimodal_spans", None) or ():
            shape = span.shape
            frame = tuple(shape[:-1]) if span.axis == -1 else tuple(shape[1:])
            runs.setdefault((span.dtype, frame, span.axis), []).append((span, eco))
    failed: dict[int, tuple] = {}
    for (dtype_name, frame, axis), items in runs.items():
        dtype = _DTYPES.get(dtype_name)
        if dtype is None or not all(type(s) is int and s >= 0 for s in frame):
            for span, eco in items:
                failed[id(eco)] = (eco, MultimodalError(f"span of unknown dtype {dtype_name!r} or shape {span.shape}",
                                                       key=span.key))
            continue
        _cut(buffer, dtype, frame, axis, items, failed)
    for eco, error in failed.values():
        eco.multimodal_spans = None
        eco.multimodal_error = error


def _cut(buffer: torch.Tensor, dtype: torch.dtype, frame: tuple, axis: int, items: list, failed: dict) -> None:
    """The views of ``items`` (spans of one dtype and frame shape): one ``split`` of the buffer when
    they lie back to back, else one view each; spans outside the buffer fail their request."""
    item, per_frame = dtype.itemsize, math.prod(frame)
    counts = [span.shape[axis] for span, _ in items]
    start = items[0][0].offset
    expected, contiguous = start, True
    for (span, _), n in zip(items, counts):
        contiguous &= span.offset == expected and len(span.shape) == len(frame) + 1
        expected += n * per_frame * item
    if contiguous and start >= 0 and start % item == 0 and expected <= buffer.numel():
        region = buffer[start:expected].view(dtype)
        if axis == 0:
            pieces = region.view(-1, *frame).split(counts)
        elif not frame:  # mono audio: the pieces are the views
            pieces = region.split(counts)
        else:
            pieces = [p.view(*frame, n) for p, n in zip(region.split([n * per_frame for n in counts]), counts)]
        for (span, _), piece in zip(items, pieces):
            span.tensor = piece
        return
    for span, eco in items:
        nbytes = math.prod(span.shape) * item
        if span.offset < 0 or span.offset % item or span.offset + nbytes > buffer.numel() \
                or len(span.shape) != len(frame) + 1:
            failed[id(eco)] = (eco, MultimodalError(
                f"span of {nbytes} bytes at offset {span.offset} is not inside the step's buffer of "
                f"{buffer.numel()} bytes on a {item}-byte boundary", key=span.key))
            continue
        span.tensor = buffer[span.offset:span.offset + nbytes].view(dtype).view(span.shape)


_DTYPES = {name: dtype for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype)}


def _is_tensor_triple(value: Any) -> bool:
    if not (isinstance(value, list | tuple) and len(value) == 3):
        return False
    dtype, shape, data = value
    return (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
            and isinstance(shape, list | tuple) and all(type(s) is int and s >= 0 for s in shape)
            and isinstance(data, int | memoryview | bytes | dict))


class OmniMsgpackDecoder(MsgpackDecoder):
    """vLLM's ``MsgpackDecoder`` for ``OmniEngineCoreOutputs`` that restores multimodal tensors and
    resolves spans (module docstring)."""

    def __init__(self, t: Any = OmniEngineCoreOutputs, **kwargs):
        super().__init__(t, **kwargs)
        self.messages = 0  # decoded so far, with their bytes (every frame), the whole decoding time
        self.bytes = 0  # and the share spent on the multimodal channel's tensors and spans
        self.seconds = 0.0
        self.multimodal_seconds = 0.0

    def decode(self, bufs: bytestr | Sequence[bytestr]) -> Any:
        t0 = time.perf_counter()
        if isinstance(bufs, bytestr):  # type: ignore[arg-type]
            bufs = (bufs,)
        self.messages += 1
        self.bytes += sum(memoryview(b).nbytes for b in bufs)
        self.aux_buffers = bufs
        try:
            out = self.decoder.decode(bufs[0])
            t1 = time.perf_counter()
            if isinstance(out, OmniEngineCoreOutputs):
                for eco in out.outputs:
                    mm = eco.multimodal_output
                    if mm:
                        eco.multimodal_output = {k: self._tensor_or_error(v, eco.request_id, k)
                                                 if _is_tensor_triple(v) else v for k, v in mm.items()}
                if out.multimodal_buffer is not None:
                    resolve_spans(out)
            t2 = time.perf_counter()
            self.multimodal_seconds += t2 - t1
            self.seconds += t2 - t0
            return out
        finally:
            self.aux_buffers = ()

    def _tensor_or_error(self, triple: Any, request_id: str, key: str) -> torch.Tensor | TensorAccumulationError:
        """The tensor a ``[dtype, shape, data]`` triple of this message stands for, or the error that
        says why it cannot be one (checked before vLLM's tensor decoding, which would raise for the
        whole frame)."""
        dtype, shape, data = triple
        if isinstance(data, int):
            if not 0 <= data < len(self.aux_buffers):
                return TensorAccumulationError(f"tensor buffer index {data} outside the message's "
                                               f"{len(self.aux_buffers)} buffers", request_id=request_id, key=key)
            nbytes = memoryview(self.aux_buffers[data]).nbytes
        elif isinstance(data, bytes | memoryview):
            nbytes = memoryview(data).nbytes
        else:
            return TensorAccumulationError(f"tensor data of type {type(data).__name__} is not a buffer of the "
                                           "message", request_id=request_id, key=key)
        expected = math.prod(shape) * getattr(torch, dtype).itemsize
        if nbytes != expected:
            return TensorAccumulationError(f"a {dtype} tensor of shape {list(shape)} needs {expected} bytes, its "
                                           f"buffer holds {nbytes}", request_id=request_id, key=key)
        return self._decode_tensor(triple)
