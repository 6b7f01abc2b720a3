"""The RFC's testing table, row by row, on real vLLM types (marker vllm)."""

import dataclasses

import pytest
import torch

pytest.importorskip("vllm")

from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402

from vllm_env import core_request, sampling, tokenizer  # noqa: E402
from vllm_omni_kernels.modality import OutputModality, TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.payload import MultimodalPayload  # noqa: E402
from vllm_omni_kernels.vllm_integration.wire import OmniEngineCoreOutput  # noqa: E402
from vllm_omni_kernels.vllm_integration.output_processor import MultimodalOutputProcessor  # noqa: E402
from vllm_omni_kernels.vllm_integration.outputs import (  # noqa: E402
    MultimodalCompletionOutput, OmniModelRunnerOutput, OmniRequestOutput, wrap_output)

pytestmark = pytest.mark.vllm
TOK = tokenizer()


@pytest.mark.parametrize("text, want", [
    ("text+image", OutputModality.TEXT | OutputModality.IMAGE), ("image,text", OutputModality.TEXT | OutputModality.IMAGE),
    ("speech", OutputModality.AUDIO), ("latents", OutputModality.LATENT), ("images", OutputModality.IMAGE),
    ("", OutputModality.TEXT), (None, OutputModality.TEXT)])
def test_from_string_aliases(text, want):
    assert OutputModality.from_string(text) == want


def test_from_string_unknown_raises_naming_the_supported():
    with pytest.raises(ValueError, match="supported"):
        OutputModality.from_string("text+hologram")


def test_payload_store_retrieve_and_primary_tensor():
    p = MultimodalPayload(tensors={"audio": torch.ones(3), "codes": torch.zeros(2, 16)}, metadata={"sr": 24000})
    assert torch.equal(p.primary_tensor, torch.ones(3)) and p.get("sr") == 24000 and p.get("codes").shape == (2, 16)
    assert MultimodalPayload().primary_tensor is None and not MultimodalPayload()


def test_completion_output_inheritance():
    base_fields = {f.name for f in dataclasses.fields(CompletionOutput)}
    ours = {f.name for f in dataclasses.fields(MultimodalCompletionOutput)}
    assert base_fields | {"multimodal_output"} == ours
    out = MultimodalCompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
    assert isinstance(out, CompletionOutput) and out.multimodal_output is None and not out.finished()


def test_runner_output_keeps_pooler_output_for_pooling_tensors():
    ok = OmniModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, pooler_output=[torch.ones(4)],
                               multimodal_outputs={"a": {"audio": torch.ones(2)}})
    assert ok.multimodal_outputs["a"]["audio"].shape == (2,)
    with pytest.raises(TypeError, match="multimodal_outputs"):
        OmniModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, pooler_output=[{"audio": torch.ones(2)}])


def stream(key, chunks):
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="image+audio+latent",
                                  strategies={key: S.CONCAT_DIM0})
    p.add_request(core_request("r", [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=len(chunks))), None)
    for i, c in enumerate(chunks):
        res = p.process_outputs([OmniEngineCoreOutput(request_id="r", new_token_ids=[5], multimodal_output={key: c},
                                                      finish_reason=FinishReason.LENGTH if i == len(chunks) - 1 else None)])
    return res.request_outputs[0].outputs[0].multimodal_output.tensors[key]


def test_processing_is_modality_agnostic():
    chunks = [torch.randn(2, 4), torch.randn(3, 4)]
    got = {key: stream(key, chunks) for key in ("image", "audio", "latent")}
    assert all(torch.equal(v, torch.cat(chunks)) for v in got.values())


@pytest.mark.parametrize("strategy, chunks, want", [
    (S.CONCAT_DIM0, [torch.ones(2, 3), torch.zeros(1, 3)], torch.cat([torch.ones(2, 3), torch.zeros(1, 3)])),
    (S.CONCAT_LAST, [torch.ones(2, 3), torch.zeros(2, 1)], torch.cat([torch.ones(2, 3), torch.zeros(2, 1)], -1)),
    (S.APPEND_LIST, [torch.ones(2), torch.zeros(5)], None),
    (S.REPLACE, [torch.ones(2), torch.zeros(5)], None),
])
def test_each_accumulation_strategy(strategy, chunks, want):
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio", strategies={"x": strategy})
    p.add_request(core_request("r", [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None)
    p.process_outputs([OmniEngineCoreOutput(request_id="r", new_token_ids=[5], multimodal_output={"x": chunks[0]})])
    res = p.process_outputs([OmniEngineCoreOutput(request_id="r", new_token_ids=[6], multimodal_output={"x": chunks[1]},
                                                  finish_reason=FinishReason.LENGTH)])
    payload = res.request_outputs[0].outputs[0].multimodal_output
    if strategy is S.APPEND_LIST:
        assert [torch.equal(a, b) for a, b in zip(payload.tensors["x"], chunks)] == [True, True]
    elif strategy is S.REPLACE:
        assert torch.equal(payload.metadata["x"], chunks[1])
    else:
        assert torch.equal(payload.tensors["x"], want)


def test_from_engine_output_from_diffusion_and_wrapping():
    payload = MultimodalPayload(tensors={"audio": torch.ones(4)})
    comp = MultimodalCompletionOutput(index=0, text="hi", token_ids=[1], cumulative_logprob=None, logprobs=None,
                                      finish_reason="stop", multimodal_output=payload)
    ro = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], prompt_logprobs=None, outputs=[comp],
                       finished=True)
    wrapped = OmniRequestOutput.from_engine_output(ro, stage_id=1, output_modality="text+audio")
    assert wrapped.multimodal is payload and wrapped.request_output is ro and wrapped.text == "hi"
    assert wrapped.output_modality == OutputModality.TEXT | OutputModality.AUDIO and wrapped.stage_id == 1
    again = wrap_output(wrapped, 2, OutputModality.AUDIO)
    assert again is wrapped and again.stage_id == 2 and not isinstance(again.request_output, OmniRequestOutput)
    assert wrap_output(ro, 0, "text").request_output is ro
    diff = OmniRequestOutput.from_diffusion("d", images=["img0", "img1"], stage_id=3)
    assert diff.finished and diff.output_modality == OutputModality.IMAGE and diff.images == ["img0", "img1"]
    assert wrap_output(diff, 4, "image") is diff and diff.request_output is None
    with pytest.raises(TypeError):
        OmniRequestOutput(request_id="x", request_output=diff)
