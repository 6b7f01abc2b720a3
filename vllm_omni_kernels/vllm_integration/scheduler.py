"""The scheduler side of the separated channel (RFC part I.3): ``OmniScheduler`` (vLLM's
``Scheduler``) and ``OmniAsyncScheduler`` (its ``AsyncScheduler``: a ``Scheduler`` subclass would
turn async scheduling off), both through ``MultimodalChannel``.

The runner output is an ``OmniModelRunnerOutput``, whose ``pooler_output`` holds pooling tensors
only, so vLLM's ``update_from_output`` runs unchanged; ``MultimodalChannel`` then threads the
multimodal channel into the step's outputs:

* plain per-step values (``multimodal_outputs``) go on their request's output; the worker's data due
  this step (``packed``: one host buffer and its regions) goes on the message of the client whose
  requests it holds, nothing built per request; when the step's data is for several clients
  (vLLM's API server processes), each message carries a copy of its own requests' data alone
  (``PackedStep.split``: one host copy in all, instead of every client receiving every client's);
* a request the worker failed (``multimodal_errors``), or whose plain values vLLM's wire would not
  carry as they are (``wire.tensor_paths``: the encoder would fail the step, or the client's decoder
  the whole message), is finished with ``FINISHED_ERROR``, its output carrying the error, which the
  frontend raises to its caller; in process as over ZMQ;
* a request vLLM finishes while the worker still holds its output (opened in ``multimodal_opened``,
  not closed in ``packed.final``: a stop token, which the worker sees only when vLLM does) keeps its
  finish until the worker's rest arrives a step or two later; its tokens go at once when the step
  has data of the request (the data belongs to them), else with the finish, and data arriving
  meanwhile goes on outputs of its own. After ``_AWAITED_STEPS`` steps (a finish the worker cannot
  tell, such as vLLM's repetition detection) the request finishes with an error, so the loss is
  visible.

A multimodal output never finishes a request, and a request with multimodal output but no token in
a step still gets an output. A request the worker paces has its outputs that carry only tokens and
events held back (``HeldTokens``) until its next output that goes (its first, one with data, the
final one, or one that carries more), which takes them in front: the client processes a paced
stream once per span instead of once per step, and every token arrives, in order. A request vLLM
ends otherwise (a client's abort, the engine's own in a pause or shutdown, an error vLLM finds)
drops its held tokens, as the worker drops its data not yet due: no token reaches a client
without the audio it belongs to.
"""

from __future__ import annotations

import time

import msgspec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from .outputs import OmniModelRunnerOutput
from ..serving.worker_accumulator import PackedStep
from ..errors import TensorAccumulationError
from .wire import (MultimodalError, MultimodalRegion, OmniEngineCoreOutput, OmniEngineCoreOutputs, tensor_paths,
                   with_carried_tensors)

_AWAITED_STEPS = 8  # a finished request's finish waits this many steps at most for the worker's rest
# The fields of vLLM's output that go with a request's finish, not with its last tokens
_FINISH_FIELDS = ("finish_reason", "stop_reason", "kv_transfer_params", "ec_transfer_params", "spec_decode_metrics")


