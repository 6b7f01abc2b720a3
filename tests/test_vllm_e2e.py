"""End to end on CPU with vLLM's real v1 scheduler (marker vllm).

``OmniScheduler`` (vLLM's ``Scheduler`` with the channel) schedules real requests; a synthetic model
runner answers each step with an ``OmniModelRunnerOutput`` (tokens, audio chunks and codes in
``multimodal_outputs``, pooling tensors in ``pooler_output``); the engine-core outputs cross vLLM's
msgpack encoder and ``OmniMsgpackDecoder`` as bytes; ``MultimodalOutputProcessor`` builds the request
outputs. Streams in DELTA, CUMULATIVE and FINAL_ONLY, a text+audio request and a pooling request run
together; a multimodal request with pooling params is not finished by its multimodal output, and its
final pooling output carries its audio.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.outputs import PoolingRequestOutput  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.serial_utils import MsgpackEncoder  # noqa: E402

from vllm_env import core_request, sampling, sched_request, scheduler, tokenizer, word_ids  # noqa: E402
from vllm_omni_kernels.errors import TensorAccumulationError  # noqa: E402
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S  # noqa: E402
from vllm_omni_kernels.vllm_integration.wire import OmniMsgpackDecoder  # noqa: E402
from vllm_omni_kernels.vllm_integration.output_processor import MultimodalOutputProcessor  # noqa: E402
from vllm_omni_kernels.vllm_integration.outputs import (  # noqa: E402
    MultimodalCompletionOutput, MultimodalPoolingOutput, OmniModelRunnerOutput, OmniRequestOutput)
from vllm_omni_kernels.vllm_integration.scheduler import OmniAsyncScheduler, OmniScheduler  # noqa: E402

pytestmark = pytest.mark.vllm
TOK = tokenizer()
SR = 24000


def chunk(rid: str, step: int) -> torch.Tensor:
    """The synthetic model's audio for one step: a request-specific tone, a varying length."""
    n = 480 * (1 + (step + len(rid)) % 3)
    t = torch.arange(n, dtype=torch.float64) + step * 1000
    return torch.sin(t * (0.01 + 0.001 * len(rid))).float()


class SyntheticRunner:
    """Answers a scheduler step like an omni TTS runner would."""

    def __init__(self, sched, mm_ids, pool_ids, mm_pool_ids, words):
        self.sched, self.mm_ids, self.pool_ids, self.mm_pool_ids = sched, mm_ids, pool_ids, mm_pool_ids
        self.words = words
        self.steps: dict[str, int] = {}
        self.sent: dict[str, list[torch.Tensor]] = {r: [] for r in mm_ids | mm_pool_ids}
        self.codes: dict[str, list[torch.Tensor]] = {r: [] for r in mm_ids}
        self.pooled: dict[str, torch.Tensor] = {}

    def step(self, so) -> OmniModelRunnerOutput:
        req_ids = list(so.num_scheduled_tokens)
        sampled, pooled, mm = [], [], {}
        for rid in req_ids:
            req = self.sched.requests[rid]
            done_prompt = req.num_computed_tokens >= req.num_tokens
            k = self.steps[rid] = self.steps.get(rid, -1) + 1
            if rid in self.pool_ids or rid in self.mm_pool_ids:
                sampled.append([])
                out = torch.arange(8, dtype=torch.float32) * (len(rid) + 1) if done_prompt else None
                pooled.append(out)
                if out is not None:
                    self.pooled[rid] = out
                if rid in self.mm_pool_ids:
                    mm[rid] = {"audio": chunk(rid, k)}
                    self.sent[rid].append(mm[rid]["audio"])
                continue
            pooled.append(None)
            sampled.append([self.words[(k + len(rid)) % len(self.words)]] if done_prompt else [])
            if rid in self.mm_ids and done_prompt:
                audio, codes = chunk(rid, k), torch.full((1 + k % 2, 16), k, dtype=torch.int64)
                mm[rid] = {"audio": audio, "codes": codes, "sr": torch.tensor(SR)}
                self.sent[rid].append(audio)
                self.codes[rid].append(codes)
        return OmniModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                     sampled_token_ids=sampled, pooler_output=pooled, multimodal_outputs=mm)


