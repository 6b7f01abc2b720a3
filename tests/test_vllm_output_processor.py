"""``MultimodalOutputProcessor`` against vLLM's own ``OutputProcessor`` (marker vllm).

Drop-in: the same engine-core outputs go through both processors, and every request output must be
identical, for every output kind, with stop strings, logprobs, parallel sampling, pooling requests,
aborts and engine errors. Then the multimodal channel itself: payloads per output kind and strategy
(the same for audio, image and latent keys), requests without a detokenizer, bad input from the wire,
and a consolidation failure that fails its request visibly.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.exceptions import GenerationError, RetryableRequestError, VLLMValidationError  # noqa: E402
from vllm.outputs import PoolingRequestOutput, RequestError  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, FinishReason  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector  # noqa: E402
from vllm.v1.engine.parallel_sampling import ParentRequest  # noqa: E402
from vllm.v1.metrics.stats import IterationStats  # noqa: E402

from vllm_env import EOS, core_request, sampling, token_output, tokenizer, word_ids  # noqa: E402
from vllm_omni_kernels.errors import MultimodalOutputError, OutputMemoryError, TensorConsolidationError  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.vllm_integration.wire import MultimodalError, OmniEngineCoreOutput  # noqa: E402
from vllm_omni_kernels.vllm_integration.output_processor import (  # noqa: E402
    MultimodalOutputProcessor, OmniRequestState, OutputMemoryFailedError)
from vllm_omni_kernels.vllm_integration.outputs import MultimodalCompletionOutput  # noqa: E402

pytestmark = pytest.mark.vllm
KINDS = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
TOK = tokenizer()


def summarize(out):
    if isinstance(out, PoolingRequestOutput):
        return ("pool", out.request_id, out.finished, out.outputs.data.tolist())
    return ("gen", out.request_id, out.finished, out.prompt_token_ids,
            [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
              repr(c.logprobs)) for c in out.outputs])


def drive(processor, requests, steps, *, queues=False, aborts=()):
    """Add requests, feed steps (lists of engine-core outputs), abort at given steps; return what
    each step produced (summaries of returned or queued outputs, and reqs_to_abort)."""
    collectors = {}
    for req, parent, index in requests:
        q = RequestOutputCollector(req.sampling_params.output_kind if req.sampling_params else
                                   req.pooling_params.output_kind, req.request_id) if queues else None
        collectors[req.request_id] = q
        processor.add_request(req, None, parent, index, q)
    record = []
    for i, step in enumerate(steps):
        res = processor.process_outputs([o for o in step])
        got = [summarize(o) for o in res.request_outputs]
        for rid, q in collectors.items():
            if q is None:
                continue
            try:
                item = q.get_nowait()
            except (GenerationError, VLLMValidationError, MultimodalOutputError) as exc:  # what generate() raises
                got.append(("err", rid, type(exc).__name__, str(exc)))
                continue
            if item is not None:
                got.append(summarize(item))
        record.append((got, sorted(res.reqs_to_abort)))
        for when, ids in aborts:
            if when == i:
                processor.abort_requests(ids, internal=False)
    return record


def text_scenario(kind):
    """Requests and steps exercising vLLM's processor: stop string, logprobs, n=2, pooling, EOS."""
    words = word_ids(TOK, "the quick brown fox jumps over a lazy dog")
    base = core_request("plain", words[:3], sampling(kind, max_tokens=6))
    stop = core_request("stop", words[:2], sampling(kind, stop=["fox"], include_stop_str_in_output=False))
    lp = core_request("lp", words[:2], sampling(kind, logprobs=2))
    parent_req = core_request("par", words[:2], sampling(kind, n=2, seed=3))
    parent = ParentRequest(parent_req)
    children = []
    for idx in range(2):
        cid, params = parent.get_child_info(idx)
        children.append((core_request(cid, words[:2], params), parent, idx))
    pool = core_request("pool", words[:4], PoolingParams(task="embed"))
    reqs = [(base, None, 0), (stop, None, 0), (lp, None, 0), *children, (pool, None, 0)]
    seq = words[3:9]
    steps = []
    for t in range(6):
        step = [token_output("plain", seq[t], finish=FinishReason.LENGTH if t == 5 else None),
                token_output("lp", seq[t], logprobs=True, finish=FinishReason.STOP if t == 4 else None,
                             stop_reason=EOS if t == 4 else None) if t <= 4 else None,
                token_output("stop", seq[t]) if t <= 3 else None]
        for idx, (child, _, _) in enumerate(children):
            if t <= 2 + idx:
                step.append(token_output(child.request_id, seq[(t + idx) % 6],
                                         finish=FinishReason.LENGTH if t == 2 + idx else None))
        if t == 1:
            step.append(EngineCoreOutput(request_id="pool", new_token_ids=[], pooling_output=torch.arange(4.0),
                                         finish_reason=FinishReason.STOP))
        steps.append([s for s in step if s is not None])
    return reqs, steps


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_drop_in_matches_vllm_for_text_and_pooling(kind):
    reqs, steps = text_scenario(kind)
    ours = drive(MultimodalOutputProcessor(TOK, log_stats=True, output_modality="text+audio"), reqs, steps)
    reqs, steps = text_scenario(kind)
    theirs = drive(OutputProcessor(TOK, log_stats=True), reqs, steps)
    assert ours == theirs
    assert any(s[0] == "gen" and s[1] == "par" for step, _ in ours for s in step)  # parallel sampling ran
    stops = [c for step, _ in ours for s in step if s[1] == "stop" for c in s[4] if c[3] == "stop"]
    assert stops and stops[0][4] == "fox" and "fox" not in stops[0][1]  # the stop string ended it


def abort_error_scenario(kind):
    """Three requests; "b" fails in the engine at step 1, "a" stops at step 2 ("c" is aborted by the
    caller)."""
    words = word_ids(TOK, "one long happy song")
    reqs = [(core_request(r, words[:2], sampling(kind)), None, 0) for r in ("a", "b", "c")]
    steps = [[token_output("a", words[2]), token_output("b", words[2]), token_output("c", words[2])],
             [token_output("a", words[3]),
              EngineCoreOutput(request_id="b", new_token_ids=[], finish_reason=FinishReason.ERROR,
                               error=RequestError(code="engine_paused", message="paused"))],
             [token_output("a", words[0], finish=FinishReason.STOP)]]
    return reqs, steps


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_drop_in_matches_vllm_for_aborts_and_errors(kind):
    reqs, steps = abort_error_scenario(kind)
    ours = drive(MultimodalOutputProcessor(TOK, log_stats=False), reqs, steps, queues=True, aborts=[(0, ["c"])])
    reqs, steps = abort_error_scenario(kind)
    theirs = drive(OutputProcessor(TOK, log_stats=False), reqs, steps, queues=True, aborts=[(0, ["c"])])
    assert ours == theirs


def test_every_request_state_is_an_omni_request_state():
    p = MultimodalOutputProcessor(TOK, log_stats=False)
    p.add_request(core_request("x", [3, 4], sampling()), None)
    assert isinstance(p.request_states["x"], OmniRequestState)


def test_unknown_modality_fails_at_configuration():
    with pytest.raises(ValueError, match="unknown output modality .smell."):
        MultimodalOutputProcessor(TOK, log_stats=False, output_modality="text+smell")


# ------------------------------------------------------------------ the multimodal channel

def mm_step(rid, token, payload, finish=None):
    return OmniEngineCoreOutput(request_id=rid, new_token_ids=[token], multimodal_output=payload,
                                finish_reason=finish)


@pytest.mark.gpu
def test_a_request_whose_first_outputs_are_metadata_goes_where_its_first_tensor_is():
    """Metadata-only outputs ({"sr": 24000}) tie a request to no device: its first tensor, on CUDA
    (an in-process engine's producer), takes it and its metadata to that device's accumulator,
    where every later tensor of it goes."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    p.add_request(core_request("r", [3, 4], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=3)), None)
    audio = torch.randn(2, 5, device="cuda")
    p.process_outputs([mm_step("r", 5, {"sr": 24000})])
    p.process_outputs([mm_step("r", 6, {"audio": audio[0]})])
    (out,) = p.process_outputs([mm_step("r", 7, {"audio": audio[1]}, FinishReason.LENGTH)]).request_outputs
    payload = out.outputs[0].multimodal_output
    assert p.accumulation_errors == 0 and torch.equal(payload.tensors["audio"], audio.reshape(-1))
    assert payload.metadata == {"sr": 24000}


def run_stream(kind, key, chunks, *, strategy=None, metadata=None):
    """One request streaming ``chunks`` under ``key``; returns the payloads of its outputs."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio",
                                  strategies={key: strategy} if strategy else None)
    p.add_request(core_request("r", [3, 4], sampling(kind, max_tokens=len(chunks))), None)
    payloads = []
    for i, chunk in enumerate(chunks):
        value = {key: chunk, **(metadata or {})}
        res = p.process_outputs([mm_step("r", 5 + i, value, FinishReason.LENGTH if i == len(chunks) - 1 else None)])
        for out in res.request_outputs:
            comp = out.outputs[0]
            assert isinstance(comp, MultimodalCompletionOutput)
            payloads.append(comp.multimodal_output)
    assert p.accumulator_stats()["devices"]["cpu"]["requests"] == 0  # freed at finish
    return payloads


