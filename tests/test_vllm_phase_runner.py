"""The phase mixin inside vLLM's real ``GPUModelRunner`` class (marker vllm).

vLLM's runner cannot be constructed without a GPU, so the test makes an instance without running
``__init__`` and gives it the attributes the preprocess path reads, with CPU buffers: the methods
under test are the real class's, resolved through its MRO.
"""

import inspect

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from phase_expect import expected_step  # noqa: E402
from phase_fakes import FakeRunner, FakeTalker  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from vllm_omni_kernels.vllm_integration.phase_runner import OmniPhaseGPUModelRunner  # noqa: E402

pytestmark = pytest.mark.vllm


def test_overrides_keep_vllm_signatures():
    for name in ("_preprocess", "_update_states", "load_model"):
        ours = inspect.signature(getattr(OmniPhaseGPUModelRunner, name))
        theirs = inspect.signature(getattr(GPUModelRunner, name))
        if name == "load_model":
            continue  # ours forwards *args/**kwargs
        assert list(ours.parameters) == list(theirs.parameters), name
    assert issubclass(OmniPhaseGPUModelRunner, GPUModelRunner)


def test_preprocess_path_runs_inside_the_vllm_runner_class():
    fake = FakeRunner(FakeTalker(8, torch.bfloat16))
    fake.add_request("a", 5)
    fake.add_request("b", 3)
    runner = object.__new__(OmniPhaseGPUModelRunner)
    runner.__dict__.update(fake.__dict__)  # the attributes a constructed runner has, on CPU
    runner.vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))  # for the MTP forward context
    rows = [("a", 0, 4), ("b", 3, 1)]
    spans = FakeRunner.schedule(runner, rows)
    runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    ids, emb, _, codes = expected_step(runner, rows)
    np.testing.assert_array_equal(runner.input_ids.numpy(), ids)
    np.testing.assert_array_equal(runner.inputs_embeds.float().numpy(), emb)
    assert runner.model_intermediate_buffer["b"]["codes"]["audio"].tolist() == codes["b"].tolist()


@pytest.mark.parametrize("v2", ["1", "0"])
def test_refuses_to_start_when_vllm_selects_model_runner_v2(v2, monkeypatch):
    from vllm_omni_kernels.vllm_integration.phase_runner import ModelRunnerV2SelectedError, check_v1_runner

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    if v2 == "1":
        with pytest.raises(ModelRunnerV2SelectedError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            OmniPhaseGPUModelRunner(config, torch.device("cpu"))
    else:
        check_v1_runner(config)  # V1 selected: nothing to refuse