def test_concurrent_streams_text_audio_and_pooling_end_to_end(tmp_path):
    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=8)
    sched.max_num_scheduled_tokens = 24  # small budget: prompts are prefilled in chunks
    processor = MultimodalOutputProcessor(TOK, log_stats=True, output_modality="text+audio",
                                          strategies={"audio": S.CONCAT_LAST, "codes": S.CONCAT_DIM0})
    words = word_ids(TOK, "happy song about audio codes frames voices tones")
    specs = {  # request id -> (prompt length, params)
        "delta": (6, sampling(RequestOutputKind.DELTA, max_tokens=7, detokenize=False)),
        "final": (9, sampling(RequestOutputKind.FINAL_ONLY, max_tokens=5, detokenize=False)),
        "cumul": (4, sampling(RequestOutputKind.CUMULATIVE, max_tokens=6, detokenize=False)),
        "talk": (5, sampling(RequestOutputKind.CUMULATIVE, max_tokens=4)),
        "embed": (30, PoolingParams(task="embed")),
        "mmpool": (40, PoolingParams(task="embed")),
    }
    for rid, (n, params) in specs.items():
        prompt = [words[i % len(words)] for i in range(n)]
        sched.add_request(sched_request(rid, prompt, params))
        processor.add_request(core_request(rid, prompt, params), None)
    runner = SyntheticRunner(sched, {"delta", "final", "cumul", "talk"}, {"embed"}, {"mmpool"}, words)
    encoder, decoder = MsgpackEncoder(), OmniMsgpackDecoder()
    outputs: dict[str, list] = {rid: [] for rid in specs}
    for _ in range(40):
        if not sched.has_requests():
            break
        so = sched.schedule()
        engine_outputs = sched.update_from_output(so, runner.step(so))
        for batch in engine_outputs.values():
            frames = encoder.encode(batch)  # the engine-core process boundary, as bytes
            wire = decoder.decode([bytes(f) for f in frames])
            for out in processor.process_outputs(wire.outputs).request_outputs:
                outputs[out.request_id].append(out)
    assert not sched.has_requests() and not processor.has_unfinished_requests()

    def audio_of(out):
        return out.outputs[0].multimodal_output.tensors["audio"]

    expect = {rid: torch.cat(runner.sent[rid], dim=-1) for rid in runner.sent}
    delta = torch.cat([audio_of(o) for o in outputs["delta"] if isinstance(o.outputs[0], MultimodalCompletionOutput)
                       and o.outputs[0].multimodal_output is not None])
    assert torch.equal(delta, expect["delta"])
    assert len(outputs["final"]) == 1 and torch.equal(audio_of(outputs["final"][0]), expect["final"])
    assert torch.equal(outputs["final"][0].outputs[0].multimodal_output.tensors["codes"], torch.cat(runner.codes["final"]))
    assert int(outputs["final"][0].outputs[0].multimodal_output.metadata["sr"]) == SR
    assert torch.equal(audio_of(outputs["cumul"][-1]), expect["cumul"])
    assert len(outputs["cumul"]) > 1 and all(o.outputs[0].multimodal_output is not None for o in outputs["cumul"])
    talk = outputs["talk"][-1]
    assert talk.finished and len(talk.outputs[0].token_ids) == 4 and talk.outputs[0].text.strip()
    assert torch.equal(audio_of(talk), expect["talk"])
    (pooled,) = outputs["embed"]
    assert isinstance(pooled, PoolingRequestOutput) and torch.equal(pooled.outputs.data, runner.pooled["embed"])
    # The multimodal request with pooling params got multimodal output in the steps of its prompt
    # chunks and finished only with its real pooling output, in its last chunk's step.
    assert len(runner.sent["mmpool"]) >= 2
    assert runner.steps["mmpool"] == len(runner.sent["mmpool"]) - 1
    final = outputs["mmpool"][-1]
    assert isinstance(final, PoolingRequestOutput) and isinstance(final.outputs, MultimodalPoolingOutput)
    assert torch.equal(final.outputs.data, runner.pooled["mmpool"])
    assert torch.equal(final.outputs.multimodal_output.tensors["audio"], expect["mmpool"])
    assert OmniRequestOutput.from_engine_output(final, 0, "audio").multimodal is final.outputs.multimodal_output
    assert processor.accumulation_errors == 0
    assert all(a["requests"] == 0 for a in processor.accumulator_stats()["devices"].values())


