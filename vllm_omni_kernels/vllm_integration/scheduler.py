"""The scheduler side of the separated channel (RFC part I.3): ``OmniScheduler`` and
``OmniAsyncScheduler``.

vLLM's v1 ``Scheduler.update_from_output`` turns a runner output into ``EngineCoreOutput``s. Here
the runner output is an ``OmniModelRunnerOutput``, whose ``pooler_output`` holds pooling tensors
only, so vLLM's own logic runs unchanged on the pooling channel (its "a pooling request finishes
when it has pooler output" check fires only for real pooling output). ``MultimodalChannel`` then
threads the multimodal channel into ``OmniEngineCoreOutput``s:

* plain per-step values (``multimodal_outputs``) go on the request's output; the worker's
  accumulated data due this step (``packed``: one host buffer, and per key the requests whose data
  lies back to back in it) goes on the message (``OmniEngineCoreOutputs``) of every client that has
  a request with data in it: nothing is built per request;
* a request whose output the worker failed (``multimodal_errors``) is finished with
  ``FINISHED_ERROR`` and its output carries the error, which the frontend raises to its caller;
* a request that finishes (length, stop) while the worker still holds its output (it opened it in
  ``multimodal_opened`` and has not closed it in ``packed.final``) would lose that output: its final
  output carries an error instead, so the loss is visible.

A multimodal output never finishes a request; a request that has multimodal output in a step but
produced no token (a generation stage) still gets an output for that step.

``OmniScheduler`` subclasses vLLM's ``Scheduler`` and ``OmniAsyncScheduler`` its ``AsyncScheduler``
(async scheduling, vLLM's default: a ``Scheduler`` subclass would turn it off).
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus

from .outputs import OmniModelRunnerOutput
from ..serving.worker_accumulator import PackedStep
from .wire import MultimodalError, MultimodalRegion, OmniEngineCoreOutput, OmniEngineCoreOutputs


class MultimodalChannel:
    """The multimodal channel of ``update_from_output``, for a vLLM scheduler class (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._worker_open: set[str] = set()  # requests whose output the worker holds

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            self._worker_open.discard(request.request_id)
        return finished

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not isinstance(model_runner_output, OmniModelRunnerOutput):
            return outputs
        out = model_runner_output
        packed = out.packed
        self._worker_open.update(out.multimodal_opened or ())
        if packed is not None:
            self._worker_open.difference_update(packed.final)
        plain = out.multimodal_outputs or {}
        errors = {rid: MultimodalError(exc.reason, exc.key) for rid, exc in (out.multimodal_errors or {}).items()}
        if errors:
            self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        if not (plain or packed or errors or self._worker_open):
            return outputs
        emitted: set[str] = set()
        for client, batch in list(outputs.items()):
            outputs[client] = outputs_with_channel(batch, packed, plain, errors, self._worker_open, emitted)
        delivered = packed.requests() if packed is not None else set()
        for rid in (set(plain) | delivered | set(errors)) - emitted:
            request = self.requests.get(rid)
            if request is None or (request.is_finished() and rid not in errors):
                continue  # finished requests already got their final output above
            batch = outputs.get(request.client_index)
            if batch is None:
                batch = outputs[request.client_index] = OmniEngineCoreOutputs()
            batch.outputs.append(OmniEngineCoreOutput(
                request_id=rid, new_token_ids=[], multimodal_output=plain.get(rid) or None,
                multimodal_error=errors.get(rid), finish_reason=FinishReason.ERROR if rid in errors else None))
            if rid in delivered:
                outputs[request.client_index] = _with_outputs(batch, batch.outputs, packed)
        return outputs


def outputs_with_channel(batch: EngineCoreOutputs, packed: PackedStep | None, plain: dict, errors: dict,
                         worker_open: set[str] = frozenset(), emitted: set[str] | None = None) -> EngineCoreOutputs:
    """One client's message of a step with the multimodal channel: plain values and errors on their
    requests' outputs, the step's buffer and regions on the message when one of its requests has
    data there (that request's output is left as it is: the client cuts its data from the regions).
    A finishing request still in ``worker_open`` gets an error (its held output would be lost) and
    leaves the set. ``emitted`` collects the requests that got an output here."""
    delivered = packed.requests() if packed is not None else ()
    with_data = changed = False
    ecos = batch.outputs
    for i, eco in enumerate(ecos):
        rid = eco.request_id
        if rid in delivered:
            with_data = True
            if emitted is not None:
                emitted.add(rid)
        error = errors.get(rid) if errors else None
        if error is None and eco.finish_reason is not None and rid in worker_open:
            worker_open.discard(rid)
            error = MultimodalError(f"the request finished ({eco.finish_reason}) while the worker still "
                                    "held its output, which is lost")
        value = plain.get(rid) if plain else None
        if value or error is not None:
            changed = True
            eco = ecos[i] = OmniEngineCoreOutput.from_base(eco, value, error)
            if error is not None:
                eco.finish_reason = FinishReason.ERROR
            if emitted is not None:
                emitted.add(rid)
    return _with_outputs(batch, ecos, packed if with_data else None) if with_data or changed else batch


def _with_outputs(batch: EngineCoreOutputs, outputs: list, packed: PackedStep | None) -> OmniEngineCoreOutputs:
    """``batch`` as ``OmniEngineCoreOutputs`` with ``outputs``, and the step's buffer and regions
    when some of them have data there."""
    regions = None if packed is None else [
        MultimodalRegion(r.key, str(r.dtype).removeprefix("torch."), list(r.frame), r.axis, r.offset,
                         r.request_ids, r.frames.tolist()) for r in packed.regions]
    if isinstance(batch, OmniEngineCoreOutputs):
        batch.outputs = outputs
        if packed is not None:
            batch.multimodal_buffer, batch.multimodal_regions = packed.host, regions
        return batch
    fields = {name: getattr(batch, name) for name in batch.__struct_fields__ if name != "outputs"}
    return OmniEngineCoreOutputs(**fields, outputs=outputs, multimodal_buffer=None if packed is None else packed.host,
                                 multimodal_regions=regions)


class OmniScheduler(MultimodalChannel, Scheduler):
    """vLLM's ``Scheduler`` with the multimodal channel; every other behaviour is vLLM's."""


class OmniAsyncScheduler(MultimodalChannel, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (async scheduling) with the multimodal channel."""