@pytest.mark.parametrize("key, chunks, axis", [
    ("audio", [torch.randn(1920), torch.randn(0), torch.randn(3840)], -1),          # CONCAT_LAST
    ("audio", [torch.randn(2, 960), torch.randn(2, 480)], -1),                       # stereo
    ("image", [torch.randn(3, 8, 8), torch.randn(2, 8, 8)], 0),                       # CONCAT_DIM0 rows
    ("latent", [torch.randn(4, 16).bfloat16(), torch.randn(1, 16).bfloat16()], 0),
    ("codes", [torch.randint(0, 99, (25, 16)), torch.randint(0, 99, (5, 16))], 0),
])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_payloads_per_output_kind_are_exact_for_every_modality(kind, key, chunks, axis):
    strategy = S.CONCAT_LAST if axis == -1 else S.CONCAT_DIM0
    payloads = run_stream(kind, key, chunks, strategy=strategy, metadata={"sr": torch.tensor(24000)})
    full = torch.cat(chunks, dim=axis)
    if kind is RequestOutputKind.DELTA:
        got = torch.cat([pl.tensors[key] for pl in payloads if pl is not None and key in pl.tensors], dim=axis)
        assert torch.equal(got, full)
    else:
        assert torch.equal(payloads[-1].tensors[key], full)
        if kind is RequestOutputKind.CUMULATIVE:
            assert torch.equal(payloads[0].tensors[key], chunks[0])
    assert int(payloads[-1].metadata["sr"]) == 24000


@pytest.mark.parametrize("upstream", [False, True], ids=["this-package", "upstream-style"])
@pytest.mark.parametrize("interval", [1, 3])
def test_cumulative_outputs_are_thinned_at_the_stream_interval_and_each_is_vllms(interval, upstream):
    """With ``stream_interval`` n, a CUMULATIVE request gets an output with its first token, then
    once every n tokens, and at finish (vLLM thins DELTA only; the upstream-style processor keeps
    vLLM's output every step); each output is the one vLLM's processor makes at that step, and its
    payload is everything so far."""
    from vllm_omni_kernels.vllm_integration.upstream_style import UpstreamStyleOutputProcessor

    words = word_ids(TOK, "the quick brown fox jumps over a lazy dog")
    chunks = [torch.randn(4 + i) for i in range(8)]
    cls = UpstreamStyleOutputProcessor if upstream else MultimodalOutputProcessor
    ours = cls(TOK, log_stats=False, output_modality="text+audio", stream_interval=interval,
               strategies={"audio": S.CONCAT_LAST})
    theirs = OutputProcessor(TOK, log_stats=False, stream_interval=interval)
    for p in (ours, theirs):
        p.add_request(core_request("c", words[:2], sampling(RequestOutputKind.CUMULATIVE, max_tokens=8)), None)
    sent = []
    for i, chunk in enumerate(chunks):
        finish = FinishReason.LENGTH if i == len(chunks) - 1 else None
        got = ours.process_outputs([mm_step("c", words[i % len(words)], {"audio": chunk}, finish)]).request_outputs
        want = theirs.process_outputs([token_output("c", words[i % len(words)], finish=finish)]).request_outputs
        assert len(want) == 1
        if got:
            sent.append(i + 1)
            assert summarize(got[0]) == summarize(want[0])
            assert torch.equal(got[0].outputs[0].multimodal_output.tensors["audio"], torch.cat(chunks[:i + 1]))
    assert sent == ([1, 2, 3, 4, 5, 6, 7, 8] if interval == 1 or upstream else [1, 4, 7, 8])


@pytest.mark.parametrize("payload", [{"sr": 24000, "audio": torch.arange(4.0)},
                                     {"loss": torch.tensor(1.0), "audio": torch.arange(4.0)}, {"sr": 24000}],
                         ids=["a plain value first", "a 0-d tensor first", "a plain value alone"])
def test_the_upstream_style_takes_plain_and_0d_values_beside_tensors(payload):
    """The upstream-style processor hands each step's values to the request as they are: a plain
    value or a 0-d tensor among them (a sample rate, a loss) is data like the others."""
    from vllm_omni_kernels.vllm_integration.upstream_style import UpstreamStyleOutputProcessor

    processor = UpstreamStyleOutputProcessor(TOK, log_stats=False, output_modality="text+audio")
    processor.add_request(core_request("c", [5, 6], sampling(RequestOutputKind.DELTA, max_tokens=2)), None)
    (out,) = processor.process_outputs([mm_step("c", 7, payload)]).request_outputs
    assert set(out.outputs[0].multimodal_output.tensors) | set(out.outputs[0].multimodal_output.metadata) \
        == set(payload)