def test_a_finish_waits_for_the_workers_rest_and_fails_visibly_when_it_never_comes(tmp_path):
    """vLLM's real scheduler finishes two requests on their stop token while the worker holds their
    output. "a": its final output waits, as vLLM made it, and goes with the worker's rest two steps
    later. "b": the worker never closes
    it; the engine keeps stepping while its finish waits (``has_finished_requests``), and after
    ``_AWAITED_STEPS`` steps it finishes with an error naming the loss."""
    import numpy as np

    from vllm.v1.engine import FinishReason

    from vllm_omni_kernels.serving.worker_accumulator import PackedStep, Region
    from vllm_omni_kernels.vllm_integration.scheduler import _AWAITED_STEPS

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    stop = 42
    for rid in ("a", "b"):
        sched.add_request(sched_request(rid, [5, 6, 7], sampling(max_tokens=8, stop_token_ids=[stop])))

    def step(sampled: dict, packed: PackedStep | None = None, opened=None):
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        out = OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[sampled.get(r, []) for r in ids], packed=packed,
                                    multimodal_opened=opened)
        return [eco for batch in sched.update_from_output(so, out).values() for eco in batch.outputs]

    first = step({"a": [stop], "b": [stop + 1]}, opened=["a", "b"])
    assert [e.request_id for e in first] == ["b"]  # "a"'s final output waits for the worker's rest
    step({"b": [stop]})  # "b" stops too; the worker closes neither yet
    audio = torch.arange(8, dtype=torch.float32)
    packed = PackedStep(host=audio.view(torch.uint8), regions=[Region("audio", torch.float32, (), -1, 0, ["a"],
                                                                      np.array([8]))], final={"a"})
    done = step({}, packed)
    final_a = next(e for e in done if e.request_id == "a")
    assert final_a.finish_reason == FinishReason.STOP and final_a.stop_reason == stop
    assert final_a.new_token_ids == [stop]  # as vLLM made it: the frontend treats its stop token as vLLM's does
    outputs_b, steps = [], 1  # "b"'s finish has waited one step ("a"'s last)
    while sched.has_requests() and steps < 2 * _AWAITED_STEPS:  # it waits: the engine steps on
        outputs_b += [e for e in step({}) if e.request_id == "b"]
        steps += 1
    assert steps == _AWAITED_STEPS
    (final_b,) = [e for e in outputs_b if e.finish_reason is not None]
    assert final_b.finish_reason == FinishReason.ERROR and "rest did not come" in final_b.multimodal_error.message


@pytest.mark.parametrize("in_flight", [1, 2], ids=["one step", "two steps (async scheduling)"])
def test_a_request_aborted_while_its_first_step_runs_leaves_nothing_held(tmp_path, in_flight):
    """vLLM's engine core takes aborts between a step and its ``update_from_output``, with one
    step in flight, or two under async scheduling (the abort lands before the update of the step
    ahead of the request's first): a request the worker opened in a step and that was aborted
    meanwhile is not held open afterwards (it would stay so for ever, and the channel's work would
    run every step)."""
    from vllm.v1.request import RequestStatus

    from vllm_omni_kernels.vllm_integration.scheduler import OmniAsyncScheduler

    def output(so, opened):
        ids = list(so.num_scheduled_tokens)
        return OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                     sampled_token_ids=[[40] for _ in ids], multimodal_opened=opened)

    sched = scheduler(OmniScheduler if in_flight == 1 else OmniAsyncScheduler, tmp_path, max_num_seqs=4)
    steps = []
    if in_flight == 2:
        sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=8)))
        steps.append((sched.schedule(), ["a"]))
    sched.add_request(sched_request("x", [5, 6, 7], sampling(max_tokens=8)))
    steps.append((sched.schedule(), ["x"]))
    assert "x" in steps[-1][0].num_scheduled_tokens
    sched.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    for so, opened in steps:
        sched.update_from_output(so, output(so, opened))
    assert "x" not in sched.requests and "x" not in sched._worker_open


