"""The frontend side of the separated channel (RFC parts II, IV, VI, VII).

``MultimodalOutputProcessor`` is vLLM's ``OutputProcessor`` that first reads the multimodal fields of
the step's ``OmniEngineCoreOutput``s, whatever the modality, and leaves everything else (text, pooling)
to vLLM. ``OmniRequestState``'s completion outputs are ``MultimodalCompletionOutput``s carrying the
request's payload per its output kind: DELTA what arrived since the last output, CUMULATIVE
everything so far, FINAL_ONLY everything at finish.

* The worker's data (``multimodal_delivered``, views of the step's received buffer) is handed on
  without a copy. A request's deliveries wait for its next output (vLLM skips steps:
  ``stream_interval``, FINAL_ONLY) and a key's pieces are concatenated only when more than one
  arrived; a CUMULATIVE output is a view of a ``GrowingTensor`` sized at the first piece for the
  request's ``max_tokens``.
* Plain per-step values (``multimodal_output``) are accumulated here, one batched append per device
  (``MultimodalAccumulator``: the wire's CPU tensors on the torch reference, CUDA tensors of an
  in-process engine on the ring kernels). A request's slots are freed when it finishes or is aborted.
* With ``stream_interval`` above 1 the CUMULATIVE outputs of a request with multimodal output are
  thinned as vLLM thins DELTA ones (a skipped output loses nothing: the next holds it all).

Errors: a bad value (not a tensor where one is expected, dtype or frame shape changing mid-stream,
a payload that is not a dict) or one the output memory cannot hold now is a
``TensorAccumulationError`` (``OutputMemoryError``) for that request and key: counted
(``accumulation_errors``), and the request fails visibly (its audio would have a hole), every other
request untouched. Output for a request never seen is an error only counted; output for one that
finished or was aborted (an abort races the engine's next step) is only counted (``late_outputs``).
Such a failure, a ``TensorConsolidationError``, or the worker's failure of the request
(``multimodal_error``), fails that request visibly: its generate() call raises it (AsyncLLM),
or its final ``RequestOutput`` (LLMEngine) has finish reason ``"error"`` and the error in
``stop_reason`` (a ``PoolingRequestOutput``: in ``error``); the engine core is asked to abort it. vLLM's
statistics count it finished with an error. Anything else propagates.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from vllm.exceptions import GenerationError, RetryableRequestError, VLLMValidationError
from vllm.outputs import PoolingRequestOutput, RequestError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.engine.output_processor import OutputProcessor, OutputProcessorOutput, RequestState

from ..accumulator import AccumulatorConfig, EmitPolicy, MultimodalAccumulator
from ..errors import (MultimodalOutputError, OutputMemoryError, OutputTooLargeError, TensorAccumulationError,
                      TensorConsolidationError)
from ..modality import OutputModality, TensorAccumulationStrategy, parse_strategy
from ..payload import GrowingTensor, MultimodalPayload
from ..profiling import nvtx_range
from .wire import OmniEngineCoreOutput
from .outputs import MultimodalCompletionOutput, MultimodalPoolingOutput, MultimodalRequestOutput, recast

logger = logging.getLogger(__name__)

_PRESIZE_BYTES = 64 << 20  # the most a CUMULATIVE key's tensor is sized for at its first piece
_GONE_KEPT = 65536  # finished or aborted request ids remembered, to tell a late output from a stranger


class AccumulationFailedError(TensorAccumulationError, GenerationError):
    """A ``TensorAccumulationError`` that is also vLLM's ``GenerationError``, so ``AsyncLLM.generate``
    raises it to the caller as it is (it wraps other errors in ``EngineGenerateError``) and vLLM's API
    server answers it as a server error."""


class ConsolidationFailedError(TensorConsolidationError, GenerationError):
    """``AccumulationFailedError``'s counterpart for a ``TensorConsolidationError``."""


class OutputMemoryFailedError(OutputMemoryError, AccumulationFailedError, RetryableRequestError):
    """``AccumulationFailedError``'s counterpart for an ``OutputMemoryError``: also vLLM's
    ``RetryableRequestError`` (a retry can succeed), which its API server answers with 503."""


