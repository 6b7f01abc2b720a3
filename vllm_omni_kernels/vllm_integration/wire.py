"""The multimodal field on vLLM's engine-core wire (RFC part I.2) and the decoder that keeps it.

``OmniEngineCoreOutput`` adds ``multimodal_output: dict[str, Any] | None`` as the last field of
vLLM's ``EngineCoreOutput`` (an ``array_like`` msgspec struct). An empty payload is stored as None;
vLLM's frames keep every position (its own None fields are encoded as nil too), so the field costs
one nil byte when absent, and frames without it (plain ``EngineCoreOutput``) decode as before.

vLLM's client decodes every frame as ``EngineCoreOutputs``, whose outputs are plain
``EngineCoreOutput``: decoded that way the field would be dropped, and even decoded into our type a
tensor under an ``Any`` annotation arrives as its raw ``[dtype, shape, buffer index]`` triple, whose
buffer is gone once ``decode`` returns. ``OmniMsgpackDecoder`` decodes into ``OmniEngineCoreOutputs``
and turns those triples back into tensors while the message's buffers are still at hand (zero-copy
for large tensors, as vLLM does). ``install_omni_decoder(client)`` puts it into a vLLM core client.

Anything under ``multimodal_output`` that is not a tensor triple is left as decoded (metadata such as
the sample rate). A triple that cannot be a tensor of this message (its data not a buffer of it, an
index past its buffers, a size that does not match the shape) becomes a ``TensorAccumulationError``
naming the request and key, in place of the value: the output processor counts it for that request
only, and the frame's other outputs are delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import math

import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, bytestr

from ..errors import TensorAccumulationError


class OmniEngineCoreOutput(EngineCoreOutput, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutput`` plus the dedicated multimodal channel; ``pooling_output`` keeps vLLM's
    meaning (pooling tensors only). ``multimodal_output`` is ``{key: tensor or metadata}``, or None
    when there is none (an empty dict is stored as None)."""

    multimodal_output: dict[str, Any] | None = None

    @classmethod
    def from_base(cls, base: EngineCoreOutput, multimodal_output: dict[str, Any] | None) -> OmniEngineCoreOutput:
        """``base`` with ``multimodal_output`` (every field of ``base`` carried over)."""
        fields = {name: getattr(base, name) for name in base.__struct_fields__}
        return cls(**fields, multimodal_output=multimodal_output or None)


class OmniEngineCoreOutputs(EngineCoreOutputs, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutputs`` whose outputs decode as ``OmniEngineCoreOutput``."""

    outputs: list[OmniEngineCoreOutput] = []


def _is_tensor_triple(value: Any) -> bool:
    if not (isinstance(value, list | tuple) and len(value) == 3):
        return False
    dtype, shape, data = value
    return (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
            and isinstance(shape, list | tuple) and all(type(s) is int and s >= 0 for s in shape)
            and isinstance(data, int | memoryview | bytes | dict))


class OmniMsgpackDecoder(MsgpackDecoder):
    """vLLM's ``MsgpackDecoder`` for ``OmniEngineCoreOutputs`` that restores multimodal tensors."""

    def __init__(self, t: Any = OmniEngineCoreOutputs, **kwargs):
        super().__init__(t, **kwargs)

    def decode(self, bufs: bytestr | Sequence[bytestr]) -> Any:
        if isinstance(bufs, bytestr):  # type: ignore[arg-type]
            bufs = (bufs,)
        self.aux_buffers = bufs
        try:
            out = self.decoder.decode(bufs[0])
            for eco in out.outputs if isinstance(out, OmniEngineCoreOutputs) else ():
                mm = eco.multimodal_output
                if mm:
                    eco.multimodal_output = {k: self._tensor_or_error(v, eco.request_id, k)
                                             if _is_tensor_triple(v) else v for k, v in mm.items()}
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


def install_omni_decoder(client: Any) -> None:
    """Make a vLLM multiprocess core client (``SyncMPClient``, ``AsyncMPClient``, ...) decode
    engine-core frames with ``OmniMsgpackDecoder`` (its own ``decoder`` is typed on plain
    ``EngineCoreOutputs``). Call right after the client is constructed."""
    if not hasattr(client, "decoder"):
        raise TypeError(f"{type(client).__name__} has no engine-core output decoder to replace")
    client.decoder = OmniMsgpackDecoder()