def _channel_step(sched, sampled: dict, packed=None, opened=None, errors=None, plain=None):
    """One step of vLLM's real scheduler answered with the given tokens, worker data and failures;
    returns the step's messages (client -> EngineCoreOutputs) as the engine core sends them."""
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    out = OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled.get(r, []) for r in ids], packed=packed,
                                multimodal_opened=opened, multimodal_errors=errors, multimodal_outputs=plain)
    return sched.update_from_output(so, out)


def _received(messages) -> dict:
    """What the client gets of the step: request id -> (its outputs, its delivered pieces), the
    messages crossing vLLM's msgpack wire and ``OmniMsgpackDecoder``."""
    got = {}
    for batch in messages.values():
        decoded = OmniMsgpackDecoder().decode([bytes(b) for b in MsgpackEncoder().encode(batch)])
        for eco in decoded.outputs:
            outs, pieces = got.setdefault(eco.request_id, ([], []))
            outs.append(eco)
            if eco.multimodal_delivered:
                pieces.append(eco.multimodal_delivered["audio"][1])
    return got


def _packed(audio: torch.Tensor, rid: str, final=()):
    import numpy as np

    from vllm_omni_kernels.serving.worker_accumulator import PackedStep, Region

    return PackedStep(host=audio.view(torch.uint8), regions=[Region("audio", torch.float32, (), -1, 0, [rid],
                                                                    np.array([audio.numel()]))], final=set(final))


def test_worker_data_of_a_running_request_and_of_one_the_worker_closes_as_vllm_finishes_it(tmp_path):
    """The worker's data goes on the message of its request's client: for a request mid-stream,
    and for one whose output the worker closes in the step vLLM finishes it (its final output goes
    at once, with the data, not held for a rest that is already there)."""
    from vllm.v1.engine import FinishReason

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=2)))
    first, last = torch.arange(4.0), torch.arange(4.0, 10.0)
    got = _received(_channel_step(sched, {"a": [40]}, _packed(first, "a"), opened=["a"]))
    (out,), pieces = got["a"]
    assert out.finish_reason is None and len(pieces) == 1 and torch.equal(pieces[0], first)
    got = _received(_channel_step(sched, {"a": [41]}, _packed(last, "a", final={"a"})))
    (out,), pieces = got["a"]
    assert out.finish_reason == FinishReason.LENGTH and out.multimodal_error is None
    assert len(pieces) == 1 and torch.equal(pieces[0], last)
    assert "a" not in sched.requests and not sched._awaiting


def test_a_stop_token_whose_text_is_left_out_waits_with_its_finish_for_the_workers_rest(tmp_path):
    """vLLM's defaults (``detokenize``, ``include_stop_str_in_output`` off): a request that stops on a
    stop token in a step that has data of it keeps the token for its final output, which waits for
    the worker's rest; the step's data goes on an output of its own. vLLM's frontend leaves the stop
    token out of the text only when it comes with the finish: sent ahead with the data, it would
    be in the request's text."""
    from vllm.v1.engine import FinishReason

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    params = sampling(max_tokens=8, stop_token_ids=[42])
    assert params.detokenize and not params.include_stop_str_in_output
    sched.add_request(sched_request("a", [5, 6, 7], params))
    _received(_channel_step(sched, {"a": [40]}, opened=["a"]))
    mid, rest = torch.arange(2.0), torch.arange(2.0, 4.0)
    outs, pieces = _received(_channel_step(sched, {"a": [42]}, _packed(mid, "a")))["a"]
    assert all(42 not in o.new_token_ids and o.finish_reason is None for o in outs)
    assert len(pieces) == 1 and torch.equal(pieces[0], mid)
    outs, pieces = _received(_channel_step(sched, {}, _packed(rest, "a", final={"a"})))["a"]
    (final,) = [o for o in outs if o.finish_reason is not None]
    assert final.finish_reason == FinishReason.STOP and final.new_token_ids == [42]
    assert len(pieces) == 1 and torch.equal(pieces[0], rest)


