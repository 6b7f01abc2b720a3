"""The multimodal channel on vLLM's msgpack wire (RFC part I.2): the engine core's messages and the
decoder that keeps the channel, and payloads handed between stages.

``OmniEngineCoreOutput`` adds to vLLM's ``EngineCoreOutput`` ``multimodal_output`` (plain per-step
``{key: tensor or metadata}``, accumulated by the frontend) and ``multimodal_error`` (the worker
failed the request's output). ``OmniEngineCoreOutputs`` (the message) adds the worker's data due
this step: ``multimodal_buffer``, one host tensor for the whole step (one zero-copy frame in vLLM's
encoder), and ``multimodal_regions``, per key the requests whose data lies back to back in it, so
the client cuts every request's tensor with one ``split`` per key. Absent fields cost nothing, and
frames without them decode as vLLM's own.

vLLM's client decodes every frame as ``EngineCoreOutputs``, dropping these fields, and a tensor
under ``Any`` arrives as a raw ``[dtype, shape, buffer index]`` triple whose buffer is gone once
``decode`` returns; a plain list of the same form would look no different. So the output also
carries ``multimodal_tensors``, where the tensors of ``multimodal_output`` are (each a path of keys
and indices), made when the output is built, and ``OmniMsgpackDecoder`` restores exactly those,
while the buffers are at hand (zero-copy): every other value arrives as it was sent. It also cuts
the regions into each output's ``multimodal_delivered`` (``{key: (axis, tensor)}``, receiving side
only). Bad data never costs another request its output: the scheduler fails a request whose
values the wire would not carry as they are (``tensor_paths(check=True)``; a tensor of one element
or none that vLLM's encoder refuses only for its strides goes as a copy), a path that leads to
no tensor of this message makes a ``TensorAccumulationError`` the value of its key, and a region
that does not fit its buffer fails the requests it names (``multimodal_error``).

``encode_payload``/``encode_completion`` and their decoders carry a ``MultimodalPayload`` or a
``MultimodalCompletionOutput`` between stages through vLLM's encoder, on typed structs so that every
tensor decodes as a tensor and the key order (``primary_tensor``) is kept.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, bytestr

from ..errors import OutputMemoryError, OutputTooLargeError, TensorAccumulationError
from ..payload import MultimodalPayload
from ..profiling import nvtx_range
from ..serving.worker_accumulator import split_region
from .outputs import MultimodalCompletionOutput


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
    ``out_of_memory``: its output memory was full, ``OutputMemoryError``; ``too_large``: it could
    never hold the request, ``OutputTooLargeError``)."""

    message: str
    key: str | None = None
    out_of_memory: bool = False
    too_large: bool = False

    @classmethod
    def of(cls, exc: TensorAccumulationError) -> MultimodalError:
        return cls(exc.reason, exc.key, isinstance(exc, OutputMemoryError), isinstance(exc, OutputTooLargeError))

    def to_exception(self, request_id: str) -> TensorAccumulationError:
        cls = OutputMemoryError if self.out_of_memory else OutputTooLargeError if self.too_large else \
            TensorAccumulationError
        return cls(self.message, request_id=request_id, key=self.key)