def test_producer_keys_are_renamed_only_where_the_stage_says_so():
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio",
                                  key_aliases={"model_outputs": "audio"})
    p.add_request(core_request("r", [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None)
    p.process_outputs([mm_step("r", 5, {"model_outputs": torch.ones(3), "hidden": torch.zeros(2, 4)})])
    res = p.process_outputs([mm_step("r", 6, {"model_outputs": torch.ones(2)}, FinishReason.LENGTH)])
    payload = res.request_outputs[0].outputs[0].multimodal_output
    assert torch.equal(payload.tensors["audio"], torch.ones(5)) and "model_outputs" not in payload.tensors
    assert "hidden" in payload.tensors  # not named by the stage: kept under its own key


def test_append_list_and_replace_strategies():
    items = [torch.randn(3), torch.randn(5)]
    lists = run_stream(RequestOutputKind.FINAL_ONLY, "frames", items, strategy=S.APPEND_LIST)
    assert [torch.equal(a, b) for a, b in zip(lists[-1].tensors["frames"], items)] == [True, True]
    replaced = run_stream(RequestOutputKind.FINAL_ONLY, "voice", ["alto", "bass"], strategy=S.REPLACE)
    assert replaced[-1].metadata["voice"] == "bass"


def test_text_and_audio_in_one_request():
    words = word_ids(TOK, "happy song about audio")
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="text+audio")
    p.add_request(core_request("ta", words[:1], sampling(RequestOutputKind.CUMULATIVE, max_tokens=3)), None)
    chunks = [torch.randn(100), torch.randn(50), torch.randn(25)]
    outs = [p.process_outputs([mm_step("ta", words[1 + i], {"audio": c},
                                       FinishReason.LENGTH if i == 2 else None)]).request_outputs[0]
            for i, c in enumerate(chunks)]
    assert outs[-1].outputs[0].text.strip() == "song about audio"
    assert torch.equal(outs[-1].outputs[0].multimodal_output.tensors["audio"], torch.cat(chunks))


@pytest.mark.parametrize("params", [PoolingParams(task="embed"), None], ids=["pooling_params", "no_detokenize"])
def test_multimodal_only_requests_without_text(params):
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    if params is not None:
        params.output_kind = RequestOutputKind.FINAL_ONLY
    req = core_request("m", [3, 4], params or sampling(RequestOutputKind.FINAL_ONLY, detokenize=False))
    p.add_request(req, None)
    chunks = [torch.randn(64), torch.randn(32)]
    p.process_outputs([OmniEngineCoreOutput(request_id="m", new_token_ids=[], multimodal_output={"audio": chunks[0]})])
    res = p.process_outputs([OmniEngineCoreOutput(request_id="m", new_token_ids=[], multimodal_output={"audio": chunks[1]},
                                                  finish_reason=FinishReason.STOP)])
    (out,) = res.request_outputs
    assert out.finished and torch.equal(out.outputs[0].multimodal_output.tensors["audio"], torch.cat(chunks))


# ------------------------------------------------------------------ bad input from the wire

def failed_with(out, key: str | None) -> bool:
    """An LLMEngine output of a request the processor failed: finish reason "error", the typed
    error (naming the request and ``key``) in its stop reason."""
    comp = out.outputs[0]
    return out.finished and comp.finish_reason == "error" and f"request '{out.request_id}'" in comp.stop_reason \
        and (key is None or f"key '{key}'" in comp.stop_reason)


def test_bad_values_fail_only_their_request():
    """A bad value fails its request visibly in the step it comes (its data would have a hole: a
    skipped step's value passed off as whole), naming the key; the others are exact, and output
    for a request never seen is an error only counted."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio",
                                  strategies={"audio": S.CONCAT_LAST, "codes": S.CONCAT_DIM0})
    ids = ["good", "nontensor", "dtype", "frame", "notdict"]
    for rid in ids:
        p.add_request(core_request(rid, [3, 4], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None)
    good = [torch.randn(10), torch.randn(7)]
    codes = [torch.randint(0, 9, (2, 16)), torch.randint(0, 9, (3, 16))]
    step1 = [mm_step(r, 5, {"audio": good[0], "codes": codes[0]}) for r in ids[:-1]]
    step1.append(mm_step("notdict", 5, ["not", "a", "dict"]))
    step1.append(mm_step("ghost", 5, {"audio": good[0]}))  # unknown request id
    (notdict,) = p.process_outputs(step1).request_outputs
    assert notdict.request_id == "notdict" and failed_with(notdict, None) and "dict" in notdict.outputs[0].stop_reason
    step2 = [mm_step("good", 6, {"audio": good[1], "codes": codes[1]}, FinishReason.LENGTH),
             mm_step("nontensor", 6, {"audio": "abc", "codes": codes[1]}, FinishReason.LENGTH),
             mm_step("dtype", 6, {"audio": good[1].double(), "codes": codes[1]}, FinishReason.LENGTH),
             mm_step("frame", 6, {"audio": good[1], "codes": torch.zeros(3, 8, dtype=torch.int64)}, FinishReason.LENGTH),
             mm_step("notdict", 6, None, FinishReason.LENGTH)]  # (it failed: vLLM drops its output)
    res = p.process_outputs(step2)
    got = {o.request_id: o for o in res.request_outputs}
    assert set(got) == {"good", "nontensor", "dtype", "frame"}
    assert torch.equal(got["good"].outputs[0].multimodal_output.tensors["audio"], torch.cat(good))
    assert torch.equal(got["good"].outputs[0].multimodal_output.tensors["codes"], torch.cat(codes))
    assert got["good"].outputs[0].finish_reason == "length"
    assert failed_with(got["nontensor"], "audio") and failed_with(got["dtype"], "audio")
    assert failed_with(got["frame"], "codes")
    assert p.accumulation_errors == 5
    assert p.accumulator_stats()["devices"]["cpu"]["requests"] == 0


def test_consolidation_error_fails_the_request_visibly():
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    queue = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, "bad")
    p.add_request(core_request("bad", [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None, None, 0, queue)
    p.add_request(core_request("ok", [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None)
    p.process_outputs([mm_step("bad", 5, {"audio": torch.randn(8)}), mm_step("ok", 5, {"audio": torch.ones(4)})])
    state = p.request_states["bad"]
    state.accumulator.pools()[0].drain(["bad"])  # a drained span can no longer be consolidated
    res = p.process_outputs([mm_step("bad", 6, {"audio": torch.randn(8)}, FinishReason.LENGTH),
                             mm_step("ok", 6, {"audio": torch.ones(4)}, FinishReason.LENGTH)])
    with pytest.raises(TensorConsolidationError):
        queue.get_nowait()  # the request's generate() raises it
    assert p.consolidation_errors == 1 and "bad" not in p.request_states
    (ok,) = res.request_outputs
    assert torch.equal(ok.outputs[0].multimodal_output.tensors["audio"], torch.ones(8))


def test_consolidation_error_in_the_engine_path_sets_finish_reason_error():
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    p.add_request(core_request("bad", [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None)
    p.process_outputs([mm_step("bad", 5, {"audio": torch.randn(8)})])
    p.request_states["bad"].accumulator.pools()[0].drain(["bad"])
    res = p.process_outputs([mm_step("bad", 6, {"audio": torch.randn(8)}, FinishReason.LENGTH)])
    (out,) = res.request_outputs
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert "consolidat" in out.outputs[0].stop_reason.lower() or "drain" in out.outputs[0].stop_reason.lower()


def test_abort_frees_the_request_slots():
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    p.add_request(core_request("a", [3], sampling(RequestOutputKind.DELTA)), None)
    p.process_outputs([mm_step("a", 5, {"audio": torch.randn(8)})])
    assert p.accumulator_stats()["devices"]["cpu"]["requests"] == 1
    p.abort_requests(["a"], internal=False)
    assert p.accumulator_stats()["devices"]["cpu"]["requests"] == 0


def test_per_request_add_multimodal_tensor():
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    p.add_request(core_request("a", [3], sampling(RequestOutputKind.CUMULATIVE)), None)
    p.process_outputs([mm_step("a", 5, {"audio": torch.ones(2)})])
    state = p.request_states["a"]
    assert state.add_multimodal_tensor({"audio": torch.zeros(3)}) == []
    assert torch.equal(state.take_payload(False).tensors["audio"], torch.tensor([1.0, 1, 0, 0, 0]))
    assert np.isclose(float(state.take_payload(True).tensors["audio"].sum()), 2.0)


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE])
def test_a_value_the_output_memory_cannot_hold_now_fails_its_request_to_be_retried(kind):
    """Three requests of 3 x 200 samples through 8 KiB of output memory: a request whose value finds
    the memory taken fails at once with the retryable ``OutputMemoryFailedError`` naming it (one
    used to lose that value and finish normally, 400 of its 600 samples with a hole in the middle);
    every other keeps every sample."""
    from vllm_omni_kernels.accumulator import AccumulatorConfig

    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio",
                                  accumulator_config=AccumulatorConfig(pool_budget_bytes=8192, initial_frames=256))
    queues = {r: RequestOutputCollector(kind, r) for r in "abc"}
    for i, r in enumerate("abc"):
        p.add_request(core_request(r, [3], sampling(kind, max_tokens=3)), None, None, i, queues[r])
    sent, last, raised = {r: [] for r in "abc"}, {}, {}
    for step in range(3):
        chunks = {r: torch.full((200,), float(step)) + ord(r) for r in "abc"}
        p.process_outputs([mm_step(r, 5 + step, {"audio": chunks[r]}, FinishReason.LENGTH if step == 2 else None)
                           for r in "abc" if r not in raised])
        for r in "abc":
            sent[r].append(chunks[r])
            try:  # (what the request's generate() gets: an output, or the error it raises)
                got = queues[r].get_nowait() if r not in raised else None
            except MultimodalOutputError as exc:
                raised[r] = exc
                continue
            if got is not None:
                last[r] = got
    assert "c" in raised and "a" not in raised  # (c's second value finds the memory taken)
    for r, exc in raised.items():
        assert isinstance(exc, OutputMemoryFailedError) and isinstance(exc, RetryableRequestError)
        assert f"request '{r}'" in str(exc)
        assert r not in last or not last[r].finished  # (no output of it said it was whole)
    for r in set("abc") - set(raised):
        assert last[r].finished and torch.equal(last[r].outputs[0].multimodal_output.tensors["audio"], torch.cat(sent[r]))
    assert p.accumulator_stats()["devices"]["cpu"]["requests"] == 0


def test_a_payload_with_a_key_and_its_alias_fails_only_that_request():
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio", key_aliases={"model_outputs": "audio"})
    for rid in ("both", "ok"):
        p.add_request(core_request(rid, [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=2)), None)
    res = p.process_outputs([mm_step("both", 5, {"model_outputs": torch.ones(3), "audio": torch.zeros(2),
                                                 "sr": 16000}),
                             mm_step("ok", 5, {"model_outputs": torch.ones(4)})])
    (both,) = res.request_outputs
    assert both.request_id == "both" and failed_with(both, "audio") and p.accumulation_errors == 1
    res = p.process_outputs([mm_step("both", 6, {"audio": torch.full((2,), 2.0)}, FinishReason.LENGTH),
                             mm_step("ok", 6, {"audio": torch.ones(1)}, FinishReason.LENGTH)])
    (ok,) = res.request_outputs
    assert ok.request_id == "ok" and list(ok.outputs[0].token_ids) == [5, 6] and p.late_outputs == 1
    assert torch.equal(ok.outputs[0].multimodal_output.tensors["audio"], torch.ones(5))


# ------------------------------------------------------------------ states vLLM builds itself

def vllm_made_states(req):
    """The same request's state built each way vLLM builds one: ``from_new_request``, the
    constructor, and ``__new__`` with the fields set afterwards."""
    def fresh():
        return OmniRequestState.from_new_request(TOK, req, None, None, 0, None, False, 1)

    source = fresh()
    by_init = OmniRequestState(**{name: getattr(source, name) for name in (
        "request_id", "external_req_id", "parent_req", "request_index", "lora_request", "output_kind", "prompt",
        "prompt_token_ids", "prompt_embeds", "logprobs_processor", "detokenizer", "max_tokens_param")},
        arrival_time=0.0, queue=None, log_stats=False, stream_interval=1)
    bare = OmniRequestState.__new__(OmniRequestState)
    bare.__dict__.update(fresh().__dict__)
    return fresh(), by_init, bare


def test_states_built_by_vllm_in_any_way_work():
    words = word_ids(TOK, "the quick brown fox")
    for state in vllm_made_states(core_request("s", words[:2], sampling(RequestOutputKind.CUMULATIVE))):
        assert state.accumulator is None and state.failures is None
        state.detokenizer.update([words[2]], False)
        out = state.make_request_output([words[2]], None, None, None)
        assert list(out.outputs[0].token_ids) == [words[2]] and out.outputs[0].text.strip() == "brown"
        assert type(out.outputs[0]).__name__ == "CompletionOutput"  # no accumulator: exactly vLLM's output


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_vllm_processor_with_omni_states_behaves_as_stock(kind, monkeypatch):
    """vLLM's own ``OutputProcessor`` with ``RequestState`` rebound to ``OmniRequestState`` (a drop-in
    state class) gives exactly the stock outputs for generate, pooling, stop strings, logprobs,
    parallel sampling, aborts and engine errors; so does ``MultimodalOutputProcessor`` beside it."""
    import vllm.v1.engine.output_processor as vllm_op

    def both_scenarios(processor_cls):
        reqs, steps = text_scenario(kind)
        text = drive(processor_cls(TOK, log_stats=True), reqs, steps)
        reqs, steps = abort_error_scenario(kind)
        aborts = drive(processor_cls(TOK, log_stats=False), reqs, steps, queues=True, aborts=[(0, ["c"])])
        return text, aborts

    stock = both_scenarios(OutputProcessor)
    monkeypatch.setattr(vllm_op, "RequestState", OmniRequestState)
    processor = OutputProcessor(TOK, log_stats=True)
    processor.add_request(core_request("probe", [3], sampling(kind)), None)
    assert type(processor.request_states["probe"]) is OmniRequestState  # vLLM built it
    assert both_scenarios(OutputProcessor) == stock
    assert both_scenarios(MultimodalOutputProcessor) == stock


@pytest.mark.parametrize("bad", [
    {"audio": ["float32", [999], 1]},      # shape not matching its buffer
    {"audio": ["float32", [4], 99]},       # buffer index past the message's buffers
    {"audio": ["float32", [4], {"h": 1}]},  # out-of-band data we never send
    {"audio": "oops"},                     # not a tensor where the request holds tensors
    {"audio": torch.ones(2, 3)},           # frame shape changes mid-stream
    {"model_outputs": torch.ones(3), "audio": torch.ones(3)},  # two keys for one
], ids=["shape", "index", "oob", "nontensor", "frame", "alias"])
def test_bad_input_over_the_wire_fails_only_its_request(bad):
    """Frames cross vLLM's msgpack encoder and the omni decoder; the bad request fails visibly in
    that step (its error counted), and the frame's other requests go on, exact."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackEncoder

    from vllm_omni_kernels.vllm_integration.wire import OmniMsgpackDecoder

    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio", key_aliases={"model_outputs": "audio"})
    ids = ["g1", "bad", "g2"]
    for rid in ids:
        p.add_request(core_request(rid, [3], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=3)), None)
    encoder, decoder = MsgpackEncoder(), OmniMsgpackDecoder()
    sent = {rid: [] for rid in ids}

    def step(token, payloads, finish=None):
        outs = EngineCoreOutputs(outputs=[mm_step(rid, token, payloads[rid], finish) for rid in ids])
        return p.process_outputs(decoder.decode(encoder.encode(outs)).outputs)

    for token in (5, 6, 7):
        payloads = {rid: {"audio": torch.randn(300 + 10 * token)} for rid in ids}
        if token == 6:
            payloads["bad"] = bad
        for rid in ids:
            if "audio" in payloads[rid] and isinstance(payloads[rid]["audio"], torch.Tensor) and (rid != "bad" or token != 6):
                sent[rid].append(payloads[rid]["audio"])
        res = step(token, payloads, FinishReason.LENGTH if token == 7 else None)
        if token == 6:
            (failed,) = res.request_outputs
            assert failed.request_id == "bad" and failed_with(failed, "audio") and p.accumulation_errors == 1
    got = {o.request_id: o.outputs[0] for o in res.request_outputs}
    assert set(got) == {"g1", "g2"}
    for rid in got:
        assert list(got[rid].token_ids) == [5, 6, 7]
        assert torch.equal(got[rid].multimodal_output.tensors["audio"], torch.cat(sent[rid])), rid
    assert p.accumulation_errors == 1 and p.accumulator_stats()["devices"]["cpu"]["requests"] == 0