class MultimodalChannel:
    """The multimodal channel of ``update_from_output``, for a vLLM scheduler class (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._worker_open: set[str] = set()  # requests whose output the worker holds
        self._text_stop: set[str] = set()  # those whose text leaves a stop token out (``_await_worker``)
        self._awaiting: dict[str, list] = {}  # finished request -> [client, its final output, steps waited]
        self.held = HeldTokens()

    def has_finished_requests(self) -> bool:
        """vLLM's, and true while a finished request's finish waits for the worker's rest: the engine
        steps on until it goes (``_awaiting``), however idle it is otherwise."""
        return super().has_finished_requests() or bool(self._awaiting)

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._worker_open.discard(request.request_id)
            self._text_stop.discard(request.request_id)
            self.held.drop(request.request_id)
        return finished

    def update_from_output(self, scheduler_output, model_runner_output):
        # The requests the worker opened in this step that are still known (one aborted since the step
        # ran would be held open for ever), taken before vLLM's update finishes those that end in it.
        opened = [rid for rid in getattr(model_runner_output, "multimodal_opened", None) or () if rid in self.requests]
        self._text_stop.update(rid for rid in opened if _text_leaves_stop_out(self.requests[rid]))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        out = model_runner_output
        if not isinstance(out, OmniModelRunnerOutput):
            if not self._awaiting:
                return outputs
            out = OmniModelRunnerOutput(req_ids=[], req_id_to_index={})  # a step with nothing on the channel
        packed = out.packed
        self._worker_open.update(opened)
        if packed is not None:
            self._worker_open.difference_update(packed.final)
        errors = {rid: MultimodalError.of(exc) for rid, exc in (out.multimodal_errors or {}).items()}
        plain, tensors = _carried(out.multimodal_outputs or {}, errors)
        failed = {rid: self.requests[rid] for rid in errors if rid in self.requests}  # (finish_requests forgets them)
        if errors:
            # (their held tokens go on their error outputs: finish_requests forgets what it holds)
            held = {rid: self.held.take(rid) for rid in errors}
            self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)  # (which forgets them)
            self.held.restore(held)
            # One that vLLM finished in this very step: its final output goes now, with the error,
            # instead of waiting for a rest the worker will never send.
            self._worker_open.difference_update(errors)
        if not (plain or packed or errors or self._worker_open or self.held.active or self._awaiting
                or self.held.unsent):
            return outputs
        emitted: set[str] = set()
        delivered = packed.requests() if packed is not None else frozenset()
        if self._awaiting:
            self._release_awaited(outputs, packed.final if packed is not None else (), errors)
        for client, batch in list(outputs.items()):
            batch.outputs = self.held.thin(batch.outputs, self._worker_open, delivered, batch.timestamp)
            if self.held.released:
                batch = _with_token_times(batch, self.held.released)
            if self._worker_open:
                batch.outputs = self._await_worker(client, batch.outputs, delivered)
            outputs[client] = outputs_with_channel(batch, packed, plain, errors, self._worker_open, emitted, tensors)
        for rid in (set(plain) | delivered | set(errors)) - emitted:
            awaiting = self._awaiting.get(rid)
            request = self.requests.get(rid) or failed.get(rid)
            if awaiting is not None:
                client = awaiting[0]  # finished, its finish waiting for this data's rest
            elif rid in failed:
                client = request.client_index  # failed by the worker in a step that gave it no output
            elif request is None or request.is_finished():
                continue  # finished requests already got their final output above
            else:
                client = request.client_index
            batch = outputs.setdefault(client, OmniEngineCoreOutputs())
            tokens, events, times = self.held.take(rid)  # (the data belongs to them; an error output ends the request)
            if times:
                batch = outputs[client] = _with_token_times(batch, {rid: times})
            batch.outputs.append(OmniEngineCoreOutput(
                request_id=rid, new_token_ids=tokens, events=events or None, multimodal_output=plain.get(rid) or None,
                multimodal_error=errors.get(rid), finish_reason=FinishReason.ERROR if rid in errors else None,
                multimodal_tensors=tensors.get(rid), trace_headers=None if request is None else request.trace_headers))
            if rid in delivered:
                outputs[client] = _with_outputs(batch, batch.outputs, packed)
        if self._text_stop:
            self._text_stop.intersection_update(self._worker_open)
        if self.held.unsent:
            count_held(self.held, outputs)
        sharing = {client: batch for client, batch in outputs.items()
                   if getattr(batch, "multimodal_buffer", None) is not None}
        if len(sharing) > 1:  # several clients: each message carries its own requests' data alone
            owner = {eco.request_id: client for client, batch in sharing.items() for eco in batch.outputs}
            shares = packed.split(owner)
            for client, batch in sharing.items():
                _set_data(batch, shares.get(client) or PackedStep(host=packed.host[:0]))
        return outputs

    def _await_worker(self, client: int, ecos: list, delivered) -> list:
        """``ecos`` without the finishes of requests whose output the worker still holds: those wait
        for its rest (``_awaiting``). A request with data in this step (``delivered``) keeps the rest
        of its output here, its tokens among it, so that its data goes with the tokens it belongs
        to; the finish waits alone (unless its text leaves a stop token out, which vLLM's frontend
        does only for the tokens that come with the finish). An error finish goes as it is."""
        kept = []
        for eco in ecos:
            rid = eco.request_id
            if eco.finish_reason is not None and eco.finish_reason != FinishReason.ERROR and rid in self._worker_open:
                self._worker_open.discard(rid)
                if rid in delivered and rid not in self._text_stop:
                    kept.append(msgspec.structs.replace(eco, **dict.fromkeys(_FINISH_FIELDS)))
                    eco = EngineCoreOutput(request_id=rid, new_token_ids=[], trace_headers=eco.trace_headers,
                                           **{name: getattr(eco, name) for name in _FINISH_FIELDS})
                self._awaiting[rid] = [client, eco, 0]
            else:
                kept.append(eco)
        return kept

    def _release_awaited(self, outputs: dict, final, errors: dict) -> None:
        """The final outputs of requests whose rest arrived this step (``final``: the requests the
        worker closed), or that failed, join the step's outputs; one that waited too long goes with
        an error (the output the worker held is lost)."""
        for rid, waiting in list(self._awaiting.items()):
            client, eco, waited = waiting
            if rid not in final and rid not in errors:
                if waited + 1 < _AWAITED_STEPS:
                    waiting[2] = waited + 1
                    continue
                errors[rid] = MultimodalError(f"the request finished ({eco.finish_reason}) while the worker held its "
                                              f"output, and the rest did not come within {_AWAITED_STEPS} steps; "
                                              "it is lost")
            del self._awaiting[rid]
            outputs.setdefault(client, OmniEngineCoreOutputs()).outputs.append(eco)


def _text_leaves_stop_out(request) -> bool:
    """Whether vLLM's frontend leaves a stop token that ends the request out of its text."""
    params = request.sampling_params
    return params is not None and params.detokenize and not params.include_stop_str_in_output