class OmniEngineCoreOutput(EngineCoreOutput, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutput`` plus the dedicated multimodal channel (module docstring);
    ``pooling_output`` keeps vLLM's meaning (pooling tensors only)."""

    multimodal_output: dict[str, Any] | None = None
    multimodal_error: MultimodalError | None = None
    multimodal_delivered: dict[str, Any] | None = None  # receiving side only: {key: (axis, tensor)}
    multimodal_tensors: list[list[str | int]] | None = None  # where multimodal_output's tensors are
    # receiving side only: the engine core's times of the earlier steps that made the tokens held
    # back for its audio that come on this output, one per token (the message's ``token_times``)
    held_times: list[float] | None = None
    tokens_held: int = 0  # tokens of paced requests the engine core held, for vLLM's statistics (HeldTokens)

    def __post_init__(self) -> None:
        # Runs on construction (with the values themselves) and on decoding (where the tensors are
        # triples, and the paths came with them): the paths are found only where none were given.
        if self.multimodal_output is not None and self.multimodal_tensors is None:
            self.multimodal_tensors = tensor_paths(self.multimodal_output) or None

    @classmethod
    def from_base(cls, base: EngineCoreOutput, multimodal_output: dict[str, Any] | None = None,
                  error: MultimodalError | None = None, tensors: list | None = None) -> OmniEngineCoreOutput:
        """``base`` with the multimodal fields (every field of ``base`` carried over; empty ones as
        None); ``tensors``: ``tensor_paths(multimodal_output)``, when the caller has them."""
        fields = {name: getattr(base, name) for name in base.__struct_fields__}
        return cls(**fields, multimodal_output=multimodal_output or None, multimodal_error=error,
                   multimodal_tensors=tensors if multimodal_output else None)


class OmniEngineCoreOutputs(EngineCoreOutputs, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """``EngineCoreOutputs`` whose outputs decode as ``OmniEngineCoreOutput``, with the step's buffer
    of worker-accumulated data (uint8, host memory) and the regions of it (module docstring)."""

    outputs: list[OmniEngineCoreOutput] = []
    multimodal_buffer: torch.Tensor | None = None
    multimodal_regions: list[MultimodalRegion] | None = None
    # by request whose held tokens go on its output here, the engine core's times of the steps that
    # made them, one per token (``scheduler.HeldTokens``)
    token_times: dict[str, list[float]] | None = None


def as_omni_outputs(outputs: OmniEngineCoreOutputs) -> None:
    """vLLM's plain ``EngineCoreOutput``s of the message (the scheduler's own objects, in process)
    made ``OmniEngineCoreOutput``s, which can carry the multimodal channel."""
    ecos = outputs.outputs
    if not all(isinstance(eco, OmniEngineCoreOutput) for eco in ecos):
        ecos[:] = [eco if isinstance(eco, OmniEngineCoreOutput) else OmniEngineCoreOutput.from_base(eco)
                   for eco in ecos]


def resolve_token_times(outputs: OmniEngineCoreOutputs) -> None:
    """Give the outputs that carry held tokens their steps' times (``held_times``). The outputs must
    be ``OmniEngineCoreOutput``s (``as_omni_outputs``)."""
    times = outputs.token_times
    if times:
        for eco in outputs.outputs:
            eco.held_times = times.get(eco.request_id)


def resolve_regions(outputs: OmniEngineCoreOutputs) -> None:
    """Give every output its pieces of the message's regions (``multimodal_delivered``), views of
    ``multimodal_buffer``. A region that does not fit the buffer (unknown dtype, frames past its
    end, an offset its dtype cannot start at, a buffer that is not 1-D bytes) fails the requests it
    names (``multimodal_error``), as does a second piece of one key for a request.
    The outputs must be ``OmniEngineCoreOutput``s (``as_omni_outputs``: the scheduler's own, in
    process; the decoder makes them so)."""
    regions = outputs.multimodal_regions
    if not regions:
        return
    buffer = outputs.multimodal_buffer
    if buffer is None:
        buffer = torch.empty(0, dtype=torch.uint8)
    by_id = {eco.request_id: eco for eco in outputs.outputs}
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
                eco.multimodal_delivered = {}
            elif key in eco.multimodal_delivered:  # a request's data of a key is one piece a step
                eco.multimodal_error = MultimodalError("two pieces of the key in one step", key=key)
                failed.append(eco)
            eco.multimodal_delivered[key] = (axis, piece)
    for eco in failed:  # none of a failed request's data is handed on
        eco.multimodal_delivered = None


def _cut(buffer: torch.Tensor, region: MultimodalRegion) -> list[torch.Tensor]:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"the step's buffer is a {buffer.dtype} tensor of shape {list(buffer.shape)}, not 1-D bytes")
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
    try:
        return split_region(buffer, dtype, frame, region.axis, region.offset, region.frames)
    except (RuntimeError, TypeError, OverflowError) as exc:  # no frames, of a shape no tensor has
        raise ValueError(f"malformed region of {region.dtype!r}, frame {frame}: {exc}") from None


# dtypes by name; no quantized one (qint8, quint4x2, ...: the names that begin with "q"), whose data is
# not its bytes alone (a scale and zero point go with it)
_DTYPES = {name: dtype for name, dtype in vars(torch).items()
           if isinstance(dtype, torch.dtype) and not name.startswith("q")}


# Values carried as they are: these types exactly (np.float64, a float subclass, is refused by the
# encoder; an int past 64 bits by ``_check_encodes`` before the walk looks at types).
_PLAIN = frozenset((type(None), bool, int, float, str, bytes))
_DECODED_KEPT = 65536  # messages whose decoding time the decoder keeps (the newest)
_MAX_DEPTH = 512  # containers within containers that ``tensor_paths`` looks into (a value holding itself stops)


def _tensor_or_refuse(obj: Any) -> None:
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"a value of type {type(obj).__name__}")
    if obj.layout is not torch.strided or obj.is_meta or obj.is_nested or obj.is_quantized:
        raise TypeError(f"a tensor of layout {obj.layout} on {obj.device} (quantized: {obj.is_quantized}): tensors go "
                        "as strided memory")
    if obj.is_conj() or obj.is_neg():  # vLLM's encoder reads the memory (numpy refuses the lazy view)
        raise TypeError("a lazily conjugated or negated tensor: resolve_conj() / resolve_neg() it first")
    return None  # vLLM's encoder writes it as a [dtype, shape, data] list