def test_delta_outputs_merged_for_a_slow_consumer_keep_every_chunk():
    """AsyncLLM merges DELTA outputs its consumer has not read yet (vLLM's ``RequestOutput.add``,
    which would keep the first output's payload only): every chunk must still arrive, in order."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio",
                                  strategies={"audio": S.CONCAT_LAST, "codes": S.CONCAT_DIM0})
    queue = RequestOutputCollector(RequestOutputKind.DELTA, "slow")
    p.add_request(core_request("slow", [3], sampling(RequestOutputKind.DELTA, max_tokens=5)), None, None, 0, queue)
    audio = [torch.randn(5 + i) for i in range(4)]
    codes = [torch.randint(0, 9, (1 + i % 2, 3)) for i in range(4)]
    p.process_outputs([token_output("slow", 4)])  # a first output without multimodal data
    for i in range(4):  # four more steps before the consumer reads
        p.process_outputs([mm_step("slow", 5 + i, {"audio": audio[i], "codes": codes[i], "sr": 16000 + i},
                                   FinishReason.LENGTH if i == 3 else None)])
    out = queue.get_nowait()
    comp = out.outputs[0]
    assert list(comp.token_ids) == [4, 5, 6, 7, 8] and out.finished
    assert torch.equal(comp.multimodal_output.tensors["audio"], torch.cat(audio))
    assert torch.equal(comp.multimodal_output.tensors["codes"], torch.cat(codes))
    assert comp.multimodal_output.metadata["sr"] == 16003


def test_output_after_an_abort_is_counted_not_an_error_and_a_strangers_output_is():
    """An abort races the engine's next step: that step's multimodal output for the aborted request
    is counted as late (no warning, no error); output for a request never seen is an error."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    for rid in ("gone", "kept"):
        p.add_request(core_request(rid, [3], sampling(RequestOutputKind.DELTA, max_tokens=5)), None)
    p.process_outputs([mm_step(r, 5, {"audio": torch.ones(2)}) for r in ("gone", "kept")])
    assert p.abort_requests(["gone"], internal=False) == ["gone"]
    res = p.process_outputs([mm_step("gone", 6, {"audio": torch.ones(3)}),
                             mm_step("kept", 6, {"audio": torch.full((2,), 2.0)}),
                             mm_step("stranger", 6, {"audio": torch.ones(1)})])
    assert p.late_outputs == 1 and p.accumulation_errors == 1
    assert p.accumulator_stats()["late_outputs"] == 1
    got = {o.request_id: o.outputs[0] for o in res.request_outputs}
    assert torch.equal(got["kept"].multimodal_output.tensors["audio"], torch.full((2,), 2.0))
    # an output with both the worker's data and plain values counts once
    both = {"multimodal_delivered": {"codes": (0, torch.ones(1, 16))}}
    p.process_outputs([OmniEngineCoreOutput(request_id="gone", new_token_ids=[7],
                                            multimodal_output={"audio": torch.ones(1)}, **both),
                       OmniEngineCoreOutput(request_id="stranger", new_token_ids=[7],
                                            multimodal_output={"audio": torch.ones(1)}, **both)])
    assert p.late_outputs == 2 and p.accumulation_errors == 2