def test_data_arriving_while_a_finish_waits_for_the_workers_rest_goes_on_outputs_of_its_own(tmp_path):
    """A request vLLM stops while the worker holds its output: data of the steps before the
    worker's rest arrives on outputs of its own, then the rest with the final output; none of it
    is lost."""
    from vllm.v1.engine import FinishReason

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    stop = 42
    sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=8, stop_token_ids=[stop])))
    assert "a" not in _received(_channel_step(sched, {"a": [stop]}, opened=["a"]))  # its final output waits
    pieces, finals = [], []
    for audio, final in ((torch.arange(3.0), ()), (torch.arange(3.0, 8.0), {"a"})):
        outs, got = _received(_channel_step(sched, {}, _packed(audio, "a", final))).get("a", ([], []))
        pieces += got
        finals += [o.finish_reason for o in outs if o.finish_reason is not None]
    assert torch.equal(torch.cat(pieces), torch.arange(8.0))
    assert finals == [FinishReason.STOP]


def test_a_request_the_worker_fails_is_finished_in_the_scheduler_and_says_so(tmp_path):
    """A request the worker failed (``multimodal_errors``) is finished in vLLM's scheduler (it
    generates no more), and its output says error with the worker's reason; the other request runs
    on."""
    from vllm.v1.engine import FinishReason

    from vllm_omni_kernels.errors import OutputMemoryError

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    for rid in ("a", "b"):
        sched.add_request(sched_request(rid, [5, 6, 7], sampling(max_tokens=8)))
    _channel_step(sched, {"a": [40], "b": [40]}, opened=["a", "b"])
    errors = {"a": OutputMemoryError("pool budget spent", request_id="a", key="audio")}
    got = _received(_channel_step(sched, {"a": [41], "b": [41]}, errors=errors))
    (out,), _ = got["a"]
    assert out.finish_reason == FinishReason.ERROR and out.multimodal_error.out_of_memory
    assert out.multimodal_error.key == "audio" and "budget" in out.multimodal_error.message
    assert "a" not in sched.requests and "b" in sched.requests
    assert "a" not in _received(_channel_step(sched, {"b": [42]}))


class _Opaque:
    """A value vLLM's encoder refuses (it pickles only where insecure serialization is allowed)."""


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _holding_itself() -> dict:
    value: dict = {"x": []}
    value["x"].append(value)
    return value