# msgspec's msgpack encoding, as vLLM's encoder runs it, of everything but the tensors: whether a value
# can be carried (strings that are not UTF-8, ints past 64 bits, depth, types it refuses).
_STRUCTURE = msgspec.msgpack.Encoder(enc_hook=_tensor_or_refuse)
_UNCARRIED = (TypeError, ValueError, OverflowError, RecursionError)


def tensor_paths(values: Any, check: bool = False) -> list[list[str | int]]:
    """Where the tensors are in a ``{key: value}`` dict, at any depth of dicts, lists and tuples
    (down to ``_MAX_DEPTH``): each as the key and then the keys or indices that lead to it.

    Raises (``check``; else what cannot be carried is passed over):
        TensorAccumulationError: naming the key, for what vLLM's wire would not carry as it is (the
            engine core's encoder would fail the whole step, or the client's decoder every request of
            the message): ``values`` not a dict or a key of it not a str, a dict below it with a key
            neither a str nor an int, a str that is not UTF-8, an int beyond 64 bits, nesting past
            what the encoder takes (or a value that holds itself), a tensor that is not strided
            memory, or a value other than a tensor, None, a bool, an int, a float, a str, bytes, a
            list, a tuple (it arrives as a list) or a dict.
    """
    if not isinstance(values, dict):
        if check:
            raise TensorAccumulationError(f"a multimodal output is a {{key: value}} dict, not a "
                                          f"{type(values).__name__}")
        return []
    if check:
        _check_encodes(values)
    paths: list[list[str | int]] = []
    stack: list[tuple[Any, list[str | int]]] = [(values, [])]  # (a dict, list or tuple, its path)
    while stack:
        value, path = stack.pop()
        is_dict = isinstance(value, dict)
        for k, v in value.items() if is_dict else enumerate(value):
            if check and is_dict and not (type(k) is str or (path and type(k) is int)):
                raise TensorAccumulationError(f"key {k!r} of a {type(k).__name__}: keys are strings (or ints below "
                                              "the top)", key=path[0] if path else None)
            if isinstance(v, torch.Tensor):
                paths.append([*path, k])
            elif isinstance(v, dict | list | tuple):
                if len(path) < _MAX_DEPTH:
                    stack.append((v, [*path, k]))
            elif check and type(v) not in _PLAIN:
                raise TensorAccumulationError(f"a value of type {type(v).__name__} at {[*path, k]}: the wire carries "
                                              "tensors and plain values (None, bool, int, float, str, bytes, lists, "
                                              "dicts)", key=path[0] if path else k)
    return paths


def carried_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a tensor of at most one element whose flattened stride is not 1 (one sample of
    a strided channel) a contiguous copy: vLLM's encoder views the flattened memory as bytes, which
    such a tensor refuses (torch counts it contiguous, so ``contiguous()`` keeps its stride), failing
    the whole message."""
    if t.numel() <= 1 and t.dim() and t.reshape(-1).stride(0) != 1:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def with_carried_tensors(values: dict, paths: list[list[str | int]]) -> dict:
    """``values`` with each tensor at ``paths`` (``tensor_paths``) as ``carried_tensor`` makes it; the
    dicts and lists that lead to a tensor it copies are copied (a tuple as a list, as it arrives),
    the caller's left as they are."""
    for path in paths:
        tensor = _holder(values, path)[path[-1]]
        carried = carried_tensor(tensor)
        if carried is not tensor:
            values = _replaced(values, path, carried)
    return values


def _replaced(root: Any, path: list[str | int], value: Any) -> Any:
    if not path:
        return value
    copy = dict(root) if isinstance(root, dict) else list(root)
    copy[path[0]] = _replaced(root[path[0]], path[1:], value)
    return copy


def _check_encodes(values: dict) -> None:
    """TensorAccumulationError, naming the key where one is to blame, unless msgspec's encoder takes
    ``values`` with its tensors left out (``_STRUCTURE``)."""
    try:
        _STRUCTURE.encode(values)
        return
    except _UNCARRIED as exc:
        whole = exc
    for k, v in values.items():
        try:
            _STRUCTURE.encode(k)
            _STRUCTURE.encode(v)
        except _UNCARRIED as exc:
            raise TensorAccumulationError(f"vLLM's wire cannot carry the value: {exc}",
                                          key=k if type(k) is str and k.isprintable() else None) from None
    raise TensorAccumulationError(f"vLLM's wire cannot carry the output: {whole}")