def test_an_aborts_failed_final_output_leaves_nothing_for_a_later_request_of_the_id():
    """An aborted FINAL_ONLY request whose held pieces do not concatenate: vLLM's abort makes its
    final output (the error in it), and the failure does not stay parked for the next step, where it
    would fail a new request that reuses the id (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``) with the
    old one's error and abort it in the engine."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")

    def add(rid):
        queue = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, rid)
        p.add_request(core_request(rid, [5, 6], sampling(RequestOutputKind.FINAL_ONLY, max_tokens=4,
                                                         detokenize=False)), None, None, 0, queue)
        return queue

    def step(piece, finish=None):
        return token_output("r", 7, finish=finish, cls=OmniEngineCoreOutput, multimodal_delivered={"codes": (0, piece)})

    old = add("r")
    p.process_outputs([step(torch.ones(2, 4))])
    p.process_outputs([step(torch.ones(2, 8))])  # a frame that does not concatenate: found when joined
    assert p.abort_requests(["r"], internal=False) == ["r"]
    final = old.get_nowait()
    assert final.finished and final.outputs[0].finish_reason == "error" and "concatenate" in final.outputs[0].stop_reason
    new = add("r")
    res = p.process_outputs([step(torch.zeros(3, 4))])
    assert res.reqs_to_abort == [] and "r" in p.request_states and new.get_nowait() is None
    res = p.process_outputs([step(torch.zeros(1, 4), FinishReason.LENGTH)])
    out = new.get_nowait()
    assert out.finished and torch.equal(out.outputs[0].multimodal_output.tensors["codes"], torch.zeros(4, 4))


def test_worker_pieces_of_every_kind_and_a_frame_that_changes_fail_only_their_request():
    """Worker-delivered pieces (``multimodal_delivered``): DELTA outputs carry the pieces since the
    last output, CUMULATIVE ones everything so far (sized at the first piece for ``max_tokens``,
    grown when that was short), FINAL_ONLY everything at finish; a CUMULATIVE request whose frame
    changes mid-stream fails with a ``TensorConsolidationError`` naming it and the key, and the
    other requests lose nothing."""
    gen = torch.Generator().manual_seed(3)
    kinds = {"d": RequestOutputKind.DELTA, "c": RequestOutputKind.CUMULATIVE, "short": RequestOutputKind.CUMULATIVE,
             "f": RequestOutputKind.FINAL_ONLY, "bad": RequestOutputKind.CUMULATIVE}
    processor = MultimodalOutputProcessor(TOK, log_stats=False)
    for rid, kind in kinds.items():  # "short" brings more per token later than its first piece told
        processor.add_request(core_request(rid, [5, 6, 7], sampling(kind, max_tokens=6, detokenize=False)), None)
    sent = {rid: [] for rid in kinds}
    got = {rid: [] for rid in kinds}
    failed = {}
    for step in range(6):
        outs = []
        for rid in kinds:
            n = 3 if rid == "short" and step > 0 else 2
            frame = (2, 1) if rid == "bad" and step == 3 else (1, 2)
            piece = torch.randn(n, *frame, generator=gen)
            sent[rid].append(piece)
            outs.append(token_output(rid, 7, finish=FinishReason.LENGTH if step == 5 else None,
                                     cls=OmniEngineCoreOutput, multimodal_delivered={"audio": (0, piece)}))
        res = processor.process_outputs(outs)
        for out in res.request_outputs:
            payload = getattr(out.outputs[0], "multimodal_output", None)
            if out.outputs[0].finish_reason == "error":
                failed[out.request_id] = out.outputs[0].stop_reason
            elif payload is not None:
                got[out.request_id].append(payload.tensors["audio"].clone())
    whole = {rid: torch.cat(pieces) for rid, pieces in sent.items() if rid != "bad"}
    assert torch.equal(torch.cat(got["d"]), whole["d"]) and len(got["d"]) == 6
    for rid in ("c", "short"):
        assert len(got[rid]) == 6 and all(torch.equal(g, whole[rid][:len(g)]) for g in got[rid])
        assert torch.equal(got[rid][-1], whole[rid])
    assert len(got["f"]) == 1 and torch.equal(got["f"][0], whole["f"])
    assert list(failed) == ["bad"] and "bad" in failed["bad"] and "audio" in failed["bad"]
    assert processor.consolidation_errors == 1 and "bad" not in processor.request_states



@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_deliveries_joined_into_one_output_keep_every_key_whichever_brought_it(kind):
    """An output that joins several deliveries (DELTA between vLLM's ``stream_interval`` outputs,
    FINAL_ONLY at its finish) holds every key any of them brought, a key's pieces in order, though
    the first delivery lacks the key (a step that had no codes due, or whose codes were left out)."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, stream_interval=2)
    processor.add_request(core_request("r", [5, 6, 7], sampling(kind, max_tokens=4, detokenize=False)), None)
    gen = torch.Generator().manual_seed(5)
    audio = [torch.randn(1920, generator=gen) for _ in range(4)]
    codes = {2: torch.randint(0, 9, (1, 8), generator=gen), 3: torch.randint(0, 9, (2, 8), generator=gen)}
    got = {"audio": [], "codes": []}
    for step in range(4):
        delivered = {"audio": (-1, audio[step])} | ({"codes": (0, codes[step])} if step in codes else {})
        res = processor.process_outputs([token_output("r", 7, finish=FinishReason.LENGTH if step == 3 else None,
                                                      cls=OmniEngineCoreOutput, multimodal_delivered=delivered)])
        for out in res.request_outputs:
            payload = out.outputs[0].multimodal_output
            if payload is not None:
                for key in payload.tensors:
                    got[key].append(payload.tensors[key].clone())
    assert torch.equal(torch.cat(got["audio"]), torch.cat(audio))
    assert torch.equal(torch.cat(got["codes"]), torch.cat([codes[2], codes[3]]))


