"""The scheduler side of the separated channel (RFC part I.3): ``OmniScheduler``.

vLLM's v1 ``Scheduler.update_from_output`` turns a runner output into ``EngineCoreOutput``s. Here
the runner output is an ``OmniModelRunnerOutput`` whose ``pooler_output`` holds pooling tensors only
and whose ``multimodal_outputs`` holds the multimodal data, so vLLM's own logic runs unchanged on the
pooling channel (its "pooling request finishes when it has pooler output" check fires only for real
pooling output) and this class threads the multimodal channel into ``OmniEngineCoreOutput``.

A multimodal output never finishes a request: completion comes from ``finish_reason`` (tokens, stop
conditions, aborts). A request that has multimodal output in a step but produced no token (a
generation stage) still gets an output for that step.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs

from .engine import OmniEngineCoreOutput
from .outputs import OmniModelRunnerOutput


class OmniScheduler(Scheduler):
    """vLLM's ``Scheduler`` with the multimodal channel; every other behaviour is vLLM's."""

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        mm = model_runner_output.multimodal_outputs if isinstance(model_runner_output, OmniModelRunnerOutput) else None
        if not mm:
            return outputs
        emitted: set[str] = set()
        for batch in outputs.values():
            converted = []
            for eco in batch.outputs:
                payload = mm.get(eco.request_id)
                if payload:
                    eco = OmniEngineCoreOutput.from_base(eco, payload)
                    emitted.add(eco.request_id)
                converted.append(eco)
            batch.outputs = converted
        for req_id, payload in mm.items():
            request = self.requests.get(req_id)
            if req_id in emitted or not payload or request is None or request.is_finished():
                continue  # finished requests already got their final output above
            batch = outputs.get(request.client_index)
            if batch is None:
                batch = outputs[request.client_index] = EngineCoreOutputs()
            batch.outputs.append(OmniEngineCoreOutput(request_id=req_id, new_token_ids=[], multimodal_output=payload))
        return outputs