def _is_tensor_triple(value: Any) -> bool:
    if not (isinstance(value, list | tuple) and len(value) == 3):
        return False
    dtype, shape, data = value
    return (isinstance(dtype, str) and dtype in _DTYPES
            and isinstance(shape, list | tuple) and all(type(s) is int and s >= 0 for s in shape)
            and isinstance(data, int | memoryview | bytes | dict))


class OmniMsgpackDecoder(MsgpackDecoder):
    """vLLM's ``MsgpackDecoder`` for ``OmniEngineCoreOutputs`` that restores multimodal tensors and
    resolves regions (module docstring). Counts the messages decoded, their bytes (every frame), the
    decoding time and the multimodal channel's share of it; ``decoded_at`` holds the newest
    messages' (engine core timestamp, ``time.monotonic()`` when decoding began)."""

    def __init__(self):
        super().__init__(OmniEngineCoreOutputs)
        self.messages = 0
        self.bytes = 0
        self.seconds = 0.0
        self.multimodal_seconds = 0.0
        self.decoded_at: collections.deque[tuple[float, float]] = collections.deque(maxlen=_DECODED_KEPT)

    def decode(self, bufs: bytestr | Sequence[bytestr]) -> Any:
        t0 = time.perf_counter()
        if isinstance(bufs, bytestr):  # type: ignore[arg-type]
            bufs = (bufs,)
        self.messages += 1
        self.bytes += sum(memoryview(b).nbytes for b in bufs)
        self.aux_buffers = bufs
        try:
            decoding = time.monotonic()
            out = self.decoder.decode(bufs[0])
            t1 = time.perf_counter()
            if isinstance(out, OmniEngineCoreOutputs):
                self.decoded_at.append((out.timestamp, decoding))
                with nvtx_range("frontend.decode_multimodal"):
                    for eco in out.outputs:
                        if eco.multimodal_tensors and eco.multimodal_output is not None:
                            self._restore(eco)
                    resolve_regions(out)
                    resolve_token_times(out)
            t2 = time.perf_counter()
            self.multimodal_seconds += t2 - t1
            self.seconds += t2 - t0
            return out
        finally:
            self.aux_buffers = ()

    def _restore(self, eco: OmniEngineCoreOutput) -> None:
        """Each tensor of ``eco.multimodal_output`` a tensor again, where ``multimodal_tensors`` says
        (vLLM's encoder makes every tensor a ``[dtype, shape, data]`` triple; its decoder restores
        only fields typed as tensors); a key with a path that leads to no tensor of this message
        gets its error as its value instead."""
        values, rid = eco.multimodal_output, eco.request_id
        for path in eco.multimodal_tensors:
            if not path or type(path[0]) is not str:  # a damaged frame: no key to blame
                eco.multimodal_output = None
                eco.multimodal_error = MultimodalError(f"a tensor's place {path} names no key of its output")
                return
            key = path[0]
            if isinstance(values.get(key), TensorAccumulationError):
                continue  # the key failed already
            try:
                parent = _holder(values, path)
                restored = self._tensor_or_error(parent[path[-1]], rid, key)
            except (KeyError, IndexError, TypeError):
                restored = TensorAccumulationError(f"no value at {path}, where the message has a tensor",
                                                   request_id=rid, key=key)
            if isinstance(restored, TensorAccumulationError):
                values[key] = restored
            else:
                parent[path[-1]] = restored

    def _tensor_or_error(self, triple: Any, request_id: str, key: str) -> torch.Tensor | TensorAccumulationError:
        """The tensor a ``[dtype, shape, data]`` triple of this message stands for, or the error that
        says why it cannot be one (checked before vLLM's tensor decoding, which would raise for the
        whole frame)."""
        if not _is_tensor_triple(triple):
            return TensorAccumulationError(f"a {type(triple).__name__} where the message has a tensor",
                                           request_id=request_id, key=key)
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
        expected = math.prod(shape) * _DTYPES[dtype].itemsize
        if nbytes != expected:
            return TensorAccumulationError(f"a {dtype} tensor of shape {list(shape)} needs {expected} bytes, its "
                                           f"buffer holds {nbytes}", request_id=request_id, key=key)
        try:
            return self._decode_tensor(triple)
        except (RuntimeError, ValueError, OverflowError) as exc:  # a shape no tensor has (its strides overflow)
            return TensorAccumulationError(f"a {dtype} tensor of shape {list(shape)}: {exc}", request_id=request_id,
                                           key=key)


