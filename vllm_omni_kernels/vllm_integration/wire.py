"""The multimodal channel on vLLM's engine-core wire (RFC part I.2) and the decoder that keeps it.

``OmniEngineCoreOutput`` appends to vLLM's ``EngineCoreOutput`` (an ``array_like`` msgspec struct):

* ``multimodal_output``: ``{key: tensor or metadata}`` a producer sends as plain per-step chunks
  (the frontend accumulates them);
* ``multimodal_error``: the worker failed the request's output (``MultimodalError``); the frontend
  fails the request visibly with a ``TensorAccumulationError`` (an ``OutputMemoryError`` when the
  worker's output memory was full).

and ``OmniEngineCoreOutputs`` (the message) the data the worker accumulated and that is due now:
``multimodal_buffer``, one host tensor for the whole step (a single zero-copy frame in vLLM's
encoder, however many requests it serves), and ``multimodal_regions``: per key the requests whose
data lies back to back in it and their frame counts (``MultimodalRegion``), so the engine core
builds nothing per request and the client cuts every request's tensor with one ``split`` per key.

Absent fields cost nothing (trailing defaults are omitted), and frames without them (plain
``EngineCoreOutput``) decode as vLLM's own.

vLLM's client decodes every frame as ``EngineCoreOutputs``: decoded that way the fields would be
dropped, and a tensor under ``Any`` arrives as its raw ``[dtype, shape, buffer index]`` triple whose
buffer is gone once ``decode`` returns. ``OmniMsgpackDecoder`` decodes into ``OmniEngineCoreOutputs``,
turns those triples back into tensors while the message's buffers are at hand (zero-copy, as vLLM
does) and cuts the regions into views of the step's buffer, handing each output its own
(``multimodal_delivered``: ``{key: (axis, tensor)}``, filled on the receiving side only;
``resolve_regions``, which the in-process client calls on the scheduler's own objects). The client
subclasses in ``client.py`` hold this decoder from construction.

Bad data never costs another request its output: a triple that cannot be a tensor of this message
(data not a buffer of it, an index past its buffers, a size that does not match the shape) becomes
a ``TensorAccumulationError`` in place of the value, and a region that does not fit its buffer
fails the requests it names (``multimodal_error``); the frame's other outputs are delivered.
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

from ..errors import OutputMemoryError, TensorAccumulationError
from ..profiling import nvtx_range
from ..serving.worker_accumulator import split_region


class MultimodalRegion(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """One key's data for several requests, back to back in the message's buffer from byte
    ``offset`` on: ``request_ids[i]`` has ``frames[i]`` frames of ``dtype``, shaped ``[*frame, n]``
    (``axis`` -1: CONCAT_LAST) or ``[n, *frame]`` (``axis`` 0: CONCAT_DIM0)."""

    key: str
    dtype: str
    frame: list[int]
    axis: int
    offset: int
    request_ids: list[str]
    frames: list[int]


class MultimodalError(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Why the worker failed a request's multimodal output (``key``: the key concerned, if one;
    ``out_of_memory``: its output memory was full, ``OutputMemoryError``)."""

    message: str
    key: str | None = None
    out_of_memory: bool = False

    @classmethod
    def of(cls, exc: TensorAccumulationError) -> MultimodalError:
        return cls(exc.reason, exc.key, isinstance(exc, OutputMemoryError))

    def to_exception(self, request_id: str) -> TensorAccumulationError:
        cls = OutputMemoryError if self.out_of_memory else TensorAccumulationError
        return cls(self.message, request_id=request_id, key=self.key)


