"""``MultimodalPayload`` and ``MultimodalCompletionOutput`` through vLLM's msgpack encoder.

Stages hand payloads to each other with vLLM's own ``MsgpackEncoder``/``MsgpackDecoder`` (tensors as
zero-copy side buffers). A payload is mapped onto a typed msgspec struct first, so every tensor
decodes as a tensor (an ``Any``-typed value would decode as its raw triple): tensors, lists of
tensors (APPEND_LIST keys), 0-d tensors in the metadata, and plain metadata values each have their
own field, and the key order (which ``primary_tensor`` follows) is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, bytestr

from ..payload import MultimodalPayload
from .outputs import MultimodalCompletionOutput


class PayloadWire(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    order: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    tensor_lists: dict[str, list[torch.Tensor]] = {}
    other_lists: dict[str, list[Any]] = {}
    meta_order: list[str] = []
    meta_tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}

    @classmethod
    def from_payload(cls, p: MultimodalPayload) -> PayloadWire:
        wire = cls(order=list(p.tensors), meta_order=list(p.metadata))
        for key, value in p.tensors.items():
            if isinstance(value, torch.Tensor):
                wire.tensors[key] = value
            elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
                wire.tensor_lists[key] = value
            else:
                wire.other_lists[key] = list(value)
        for key, value in p.metadata.items():
            (wire.meta_tensors if isinstance(value, torch.Tensor) else wire.metadata)[key] = value
        return wire

    def to_payload(self) -> MultimodalPayload:
        tensors = {**self.tensors, **self.tensor_lists, **self.other_lists}
        meta = {**self.meta_tensors, **self.metadata}
        return MultimodalPayload(tensors={k: tensors[k] for k in self.order},
                                 metadata={k: meta[k] for k in self.meta_order})


class CompletionWire(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    multimodal: PayloadWire | None = None


def encode_payload(payload: MultimodalPayload, encoder: MsgpackEncoder | None = None) -> Sequence[bytestr]:
    return (encoder or MsgpackEncoder()).encode(PayloadWire.from_payload(payload))


def decode_payload(bufs: bytestr | Sequence[bytestr]) -> MultimodalPayload:
    return MsgpackDecoder(PayloadWire).decode(bufs).to_payload()


def encode_completion(out: MultimodalCompletionOutput, encoder: MsgpackEncoder | None = None) -> Sequence[bytestr]:
    """A completion output with its payload (logprobs are not carried between stages)."""
    wire = CompletionWire(index=out.index, text=out.text, token_ids=list(out.token_ids),
                          cumulative_logprob=out.cumulative_logprob, finish_reason=out.finish_reason,
                          stop_reason=out.stop_reason,
                          multimodal=None if out.multimodal_output is None else
                          PayloadWire.from_payload(out.multimodal_output))
    return (encoder or MsgpackEncoder()).encode(wire)


def decode_completion(bufs: bytestr | Sequence[bytestr]) -> MultimodalCompletionOutput:
    w = MsgpackDecoder(CompletionWire).decode(bufs)
    return MultimodalCompletionOutput(index=w.index, text=w.text, token_ids=w.token_ids,
                                      cumulative_logprob=w.cumulative_logprob, logprobs=None,
                                      finish_reason=w.finish_reason, stop_reason=w.stop_reason,
                                      multimodal_output=None if w.multimodal is None else w.multimodal.to_payload())