class PayloadWire(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    """A ``MultimodalPayload`` on typed fields, so that every tensor decodes as one: those inside the
    plain values (``other_lists``, ``metadata``) travel in ``nested``, each put back where
    ``nested_paths`` says (the field, then keys and indices); a tuple arrives as a list. ``axes``:
    the payload's (the axis each tensor grows along, which ``MultimodalPayload.merge`` follows)."""

    order: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    tensor_lists: dict[str, list[torch.Tensor]] = {}
    other_lists: dict[str, list[Any]] = {}
    meta_order: list[str] = []
    meta_tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    nested: list[torch.Tensor] = []
    nested_paths: list[list[str | int]] = []
    axes: dict[str, int] = {}

    @classmethod
    def from_payload(cls, p: MultimodalPayload) -> PayloadWire:
        """The payload's wire form. Raises ``TensorAccumulationError`` naming the key for a value
        vLLM's encoder would not carry as it is (``tensor_paths(check=True)``)."""
        wire = cls(order=list(p.tensors), meta_order=list(p.metadata), axes=dict(p.axes))
        tensors, metadata = (with_carried_tensors(values, tensor_paths(values, check=True))
                             for values in (dict(p.tensors), dict(p.metadata)))
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor):
                wire.tensors[key] = value
            elif isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
                wire.tensor_lists[key] = value
            else:
                wire.other_lists[key] = list(value)
        for key, value in metadata.items():
            (wire.meta_tensors if isinstance(value, torch.Tensor) else wire.metadata)[key] = value
        wire.other_lists = _lifted(wire.other_lists, ["other_lists"], wire.nested, wire.nested_paths)
        wire.metadata = _lifted(wire.metadata, ["metadata"], wire.nested, wire.nested_paths)
        return wire

    def to_payload(self) -> MultimodalPayload:
        for path, tensor in zip(self.nested_paths, self.nested):
            _holder(getattr(self, str(path[0])), path[1:])[path[-1]] = tensor
        tensors = {**self.tensors, **self.tensor_lists, **self.other_lists}
        meta = {**self.meta_tensors, **self.metadata}
        return MultimodalPayload(tensors={k: tensors[k] for k in self.order},
                                 metadata={k: meta[k] for k in self.meta_order}, axes=dict(self.axes))


def _holder(root: Any, path: list[str | int]) -> Any:
    """The dict or list below ``root`` that holds the value at ``path`` (keys and indices)."""
    for step in path[:-1]:
        root = root[step]
    return root


def _lifted(value: Any, path: list[str | int], tensors: list[torch.Tensor], paths: list[list[str | int]]) -> Any:
    """A copy of ``value`` with every tensor inside its dicts, lists and tuples replaced by None,
    each tensor appended to ``tensors`` and its place to ``paths``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        paths.append(path)
        return None
    if isinstance(value, dict):
        return {k: _lifted(v, [*path, k], tensors, paths) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lifted(v, [*path, i], tensors, paths) for i, v in enumerate(value)]
    return value


class CompletionWire(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    multimodal: PayloadWire | None = None


def encode_payload(payload: MultimodalPayload) -> Sequence[bytestr]:
    return MsgpackEncoder().encode(PayloadWire.from_payload(payload))


def decode_payload(bufs: bytestr | Sequence[bytestr]) -> MultimodalPayload:
    return MsgpackDecoder(PayloadWire).decode(bufs).to_payload()


def encode_completion(out: MultimodalCompletionOutput) -> Sequence[bytestr]:
    """A completion output with its payload (logprobs are not carried between stages)."""
    wire = CompletionWire(index=out.index, text=out.text, token_ids=list(out.token_ids),
                          cumulative_logprob=out.cumulative_logprob, finish_reason=out.finish_reason,
                          stop_reason=out.stop_reason,
                          multimodal=None if out.multimodal_output is None else
                          PayloadWire.from_payload(out.multimodal_output))
    return MsgpackEncoder().encode(wire)


def decode_completion(bufs: bytestr | Sequence[bytestr]) -> MultimodalCompletionOutput:
    w = MsgpackDecoder(CompletionWire).decode(bufs)
    return MultimodalCompletionOutput(index=w.index, text=w.text, token_ids=w.token_ids,
                                      cumulative_logprob=w.cumulative_logprob, logprobs=None,
                                      finish_reason=w.finish_reason, stop_reason=w.stop_reason,
                                      multimodal_output=None if w.multimodal is None else w.multimodal.to_payload())