class HeldTokens:
    """Token outputs of paced requests held back until their request's data is due (module
    docstring). ``thin`` filters a step's outputs; ``drop`` forgets a request that ended without a
    final output (aborted, failed). vLLM's frontend statistics stay what they would be with an
    output every step: with each token it keeps the engine core's time of the step that made it
    (``time.monotonic``, as vLLM's message timestamps), which go with the tokens (``released``),
    so that the frontend takes one inter-token latency per step; and it counts the tokens it holds
    (``unsent``) for the step's message, whose generation-token count takes them then (the tokens
    of a whole file while it is made, those of a request aborted while held at all), and the
    output that later carries them leaves them out of its count."""

    def __init__(self):
        self._held: dict[str, tuple[list[int], list, list[float]]] = {}  # request id -> (token ids, events, times)
        self._started: set[str] = set()  # paced requests that had their first output
        self.released: dict[str, list[float]] = {}  # the times of the tokens the last ``thin`` let go, by request
        self.unsent = 0  # tokens held since a message last counted them (``count_held``)

    @property
    def active(self) -> bool:
        """Whether it holds tokens or follows a paced request that had its first output."""
        return bool(self._held or self._started)

    def __len__(self) -> int:
        """Requests with tokens held now."""
        return len(self._held)

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self._started.discard(request_id)

    def take(self, request_id: str) -> tuple[list[int], list, list[float]]:
        """The tokens, events and step times held for the request (empty when none), no longer held."""
        return self._held.pop(request_id, None) or ([], [], [])

    def restore(self, held: dict[str, tuple[list[int], list, list[float]]]) -> None:
        """Hold ``take``'s tokens, events and times again, by request, for the request's next output
        that goes, whatever its pace (a request that failed: its error output)."""
        for rid, (tokens, events, times) in held.items():
            if tokens or events:
                self._held[rid] = (tokens, events, times)

    def thin(self, ecos: list, paced, due, now: float | None = None) -> list:
        """``ecos`` without the outputs held this step, the earlier held tokens and events put in
        front of the ones that go (their step times in ``released``). ``paced``: requests the
        worker paces; ``due``: those with data this step; ``now``: the step's time (its message's
        timestamp; default ``time.monotonic()``)."""
        self.released = {}
        if not (paced or self.active):
            return ecos
        kept = []
        for eco in ecos:
            rid = eco.request_id
            if rid in paced and rid not in due and rid in self._started and _holdable(eco):
                tokens, events, times = self._held.setdefault(rid, ([], [], []))
                tokens += eco.new_token_ids
                if eco.events:
                    events += eco.events
                if eco.new_token_ids:
                    times += [time.monotonic() if now is None else now] * len(eco.new_token_ids)
                    self.unsent += len(eco.new_token_ids)
                continue
            held = self._held.pop(rid, None)
            if held is not None:
                eco.new_token_ids = held[0] + eco.new_token_ids
                if held[1]:
                    eco.events = held[1] + (eco.events or [])
                if held[2]:
                    self.released[rid] = held[2]
            if eco.finish_reason is not None:
                self._started.discard(rid)
            elif rid in paced:
                self._started.add(rid)
            kept.append(eco)
        return kept


def count_held(held: HeldTokens, outputs: dict) -> None:
    """Put the tokens ``held`` holds unsent on the first output of a message that has one
    (``tokens_held``: vLLM's statistics count them with that message; module docstring)."""
    for batch in outputs.values():
        if batch.outputs:
            eco = batch.outputs[0]
            if not isinstance(eco, OmniEngineCoreOutput):
                eco = batch.outputs[0] = OmniEngineCoreOutput.from_base(eco)
            eco.tokens_held = held.unsent
            held.unsent = 0
            return


def _holdable(eco) -> bool:
    """Whether ``eco`` is vLLM's ``EngineCoreOutput`` carrying nothing but what may be held
    (``HOLDABLE``); anything else (a finish, logprobs, pooling output, transfer parameters, prefill
    statistics, NaNs in its logits, an error...) sends it, with what was held before it."""
    return (type(eco) is EngineCoreOutput and eco.finish_reason is None and eco.stop_reason is None
            and eco.new_logprobs is None and eco.new_prompt_logprobs_tensors is None and eco.pooling_output is None
            and eco.kv_transfer_params is None and eco.ec_transfer_params is None and eco.prefill_stats is None
            and eco.routed_experts is None and eco.mm_cache_miss_hashes is None and eco.new_sampling_mask is None
            and eco.spec_decode_metrics is None and eco.prompt_token_id_logprobs is None and eco.error is None
            and not eco.num_nans_in_logits)