class OmniEngineCoreOutput(EngineCoreOutput, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutput`` plus the dedicated multimodal channel (module docstring);
    ``pooling_output`` keeps vLLM's meaning (pooling tensors only)."""

    multimodal_output: dict[str, Any] | None = None
    multimodal_error: MultimodalError | None = None
    multimodal_delivered: dict[str, Any] | None = None  # receiving side only: {key: (axis, tensor)}

    @classmethod
    def from_base(cls, base: EngineCoreOutput, multimodal_output: dict[str, Any] | None = None,
                  error: MultimodalError | None = None) -> OmniEngineCoreOutput:
        """``base`` with the multimodal fields (every field of ``base`` carried over; empty ones as None)."""
        fields = {name: getattr(base, name) for name in base.__struct_fields__}
        return cls(**fields, multimodal_output=multimodal_output or None, multimodal_error=error)


class OmniEngineCoreOutputs(EngineCoreOutputs, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutputs`` whose outputs decode as ``OmniEngineCoreOutput``, with the step's buffer
    of worker-accumulated data (uint8, host memory) and the regions of it (module docstring)."""

    outputs: list[OmniEngineCoreOutput] = []
    multimodal_buffer: torch.Tensor | None = None
    multimodal_regions: list[MultimodalRegion] | None = None


def resolve_regions(outputs: OmniEngineCoreOutputs, decoded: bool = False) -> None:
    """Give every output its pieces of the message's regions (``multimodal_delivered``), views of
    ``multimodal_buffer`` cut with one ``split`` per region. A region that does not fit the buffer
    (unknown dtype, frames past its end, an offset its dtype cannot start at) fails the requests it
    names (``multimodal_error``). An output of a request with data that is vLLM's plain
    ``EngineCoreOutput`` (the scheduler's own objects, in process) becomes an ``OmniEngineCoreOutput``
    (``decoded``: the message came through ``OmniMsgpackDecoder``, whose outputs all are)."""
    regions = outputs.multimodal_regions
    if not regions:
        return
    buffer = outputs.multimodal_buffer
    if buffer is None:
        buffer = torch.empty(0, dtype=torch.uint8)
    ecos = outputs.outputs
    if not decoded and not all(isinstance(eco, OmniEngineCoreOutput) for eco in ecos):
        ecos[:] = [eco if isinstance(eco, OmniEngineCoreOutput) else OmniEngineCoreOutput.from_base(eco)
                   for eco in ecos]
    by_id = {eco.request_id: eco for eco in ecos}
    failed = []
    for region in regions:
        try:
            pieces = _cut(buffer, region)
        except ValueError as exc:
            for rid in region.request_ids:
                eco = by_id.get(rid)
                if eco is not None:
                    eco.multimodal_error = MultimodalError(str(exc), key=region.key)
                    failed.append(eco)
            continue
        key, axis = region.key, region.axis
        for rid, piece in zip(region.request_ids, pieces):
            eco = by_id.get(rid)
            if eco is None:
                continue  # another client's request
            if eco.multimodal_delivered is None:
                eco.multimodal_delivered = {key: (axis, piece)}
            else:
                eco.multimodal_delivered[key] = (axis, piece)
    for eco in failed:  # none of a failed request's data is handed on
        eco.multimodal_delivered = None


def _cut(buffer: torch.Tensor, region: MultimodalRegion) -> list[torch.Tensor]:
    dtype = _DTYPES.get(region.dtype)
    frame = region.frame
    if dtype is None or region.axis not in (0, -1) or not all(type(s) is int and s > 0 for s in frame) \
            or len(region.frames) != len(region.request_ids) or not all(type(n) is int and n >= 0 for n in region.frames):
        raise ValueError(f"malformed region of {region.dtype!r}, frame {frame}, axis {region.axis}")
    item = dtype.itemsize
    end = region.offset + sum(region.frames) * math.prod(frame) * item
    if region.offset < 0 or region.offset % item or end > buffer.numel():
        raise ValueError(f"a region of bytes {region.offset}..{end} does not fit the step's buffer of "
                         f"{buffer.numel()} bytes on a {item}-byte boundary")
    return split_region(buffer, dtype, frame, region.axis, region.offset, region.frames)


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
                with nvtx_range("frontend.decode_multimodal"):
                    for eco in [eco for eco in out.outputs if eco.multimodal_output]:
                        eco.multimodal_output = {k: self._restore(v, eco.request_id, k)
                                                 for k, v in eco.multimodal_output.items()}
                    resolve_regions(out, decoded=True)
            t2 = time.perf_counter()
            self.multimodal_seconds += t2 - t1
            self.seconds += t2 - t0
            return out
        finally:
            self.aux_buffers = ()

    def _restore(self, value: Any, request_id: str, key: str) -> Any:
        """A plain value with each tensor in it a tensor again, at any depth of lists and dicts (vLLM's
        encoder makes every tensor a ``[dtype, shape, data]`` triple; its decoder restores only
        fields typed as tensors), or the error of the first triple that cannot be one."""
        if _is_tensor_triple(value):
            return self._tensor_or_error(value, request_id, key)
        if isinstance(value, dict):
            items = list(zip(value, (self._restore(v, request_id, key) for v in value.values())))
        elif isinstance(value, list | tuple):
            items = list(enumerate(self._restore(v, request_id, key) for v in value))
        else:
            return value
        error = next((v for _, v in items if isinstance(v, TensorAccumulationError)), None)
        if error is not None:
            return error
        return dict(items) if isinstance(value, dict) else [v for _, v in items]

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