def test_two_worker_keys_that_alias_to_one_name_fail_their_request_and_lose_nothing_of_another():
    """With ``model_outputs`` an alias of ``audio``, a worker delivery that has both would keep one of
    them: that request fails visibly, naming the key, and a request whose delivery has one of them
    gets it under its name."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio",
                                          key_aliases={"model_outputs": "audio"})
    for rid in ("ok", "both"):
        processor.add_request(core_request(rid, [5, 6, 7], sampling(RequestOutputKind.DELTA, max_tokens=1,
                                                                    detokenize=False)), None)
    a, b = torch.arange(4.0), -torch.arange(4.0)
    outs = [token_output("ok", 7, finish=FinishReason.LENGTH, cls=OmniEngineCoreOutput,
                         multimodal_delivered={"model_outputs": (0, a)}),
            token_output("both", 7, finish=FinishReason.LENGTH, cls=OmniEngineCoreOutput,
                         multimodal_delivered={"model_outputs": (0, a), "audio": (0, b)})]
    got = {out.request_id: out.outputs[0] for out in processor.process_outputs(outs).request_outputs}
    assert torch.equal(got["ok"].multimodal_output.tensors["audio"], a)
    assert got["both"].finish_reason == "error" and "audio" in got["both"].stop_reason
    assert not processor.request_states


@pytest.mark.parametrize("n", [1, 2])
def test_a_failure_in_a_step_without_the_requests_output_still_ends_it_visibly(n):
    """LLMEngine (no output queue), DELTA at ``stream_interval`` 4: a delivery whose two worker keys
    alias to one name fails its request in a step where vLLM makes no output for it. The request
    still ends with an output that says "error" (of a sample of n, its own completion, when its
    parent reports), not silently."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, stream_interval=4, output_modality="audio",
                                  key_aliases={"model_outputs": "audio"})
    params = sampling(RequestOutputKind.DELTA, max_tokens=20, detokenize=False, n=n)
    if n == 1:
        p.add_request(core_request("r", [5, 6, 7], params), None)
        ids = ["r"]
    else:
        from vllm.v1.engine.parallel_sampling import ParentRequest

        parent = ParentRequest(core_request("r", [5, 6, 7], params))
        ids = []
        for index in range(n):
            child_id, child_params = parent.get_child_info(index)
            p.add_request(core_request(child_id, [5, 6, 7], child_params), None, parent, index, None)
            ids.append(child_id)
    a = torch.arange(4.0)
    first = p.process_outputs([token_output(rid, 7, cls=OmniEngineCoreOutput, multimodal_delivered={"audio": (0, a)})
                               for rid in ids])
    assert {o.request_id for o in first.request_outputs} == {"r"}
    bad = token_output(ids[0], 8, cls=OmniEngineCoreOutput,
                       multimodal_delivered={"model_outputs": (0, a), "audio": (0, -a)})
    later = p.process_outputs([bad])
    assert ids[0] not in p.request_states
    reasons = {c.index: c.finish_reason for o in later.request_outputs for c in o.outputs}
    assert reasons == {0: "error"} and "audio" in later.request_outputs[0].outputs[0].stop_reason
    assert later.request_outputs[0].finished == (n == 1)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_worker_pieces_and_per_step_values_of_one_request(kind):
    """A request whose worker data (``multimodal_delivered``) and per-step values
    (``multimodal_output``) come in the same outputs, the worker's less often (its cadence): every
    CUMULATIVE output holds everything so far of both, the steps without new worker data included;
    DELTA outputs add up to everything. A key that comes both ways fails the request, naming it."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, strategies={"emb": "concat_dim0"})
    for rid in ("r", "both"):
        processor.add_request(core_request(rid, [5, 6, 7], sampling(kind, max_tokens=3, detokenize=False)), None)
    audio = torch.arange(8.0)
    got, errors = [], {}
    for step in range(3):
        worker = {"multimodal_delivered": {"audio": (-1, audio)}} if step == 0 else {}
        outs = [token_output("r", 7 + step, finish=FinishReason.LENGTH if step == 2 else None,
                             cls=OmniEngineCoreOutput, multimodal_output={"emb": torch.full((1, 2), float(step))},
                             **worker)]
        if step == 0:
            outs.append(token_output("both", 7, cls=OmniEngineCoreOutput, multimodal_output={"audio": audio},
                                     multimodal_delivered={"audio": (-1, audio)}))
        for out in processor.process_outputs(outs).request_outputs:
            if out.outputs[0].finish_reason == "error":
                errors[out.request_id] = out.outputs[0].stop_reason
            elif out.request_id == "r":
                got.append(out.outputs[0].multimodal_output)
    embs = torch.arange(3.0).repeat_interleave(2).view(3, 2)
    if kind == RequestOutputKind.CUMULATIVE:
        assert len(got) == 3
        for step, payload in enumerate(got):
            assert torch.equal(payload.tensors["audio"], audio), step
            assert torch.equal(payload.tensors["emb"], embs[:step + 1]), step
    else:
        assert torch.equal(torch.cat([p.tensors["audio"] for p in got if "audio" in p.tensors]), audio)
        assert torch.equal(torch.cat([p.tensors["emb"] for p in got]), embs)
    assert list(errors) == ["both"] and "audio" in errors["both"] and "both" not in processor.request_states


def test_a_failed_sample_of_n_leaves_its_siblings_outputs_as_they_are():
    """n = 2 under ``LLMEngine`` (no queue): sample 0 fails in the worker while sample 1 gets its
    next token in the same step. Only sample 0's completion says "error"; sample 1's output
    goes on, and the request is not reported finished."""
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from vllm_omni_kernels.vllm_integration.wire import MultimodalError

    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    parent = ParentRequest(core_request("par", [3, 4], sampling(RequestOutputKind.DELTA, n=2, max_tokens=6)))
    kids = []
    for index in range(2):
        child_id, params = parent.get_child_info(index)
        kids.append(child_id)
        child = core_request(child_id, [3, 4], params)
        child.external_req_id = "par"  # as LLMEngine.add_request makes the samples: copies of the request
        processor.add_request(child, None, parent, index, None)
    processor.process_outputs([OmniEngineCoreOutput(request_id=c, new_token_ids=[5],
                                                    multimodal_output={"audio": torch.ones(4)}) for c in kids])
    result = processor.process_outputs([
        OmniEngineCoreOutput(request_id=kids[0], new_token_ids=[6], finish_reason=FinishReason.ERROR,
                             multimodal_error=MultimodalError("boom")),
        OmniEngineCoreOutput(request_id=kids[1], new_token_ids=[6], multimodal_output={"audio": torch.ones(4)})])
    by_index = {completion.index: (out, completion) for out in result.request_outputs for completion in out.outputs}
    assert by_index[0][1].finish_reason == "error" and "boom" in by_index[0][1].stop_reason
    out, completion = by_index[1]
    assert (out.finished, completion.finish_reason, completion.stop_reason) == (False, None, None)
    assert torch.equal(completion.multimodal_output.tensors["audio"], torch.ones(4))


def _samples_of(processor, kind, n=2):
    """A request of ``n`` samples as ``LLMEngine.add_request`` makes them (copies of the request,
    each a child of one ``ParentRequest``); returns the children's ids."""
    from vllm.v1.engine.parallel_sampling import ParentRequest

    parent = ParentRequest(core_request("par", [3, 4], sampling(kind, n=n, max_tokens=6, detokenize=False)))
    kids = []
    for index in range(n):
        child_id, params = parent.get_child_info(index)
        kids.append(child_id)
        child = core_request(child_id, [3, 4], params)
        child.external_req_id = "par"
        processor.add_request(child, None, parent, index, None)
    return kids


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda k: k.name)
@pytest.mark.parametrize("by", ["caller's id", "parent's id"])
@pytest.mark.parametrize("queued", [False, True], ids=["LLMEngine", "AsyncLLM"])
def test_samples_of_n_aborted_leave_nothing_behind(kind, by, queued):
    """A request of n = 2 aborted mid-way, by the caller's id (``AsyncLLM.abort``, ``LLMEngine.abort_request``)
    or its parent's (a cancelled ``generate``): no sample's state and no ``ParentRequest`` is left (by
    the caller's id, vLLM kept the parent, its params and its aggregate, for every such request)."""
    from vllm.v1.engine.parallel_sampling import ParentRequest

    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    parent = ParentRequest(core_request("par-1234", [3, 4], sampling(kind, n=2, max_tokens=6, detokenize=False)))
    parent.external_req_id = "par"
    queue = RequestOutputCollector(kind, "par") if queued else None
    kids = []
    for index in range(2):
        child_id, params = parent.get_child_info(index)
        kids.append(child_id)
        child = core_request(child_id, [3, 4], params)
        child.external_req_id = "par"
        processor.add_request(child, None, parent, index, queue)
    processor.process_outputs([token_output(c, 5, cls=OmniEngineCoreOutput, multimodal_output={"audio": torch.ones(4)})
                               for c in kids])
    if by == "caller's id":
        aborted = processor.abort_requests(["par"], internal=False)
    else:
        aborted = processor.abort_requests([parent.request_id], internal=True)
    assert sorted(aborted) == sorted(kids)
    assert not processor.request_states and not processor.external_req_ids and not processor.parent_requests
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("kind", list(RequestOutputKind), ids=lambda k: k.name)
@pytest.mark.parametrize("one_step", [True, False], ids=["in one step", "step by step"])
def test_samples_of_n_the_worker_fails_end_their_request_once_each_saying_why(kind, one_step):
    """n = 3 under ``LLMEngine``, every sample failed by the worker, all in one step or one a step:
    the request's outputs say finished once, on the last (vLLM's contract for n; two failing in one
    step each said so), and every sample's completion says "error" with the worker's message
    (FINAL_ONLY: those of the samples that failed before the last, waiting in the aggregate, had no
    message)."""
    from vllm_omni_kernels.vllm_integration.wire import MultimodalError

    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    kids = _samples_of(processor, kind, n=3)
    seen = processor.process_outputs([token_output(c, 5, cls=OmniEngineCoreOutput,
                                                   multimodal_output={"audio": torch.ones(4)}) for c in kids]
                                     ).request_outputs
    failing = [OmniEngineCoreOutput(request_id=c, new_token_ids=[6], finish_reason=FinishReason.ERROR,
                                    multimodal_error=MultimodalError(f"boom {i}")) for i, c in enumerate(kids)]
    for step in ([failing] if one_step else [[f] for f in failing]):
        seen += processor.process_outputs(step).request_outputs
    assert not processor.request_states and not processor.has_unfinished_requests()
    assert [out.finished for out in seen].count(True) == 1 and seen[-1].finished
    ended = {c.index: c for out in seen for c in out.outputs if c.finish_reason}
    assert sorted(ended) == [0, 1, 2]
    assert all(c.finish_reason == "error" and f"boom {i}" in c.stop_reason for i, c in ended.items()), ended


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_a_sample_of_n_failing_in_the_frontend_last_or_first_ends_its_request_visibly(kind):
    """A sample whose key comes both ways fails in the frontend at its last output: after its
    sibling finished (the request's last output must say finished), or before (FINAL_ONLY: the one
    aggregated output must say that sample failed, not carry it as a plain finished one)."""
    audio = torch.arange(4.0)
    for last in (True, False):
        processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
        kids = _samples_of(processor, kind)
        failing, other = kids
        first = [token_output(c, 5, cls=OmniEngineCoreOutput, multimodal_output={"audio": audio}) for c in kids]
        seen = processor.process_outputs(first).request_outputs
        bad = token_output(failing, 6, finish=FinishReason.LENGTH, cls=OmniEngineCoreOutput,
                           multimodal_output={"audio": audio}, multimodal_delivered={"audio": (-1, audio)})
        done = token_output(other, 6, finish=FinishReason.LENGTH, cls=OmniEngineCoreOutput,
                            multimodal_output={"audio": audio})
        steps = [[done], [bad]] if last else [[bad], [done]]
        for step in steps:
            seen += processor.process_outputs(step).request_outputs
        assert not processor.request_states and not processor.has_unfinished_requests()
        (final,) = [out for out in seen if out.finished]
        assert final is seen[-1]
        reasons = {c.index: c.finish_reason for out in seen for c in out.outputs if c.finish_reason}
        assert reasons == {0: "error", 1: "length"}, (last, reasons)