# The fields of an output ``_holdable`` lets through: the rest are the ones it checks.
HOLDABLE = frozenset({"request_id", "new_token_ids", "events", "trace_headers"})


def _carried(plain: dict, errors: dict) -> tuple[dict, dict]:
    """The plain values that vLLM's wire carries (``with_carried_tensors``), and where their tensors
    are (``tensor_paths``); a request whose value it would not carry (the engine core's encoder would
    fail the step, or the client's decoder the message) gets its error in ``errors`` instead, and
    none of its value goes."""
    tensors, unfit = {}, []
    for rid, value in plain.items():
        if not value:
            continue
        try:
            tensors[rid] = paths = tensor_paths(value, check=True)
        except TensorAccumulationError as exc:
            errors.setdefault(rid, MultimodalError.of(exc))
            unfit.append(rid)
            continue
        carried = with_carried_tensors(value, paths)
        if carried is not value:
            plain = {**plain, rid: carried}
    if unfit:
        plain = {rid: value for rid, value in plain.items() if rid not in unfit}
    return plain, tensors


def outputs_with_channel(batch: EngineCoreOutputs, packed: PackedStep | None, plain: dict, errors: dict,
                         worker_open: set[str] = frozenset(), emitted: set[str] | None = None,
                         tensors: dict | None = None) -> EngineCoreOutputs:
    """One client's message of a step with the multimodal channel: plain values and errors on their
    requests' outputs, the step's buffer and regions on the message when one of its requests has
    data there (that request's output is left as it is: the client cuts its data from the regions).
    A finishing request still in ``worker_open`` (one whose final output nothing held back for the
    worker's rest, as ``MultimodalChannel`` does) gets an error, its held output being lost, and
    leaves the set. ``emitted`` collects the requests that got an output here; ``tensors``: where the
    plain values' tensors are, by request (``_carried``; else found here)."""
    delivered = packed.requests() if packed is not None else ()
    emitted = set() if emitted is None else emitted
    with_data = changed = False
    ecos = batch.outputs
    for i, eco in enumerate(ecos):
        rid = eco.request_id
        if rid in delivered:
            with_data = True
            emitted.add(rid)
        error = errors.get(rid)
        if error is None and eco.finish_reason is not None and rid in worker_open:
            worker_open.discard(rid)
            error = MultimodalError(f"the request finished ({eco.finish_reason}) while the worker still "
                                    "held its output, which is lost")
        value = plain.get(rid)
        if value or error is not None:
            changed = True
            eco = ecos[i] = OmniEngineCoreOutput.from_base(eco, value, error, (tensors or {}).get(rid))
            if error is not None:
                eco.finish_reason = FinishReason.ERROR
            emitted.add(rid)
    return _with_outputs(batch, ecos, packed if with_data else None) if with_data or changed else batch


def _with_outputs(batch: EngineCoreOutputs, outputs: list, packed: PackedStep | None) -> OmniEngineCoreOutputs:
    """``batch`` as ``OmniEngineCoreOutputs`` with ``outputs``, and the step's buffer and regions
    when some of them have data there."""
    if not isinstance(batch, OmniEngineCoreOutputs):
        fields = {name: getattr(batch, name) for name in batch.__struct_fields__ if name != "outputs"}
        batch = OmniEngineCoreOutputs(**fields)
    batch.outputs = outputs
    if packed is not None:
        _set_data(batch, packed)
    return batch


def _with_token_times(batch: EngineCoreOutputs, times: dict[str, list[float]]) -> OmniEngineCoreOutputs:
    """``batch`` as ``OmniEngineCoreOutputs`` with ``times`` among its held tokens' times
    (``token_times``, by request)."""
    batch = _with_outputs(batch, batch.outputs, None)
    batch.token_times = {**(batch.token_times or {}), **times}
    return batch


def _set_data(batch: OmniEngineCoreOutputs, packed: PackedStep) -> None:
    """The message carries ``packed``'s buffer and regions."""
    batch.multimodal_buffer = packed.host
    batch.multimodal_regions = [MultimodalRegion(r.key, str(r.dtype).removeprefix("torch."), list(r.frame), r.axis,
                                                 r.offset, r.request_ids, r.frames.tolist()) for r in packed.regions]


class OmniScheduler(MultimodalChannel, Scheduler):
    """vLLM's ``Scheduler`` with the multimodal channel; every other behaviour is vLLM's."""


class OmniAsyncScheduler(MultimodalChannel, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling) with the multimodal channel."""
