"""The comparison path, as upstream vllm-omni serves: ``upstream_worker_outputs`` (the worker copies
every key's batched output to the host each step and slices it per request) and
``UpstreamStyleOutputProcessor`` (the frontend keeps each request's chunks in Python lists and
concatenates them when an output needs them: the chunks since the last output for DELTA, everything
so far for CUMULATIVE, everything at finish for FINAL_ONLY; CUMULATIVE gets an output every step,
whatever vLLM's ``stream_interval``, as vLLM itself does, where this package thins them at the
interval). The main job and the load tests measure this package against it, in the same run.
"""

from __future__ import annotations

import torch

from ..modality import TensorAccumulationStrategy as Strategy
from .output_processor import MultimodalOutputProcessor, OmniRequestState
from .wire import OmniEngineCoreOutput


class UpstreamStyleOutputProcessor(MultimodalOutputProcessor):
    """Per-step chunks kept in per-request lists and concatenated for each output (module
    docstring); a key concatenates along its declared strategy's axis (default: along dim 0)."""

    upstream_style = True

    def _accumulate(self, engine_core_outputs) -> None:
        strategies = self._config.strategies
        for eco in engine_core_outputs:
            if not isinstance(eco, OmniEngineCoreOutput):
                continue
            if eco.multimodal_delivered or eco.multimodal_error is not None:
                self._take_from_worker(eco, [])
            if not eco.multimodal_output:
                continue
            state = self.request_states.get(eco.request_id)
            if not isinstance(state, OmniRequestState):
                continue
            if state.arrived is None:
                self._note_first_data(state)
            state.stopwatch = self.stopwatch
            state.deliver({key: (-1 if strategies.get(key) is Strategy.CONCAT_LAST else 0, value)
                           for key, value in eco.multimodal_output.items()})


def upstream_worker_outputs(request_ids: list[str],
                            batch: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The worker half: every key's step output ``[B, *chunk]`` (row b: ``request_ids[b]``'s chunk)
    copied to the host, one blocking copy per key as ``tensor.cpu()`` does, and sliced per request."""
    host = {key: value.cpu() for key, value in batch.items()}
    return {rid: {key: value[b] for key, value in host.items()} for b, rid in enumerate(request_ids)}