@pytest.mark.parametrize("unfit, key", [
    ([torch.ones(2)], None),  # not a {key: value} dict: the client's decoder would refuse the message
    ({"audio": torch.ones(2), "meta": _Opaque()}, "meta"),  # the engine core's encoder would fail the step
    ({"audio": torch.ones(2), "n": 1 << 70}, "n"),  # past 64 bits
    ({"audio": torch.ones(2), "sr": [np.float64(24000.0)]}, "sr"),  # a numpy scalar, though a float subclass
    ({"audio": torch.ones(2), 7: "x"}, None),  # a key that is no string
    ({"audio": torch.ones(2), "deep": {(1, 2): 3}}, "deep"),  # a key no decoder can hash
    ({"audio": torch.ones(2), "deep": {1 << 70: 3}}, "deep"),  # a key past 64 bits
    ({"audio": torch.ones(2), "text": "hi \ud800"}, "text"),  # not UTF-8
    ({"audio": torch.ones(2), "meta": {"\ud800": 1}}, "meta"),
    ({"\ud800": 1}, None),
    ({"audio": torch.ones(2), "deep": _nested(2000)}, "deep"),  # past the encoder's depth
    ({"audio": torch.ones(2), "loop": _holding_itself()}, "loop"),
    ({"audio": torch.eye(2).to_sparse()}, "audio"),  # a tensor that is not strided memory
    ({"audio": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "audio"),  # strided, but nested
])
def test_a_plain_value_the_wire_cannot_carry_fails_its_request_alone(tmp_path, unfit, key):
    """A model output for one request that vLLM's msgpack wire would not carry as it is fails that
    request, with an error naming its key where there is one; the step's message encodes and
    decodes, and the other request gets its values exactly."""
    from vllm.v1.engine import FinishReason

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    for rid in ("a", "b"):
        sched.add_request(sched_request(rid, [5, 6, 7], sampling(max_tokens=8)))
    _channel_step(sched, {"a": [40], "b": [40]})
    good = {"audio": torch.arange(5.0), "meta": {"sr": 24000, "ids": [1, 2]}, "pair": (1, "x")}
    got = _received(_channel_step(sched, {"a": [41], "b": [41]}, plain={"a": unfit, "b": good}))
    (out,), _ = got["a"]
    assert out.finish_reason == FinishReason.ERROR and out.multimodal_output is None
    assert out.multimodal_error is not None and out.multimodal_error.key == key
    (b,), _ = got["b"]
    assert torch.equal(b.multimodal_output["audio"], torch.arange(5.0))
    assert b.multimodal_output["meta"] == {"sr": 24000, "ids": [1, 2]} and b.multimodal_output["pair"] == [1, "x"]
    assert "a" not in sched.requests and "b" in sched.requests


def test_a_one_sample_view_of_a_strided_channel_is_carried_and_nothing_else_is_lost(tmp_path):
    """A tensor of at most one element whose memory is strided (one sample of a channel of a
    ``[T, C]`` buffer, or none: torch counts it contiguous) goes as its value: vLLM's encoder views
    its flattened memory as bytes, which it refused, failing the whole step's message, every
    request's output with it. The caller's values are left as they were."""
    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    for rid in ("a", "b"):
        sched.add_request(sched_request(rid, [5, 6, 7], sampling(max_tokens=8)))
    _channel_step(sched, {"a": [40], "b": [40]})
    wav = torch.randn(48, 2)
    one, none, deep = wav.t()[0][10:11], wav.t()[1][4:4], wav[3:4, 1:2].t()
    strided = {"audio": one, "empty": none, "nested": {"x": [1, (deep, "y")]}}
    got = _received(_channel_step(sched, {"a": [41], "b": [41]},
                                  plain={"a": strided, "b": {"audio": torch.arange(5.0)}}))
    (a,), _ = got["a"]
    assert a.multimodal_error is None and a.finish_reason is None
    mm = a.multimodal_output
    assert torch.equal(mm["audio"], one) and mm["empty"].shape == (0,)
    assert torch.equal(mm["nested"]["x"][1][0], deep) and mm["nested"]["x"][1][1] == "y"
    (b,), _ = got["b"]
    assert torch.equal(b.multimodal_output["audio"], torch.arange(5.0))
    assert strided["audio"] is one and strided["nested"]["x"][1][0] is deep  # (copies went, not these)


def test_data_for_a_waiting_finish_reaches_a_client_whose_message_carries_plain_values_too(tmp_path):
    """In one step, a client's message carries another request's plain per-step values and the
    worker's data for a request whose finish waits for the worker's rest: that data arrives."""
    from vllm.v1.engine import FinishReason

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    stop = 42
    sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=8, stop_token_ids=[stop])))
    sched.add_request(sched_request("b", [5, 6, 7], sampling(max_tokens=8)))
    _channel_step(sched, {"a": [stop], "b": [40]}, opened=["a"])  # "a" stops; its final output waits
    pieces, finals = [], []
    for step, (audio, final) in enumerate(((torch.arange(3.0), ()), (torch.arange(3.0, 6.0), {"a"}))):
        got = _received(_channel_step(sched, {"b": [41 + step]}, _packed(audio, "a", final),
                                      plain={"b": {"emb": torch.full((1, 2), float(step))}}))
        outs, got_a = got["a"]
        pieces += got_a
        finals += [o.finish_reason for o in outs if o.finish_reason is not None]
        assert torch.equal(got["b"][0][0].multimodal_output["emb"], torch.full((1, 2), float(step)))
    assert torch.equal(torch.cat(pieces), torch.arange(6.0))
    assert finals == [FinishReason.STOP]


