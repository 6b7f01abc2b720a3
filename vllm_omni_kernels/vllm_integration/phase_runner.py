"""``OmniPhaseGPUModelRunner``: vLLM's ``GPUModelRunner`` with the phase contract and fused gather.

For models with ``has_preprocess``: after vLLM's own ``_preprocess`` has laid out the step, every row
goes through the model's hooks as ``OmniPhaseRunnerMixin._omni_preprocess`` routes it (phase keys,
batched decode runs, runner MTP), and the model gets ``input_ids`` and ``inputs_embeds`` from the
runner's persistent buffers. Other models run exactly as in vLLM.

It is a subclass of vLLM's V1 ``GPUModelRunner``. vLLM 0.33 selects its Model Runner V2 by default,
which would never construct this class: the constructor refuses to run on a configuration that
selects V2, with an error that says how to select V1 (``VLLM_USE_V2_MODEL_RUNNER=0``), rather than
let the phase contract silently go unused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.distributed.parallel_state import get_pp_group
from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ..phase.runner import OmniPhaseRunnerMixin


class ModelRunnerV2SelectedError(RuntimeError):
    """The configuration selects vLLM's Model Runner V2, which does not use this runner."""


def check_v1_runner(vllm_config) -> None:
    """Raise ``ModelRunnerV2SelectedError`` when ``vllm_config`` selects Model Runner V2."""
    if vllm_config.use_v2_model_runner:
        raise ModelRunnerV2SelectedError(
            "OmniPhaseGPUModelRunner is a V1 GPUModelRunner, but this configuration selects vLLM's Model Runner "
            "V2 (vLLM 0.33's default), which would never run it: set VLLM_USE_V2_MODEL_RUNNER=0")


class OmniPhaseGPUModelRunner(OmniPhaseRunnerMixin, GPUModelRunner):
    """A ``GPUModelRunner`` whose preprocess follows the prefill/decode phase contract."""

    def __init__(self, vllm_config, *args, **kwargs):
        check_v1_runner(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.model_intermediate_buffer: dict[str, dict[str, Any]] = {}
        self._omni_gather = None

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if getattr(self.model, "has_preprocess", False):
            self._omni_init_phase_routing(hidden_size=self.inputs_embeds.gpu.shape[-1], dtype=self.dtype,
                                          device=self.device, max_num_reqs=self.max_num_reqs,
                                          max_num_tokens=self.max_num_tokens)

    def _update_states(self, scheduler_output):
        if self._omni_gather is not None:
            for req_id in scheduler_output.finished_req_ids:
                self._omni_release_request(req_id)
                self.model_intermediate_buffer.pop(req_id, None)
        return super()._update_states(scheduler_output)

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        out = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        if self._omni_gather is None:
            return out
        input_ids = self.input_ids.gpu[:num_input_tokens]
        inputs_embeds = self.inputs_embeds.gpu[:num_input_tokens]
        spans = np.fromiter((scheduler_output.num_scheduled_tokens[r] for r in self.input_batch.req_ids),
                            dtype=np.int64, count=len(self.input_batch.req_ids))
        # (a text-only model on the first pipeline rank: vLLM passes token ids and leaves the embedding
        # buffer as the last step left it; a later rank takes the hidden states of the rank before)
        embedded = out[1] is not None or not get_pp_group().is_first_rank
        self._omni_preprocess(input_ids, inputs_embeds, spans, embedded=embedded)
        return (input_ids, inputs_embeds, *out[2:])

    def _omni_call_talker_mtp(self, ids, embeds, hidden, text, request_ids):
        with set_forward_context(None, self.vllm_config):
            return self.model.talker_mtp(ids, embeds, hidden, text)