def test_an_output_with_data_only_adds_no_inter_token_latency():
    """While a stopped request's final output waits for the worker's rest, the scheduler sends the
    data that arrives on an output without tokens: vLLM's statistics see the request's tokens as
    they came (an inter-token latency per token step, the first token's latency once)."""
    processor = MultimodalOutputProcessor(TOK, log_stats=True)
    processor.add_request(core_request("r", [5, 6, 7], sampling(RequestOutputKind.DELTA, detokenize=False)), None)
    piece = {"audio": (0, torch.ones(2))}
    steps = [token_output("r", 7, cls=OmniEngineCoreOutput, multimodal_delivered=piece),
             token_output("r", 8, cls=OmniEngineCoreOutput, multimodal_delivered=piece),
             OmniEngineCoreOutput(request_id="r", new_token_ids=[], multimodal_delivered=piece),
             token_output("r", 9, finish=FinishReason.STOP, cls=OmniEngineCoreOutput, multimodal_delivered=piece)]
    stats = []
    for t, eco in enumerate(steps):
        iteration = IterationStats()
        processor.process_outputs([eco], engine_core_timestamp=float(t), iteration_stats=iteration)
        stats.append(iteration)
    assert [len(s.time_to_first_tokens_iter) for s in stats] == [1, 0, 0, 0]
    assert [s.inter_token_latencies_iter for s in stats] == [[], [1.0], [], [2.0]]
    assert sum(s.num_generation_tokens for s in stats) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_delivery_without_frames_is_nothing_new(kind):
    """The worker's rest of a request that had nothing left unread (a stop on its first token,
    whose frame went out at once) has no frames of any key: its output has nothing new, so a DELTA
    one has no payload (not an empty one), a CUMULATIVE one everything so far. A key without frames
    beside one with them stays (a consumer finds every key it knows)."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False)
    processor.add_request(core_request("r", [5, 6, 7], sampling(kind, max_tokens=4, detokenize=False)), None)
    empty = {"audio": (-1, torch.zeros(0)), "codes": (0, torch.zeros(0, 1, dtype=torch.int64))}
    steps = [token_output("r", 7, cls=OmniEngineCoreOutput,
                          multimodal_delivered={"audio": (-1, torch.arange(3.0)), "codes": empty["codes"]}),
             token_output("r", 8, finish=FinishReason.STOP, cls=OmniEngineCoreOutput, multimodal_delivered=empty)]
    payloads = [out.outputs[0].multimodal_output for step in steps
                for out in processor.process_outputs([step]).request_outputs]
    first = payloads[0] if kind == RequestOutputKind.DELTA else payloads[-1]
    assert first.tensors["audio"].equal(torch.arange(3.0)) and first.tensors["codes"].shape == (0, 1)
    if kind == RequestOutputKind.DELTA:
        assert payloads[1] is None
    elif kind == RequestOutputKind.CUMULATIVE:
        assert payloads[1].tensors["audio"].equal(torch.arange(3.0))


@pytest.mark.parametrize("skipped", ["a request gone", "an error to a queue"])
def test_the_tokens_held_count_when_vllm_skips_the_output_that_carries_the_count(skipped):
    """The engine core puts the count of the tokens it held (``tokens_held``) on its message's first
    output; vLLM takes no statistics from an output whose request was aborted here meanwhile, nor
    from an error output to a request with a queue (AsyncLLM's). The count is the step's all the
    same: generation tokens are what the engine made."""
    processor = MultimodalOutputProcessor(TOK, log_stats=True)
    params = sampling(RequestOutputKind.DELTA, max_tokens=8, detokenize=False)
    processor.add_request(core_request("live", [5, 6, 7], params), None)
    if skipped == "a request gone":
        first = OmniEngineCoreOutput(request_id="gone", new_token_ids=[9], tokens_held=5)
    else:
        processor.add_request(core_request("queued", [5, 6, 7], params), None,
                              queue=RequestOutputCollector(RequestOutputKind.DELTA, "queued"))
        first = OmniEngineCoreOutput(request_id="queued", new_token_ids=[], finish_reason=FinishReason.ERROR,
                                     error=RequestError(code="engine_paused", message="paused"), tokens_held=5)
    processor.process_outputs([token_output("live", 7)], engine_core_timestamp=0.0, iteration_stats=IterationStats())
    stats = IterationStats()
    processor.process_outputs([first, token_output("live", 8)], engine_core_timestamp=1.0, iteration_stats=stats)
    assert stats.num_generation_tokens == 5 + 1  # the held five, and the live request's token


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_worker_pieces_keep_the_per_step_values_metadata_and_axes(kind):
    """A request whose worker pieces and per-step values meet in one output gets the per-step
    values' metadata (REPLACE values) and their keys' axes along with the worker's pieces, at every
    output: nothing it sent is dropped because the worker's data came too."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, strategies={"emb": "concat_last"})
    processor.add_request(core_request("r", [5, 6, 7], sampling(kind, max_tokens=2, detokenize=False)), None)
    got = []
    for step in range(2):
        outs = [token_output("r", 7 + step, finish=FinishReason.LENGTH if step == 1 else None,
                             cls=OmniEngineCoreOutput, multimodal_delivered={"audio": (-1, torch.arange(4.0))},
                             multimodal_output={"emb": torch.full((2, 3), float(step)),
                                                "sr": torch.tensor(24000 + step)})]
        got += [out.outputs[0].multimodal_output for out in processor.process_outputs(outs).request_outputs]
    assert len(got) == 2
    for step, payload in enumerate(got):
        assert payload.axes == {"audio": -1, "emb": -1}, step
        assert int(payload.metadata["sr"]) == 24000 + step, step
    if kind == RequestOutputKind.CUMULATIVE:
        assert torch.equal(got[-1].tensors["emb"], torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], dim=-1))
        assert torch.equal(got[-1].tensors["audio"], torch.arange(4.0).repeat(2))


def test_a_cumulative_output_between_worker_deliveries_still_holds_everything_so_far():
    """CUMULATIVE: an output of a step that brought no worker data (tokens only) carries everything
    delivered so far, as the one before it did; the final output everything."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False)
    processor.add_request(core_request("r", [5, 6, 7], sampling(RequestOutputKind.CUMULATIVE, max_tokens=3,
                                                                detokenize=False)), None)
    pieces = [torch.arange(4.0), None, torch.arange(4.0, 6.0)]
    got = []
    for step, piece in enumerate(pieces):
        worker = {"multimodal_delivered": {"audio": (-1, piece)}} if piece is not None else {}
        outs = [token_output("r", 7 + step, finish=FinishReason.LENGTH if step == 2 else None,
                             cls=OmniEngineCoreOutput, **worker)]
        got += [out.outputs[0].multimodal_output for out in processor.process_outputs(outs).request_outputs]
    assert len(got) == 3 and all(p is not None for p in got)
    assert torch.equal(got[0].tensors["audio"], torch.arange(4.0))
    assert torch.equal(got[1].tensors["audio"], torch.arange(4.0))
    assert torch.equal(got[2].tensors["audio"], torch.arange(6.0))


def test_a_request_failing_mid_stream_ends_its_output_and_is_aborted_in_the_engine():
    """LLMEngine: a CUMULATIVE request whose worker frame changes mid-stream (vLLM's output of that
    step is not a final one) ends there: its output is finished, says error, and the engine core
    is asked to abort it (it would generate on for nothing); the other request streams on."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False)
    for rid in ("bad", "ok"):
        processor.add_request(core_request(rid, [5, 6, 7], sampling(RequestOutputKind.CUMULATIVE, max_tokens=4,
                                                                    detokenize=False)), None)
    for step, frame in enumerate([(1, 2), (2, 1)]):
        res = processor.process_outputs([
            token_output(rid, 7, cls=OmniEngineCoreOutput,
                         multimodal_delivered={"audio": (0, torch.ones(2, *(frame if rid == "bad" else (1, 2))))})
            for rid in ("bad", "ok")])
    outs = {o.request_id: o for o in res.request_outputs}
    assert outs["bad"].finished and outs["bad"].outputs[0].finish_reason == "error"
    assert res.reqs_to_abort == ["bad"] and "bad" not in processor.request_states
    assert not outs["ok"].finished and outs["ok"].outputs[0].multimodal_output.tensors["audio"].shape == (4, 1, 2)


def test_a_failed_request_is_named_by_the_id_its_caller_gave():
    """vLLM runs a request under an internal id (the caller's plus a suffix): the error its
    generate() raises, and the error an LLMEngine output carries, name the caller's id."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    queue = RequestOutputCollector(RequestOutputKind.DELTA, "mine")
    for internal, external, q in (("mine-1a2b", "mine", queue), ("yours-3c4d", "yours", None)):
        req = core_request(internal, [3], sampling(RequestOutputKind.DELTA, max_tokens=4))
        req.external_req_id = external
        p.add_request(req, None, None, 0, q)
    err = {"multimodal_error": MultimodalError("pool budget spent", key="audio", out_of_memory=True)}
    res = p.process_outputs([token_output(rid, 5, finish=FinishReason.ERROR, cls=OmniEngineCoreOutput, **err)
                             for rid in ("mine-1a2b", "yours-3c4d")])
    with pytest.raises(MultimodalOutputError) as info:
        queue.get_nowait()
    assert info.value.request_id == "mine" and info.value.key == "audio" and isinstance(info.value, GenerationError)
    assert isinstance(info.value, OutputMemoryError) and isinstance(info.value, RetryableRequestError)  # 503
    (out,) = res.request_outputs
    assert out.request_id == "yours" and out.outputs[0].finish_reason == "error"
    assert "'yours'" in out.outputs[0].stop_reason and "yours-3c4d" not in out.outputs[0].stop_reason


def test_the_last_sample_of_n_failing_mid_stream_finishes_its_request():
    """n = 2 under ``LLMEngine``: sample 1 finished, then sample 0 fails mid-stream (the worker's
    region did not fit; vLLM's output of that step is not a final one). That output ends the request:
    it says finished and sample 0's error, and nothing is left unfinished (the request would
    otherwise never end, and ``generate`` would return without it)."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    kids = _samples_of(processor, RequestOutputKind.DELTA)
    audio = torch.arange(4.0)
    processor.process_outputs([token_output(c, 5, cls=OmniEngineCoreOutput, multimodal_delivered={"audio": (-1, audio)})
                               for c in kids])
    done = processor.process_outputs([token_output(kids[1], 6, finish=FinishReason.LENGTH, cls=OmniEngineCoreOutput,
                                                   multimodal_delivered={"audio": (-1, audio)})])
    assert not done.request_outputs[0].finished  # sample 0 streams on
    failed = processor.process_outputs([token_output(kids[0], 6, cls=OmniEngineCoreOutput,
                                                     multimodal_error=MultimodalError("region does not fit"))])
    (out,) = failed.request_outputs
    assert out.finished and [(c.index, c.finish_reason) for c in out.outputs] == [(0, "error")]
    assert failed.reqs_to_abort == [kids[0]] and not processor.has_unfinished_requests()