class OutputTooLargeFailedError(OutputTooLargeError, VLLMValidationError):
    """What ``generate`` raises for an ``OutputTooLargeError``: vLLM's ``VLLMValidationError`` (the
    request asks for more than the output memory ever holds for one: no retry would succeed), which
    its API server answers with 400 naming ``max_tokens``, and ``generate`` raises as it is."""

    def __init__(self, message: str, *, request_id: str | None = None, key: str | None = None):
        super().__init__(message, request_id=request_id, key=key)
        self.parameter = "max_tokens"


def _raised_by_generate(exc: MultimodalOutputError, request_id: str) -> MultimodalOutputError:
    """``exc`` as what ``generate`` raises, naming the request by the id its caller gave."""
    cls = ConsolidationFailedError if isinstance(exc, TensorConsolidationError) else \
        OutputMemoryFailedError if isinstance(exc, OutputMemoryError) else \
        OutputTooLargeFailedError if isinstance(exc, OutputTooLargeError) else AccumulationFailedError
    return cls(exc.reason, request_id=request_id, key=exc.key)


class Stopwatch:
    """Seconds spent inside ``with stopwatch:`` blocks, summed (the processor's multimodal share)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._t0


class OmniRequestState(RequestState):
    """vLLM's ``RequestState`` with the request's multimodal output (module docstring). The fields
    below have class defaults, so a state built any way vLLM builds one works, and until the
    request's first multimodal output it behaves exactly as vLLM's."""

    accumulator: MultimodalAccumulator | None = None
    failures: list | None = None  # the processor's (state, error) of the current step
    arrived: list[dict[str, tuple[int, torch.Tensor]]] | None = None  # the worker's deliveries since the last output
    so_far: dict[str, tuple[int, Any]] | None = None  # CUMULATIVE: key -> (axis, GrowingTensor) of everything so far
    last: MultimodalPayload | None = None  # CUMULATIVE: everything so far, for outputs with nothing new
    stopwatch: Stopwatch | None = None  # the processor's, timing payload assembly
    cumulative_sent: int = 0  # CUMULATIVE: output tokens at its last output (``stream_interval``)
    upstream: bool = False  # the upstream style: CUMULATIVE at vLLM's own cadence (an output every step),
    #                         everything so far concatenated from a list at each output
    multimodal: bool = False  # the processor's output modality has multimodal output: every completion
    #                           output is a MultimodalCompletionOutput (multimodal_output None until data)
    made: weakref.ref | None = None  # the output this state made last: the one a failure marks (by
    #                                  identity: several requests may share an external id)

    @property
    def has_multimodal_output(self) -> bool:
        """Whether the request's outputs carry multimodal output: its processor's modality has it, or
        data came for it."""
        return self.multimodal or self.has_data

    @property
    def has_data(self) -> bool:
        """Whether multimodal data came for the request (from the worker, or as plain per-step values)."""
        return self.arrived is not None or self.accumulator is not None

    def add_multimodal_tensor(self, payload: Mapping[str, Any] | None) -> list[TensorAccumulationError]:
        """Accumulate one step's ``{key: value}`` for this request (the per-request form of what the
        processor does for a whole step); returns the errors (logged and counted)."""
        if payload is None:
            return []
        if self.accumulator is None:
            raise TensorAccumulationError("no accumulator: the request is not attached to a processor",
                                          request_id=self.request_id)
        return self.accumulator.append_step([self.request_id], {k: [v] for k, v in payload.items()})

    def deliver(self, pieces: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Keep one delivery of the worker's data (``{key: (axis, tensor)}``) for the next output."""
        if self.arrived is None:
            self.arrived = []
        self.arrived.append(pieces)

    def take_payload(self, finished: bool) -> MultimodalPayload | None:
        """The payload due now (per output kind): the worker's pieces, then what the accumulator
        holds; frees the request's slots when ``finished``. A CUMULATIVE output with nothing new
        since the last one shares that one's payload."""
        if not self.arrived and self.accumulator is None:
            return self.last  # the common step of a stream between deliveries
        with self.stopwatch or contextlib.nullcontext():
            payload = None
            cumulative = self.output_kind == RequestOutputKind.CUMULATIVE
            if self.arrived:
                arrived, self.arrived = self.arrived, []
                payload = self._so_far(arrived) if cumulative else self._joined(arrived)
            elif cumulative and self.so_far:  # nothing new from the worker: still everything so far
                payload = self._so_far([])
            acc = self.accumulator
            if acc is not None and self.request_id in acc:
                own = acc.collect([self.request_id] if finished else (), request_ids=[self.request_id])
                own = own.get(self.request_id)
                if own and payload is not None:
                    for key, value in own.tensors.items():
                        if key in payload.tensors:
                            raise TensorConsolidationError("the key came both from the worker and as per-step "
                                                           "values", request_id=self.request_id, key=key)
                        payload.tensors[key] = value
                        if key in own.axes:
                            payload.axes[key] = own.axes[key]
                    payload.metadata.update(own.metadata)
                elif own:
                    payload = own
            if cumulative and self.accumulator is None:
                self.last = payload or None
            return payload if payload else None

    def _joined(self, arrived: list[dict[str, tuple[int, torch.Tensor]]]) -> MultimodalPayload:
        """DELTA and FINAL_ONLY: the deliveries since the last output, a key's pieces concatenated."""
        if len(arrived) == 1:  # the common output: one delivery, its pieces as they are
            pieces = arrived[0]
            return MultimodalPayload({key: t for key, (_, t) in pieces.items()},
                                     axes={key: axis for key, (axis, _) in pieces.items()})
        tensors, axes = {}, {}
        for key in dict.fromkeys(key for pieces in arrived for key in pieces):
            got = [pieces[key] for pieces in arrived if key in pieces]
            axes[key] = axis = got[0][0]
            tensors[key] = self._cat(key, [t for _, t in got], axis)
        return MultimodalPayload(tensors, axes=axes)

    def _so_far(self, arrived: list[dict[str, tuple[int, torch.Tensor]]]) -> MultimodalPayload:
        """CUMULATIVE: the deliveries appended to everything so far (views of a ``GrowingTensor`` per
        key, sized at the first piece for ``max_tokens``; in the upstream style, a list concatenated
        anew)."""
        if self.so_far is None:
            self.so_far = {}
        for pieces in arrived:
            for key, (axis, tensor) in pieces.items():
                held = self.so_far.get(key)
                if held is None:
                    self.so_far[key] = (axis, [tensor] if self.upstream else
                                        GrowingTensor(tensor, axis, self._expected_length(key, arrived)))
                    continue
                try:
                    held[1].append(tensor)
                except ValueError as exc:  # the GrowingTensor's: the frame changed
                    raise TensorConsolidationError(str(exc), request_id=self.request_id, key=key) from None
        tensors = {}
        for key, (axis, data) in self.so_far.items():
            if isinstance(data, GrowingTensor):
                tensors[key] = data.view()
            else:
                tensors[key] = self._cat(key, data, axis)
                data[:] = [tensors[key]]
        return MultimodalPayload(tensors, axes={key: axis for key, (axis, _) in self.so_far.items()})

    def _cat(self, key: str, pieces: list[torch.Tensor], axis: int) -> torch.Tensor:
        """A key's pieces as one tensor (the piece itself when there is one)."""
        if len(pieces) == 1:
            return pieces[0]
        try:
            return torch.cat(pieces, dim=axis)
        except RuntimeError as exc:
            raise TensorConsolidationError(f"pieces do not concatenate: {exc}", request_id=self.request_id,
                                           key=key) from None

    def _expected_length(self, key: str, arrived: list[dict[str, tuple[int, torch.Tensor]]]) -> int:
        """The length along its axis of all of ``key``'s data if every output token brings as much
        as those so far did (the output tokens so far go with the data so far: the scheduler paces
        them together); 0 when that cannot be told; at most ``_PRESIZE_BYTES``."""
        limit = self.max_tokens_param
        tokens = self.detokenizer.num_output_tokens() if self.detokenizer is not None else 0
        got = [pieces[key] for pieces in arrived if key in pieces]
        axis, first = got[0]
        n = sum(t.shape[axis] for _, t in got)
        if not limit or tokens <= 0 or first.numel() == 0:
            return 0
        frame_bytes = first.numel() // first.shape[axis] * first.element_size()
        return min(-(-n * limit // tokens), _PRESIZE_BYTES // frame_bytes)

    def _payload_or_failure(self, finished: bool) -> tuple[MultimodalPayload | None, MultimodalOutputError | None]:
        """``take_payload`` and None, or None and its consolidation failure, recorded for the processor
        (which fails the request visibly after the step) instead of raised into vLLM's loop."""
        try:
            return self.take_payload(finished), None
        except TensorConsolidationError as exc:
            logger.error("request %s failed: %s", self.request_id, exc)
            if self.failures is None:
                raise
            self.failures.append((self, exc))
            return None, exc

    def make_request_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs):
        """vLLM's, with the CUMULATIVE outputs of a request that has multimodal data thinned at
        ``stream_interval`` as vLLM thins DELTA ones (the worker sends a request's first data with
        its first output; a request without data is vLLM's, every step, whatever the modality)."""
        if (not self.upstream and self.output_kind == RequestOutputKind.CUMULATIVE and self.stream_interval > 1
                and finish_reason is None and pooling_output is None and self.detokenizer is not None
                and self.has_data):
            tokens = self.detokenizer.num_output_tokens()
            if self.cumulative_sent and tokens - self.cumulative_sent < self.stream_interval:
                return None
            self.cumulative_sent = tokens
        out = super().make_request_output(new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs)
        self.made = None if out is None else weakref.ref(out)
        return out

    def _new_request_output(self, *args, **kwargs):
        """vLLM's output of the request as a ``MultimodalRequestOutput`` (the same fields; when
        AsyncLLM merges DELTA outputs a consumer has not read yet, their payloads are merged too)."""
        return MultimodalRequestOutput.adopt(super()._new_request_output(*args, **kwargs))

    def _new_completion_output(self, token_ids, finish_reason, stop_reason):
        """vLLM's completion output; once the request has multimodal output, or from the start where
        the processor's output modality has it, a ``MultimodalCompletionOutput``, every one (an
        abort's and one with nothing new included: ``multimodal_output`` None)."""
        base = super()._new_completion_output(token_ids, finish_reason, stop_reason)
        if not self.has_multimodal_output:
            return base
        out = recast(base, MultimodalCompletionOutput)
        # (the end of a streamed input's chunk says why the chunk ended; the request goes on)
        chunk_ends = self.streaming_input and finish_reason not in (FinishReason.ABORT, FinishReason.ERROR)
        out.multimodal_output, exc = self._payload_or_failure(finish_reason is not None and not chunk_ends)
        if exc is not None:  # the completion says so, so that vLLM's ParentRequest counts a sample of n as finished
            out.finish_reason = str(FinishReason.ERROR)
            out.stop_reason = str(_raised_by_generate(exc, self.external_req_id))
        return out

    def _new_pooling_output(self, pooling_output: torch.Tensor):
        """A request with pooling params that also produced multimodal output ends with its pooling
        output, which carries the payload due at finish (per its output kind)."""
        if self.arrived is None and (self.accumulator is None or self.request_id not in self.accumulator):
            return super()._new_pooling_output(pooling_output)
        return MultimodalPoolingOutput(data=pooling_output, multimodal_output=self._payload_or_failure(True)[0])


class MultimodalOutputProcessor(OutputProcessor):
    """vLLM's ``OutputProcessor`` plus the multimodal channel; a drop-in replacement.

    Args (besides vLLM's): ``output_modality`` (an ``OutputModality`` or a string such as
    ``"text+audio"``; unknown strings raise ``ValueError`` here, at configuration time);
    ``strategies``: ``{key: strategy}`` declared by the stage (others resolved per value: see
    ``modality.resolve_strategy``); ``key_aliases``: producer keys renamed where the stage says so
    (``{"model_outputs": "audio"}``); ``accumulator_config``: pool sizing.
    """

    upstream_style = False  # OmniRequestState.upstream for every request

    def __init__(self, tokenizer, *, log_stats: bool, stream_interval: int = 1,
                 output_modality: OutputModality | str = OutputModality.TEXT,
                 strategies: Mapping[str, TensorAccumulationStrategy | str] | None = None,
                 key_aliases: Mapping[str, str] | None = None, accumulator_config: AccumulatorConfig | None = None,
                 **kwargs):
        super().__init__(tokenizer, log_stats=log_stats, stream_interval=stream_interval, **kwargs)
        modality = OutputModality.from_string(output_modality)
        self.output_modality = modality
        self._config = dataclasses.replace(accumulator_config or AccumulatorConfig(), modality=modality,
                                           strategies={k: parse_strategy(v) for k, v in (strategies or {}).items()})
        self._key_aliases = dict(key_aliases or {})
        self._accumulators: dict[torch.device, MultimodalAccumulator] = {}
        self._failures: list[tuple[OmniRequestState, MultimodalOutputError]] = []
        self.failed_by_worker = 0
        self.stopwatch = Stopwatch()  # time spent on multimodal output (reading it, making payloads)
        self.accumulation_errors = 0
        self.consolidation_errors = 0
        self.late_outputs = 0  # multimodal outputs that arrived after their request finished or was aborted
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()  # recently, bounded
        # request id (the caller's) -> (the engine core's timestamp of the message that brought the
        # request's first multimodal data, when this process began to process it), time.monotonic
        # (one clock for every process of a host); the newest _GONE_KEPT requests
        self.first_data_at: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        self._message_times: tuple[float | None, float] = (None, 0.0)

    def add_request(self, request, prompt, parent_req=None, request_index: int = 0, queue=None) -> None:
        rid = request.request_id
        new = rid not in self.request_states
        super().add_request(request, prompt, parent_req, request_index, queue)
        state = self.request_states.get(rid)
        if new and state is not None:
            if not isinstance(state, OmniRequestState):
                state = self.request_states[rid] = recast(state, OmniRequestState)
            state.upstream = self.upstream_style
            state.multimodal = self.output_modality.has_multimodal

    # ------------------------------------------------------------------ the step

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput], engine_core_timestamp=None,
                        iteration_stats=None, weight_version: str | None = None) -> OutputProcessorOutput:
        self._message_times = (engine_core_timestamp, time.monotonic())  # (first_data_at)
        if iteration_stats is not None and engine_core_outputs:
            # the tokens the engine core held, counted on its message's first output; here, not in
            # _update_stats_from_output, which vLLM skips for some outputs (a request gone, an error)
            iteration_stats.num_generation_tokens += getattr(engine_core_outputs[0], "tokens_held", 0)
        with self.stopwatch, nvtx_range("frontend.multimodal"):
            self._accumulate(engine_core_outputs)
        result = super().process_outputs(engine_core_outputs, engine_core_timestamp, iteration_stats, weight_version)
        self._fail_visibly(result, iteration_stats)
        return result

    def _update_stats_from_output(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats):
        """vLLM's, except for an output with multimodal data only (no token, no event, not the first,
        not the last: data arriving while the final output waits for the worker's rest), which adds
        no inter-token latency; and the tokens the engine core held for their audio count as they
        would have with an output every step (``scheduler.HeldTokens``): in the step's generation
        tokens when held (``tokens_held``, on the message's first output: ``process_outputs`` counts
        it, whatever vLLM does with that output), not again on the output that carries them, which adds
        one inter-token latency for each step that made them (``held_times``)."""
        eco = engine_core_output
        data_only = not (eco.new_token_ids or eco.events or req_state.is_prefilling or eco.finish_reason is not None) \
            and (getattr(eco, "multimodal_output", None) is not None or getattr(eco, "multimodal_delivered", None))
        held_times = getattr(eco, "held_times", None) if iteration_stats is not None else None
        if held_times and not req_state.is_prefilling:
            stats = req_state.stats
            for at in held_times:
                if at != stats.last_token_ts:  # (a step that made several tokens: one latency)
                    iteration_stats.inter_token_latencies_iter.append(at - stats.last_token_ts)
                    stats.last_token_ts = at
        if not data_only:
            super()._update_stats_from_output(req_state, engine_core_output, engine_core_timestamp, iteration_stats)
        if iteration_stats is not None:
            iteration_stats.num_generation_tokens -= len(held_times or ())  # (counted when held: process_outputs)

    def _accumulate(self, engine_core_outputs: Iterable[EngineCoreOutput]) -> None:
        """One batched append per device for every multimodal output of the step. A bad value (or
        payload) is an error for its request and key; it never costs another request anything."""
        steps: dict[torch.device, tuple[list[str], list[dict[str, Any]]]] = {}
        errors: list[TensorAccumulationError] = []
        for eco in engine_core_outputs:
            if not isinstance(eco, OmniEngineCoreOutput):
                continue  # plain vLLM outputs (text, pooling) are vLLM's business
            from_worker = eco.multimodal_delivered or eco.multimodal_error is not None
            if from_worker:
                self._take_from_worker(eco, errors)
            payload = eco.multimodal_output
            if payload is None:
                continue
            rid = eco.request_id
            state = self.request_states.get(rid)
            if not isinstance(state, OmniRequestState):
                if not from_worker:  # else _take_from_worker counted this output already
                    self._unknown(rid, errors)
                continue
            if not isinstance(payload, Mapping):
                errors.append(TensorAccumulationError(
                    f"multimodal_output must be a {{key: value}} dict, got {type(payload).__name__}", request_id=rid))
                continue
            values = self._values(rid, payload, errors)
            device = next((v.device for v in values.values() if isinstance(v, torch.Tensor)), None)
            acc = self._attach(state, eco, device, errors)
            if acc is None:
                continue
            ids, rows = steps.setdefault(acc.device, ([], []))
            ids.append(rid)
            rows.append(values)
        for exc in errors:
            logger.warning("multimodal output refused: %s", exc)
        for device, (ids, rows) in steps.items():
            columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)}
            errors += self._accumulators[device].append_step(ids, columns)  # (it logs its own)
        self.accumulation_errors += len(errors)
        for exc in errors:  # a request missing a step's value fails: its data would not be whole
            state = self.request_states.get(exc.request_id)
            if isinstance(state, OmniRequestState):
                self._failures.append((state, exc))

    def _take_from_worker(self, eco: OmniEngineCoreOutput, errors: list) -> None:
        """The worker's data of ``eco`` handed to its request as it is; its error recorded to fail the
        request visibly after the step."""
        state = self.request_states.get(eco.request_id)
        if not isinstance(state, OmniRequestState):
            self._unknown(eco.request_id, errors)
            return
        if eco.multimodal_error is not None:
            exc = eco.multimodal_error.to_exception(eco.request_id)
            logger.error("request %s failed: %s", eco.request_id, exc)
            self.failed_by_worker += 1
            self._failures.append((state, exc))
            return
        if state.arrived is None:  # its first delivery
            self._hook(state, eco)
        pieces = eco.multimodal_delivered
        if self._key_aliases:
            clashes: list[TensorAccumulationError] = []
            pieces = self._values(eco.request_id, pieces, clashes)
            if clashes:  # two of the worker's keys map to one name: the request's data is not whole
                exc = TensorConsolidationError(clashes[0].reason, request_id=eco.request_id, key=clashes[0].key)
                logger.error("request %s failed: %s", eco.request_id, exc)
                self._failures.append((state, exc))
                return
        if any(t.shape[axis] for axis, t in pieces.values()):
            state.deliver(pieces)
        elif state.arrived is None:  # (data came for it, none of it frames: nothing new)
            state.arrived = []

    def _unknown(self, request_id: str, errors: list) -> None:
        """Output for a request without a state: one that finished or was aborted while the step was
        in flight is counted (``late_outputs``: an abort races the engine's next step, nothing is
        wrong); one never seen is an error."""
        if request_id in self._gone:
            self.late_outputs += 1
        else:
            errors.append(TensorAccumulationError("multimodal output for an unknown request", request_id=request_id))

    def _values(self, rid: str, payload: Mapping[str, Any], errors: list) -> dict[str, Any]:
        """The payload's values (plain ones, or the worker's pieces) under the stage's key names; a key
        that two payload keys map to (say ``model_outputs`` and ``audio``) is an error and neither
        value is taken; values the decoder could not make into tensors are their errors."""
        values: dict[str, Any] = {}
        dropped: set[str] = set()
        for key, value in payload.items():
            name = self._key_aliases.get(key, key)
            if isinstance(value, TensorAccumulationError):
                errors.append(value)
                dropped.add(name)
            elif name in values or name in dropped:
                errors.append(TensorAccumulationError(f"payload key {key!r} maps to a key the payload already "
                                                      "has; neither value is taken", request_id=rid, key=name))
                dropped.add(name)
            else:
                values[name] = value
        for name in dropped:
            values.pop(name, None)
        return values

    def _attach(self, state: OmniRequestState, eco: EngineCoreOutput, device: torch.device | None,
                errors: list) -> MultimodalAccumulator | None:
        held = state.accumulator
        if held is not None:
            if device is None or device.type == held.device.type:
                return held
            acc = self._accumulator_on(device)
            if held.move(state.request_id, acc):  # its values so far were metadata: it goes with its first tensor
                state.accumulator = acc
                return acc
            errors.append(TensorAccumulationError(f"tensors moved from {held.device} to {device} mid-stream",
                                                  request_id=state.request_id))
            return None
        acc = self._accumulator_on(device if device is not None else torch.device("cpu"))
        acc.add_request(state.request_id, emit=EmitPolicy[state.output_kind.name])
        state.accumulator = acc
        self._hook(state, eco)
        return acc

    def _accumulator_on(self, device: torch.device) -> MultimodalAccumulator:
        acc = self._accumulators.get(device)
        if acc is None:
            acc = self._accumulators[device] = MultimodalAccumulator(self._config, device)
        return acc

    def _hook(self, state: OmniRequestState, eco: EngineCoreOutput) -> None:
        """A request's first multimodal output: its payload time and failures are the processor's. A
        request without a detokenizer (pooling params), unless this is its pooling output, gets vLLM's
        token-id-only detokenizer, so that its outputs are completion outputs carrying the payload."""
        state.stopwatch = self.stopwatch
        state.failures = self._failures
        self._note_first_data(state)
        if state.detokenizer is None and eco.pooling_output is None:
            state.detokenizer = IncrementalDetokenizer()
            state.logprobs_processor = LogprobsProcessor(tokenizer=None, logprobs=None, prompt_logprobs=None,
                                                         cumulative_logprob=None, num_logprobs=None,
                                                         num_prompt_logprobs=None)

    def _note_first_data(self, state: OmniRequestState) -> None:
        """``first_data_at`` for a request whose first multimodal data is in the message at hand."""
        if self._message_times[0] is not None:
            self.first_data_at[state.external_req_id] = self._message_times
            if len(self.first_data_at) > _GONE_KEPT:
                self.first_data_at.popitem(last=False)

    def _fail_visibly(self, result: OutputProcessorOutput, iteration_stats=None) -> None:
        """Requests whose output failed in this step (a consolidation here, or the worker's
        accumulation): fail them through vLLM's error paths, and count them finished with an error
        in vLLM's statistics."""
        failures, self._failures[:] = list(self._failures), []
        failed = set()
        for state, exc in failures:
            if id(state) in failed:
                continue  # (a second error of the step for the request: the first fails it)
            failed.add(id(state))
            if isinstance(exc, TensorConsolidationError):
                self.consolidation_errors += 1
            raised = _raised_by_generate(exc, state.external_req_id)  # naming the caller's request id
            if state.queue is not None:
                # AsyncLLM: the request's generate() raises it
                state.queue.put(raised)
            last = state.made() if state.made is not None else None
            outs = [out for out in result.request_outputs if out is last]
            if state.queue is None and not outs and self.request_states.get(state.request_id) is state:
                # LLMEngine, a step without the request's output (vLLM thinned it): its final one
                made = state.make_request_output([], None, FinishReason.ERROR, str(raised))
                if made is not None:  # (None: a sample of n whose parent waits for its siblings)
                    result.request_outputs.append(made)
                    outs.append(made)
            parent = state.parent_req
            completions = []
            for out in outs:  # LLMEngine: the output says so
                if isinstance(out, PoolingRequestOutput):  # (its field for a request-level error)
                    code = "validation_error" if isinstance(raised, VLLMValidationError) else "multimodal_output_error"
                    out.error = RequestError(code, str(raised), retryable=isinstance(raised, RetryableRequestError))
                    continue
                # of a sample of n, its own completion (vLLM's parent does the rest)
                completions += [c for c in out.outputs if parent is None or c.index == state.request_index]
            waiting = parent.output_aggregator if parent is not None and not outs else []  # (FINAL_ONLY's: n slots)
            if state.request_index < len(waiting) and waiting[state.request_index] is not None:
                # FINAL_ONLY: the sample's completion waits among its siblings' for the last to finish
                completions.append(waiting[state.request_index])
            for completion in completions:
                completion.finish_reason = str(FinishReason.ERROR)
                completion.stop_reason = str(raised)
            # The request's output is finished once its last sample is: vLLM's parent counted a sample
            # whose completion was finished when it was made (several samples failing in one step: the
            # output of the last alone); one it took for unfinished is over now.
            unfinished = parent is not None and state.request_id in parent.child_requests
            if self.request_states.get(state.request_id) is state:  # (else vLLM finished it in this step)
                self._finish_request(state)  # (a sample: its parent forgets it)
                result.reqs_to_abort.append(state.request_id)
                self._update_stats_from_finished(state, FinishReason.ERROR, iteration_stats)
            if parent is None or (unfinished and not parent.child_requests):
                for out in outs:
                    out.finished = True

    # ------------------------------------------------------------------ lifecycle

    def _finish_request(self, req_state: RequestState) -> None:
        super()._finish_request(req_state)
        self._forget(req_state.request_id, req_state)
        self._drop_parent_if_over(getattr(req_state, "parent_req", None))

    def abort_requests(self, request_ids, internal: bool) -> list[str]:
        states = dict(self.request_states)
        aborted = super().abort_requests(request_ids, internal)
        for rid in aborted:
            state = states.get(rid)
            self._forget(rid, state)
            self._drop_parent_if_over(getattr(state, "parent_req", None))
        if self._failures:  # an abort's final output that failed to consolidate: the request is over already
            gone = {id(states.get(rid)) for rid in aborted}
            self._failures[:] = [(state, exc) for state, exc in self._failures if id(state) not in gone]
        return aborted

    def _drop_parent_if_over(self, parent) -> None:
        """Forget a request of n samples none of whose samples is in flight any more (vLLM forgets
        one when its last sample finishes: one with an aborted sample, the caller's abort of them
        all included, stayed for ever). Its samples' outputs are left as vLLM makes them."""
        if parent is not None and not any(child in self.request_states for child in parent.child_requests):
            self.parent_requests.pop(parent.request_id, None)

    def _forget(self, request_id: str, state: RequestState | None) -> None:
        """A request that finished or was aborted: remembered as gone (the latest ``_GONE_KEPT``), its
        slots freed."""
        self._gone[request_id] = None
        if len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
        acc = state.accumulator if isinstance(state, OmniRequestState) else None
        if acc is not None and request_id in acc:
            acc.abort(request_id)

    def accumulator_stats(self) -> dict[str, Any]:
        """Pool statistics per device, plus the error counters."""
        return {"accumulation_errors": self.accumulation_errors, "consolidation_errors": self.consolidation_errors,
                "failed_by_worker": self.failed_by_worker, "late_outputs": self.late_outputs,
                "multimodal_seconds": self.stopwatch.seconds,
                "devices": {str(d): a.stats() for d, a in self._accumulators.items()}}