def test_a_waiting_finish_the_worker_fails_ends_once_with_the_workers_error(tmp_path):
    """A request whose final output waits for the worker's rest and that the worker then fails:
    its finish goes in that step, saying error with the worker's reason, and nothing of it comes
    later."""
    from vllm.v1.engine import FinishReason

    from vllm_omni_kernels.errors import TensorAccumulationError

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    stop = 42
    sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=8, stop_token_ids=[stop])))
    _channel_step(sched, {"a": [stop]}, opened=["a"])  # its final output waits
    finals = []
    errors = {"a": TensorAccumulationError("frame shape changed", request_id="a", key="audio")}
    for step in range(10):
        got = _received(_channel_step(sched, {}, errors=errors if step == 0 else None))
        finals += [(step, o) for o in got.get("a", ([], []))[0] if o.finish_reason is not None]
    assert [(step, o.finish_reason) for step, o in finals] == [(0, FinishReason.ERROR)]
    assert "frame shape changed" in finals[0][1].multimodal_error.message and not sched._awaiting


def test_an_aborted_paced_request_leaves_no_held_tokens(tmp_path):
    """Tokens held back for a paced request (until its data is due) are dropped when vLLM finishes
    the request otherwise (an abort): nothing of it stays held."""
    from vllm.v1.request import RequestStatus

    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=8)))
    assert "a" in _received(_channel_step(sched, {"a": [40]}, opened=["a"]))  # its first output goes
    assert "a" not in _received(_channel_step(sched, {"a": [41]}))  # then its tokens wait for its data
    assert len(sched.held) == 1
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert len(sched.held) == 0 and not sched.held.active


@pytest.mark.parametrize("cls", [OmniScheduler, OmniAsyncScheduler], ids=["sync", "async"])
def test_data_on_an_output_the_channel_makes_takes_the_tokens_held_for_it(tmp_path, cls):
    """vLLM drops a step's token output when its running requests are reset (``reset_prefix_cache``
    with ``reset_running_requests``, as its pause and sleep do); the worker's data of that step goes
    on an output of its own, which takes the tokens held for that data, so none stay behind it."""
    sched = scheduler(cls, tmp_path, max_num_seqs=4)
    sched.add_request(sched_request("a", [5, 6, 7], sampling(max_tokens=20, detokenize=False)))
    _channel_step(sched, {"a": [40]}, opened=["a"])
    for token in (41, 42):
        assert "a" not in _received(_channel_step(sched, {"a": [token]}))  # held for their data
    so = sched.schedule()
    sched.reset_prefix_cache(reset_running_requests=True)
    ids = list(so.num_scheduled_tokens)
    out = OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[43] for _ in ids], packed=_packed(torch.arange(3.0), "a"))
    (eco,), pieces = _received(sched.update_from_output(so, out))["a"]
    assert eco.new_token_ids == [41, 42] and torch.equal(pieces[0], torch.arange(3.0)) and len(sched.held) == 0


def test_finish_outputs_the_channel_makes_carry_the_requests_trace_headers(tmp_path):
    """vLLM's frontend reads a request's trace context from its finishing output: the finish that
    waited for the worker's rest, and the error output of a request the worker failed in a step
    that gave it no output, carry the request's trace headers as vLLM's own outputs do."""
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    sched = scheduler(OmniScheduler, tmp_path, max_num_seqs=4)
    stop = 42
    for rid in ("a", "b"):
        request = sched_request(rid, [5, 6, 7], sampling(max_tokens=8, stop_token_ids=[stop], detokenize=False))
        request.trace_headers = trace
        sched.add_request(request)
    _channel_step(sched, {"a": [40], "b": [40]}, opened=["a", "b"])
    _channel_step(sched, {"a": [stop], "b": [41]}, _packed(torch.arange(2.0), "a"))  # "a" stops with data
    assert "b" not in _received(_channel_step(sched, {"b": [43]}))  # (its token is held)
    got = _received(_channel_step(sched, {}, _packed(torch.arange(2.0, 4.0), "a", final={"a"}),
                                  errors={"b": TensorAccumulationError("boom", request_id="b", key="audio")}))
    (final_a,), _ = got["a"]
    (final_b,), _ = got["b"]
    assert final_a.finish_reason == FinishReason.STOP and final_a.trace_headers == trace
    assert final_b.finish_reason == FinishReason.ERROR and final_b.trace_headers == trace
    assert final_b.new_token_ids == [41, 43]  # the tokens held for it go with its error