def test_a_failure_marks_the_output_of_its_own_request_among_requests_of_one_external_id():
    """vLLM runs two requests the caller named alike ("job") under internal ids of their own: one
    failing marks its own output, not the other's, which streams on with its audio."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    for internal in ("job-aaaa", "job-bbbb"):
        req = core_request(internal, [3], sampling(RequestOutputKind.DELTA, max_tokens=4, detokenize=False))
        req.external_req_id = "job"
        processor.add_request(req, None)
    res = processor.process_outputs([
        token_output("job-aaaa", 5, cls=OmniEngineCoreOutput, multimodal_delivered={"audio": (0, torch.ones(2))}),
        token_output("job-bbbb", 5, cls=OmniEngineCoreOutput, multimodal_error=MultimodalError("region does not fit"))])
    healthy, failed = res.request_outputs
    assert (healthy.finished, healthy.outputs[0].finish_reason) == (False, None)
    assert torch.equal(healthy.outputs[0].multimodal_output.tensors["audio"], torch.ones(2))
    assert (failed.finished, failed.outputs[0].finish_reason) == (True, "error")
    assert list(processor.request_states) == ["job-aaaa"] and res.reqs_to_abort == ["job-bbbb"]


def test_a_request_the_frontend_fails_counts_in_vllms_statistics_as_finished_with_an_error():
    """vLLM's statistics (request success by finish reason, the latency histograms) count a request
    this package fails as finished with an error, as they count one vLLM ends itself."""
    processor = MultimodalOutputProcessor(TOK, log_stats=True, output_modality="audio")
    for rid in ("bad", "ok"):
        processor.add_request(core_request(rid, [5, 6, 7], sampling(RequestOutputKind.DELTA, max_tokens=4,
                                                                    detokenize=False)), None)
    piece = {"multimodal_delivered": {"audio": (0, torch.ones(2))}}
    processor.process_outputs([token_output(rid, 7, cls=OmniEngineCoreOutput, **piece) for rid in ("bad", "ok")],
                              engine_core_timestamp=0.0, iteration_stats=IterationStats())
    stats = IterationStats()
    processor.process_outputs([
        token_output("ok", 7, finish=FinishReason.LENGTH, cls=OmniEngineCoreOutput, **piece),
        token_output("bad", 8, cls=OmniEngineCoreOutput, multimodal_error=MultimodalError("region does not fit"))],
        engine_core_timestamp=1.0, iteration_stats=stats)
    assert sorted(f.finish_reason for f in stats.finished_requests) == [FinishReason.LENGTH, FinishReason.ERROR]
    assert not processor.request_states


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_streamed_inputs_chunk_ending_keeps_the_requests_output_going(kind):
    """A request whose input streams in (vLLM's resumable requests) ends each input chunk with a
    finish reason but goes on: its per-step values after the chunk's end are kept like those before
    it (DELTA each once, CUMULATIVE everything so far)."""
    processor = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    queue = RequestOutputCollector(kind, "s")
    req = core_request("s", [3, 4], sampling(kind, max_tokens=6, detokenize=False))
    req.resumable = True
    processor.add_request(req, None, None, 0, queue)
    got = []
    for token, value, finish in ((5, 1.0, None), (6, 2.0, FinishReason.STOP), (7, 3.0, None), (8, 4.0, None)):
        processor.process_outputs([OmniEngineCoreOutput(request_id="s", new_token_ids=[token], finish_reason=finish,
                                                        multimodal_output={"audio": torch.full((3,), value)})])
        got.append(queue.get_nowait().outputs[0].multimodal_output.tensors["audio"])
    values = [torch.full((3,), v) for v in (1.0, 2.0, 3.0, 4.0)]
    want = values if kind == RequestOutputKind.DELTA else [torch.cat(values[:i + 1]) for i in range(4)]
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and processor.accumulation_errors == 0


def test_a_pooling_output_whose_multimodal_output_fails_carries_the_error():
    """A request with pooling params ends with its pooling output, which carries the payload; when
    that payload cannot be made (the request's drained span cannot be consolidated), the pooling
    output says so in vLLM's ``error`` field instead of arriving as a success without its data."""
    p = MultimodalOutputProcessor(TOK, log_stats=False, output_modality="audio")
    params = PoolingParams(task="embed")
    params.output_kind = RequestOutputKind.FINAL_ONLY
    p.add_request(core_request("m", [3, 4], params), None)
    p.process_outputs([OmniEngineCoreOutput(request_id="m", new_token_ids=[], multimodal_output={"audio": torch.ones(8)})])
    p.request_states["m"].accumulator.pools()[0].drain(["m"])  # a drained span can no longer be consolidated
    res = p.process_outputs([OmniEngineCoreOutput(request_id="m", new_token_ids=[], pooling_output=torch.arange(4.0),
                                                  finish_reason=FinishReason.STOP)])
    (out,) = res.request_outputs
    assert isinstance(out, PoolingRequestOutput) and out.finished and out.outputs.multimodal_output is None
    assert out.error is not None and "'m'" in out.error.message and p.consolidation_errors == 1


def test_a_text_only_cumulative_request_gets_vllms_output_every_step_at_any_stream_interval():
    """The thinning of CUMULATIVE outputs at ``stream_interval`` is for requests with multimodal
    output (each output carries everything so far); a text-only processor's CUMULATIVE request gets
    vLLM's outputs, every step."""
    words = word_ids(TOK, "the quick brown fox jumps over a lazy dog")
    ours = MultimodalOutputProcessor(TOK, log_stats=False, stream_interval=3)
    theirs = OutputProcessor(TOK, log_stats=False, stream_interval=3)
    for p in (ours, theirs):
        p.add_request(core_request("c", words[:2], sampling(RequestOutputKind.CUMULATIVE, max_tokens=6)), None)
    for i in range(6):
        finish = FinishReason.LENGTH if i == 5 else None
        got = ours.process_outputs([token_output("c", words[i], finish=finish)]).request_outputs
        want = theirs.process_outputs([token_output("c", words[i], finish=finish)]).request_outputs
        assert len(got) == len(want) == 1 and summarize(got[0]) == summarize(want[0])


def _side_by_side(**kw):
    """vLLM's processor and this package's under the talker's modality (text+audio), alike otherwise."""
    return {"vllm": OutputProcessor(TOK, **kw),
            "omni": MultimodalOutputProcessor(TOK, output_modality="text+audio", **kw)}


def test_a_text_only_cumulative_request_gets_vllms_outputs_under_a_multimodal_modality():
    """A request that has no multimodal data, CUMULATIVE with ``stream_interval`` 3, served by a
    processor whose modality has audio: an output every step with its text so far, as vLLM's
    (thinning at the interval is for requests with data: two of five outputs came out empty)."""
    texts = {}
    for name, processor in _side_by_side(log_stats=False, stream_interval=3).items():
        processor.add_request(core_request("c", [3, 4], sampling(RequestOutputKind.CUMULATIVE, max_tokens=5)), None)
        texts[name] = [[o.outputs[0].text for o in processor.process_outputs(
            [token_output("c", t, finish=FinishReason.LENGTH if i == 4 else None)]).request_outputs]
            for i, t in enumerate(word_ids(TOK, "the quick brown fox jumps"))]
    assert texts["omni"] == texts["vllm"] and all(len(step) == 1 for step in texts["vllm"])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_sample_of_n_aborted_alone_leaves_its_siblings_outputs_as_vllm_makes_them(kind):
    """n = 2 under ``LLMEngine`` (no queue), one sample aborted by its own id, the other finishing:
    the outputs are vLLM's (a FINAL_ONLY request's had None in the aborted sample's place, which a
    consumer reading each completion's text failed on), and once no sample is left its
    ``ParentRequest`` is gone (vLLM keeps it for ever)."""
    got = {}
    for name, processor in _side_by_side(log_stats=False).items():
        parent = ParentRequest(core_request("p", [3, 4], sampling(kind, n=2, max_tokens=2)))
        kids = []
        for index in range(2):
            child_id, params = parent.get_child_info(index)
            kids.append(child_id)
            processor.add_request(core_request(child_id, [3, 4], params), None, parent, index, None)
        first, second, third = word_ids(TOK, "the quick brown")
        processor.process_outputs([token_output(kids[0], first), token_output(kids[1], second)])
        processor.abort_requests([kids[1]], internal=True)
        outs = processor.process_outputs([token_output(kids[0], third, finish=FinishReason.LENGTH)]).request_outputs
        got[name] = [(o.finished, [None if c is None else (c.index, c.text, c.finish_reason) for c in o.outputs])
                     for o in outs]
        if name == "omni":
            assert not processor.parent_requests and not processor.request_states
    assert got["omni"] == got["vllm"]


def test_a_text_output_without_a_token_counts_in_vllms_statistics():
    """With ``log_stats``, an output with no new token that carries an event (a preemption) is vLLM's
    to count (the processor's rule for outputs with multimodal data alone skipped it: no preemption
    counted, no inter-token latency, the request's metrics a step behind)."""
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType

    seen = {}
    for name, processor in _side_by_side(log_stats=True).items():
        processor.add_request(core_request("a", [3, 4], sampling(max_tokens=3)), None)
        processor.process_outputs([token_output("a", word_ids(TOK, "the")[0])], 2001.0, IterationStats())
        stats = IterationStats()
        preempted = EngineCoreEvent(type=EngineCoreEventType.PREEMPTED, timestamp=2001.5)
        out = processor.process_outputs([EngineCoreOutput(request_id="a", new_token_ids=[], events=[preempted])],
                                        2002.0, stats).request_outputs
        metrics = out[0].metrics if out else None
        seen[name] = (stats.num_preempted_reqs, len(stats.inter_token_latencies_iter),
                      getattr(metrics, "num_preemptions", None), getattr(metrics, "last_token_ts", None))
    assert seen["omni"] == seen["vllm"] and seen["vllm"][0] == 1
