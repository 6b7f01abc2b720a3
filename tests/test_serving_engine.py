"""TTS served through a real vLLM engine core in its own process (ZMQ, vLLM's msgpack), the way
users run it (marker vllm): every sample of every request checked against what its codes decode
to, every output kind, aborts, a request whose chunk is malformed, and the slots all given back.

vLLM's own client decodes the same frames with its ``EngineCoreOutputs`` decoder and loses the
whole multimodal channel without an error; the first test shows that this run catches exactly that.
"""

import asyncio
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams, TokensPrompt  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.executor import Executor  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

from vllm_omni_kernels.errors import MultimodalOutputError, OutputMemoryError, OutputTooLargeError  # noqa: E402
from vllm_omni_kernels.serving import talker as tk  # noqa: E402
from vllm_omni_kernels.vllm_integration.llm import (  # noqa: E402
    OmniAsyncLLM, OmniLLM, omni_vllm_config, talker_engine_args, talker_processor_options)
from vllm_omni_kernels.vllm_integration.outputs import MultimodalCompletionOutput  # noqa: E402
from vllm_omni_kernels.vllm_integration.scheduler import OmniAsyncScheduler, OmniScheduler  # noqa: E402
from vllm_omni_kernels.vllm_integration.simulate import STAGES, SimConfig, _plans, run  # noqa: E402
from vllm_omni_kernels.vllm_integration.talker_model import make_model_dir  # noqa: E402
from vllm_omni_kernels.vllm_integration.wire import OmniMsgpackDecoder  # noqa: E402
from vllm_omni_kernels.accumulator import EmitPolicy  # noqa: E402
from vllm_omni_kernels.serving.worker_accumulator import WorkerAccumulator  # noqa: E402
from vllm_omni_kernels.vllm_integration.worker import (  # noqa: E402
    TalkerExecutor, key_budgets, talker_cpu_threads, talker_output_keys)

pytestmark = pytest.mark.vllm


def test_vllm_own_async_client_loses_all_audio_silently(tmp_path):
    """vLLM's AsyncLLM with this package's scheduler and worker: requests finish normally with
    zero audio and no error (as with any client whose decoder is set after construction: its output
    task has taken vLLM's decoder by then)."""
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, max_num_seqs=4, args_cls=AsyncEngineArgs, disable_log_stats=True)
    config = omni_vllm_config(args, UsageContext.ENGINE_CONTEXT)

    async def one():
        engine = AsyncLLM(config, Executor.get_class(config), log_stats=False)
        try:
            params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
            async for out in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, request_id="r"):
                last = out
            return last, type(engine.engine_core.decoder)
        finally:
            engine.shutdown()

    out, decoder = asyncio.run(one())
    assert out.finished and len(out.outputs[0].token_ids) == 4  # the tokens arrive...
    assert not hasattr(out.outputs[0], "multimodal_output") and decoder is not OmniMsgpackDecoder  # ...no audio


def all_checked(s: dict, cfg, failed: int = 0) -> bool:
    """Every request of the run checked: finished whole, aborted up to where it got (some of those
    planned to be aborted finish first), or failed as planned."""
    aborts = sum(p.abort for p in _plans(cfg))
    return (s["finished_exact"] + s["aborted_checked"] + s["failed_as_expected"] == cfg.requests
            and s["failed_as_expected"] == failed and 0 < s["aborted_checked"] <= aborts)


def test_two_hundred_streams_over_zmq_every_sample_exact(tmp_path):
    """Under async scheduling (vLLM's AsyncScheduler), which a CPU talker has only when asked for:
    the other engine tests here, the main job's and the speech server's run the CPU default."""
    cfg = SimConfig(requests=200, concurrency=32, min_frames=2, max_frames=9, abort_every=10, bad_every=50,
                    stop_every=7, cadence=2 * tk.FRAME_SAMPLES, device="cpu", async_scheduling=True, paths=("worker",),
                    out_dir=str(tmp_path), progress=False, write_wavs=False)
    s = run(cfg)["paths"]["worker"]
    assert s["async_scheduling"] is True
    # every sample of every finished request, its length and finish reason (simulate._check raises
    # otherwise): 25 of them end on a stop token, most of those before their last frame
    assert s["requests"] == 200 and all_checked(s, cfg, failed=4) and s["requests_stopped"] >= 15
    assert s["slots_held_after"] == 0 and s["engine_steps"] > 0


def test_client_processes_share_one_engine_core_every_sample_exact(tmp_path):
    """``clients=2``: two ``OmniAsyncLLM`` processes on one engine core that vLLM's launcher started,
    as ``vllm serve --api-server-count 2`` runs them (the engine core answers each over its own
    sockets, each message with its own requests' data alone); each serves its share of the
    requests, every sample is checked, the worker's statistics come from the first, and the first
    chunk's stages are found for every streaming request of both."""
    cfg = SimConfig(requests=96, concurrency=16, clients=2, min_frames=2, max_frames=9, abort_every=8,
                    stop_every=5, bad_every=13, cadence=2 * tk.FRAME_SAMPLES, device="cpu", paths=("worker",),
                    out_dir=str(tmp_path), progress=False, write_wavs=False)
    s = run(cfg)["paths"]["worker"]
    # (requests that end on their stop token, whose final output waits for the worker's rest, and
    # requests the worker fails, with the error on their own client's message)
    assert s["client_processes"] == 2 and s["requests"] == 96 and s["requests_stopped"] > 0
    assert all_checked(s, cfg, failed=sum(p.bad for p in _plans(cfg)))
    assert s["slots_held_after"] == 0 and s["engine_steps"] > 0 and s["d2h_copies_per_step"] == 0  # (CPU)
    assert s["stage_split_requests"] == s["streaming_requests"] > 0
    assert all(s[f"first_chunk_{stage}_ms_p99"] >= 0 for stage in STAGES)


class _OwnTalkerExecutor(TalkerExecutor):
    """An integrator's executor: the talker's, subclassed."""


@pytest.mark.parametrize("executor", [None, _OwnTalkerExecutor])
@pytest.mark.parametrize("device, wanted, on", [("cpu", None, False), ("cpu", True, True), ("cuda", None, True),
                                                ("cuda", False, False)])
def test_async_scheduling_is_on_for_a_talker_on_cuda_unless_the_arguments_name_it(tmp_path, device, wanted, on,
                                                                                   executor):
    """On the CPU the talker's forward runs inside ``execute_model``: scheduling a step ahead would
    overlap nothing and hold every output back by one step. The config alone (no engine starts). A
    subclass of ``TalkerExecutor`` passed to ``talker_engine_args`` is used, and decides the same."""
    model = make_model_dir(tmp_path / "model")
    own = {} if executor is None else {"distributed_executor_backend": executor}
    args = talker_engine_args(model, device=device, async_scheduling=wanted, **own)
    config = omni_vllm_config(args, UsageContext.ENGINE_CONTEXT)
    sched = config.scheduler_config
    assert Executor.get_class(config) is (executor or TalkerExecutor)
    assert sched.async_scheduling is on
    assert sched.scheduler_cls is (OmniAsyncScheduler if on else OmniScheduler)


def test_sync_engine_in_its_own_process_and_in_process(tmp_path):
    model = make_model_dir(tmp_path / "model")
    prompts = [TokensPrompt(prompt_token_ids=list(range(4, 4 + n))) for n in (3, 9, 17)]
    params = [SamplingParams(max_tokens=f, output_kind=k, detokenize=False) for f, k in
              ((5, RequestOutputKind.FINAL_ONLY), (3, RequestOutputKind.CUMULATIVE), (7, RequestOutputKind.FINAL_ONLY))]
    results = {}
    for multiprocess in (True, False):
        engine = OmniLLM.from_engine_args(talker_engine_args(model, max_num_seqs=4, disable_log_stats=True),
                                          enable_multiprocessing=multiprocess)
        try:
            assert type(engine.engine_core).__name__ == ("OmniSyncMPClient" if multiprocess else "OmniInprocClient")
            if not multiprocess:  # the talker's engine core is this process: it set torch's threads
                assert talker_cpu_threads(None) in (None, torch.get_num_threads())
            outs = engine.generate(prompts, params)
            # token ids that are not Python ints: refused alike, naming the request; in an engine core of
            # its own a float or a bool ended its input thread, and every later request waited forever
            for bad in ([5, "x", 7], [5, 6.0, 7], [5, True, 7], [5, np.int64(6), 7], [5, None]):
                with pytest.raises(VLLMValidationError, match=r"request \S+-1: .* position 1 is a") as caught:
                    engine.generate([prompts[0], TokensPrompt(prompt_token_ids=bad)], params[0])
                assert caught.value.parameter == "prompt_token_ids"
            again = engine.generate(prompts, params)
            assert all(a.multimodal.tensors["audio"].equal(b.multimodal.tensors["audio"]) for a, b in zip(again, outs))
            # the multimodal channel's time on the client: the decoder's in its own process, the
            # in-process client's (the step's buffer copied and cut into pieces) in process
            spent = engine.engine_core.decoder if multiprocess else engine.engine_core
            assert spent.multimodal_seconds > 0
        finally:
            engine.shutdown()
        results[multiprocess] = outs
        for out, p in zip(outs, params):
            codes, audio = out.multimodal.tensors["codes"], out.multimodal.tensors["audio"]
            assert codes.shape == (p.max_tokens, tk.CODEBOOKS) and audio.equal(tk.expected_audio(codes))
            assert list(out.request_output.outputs[0].token_ids) == (codes[:, 0] + tk.TEXT_VOCAB).tolist()
            assert out.outputs[0].multimodal_output is out.multimodal  # as vLLM's RequestOutput reads
    for a, b in zip(results[True], results[False]):  # the same talker, the same frames either way
        assert a.multimodal.tensors["codes"].equal(b.multimodal.tensors["codes"])


def test_engines_made_from_vllms_own_config_serve_the_audio_and_generate_as_vllms_llm_does(tmp_path):
    """``from_vllm_config`` with the config vLLM makes of the engine arguments (its scheduler class
    unset, as vLLM's launchers build it): the engine runs this package's scheduler, so the audio
    arrives (vLLM's own scheduler would drop every sample, the request finishing normally).
    ``generate`` takes ``sampling_params`` by vLLM's name, or none, and returns whole results
    whatever the output kind, as ``LLM.generate`` does (a DELTA request's too, run CUMULATIVE: its
    audio leaves the worker as it is made: 4 requests of 200 frames, 1.5 MB of audio each, go
    through 4 MiB of output memory, which FINAL_ONLY would need to hold all of at once)."""
    args = talker_engine_args(make_model_dir(tmp_path / "model"), max_num_seqs=4, disable_log_stats=True,
                              additional_config={"omni": {"pool_budget_bytes": 4 << 20}})
    engine = OmniLLM.from_vllm_config(args.create_engine_config(UsageContext.ENGINE_CONTEXT))
    prompts = [[5, 6, 7 + i] for i in range(4)]
    try:
        delta = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.DELTA, detokenize=False)
        outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling_params=delta)
        (default,) = engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]))
    finally:
        engine.shutdown()
    assert delta.output_kind == RequestOutputKind.DELTA  # the caller's parameters are left as they were
    for prompt, out in zip(prompts, outs, strict=True):
        want = tk.rollout(tk.ToyTalker(0), prompt, 200)
        assert out.outputs[0].finish_reason == "length", out.outputs[0].stop_reason
        assert out.multimodal.tensors["codes"].equal(want)
        assert out.multimodal.tensors["audio"].equal(tk.expected_audio(want))
    assert default.multimodal.tensors["codes"].shape[0] == SamplingParams().max_tokens


@pytest.mark.parametrize("option, value", [("cadence", -1), ("pool_budget_bytes", 0), ("cpu_threads", 0),
                                           ("rows", 0), ("cadence", 2.5), ("rows", True)])
def test_the_talkers_options_out_of_range_are_refused_with_the_config(tmp_path, option, value):
    """``additional_config['omni']`` is checked as the server's options are, when vLLM's config is
    made (before any engine process starts), naming the option."""
    args = talker_engine_args(make_model_dir(tmp_path / "model"), additional_config={"omni": {option: value}})
    with pytest.raises(ValueError, match=f"'{option}'\\] must be a whole number"):
        omni_vllm_config(args, UsageContext.ENGINE_CONTEXT)


def test_vllm_own_model_loader_refuses_the_talker_naming_this_packages_entry_points(tmp_path):
    """``vllm serve DIR``, ``LLM`` or ``AsyncLLM`` on a talker directory, with vLLM's executor, build
    the model with vLLM's loader for vLLM's model runner, which has no audio path for it: refused
    there, saying what to run."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    model = str(make_model_dir(tmp_path / "model"))
    config = EngineArgs(model=model, tokenizer=model, dtype="float32", enforce_eager=True,
                        max_model_len=512).create_engine_config()
    with set_current_vllm_config(config), pytest.raises(ValueError, match="python -m vllm_omni_kernels serve DIR"):
        initialize_model(vllm_config=config)


def test_a_talker_on_more_than_one_device_is_refused_with_the_config(tmp_path):
    """``TalkerExecutor`` runs one worker on one device: tensor parallelism is refused when the
    config is made and when an engine is built from vLLM's own config (it ran on one device, the
    other ignored, without a word; vLLM refuses pipeline parallelism with this executor itself)."""
    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="one device"):
        omni_vllm_config(args, UsageContext.ENGINE_CONTEXT)
    with pytest.raises(ValueError, match="one device"):
        OmniLLM.from_vllm_config(args.create_engine_config(UsageContext.ENGINE_CONTEXT))


class _Latencies(StatLoggerBase):
    """A vLLM stat logger that keeps every inter-token latency and generation token count."""

    def __init__(self, vllm_config, engine_index=0):
        self.itl, self.tokens, self.ttft, self.per_iteration = [], 0, 0, []

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if iteration_stats is not None:
            self.itl += iteration_stats.inter_token_latencies_iter
            self.tokens += iteration_stats.num_generation_tokens
            self.per_iteration.append(iteration_stats.num_generation_tokens)
            self.ttft += len(iteration_stats.time_to_first_tokens_iter)

    def log_engine_initialized(self):
        pass


def _engine_logging_statistics(tmp_path, multiprocess: bool) -> tuple[OmniLLM, _Latencies]:
    """A CPU talker's engine with statistics on, and the stat logger vLLM made for it."""
    loggers = []

    def factory(config, index=0):
        loggers.append(_Latencies(config, index))
        return loggers[-1]

    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", max_num_seqs=4,
                              disable_log_stats=False)
    engine = OmniLLM.from_engine_args(args, stat_loggers=[factory], enable_multiprocessing=multiprocess)
    return engine, loggers[0]


@pytest.mark.parametrize("multiprocess", [True, False])
def test_vllms_statistics_take_one_inter_token_latency_per_step_of_a_paced_stream(tmp_path, multiprocess):
    """The scheduler holds a paced request's tokens back for its audio (a cadence of 4 frames:
    one output in 4 steps; a whole file: one at its end), but vLLM's statistics are what they would
    be from an output every step: one inter-token latency per step after the first token, each
    about a step long, not one per output spanning the steps held (a 40-frame whole file read as
    1 latency of its whole decode); and the generation tokens counted as they are made, a step's
    at a time (a whole file's came all at its end)."""
    engine, log = _engine_logging_statistics(tmp_path, multiprocess)
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    try:
        engine.generate([TokensPrompt(prompt_token_ids=[5, 6, 7 + i]) for i in range(3)],
                        sampling_params=[SamplingParams(max_tokens=40, output_kind=k, detokenize=False) for k in kinds])
    finally:
        engine.shutdown()
    assert log.tokens == 120 and log.ttft == 3
    # counted with the messages that carry outputs (a cadence interval apart here, when the three
    # streams' outputs go): never a whole file's 39 held tokens at once
    assert max(log.per_iteration) <= 3 * 4, log.per_iteration
    assert len(log.itl) == 3 * 39, len(log.itl)
    assert min(log.itl) >= 0 and max(log.itl) < 5 * float(np.median(log.itl)) + 0.05


def test_the_tokens_of_a_whole_file_aborted_while_held_count_in_vllms_statistics(tmp_path):
    """A whole file's tokens wait in the engine core for its audio, and an abort drops them with
    its audio (no token goes without it); vLLM's generation-token count still has them, as it has
    every token the engine made (it had the first alone)."""
    engine, log = _engine_logging_statistics(tmp_path, True)
    try:
        whole = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        engine.add_request("file", TokensPrompt(prompt_token_ids=[5, 6, 7]), whole)
        engine.add_request("stream", TokensPrompt(prompt_token_ids=[5, 6, 8]),
                           SamplingParams(max_tokens=30, output_kind=RequestOutputKind.DELTA, detokenize=False))
        for _ in range(20):
            engine.step()
        engine.abort_request(["file"])
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    assert 30 + 19 <= log.tokens <= 30 + 22, log.tokens  # the stream's, and the file's made before its abort


def test_engines_in_the_callers_process_give_torchs_threads_back(tmp_path):
    """A talker on the CPU sets torch's intra-op threads for its steps (``cpu_threads``): in the
    caller's process they are the caller's again once the last such engine has shut down, and an
    engine that fails to start changes nothing."""
    model = make_model_dir(tmp_path / "model")
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with pytest.raises(ValueError, match="pool_budget_bytes"):
            OmniLLM.from_engine_args(talker_engine_args(model, device="cpu", max_num_seqs=4, additional_config={
                "omni": {"pool_budget_bytes": 1 << 10, "cpu_threads": 1}}), enable_multiprocessing=False)
        assert torch.get_num_threads() == 3
        engines = [OmniLLM.from_engine_args(talker_engine_args(model, device="cpu", max_num_seqs=4, disable_log_stats=True,
                                                               additional_config={"omni": {"cpu_threads": 1}}),
                                            enable_multiprocessing=False) for _ in range(2)]
        assert torch.get_num_threads() == 1
        engines[0].shutdown()
        assert torch.get_num_threads() == 1  # the other one still steps with its own
        engines[1].shutdown()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_generate_takes_an_idle_engine_and_leaves_nothing_behind_a_refused_prompt(tmp_path):
    """``OmniLLM.generate`` takes every output ``step`` returns: with a request of the caller's own
    in flight (id "0", which ``generate`` once used itself) it refuses to run; a prompt vLLM refuses
    (longer than ``max_model_len``) raises, and the prompts added before it are aborted. One prompt
    is one request (a list of token ids too, as vLLM's ``LLM.generate`` takes it); sampling
    parameters that are neither one nor one per prompt are refused, and so are those the talker
    cannot honour, as vLLM refuses a bad parameter, and prompt embeddings (the talker speaks token
    ids: served, every embeddings prompt would get the audio of token 0)."""
    engine = OmniLLM.from_engine_args(talker_engine_args(make_model_dir(tmp_path / "model"), max_num_seqs=4,
                                                         max_model_len=64, disable_log_stats=True,
                                                         enable_prompt_embeds=True),
                                      enable_multiprocessing=False)
    final = SamplingParams(max_tokens=7, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
    try:
        engine.add_request("0", TokensPrompt(prompt_token_ids=[20, 21, 22, 23]), final)
        with pytest.raises(RuntimeError, match="idle engine"):
            engine.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], final)
        while engine.has_unfinished_requests():
            engine.step()
        with pytest.raises(VLLMValidationError, match="maximum context length"):
            engine.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TokensPrompt(prompt_token_ids=[9] * 80)], final)
        assert not engine.has_unfinished_requests()
        (out,) = engine.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], final)
        assert out.multimodal.tensors["audio"].equal(tk.expected_audio(tk.rollout(tk.ToyTalker(0), [5, 6, 7], 7)))
        # what code written for vLLM's LLM.generate reads, as on vLLM's RequestOutput
        assert (out.prompt_token_ids, out.finished, out.outputs[0].finish_reason) == ([5, 6, 7], True, "length")
        assert out.num_cached_tokens == out.request_output.num_cached_tokens and out.prompt_logprobs is None
        for not_a_field in ("no_such_field", "add"):  # (vLLM's methods stay the wrapped output's)
            with pytest.raises(AttributeError, match=f"'OmniRequestOutput' object has no attribute '{not_a_field}'"):
                getattr(out, not_a_field)
        (one,) = engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), final)  # one prompt, not a list of keys
        assert one.multimodal.tensors["audio"].equal(out.multimodal.tensors["audio"])
        (ids,) = engine.generate([5, 6, 7], final)  # one prompt of token ids
        assert ids.multimodal.tensors["audio"].equal(out.multimodal.tensors["audio"])
        from vllm.inputs import EmbedsPrompt

        with pytest.raises(VLLMValidationError, match="takes no prompt embeddings") as caught:
            engine.generate(EmbedsPrompt(prompt_embeds=torch.zeros(5, 64)), final)
        assert caught.value.parameter == "prompt_embeds" and not engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
            engine.generate([TokensPrompt(prompt_token_ids=[5, 6, 7 + i]) for i in range(3)], [final, final])
        # n samples: the whole of each, CUMULATIVE as FINAL_ONLY (vLLM sends a streaming kind's outputs
        # one sample at a time)
        want = (tk.rollout(tk.ToyTalker(0), [5, 6, 7], 5)[:, 0] + tk.TEXT_VOCAB).tolist()
        for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
            (two,) = engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]),
                                     SamplingParams(n=2, max_tokens=5, output_kind=kind, detokenize=False))
            assert [list(c.token_ids) for c in two.request_output.outputs] == [want, want], kind
        # what the talker's sampling cannot honour is refused at admission (TalkerSampling), not ignored
        from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

        for refused in ({"logprobs": 2}, {"prompt_logprobs": 1}, {"logprob_token_ids": [1800]},
                        {"prompt_logprob_token_ids": [[1800]]},
                        {"min_tokens": 3, "stop_token_ids": [1100]},
                        {"allowed_token_ids": [1500]}, {"bad_words": ["x"]}, {"logit_bias": {1800: -100.0}},
                        {"structured_outputs": StructuredOutputsParams(choice=["yes", "no"])},
                        {"repetition_detection": RepetitionDetectionParams(max_pattern_size=4, min_count=3)}):
            with pytest.raises(VLLMValidationError, match="the talker") as caught:
                engine.add_request("refused", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                                   SamplingParams(max_tokens=7, detokenize=False, **refused))
            assert caught.value.parameter == next(iter(refused))
        assert not engine.has_unfinished_requests()
        # vLLM's LLM.generate keywords: a progress bar made by the caller's callable, one priority
        # per prompt
        bars = []

        class Bar:
            def __init__(self, total, **kwargs):
                self.total, self.n, self.closed = total, 0, False
                bars.append(self)

            def update(self, n):
                self.n += n

            def close(self):
                self.closed = True

        prompts = [TokensPrompt(prompt_token_ids=[5, 6, 7]), [5, 6, 7]]
        both = engine.generate(prompts, final, use_tqdm=Bar, priority=[0, 0], lora_request=None,
                               tokenization_kwargs={})
        assert [(b.total, b.n, b.closed) for b in bars] == [(2, 2, True)]
        assert all(o.multimodal.tensors["audio"].equal(out.multimodal.tensors["audio"]) for o in both)
        assert len(engine.generate(prompts, final, use_tqdm=False)) == 2 and len(bars) == 1
        with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
            engine.generate(prompts, final, priority=[0])
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_the_async_engine_refuses_a_deeper_sleep_before_it_pauses(tmp_path):
    """``OmniAsyncLLM.sleep`` (what vLLM's ``/sleep`` route calls): levels 1 and 2 refused, and the
    engine serves on, unpaused."""
    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", max_num_seqs=2,
                              args_cls=AsyncEngineArgs, disable_log_stats=True)

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            for level in (1, 2):
                with pytest.raises(ValueError, match=f"sleep level {level}: .*nothing was paused"):
                    await engine.sleep(level=level)
            assert not await engine.is_sleeping()
            params = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
            return await asyncio.wait_for(_served(engine, "after", [5, 6, 7], params), 60)
        finally:
            engine.shutdown()

    reason, audio = asyncio.run(serve())
    assert reason == "length" and audio.equal(tk.expected_audio(tk.rollout(tk.ToyTalker(0), [5, 6, 7], 5)))


def test_a_paused_engine_loses_nothing_and_a_deeper_sleep_is_refused_clearly(tmp_path):
    """vLLM's ``sleep(level=0)`` pauses scheduling (its pause asks the worker to wait for its
    device); a stream paused mid-way resumes on ``wake_up`` with every sample. Levels 1 and 2
    would free the worker's memory, which the talker keeps: they raise an error that says so
    before anything pauses (vLLM's engine core paused, aborting the request in flight, and stayed
    paused until ``wake_up``); ``release_kv_cache_memory`` is refused after a pause, and
    ``wake_up`` resumes serving. Over ZMQ."""
    engine = OmniLLM.from_engine_args(talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu",
                                                         max_num_seqs=4, disable_log_stats=True))
    prompt, frames = [10, 11, 12], 40
    want = tk.expected_audio(tk.rollout(tk.ToyTalker(0), prompt, frames))
    delta = SamplingParams(max_tokens=frames, output_kind=RequestOutputKind.DELTA, detokenize=False)
    try:
        engine.add_request("a", TokensPrompt(prompt_token_ids=prompt), delta)
        pieces = []

        def step():
            for out in engine.step():
                if out.outputs[0].multimodal_output is not None:
                    pieces.append(out.outputs[0].multimodal_output.tensors["audio"])

        for _ in range(4):
            step()
        engine.sleep(level=0, mode="keep")  # (a step now would wait for output, as vLLM's client does)
        assert engine.is_sleeping()
        assert engine.wake_up(["scheduling"]) and not engine.is_sleeping()
        while engine.has_unfinished_requests():
            step()
        assert torch.cat(pieces).equal(want)
        pieces.clear()
        engine.add_request("in-flight", TokensPrompt(prompt_token_ids=prompt), delta)
        step()
        for level in (1, 2):  # refused before vLLM pauses: the request in flight goes on, whole
            with pytest.raises(ValueError, match=f"sleep level {level}: the talker keeps its weights.*nothing was"):
                engine.sleep(level=level)
            assert not engine.is_sleeping()
        while engine.has_unfinished_requests():
            step()
        assert torch.cat(pieces).equal(want)
        # vLLM's release_kv_cache_memory (after a completed pause): refused, and the engine wakes up
        engine.sleep(level=0)
        with pytest.raises(Exception, match="the talker keeps no KV cache"):
            engine.release_kv_cache_memory()
        assert engine.wake_up() and not engine.is_sleeping()
        with pytest.raises(Exception, match="the talker serves no LoRA adapters"):  # and vLLM's LoRA calls say why
            engine.add_lora(LoRARequest("voice", 1, str(tmp_path)))
        assert not engine.list_loras()
        pieces.clear()
        engine.add_request("b", TokensPrompt(prompt_token_ids=prompt), delta)
        while engine.has_unfinished_requests():
            step()
        assert torch.cat(pieces).equal(want)
    finally:
        engine.shutdown()


def test_an_in_process_caller_that_keeps_its_audio_holds_no_buffer_of_the_worker(tmp_path):
    """In process the frontend cuts each step's pieces from a copy of the step's buffer, so the
    worker reuses its buffers however long the caller keeps the audio (simulate keeps a FINAL_ONLY
    request's until its check): with views of the worker's own buffers this run allocated 17 in
    75 steps."""
    cfg = SimConfig(requests=48, concurrency=8, max_frames=10, paths=("worker",), in_process=True, device="cpu",
                    out_dir=str(tmp_path), progress=False, write_wavs=False)
    s = run(cfg)["paths"]["worker"]
    assert s["finished_exact"] + s["aborted_checked"] == 48 and s["slots_held_after"] == 0
    # (the steps depend on how the arrivals fall on the host's load: 75 to 106 here)
    assert s["engine_steps"] > 40 and s["host_buffers_allocated"] <= 4


def test_a_cpu_talker_leaves_half_the_cores_to_the_api_servers():
    assert talker_cpu_threads(None, environ={}, cores=16) == 8
    assert talker_cpu_threads(None, environ={}, cores=1) == 1
    assert talker_cpu_threads(None, environ={"OMP_NUM_THREADS": "3"}, cores=16) is None  # the user's setting
    assert talker_cpu_threads(3, environ={"OMP_NUM_THREADS": "1"}, cores=16) == 3  # the option wins


def test_the_talkers_audio_and_codes_are_what_they_are_defined_as():
    """decode_frames against its definition in Python integers (sample t of codebook q:
    ``(t * step_q) mod 2**16 - 2**15``, summed, times 2**-18), frames far along included; the
    talker's heads as one matmul against the per-codebook contraction."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, tk.CODEBOOK_SIZE, (5, tk.CODEBOOKS), generator=g)
    frames = torch.tensor([0, 1, 777, 2**20 + 3, 2**24 - 1])
    got = tk.decode_frames(codes, frames)
    for b in range(5):
        steps = [1 + (int(codes[b, q]) * 37 + q * 101) % 2039 for q in range(tk.CODEBOOKS)]
        for i in (0, 1, 999, tk.FRAME_SAMPLES - 1):
            t = int(frames[b]) * tk.FRAME_SAMPLES + i
            want = sum((t * s) % 65536 - 32768 for s in steps) * 2.0 ** -18
            assert got[b, i].item() == want, (b, i)
    talker = tk.ToyTalker(0)
    last, frame = torch.randint(0, tk.VOCAB, (6,), generator=g), torch.randint(0, 9000, (6,), generator=g)
    context = talker.prompt_context(torch.randint(0, tk.TEXT_VOCAB, (6, 9), generator=g), torch.full((6,), 9))
    h = tk._fold(tk._fold(talker.embed[last] + talker.position[frame % tk._POSITIONS] + context) @ talker.mix)
    logits = torch.einsum("bh,qhc->bqc", h, talker.heads)
    assert torch.equal(talker(last, frame, context), (logits * tk.CODEBOOK_SIZE + talker.rank).argmax(-1))


def test_a_client_behind_the_engine_hands_every_step_to_its_streams_before_the_next(tmp_path):
    """The client's event loop is blocked while the engine core streams on, so every step of the
    requests waits at once when it frees up. Each DELTA stream still takes each step's audio on its
    own (one frame a step, cadence one frame): the waiting steps are not processed back to back with
    the streams' outputs merged (``client.OmniAsyncMPClient.get_output_async``)."""
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", cadence=tk.FRAME_SAMPLES, max_num_seqs=4,
                              args_cls=AsyncEngineArgs, disable_log_stats=True)
    frames = 24

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args, processor_options=talker_processor_options("worker"))
        try:
            pieces = {f"r{i}": [] for i in range(3)}
            started = asyncio.Event()

            async def stream(rid):
                params = SamplingParams(max_tokens=frames, output_kind=RequestOutputKind.DELTA, detokenize=False)
                async for out in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, request_id=rid):
                    payload = getattr(out.outputs[0], "multimodal_output", None)
                    if payload is not None:
                        pieces[rid].append(payload.tensors["audio"].numel())
                    if all(pieces.values()):
                        started.set()

            streams = asyncio.gather(*(stream(rid) for rid in pieces))
            await started.wait()
            time.sleep(1.0)  # the client falls behind: the engine core runs on in its own process
            await streams
            return pieces
        finally:
            engine.shutdown()

    pieces = asyncio.run(serve())
    for rid, sizes in pieces.items():
        assert sum(sizes) == frames * tk.FRAME_SAMPLES, rid
        assert set(sizes) == {tk.FRAME_SAMPLES}, (rid, sizes)  # no output carries two steps' audio


def _stopping_at_the_third_frame(count: int) -> list[tuple[list[int], int]]:
    """``count`` (prompt, stop token) pairs: prompts whose third frame's token is new there, so a
    request with that stop token makes 3 frames, then stops."""
    found = []
    for i in range(200):
        prompt = [5, 6, 7 + i]
        tokens = (tk.rollout(tk.ToyTalker(0), prompt, 3)[:, 0] + tk.TEXT_VOCAB).tolist()
        if tokens[2] not in tokens[:2]:
            found.append((prompt, tokens[2]))
        if len(found) == count:
            return found
    raise AssertionError(f"fewer than {count} such prompts")


def test_a_step_that_only_delivers_the_rest_of_a_stopped_request_counts_as_a_step_with_output(tmp_path):
    """A request alone that ends on its third token: three steps sample a frame each, and a fourth
    samples nothing and delivers its rest (the stop is seen once the third step resolves). The
    worker's figures count four steps with output, as its copies do on a GPU (the fourth was left
    out: copies per step came out above one)."""
    ((prompt, stop),) = _stopping_at_the_third_frame(1)
    engine = OmniLLM.from_engine_args(talker_engine_args(make_model_dir(tmp_path / "model"), max_num_seqs=2,
                                                         disable_log_stats=True, async_scheduling=False),
                                      enable_multiprocessing=False)
    try:
        engine.collective_rpc("reset_output_path_stats")
        (out,) = engine.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
            max_tokens=10, output_kind=RequestOutputKind.DELTA, detokenize=False, stop_token_ids=[stop]))
        stats = engine.collective_rpc("output_path_stats")[0]
    finally:
        engine.shutdown()
    assert out.outputs[0].finish_reason == "stop" and stats["stopped"] == 1
    assert stats["output_steps"] == 4 and stats["steps"] == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_that_end_on_a_stop_token_get_all_their_audio_in_process(tmp_path, async_scheduling):
    """A stop token is known only when its step's copy lands, after the scheduler has sent the
    step's outputs on: the request's final output waits for the rest, which the worker delivers
    (up to the stopping frame) at the next step, or the one after under async scheduling. In
    process (``OmniLLM``), sync and async; every output kind. Under async scheduling the worker
    runs a frame past the stop before it sees the token: that frame must never reach the client.
    The engine is full: vLLM gives a stopped request's seat to a waiting one before the worker has
    closed its output, so the worker needs more rows than vLLM has seats."""
    cfg = SimConfig(requests=60, concurrency=16, min_frames=6, max_frames=30, abort_every=10, stop_every=4,
                    arrival_ms=0, cadence=2 * tk.FRAME_SAMPLES, device="cpu", async_scheduling=async_scheduling,
                    in_process=True, paths=("worker",), out_dir=str(tmp_path), progress=False, write_wavs=False,
                    engine_args={"max_num_seqs": 4})  # requests wait for seats: a freed one is taken at once
    s = run(cfg)["paths"]["worker"]
    planned = sum(p.stop is not None for p in _plans(cfg))
    assert all_checked(s, cfg) and s["requests_stopped"] == s["worker_stops_seen"] == planned
    assert s["slots_held_after"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_output_carries_the_tokens_its_audio_belongs_to_at_a_stop_and_at_a_failure(tmp_path, async_scheduling):
    """Over ZMQ (``OmniLLM``, its engine core in its own process), step by step. A request that
    stops on its first token has that frame's audio due at once (a stream's first data), while its
    finish waits for the worker's rest: the audio goes with its token, the finish after it; so does
    a stop at the fourth token with the audio due every step (cadence 0 in the second engine).
    Every output's frames are its tokens' frames. A request the worker fails at its fourth frame,
    two of whose tokens the scheduler holds back for its pace then (the default cadence: four
    frames), gets every token on its outputs, the error's last."""
    model = make_model_dir(tmp_path / "model")
    prompt = [5, 17, 33, 44, 61, 70]
    tokens = (tk.rollout(tk.ToyTalker(0), prompt, 12)[:, 0] + tk.TEXT_VOCAB).tolist()
    bad_prompt = [5] + [BAD] * 3 + [7]  # its chunk of frame 3 is malformed
    bad_tokens = (tk.rollout(tk.ToyTalker(0), bad_prompt, 4)[:, 0] + tk.TEXT_VOCAB).tolist()
    for cadence, stop_at in ((None, 0), (0, 3)):
        engine = OmniLLM.from_engine_args(talker_engine_args(
            model, max_num_seqs=4, disable_log_stats=True, async_scheduling=async_scheduling, cadence=cadence,
            additional_config={"omni": {"bad_prompt_token": BAD}}))
        try:
            for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
                engine.add_request(f"stop-{kind.name}", TokensPrompt(prompt_token_ids=prompt), SamplingParams(
                    max_tokens=12, output_kind=kind, detokenize=False, stop_token_ids=[tokens[stop_at]]))
                engine.add_request(f"bad-{kind.name}", TokensPrompt(prompt_token_ids=bad_prompt), SamplingParams(
                    max_tokens=12, output_kind=kind, detokenize=False))
            outs: dict[str, list] = {}  # request -> (token ids, frames of codes, finish, stop) of each output
            while engine.has_unfinished_requests():
                for out in engine.step():  # (a CUMULATIVE output's token list grows after it came)
                    comp = out.outputs[0]
                    frames = 0 if comp.multimodal_output is None else comp.multimodal_output.tensors["codes"].shape[0]
                    outs.setdefault(out.request_id, []).append(
                        (list(comp.token_ids), frames, comp.finish_reason, str(comp.stop_reason)))
        finally:
            engine.shutdown()
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
            delta = kind == RequestOutputKind.DELTA
            got = outs[f"stop-{kind.name}"]
            assert got[-1][2] == "stop"
            assert all(frames == len(ids) for ids, frames, _, _ in got), (kind, cadence, got)
            assert ([t for ids, *_ in got for t in ids] if delta else got[-1][0]) == tokens[:stop_at + 1]
            failed = outs[f"bad-{kind.name}"]
            assert failed[-1][2] == "error" and "dtype" in failed[-1][3]
            assert ([t for ids, *_ in failed for t in ids] if delta else failed[-1][0]) == bad_tokens, (kind, cadence)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failure_on_the_last_frame_of_a_request_that_may_stop_reaches_its_caller(tmp_path, async_scheduling):
    """A request with stop tokens whose last frame's chunk is malformed, alone in the engine: under
    async scheduling the worker holds the failure until the step before it resolves (its token may
    have ended the request), and vLLM has finished the request by its length by then; the next
    step has nothing scheduled, and the failure goes out with a step output of its own. Its caller
    gets the worker's typed error, not the scheduler's "lost" one, and no slot stays held."""
    frames = 3
    prompt = [5] + [BAD] * (frames - 1) + [7]  # its chunk of frame 2, the last, is malformed
    rolled = set((tk.rollout(tk.ToyTalker(0), prompt, frames)[:, 0] + tk.TEXT_VOCAB).tolist())
    never = next(t for t in range(tk.TEXT_VOCAB, tk.VOCAB) if t not in rolled)  # a stop token it never samples
    engine = OmniLLM.from_engine_args(talker_engine_args(
        make_model_dir(tmp_path / "model"), max_num_seqs=4, disable_log_stats=True, async_scheduling=async_scheduling,
        additional_config={"omni": {"bad_prompt_token": BAD}}))
    try:
        finishes = {}
        for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
            engine.add_request(kind.name, TokensPrompt(prompt_token_ids=prompt), SamplingParams(
                max_tokens=frames, output_kind=kind, detokenize=False, stop_token_ids=[never]))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finishes[kind.name] = (out.outputs[0].finish_reason, str(out.outputs[0].stop_reason))
        stats = engine.collective_rpc("output_path_stats")[0]
    finally:
        engine.shutdown()
    for kind, (reason, why) in finishes.items():
        assert reason == "error" and "dtype" in why, (kind, why)
    assert stats["requests_held"] == 0 and "first_chunk_at" not in stats


# vLLM's model runner: V2, its default where Triton runs on a GPU, hands the worker a resumed
# request as a new one; async scheduling is the default there too
RUNNERS = pytest.mark.parametrize("async_scheduling, runner", [(False, "v1"), (True, "v1"), (True, "v2")])


def use_runner(monkeypatch, runner: str) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")


@RUNNERS
def test_requests_preempted_for_kv_cache_are_recomputed_and_lose_nothing(tmp_path, monkeypatch, async_scheduling,
                                                                          runner):
    """A KV cache of 16 blocks for 32 streams of up to 100 tokens: vLLM preempts running requests and
    recomputes them (in chunks of at most 32 tokens, with no prefix cache to shorten the
    recomputation) when blocks come free. Their rows and slots stay; every sample is still exact,
    every fourth request ending on a stop token among them."""
    use_runner(monkeypatch, runner)
    cfg = SimConfig(requests=120, concurrency=32, min_frames=20, max_frames=60, abort_every=10, stop_every=4,
                    cadence=2 * tk.FRAME_SAMPLES, device="cpu", async_scheduling=async_scheduling, paths=("worker",),
                    out_dir=str(tmp_path), progress=False, write_wavs=False,
                    engine_args={"num_gpu_blocks_override": 16, "max_model_len": 128, "max_num_batched_tokens": 32,
                                 "enable_prefix_caching": False})
    s = run(cfg)["paths"]["worker"]
    assert s["resumptions"] >= 20 and s["requests_stopped"] >= 20  # preempted, then scheduled again
    assert all_checked(s, cfg) and s["slots_held_after"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_scheduling_preempts_for_each_arrival_and_loses_nothing(tmp_path, async_scheduling):
    """vLLM's priority scheduling, each arrival outranking every earlier request, through a KV
    cache of 16 blocks: vLLM preempts running requests again and again and serves the newcomers
    first, and every preempted request keeps its row and audio in the worker until it resumes. The
    worker starts with 2 rows and makes more as requests need them (twice as many each time), the
    rows held and their state staying where they are; every sample is exact."""
    cfg = SimConfig(requests=160, concurrency=64, min_frames=30, max_frames=60, abort_every=10, stop_every=4,
                    priorities=160, arrival_ms=0, cadence=2 * tk.FRAME_SAMPLES, device="cpu",
                    async_scheduling=async_scheduling, paths=("worker",), out_dir=str(tmp_path), progress=False,
                    write_wavs=False, engine_args={"num_gpu_blocks_override": 16, "max_model_len": 128,
                                                   "max_num_batched_tokens": 32, "enable_prefix_caching": False,
                                                   "max_num_seqs": 8, "additional_config": {"omni": {"rows": 2}}})
    s = run(cfg)["paths"]["worker"]
    assert s["resumptions"] >= 20 and s["worker_rows"] >= 8  # grown twice at least
    assert all_checked(s, cfg) and s["slots_held_after"] == 0


@RUNNERS
def test_a_reset_of_running_requests_loses_nothing(tmp_path, monkeypatch, async_scheduling, runner):
    """``reset_prefix_cache(reset_running_requests=True)`` (vLLM's admin call, over ZMQ; its pause
    and sleep make it too) preempts every running request and vLLM recomputes them. With a step in
    flight (async scheduling) it drops that step's tokens, whose audio the worker has produced:
    when vLLM samples those frames again the worker hands it the tokens it sampled, and every
    stream stays exact (without that, the stream would wait for ever for a token the worker does not
    sample again)."""
    use_runner(monkeypatch, runner)
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=8, args_cls=AsyncEngineArgs, disable_log_stats=True,
                              async_scheduling=async_scheduling)
    frames = 300

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            got = {f"r{i}": [] for i in range(6)}
            started = asyncio.Event()

            async def stream(rid):
                tokens, pieces = [], []
                params = SamplingParams(max_tokens=frames, output_kind=RequestOutputKind.DELTA, detokenize=False)
                try:
                    async for out in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, int(rid[1:]) + 7]), params,
                                                     request_id=rid):
                        tokens += out.outputs[0].token_ids
                        payload = getattr(out.outputs[0], "multimodal_output", None)
                        if payload is not None:
                            pieces.append(payload.tensors)
                            got[rid] = pieces
                        if all(got.values()):
                            started.set()
                except MultimodalOutputError as exc:
                    return exc
                return tokens, pieces

            streams = asyncio.gather(*(stream(rid) for rid in got))
            await started.wait()
            assert await engine.reset_prefix_cache(reset_running_requests=True)
            results = await asyncio.wait_for(streams, 120)
            for _ in range(100):  # vLLM tells the worker of the last finishes with a step of their own
                stats = (await engine.collective_rpc("output_path_stats"))[0]
                if stats["requests_held"] == 0:
                    break
                await asyncio.sleep(0.05)
            return dict(zip(got, results)), stats
        finally:
            engine.shutdown()

    results, stats = asyncio.run(serve())
    assert stats["resumed"] >= 1 and stats["requests_held"] == 0
    assert (stats["replayed"] >= 1) == async_scheduling  # tokens vLLM dropped and sampled again
    assert all(p["slots_used"] == 0 for p in stats["accumulator"]["pools"].values())
    for rid, result in results.items():
        assert not isinstance(result, Exception), result
        tokens, pieces = result
        codes = torch.cat([p["codes"] for p in pieces])
        assert len(tokens) == frames and (codes[:, 0] + tk.TEXT_VOCAB).tolist() == tokens, rid
        assert codes.equal(tk.rollout(tk.ToyTalker(0), [5, 6, int(rid[1:]) + 7], frames)), rid
        assert torch.cat([p["audio"] for p in pieces]).equal(tk.expected_audio(codes)), rid


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_reset_that_drops_a_stop_token_loses_nothing(tmp_path, monkeypatch, runner):
    """The reset comes while the step in flight samples request "s"'s stop token: vLLM drops that
    output and never sees the stop, the worker does and closes "s"'s output at it. When vLLM resumes
    "s" (steps later: recomputing every request takes several steps of 32 tokens) it samples the
    stop again and gets it from the worker, and "s" ends there with every sample; the other
    requests, whose tokens vLLM dropped too, go on exactly. In process, async."""
    use_runner(monkeypatch, runner)
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=8, async_scheduling=True, disable_log_stats=True,
                              max_num_batched_tokens=32, max_model_len=256, enable_prefix_caching=False)
    engine = OmniLLM.from_engine_args(args, enable_multiprocessing=False)
    assert engine.vllm_config.use_v2_model_runner == (runner == "v2")
    try:
        prompt, stop_at = [5, 6, 7, 8], 6
        tokens = (tk.rollout(tk.ToyTalker(0), prompt, 40)[:, 0] + tk.TEXT_VOCAB).tolist()
        assert tokens.index(tokens[stop_at]) == stop_at  # its first occurrence: "s" ends there
        requests = {f"long{i}": ([10 + i] * 30, None, 60) for i in range(3)}
        requests["s"] = (prompt, tokens[stop_at], 40)
        for rid, (p, stop, n) in requests.items():
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), SamplingParams(
                max_tokens=n, output_kind=RequestOutputKind.DELTA, detokenize=False,
                stop_token_ids=None if stop is None else [stop]))
        worker = engine.model_executor.driver_worker
        finish, reset = {}, False
        got = {rid: ([], []) for rid in requests}
        for _ in range(500):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                got[out.request_id][0].extend(out.outputs[0].token_ids)
                if out.outputs[0].multimodal_output is not None:
                    got[out.request_id][1].append(out.outputs[0].multimodal_output.tensors["audio"])
                if out.finished:
                    finish[out.request_id] = out.outputs[0].finish_reason
            row = next((r for k, r in worker._row.items() if k.startswith("s-")), None)
            if not reset and row is not None and worker._produced[row] == stop_at + 1:  # the stop is in flight
                assert engine.reset_prefix_cache(reset_running_requests=True)
                reset = True
        assert reset and not engine.has_unfinished_requests() and worker.stats["replayed"] >= 1
        assert finish == {"long0": "length", "long1": "length", "long2": "length", "s": "stop"}
        for rid, (p, _, n) in requests.items():
            n = stop_at + 1 if rid == "s" else n
            codes = tk.rollout(tk.ToyTalker(0), p, n)
            assert got[rid][0] == (codes[:, 0] + tk.TEXT_VOCAB).tolist(), rid
            assert torch.cat(got[rid][1]).equal(tk.expected_audio(codes)), rid
        engine.step()  # vLLM tells the worker of the last finish with a step of its own
        assert not worker._row and len(worker.acc) == 0
    finally:
        engine.shutdown()


def test_requests_the_output_memory_cannot_hold_fail_alone_and_the_engine_serves_on(tmp_path):
    """An audio arena of 9 MiB (``pool_budget_bytes``) holds nine whole-file requests of 69 frames
    (each reserves a 1 MiB region for all its audio at once); twelve arrive together over ZMQ. The
    ones it cannot hold fail with an ``OutputMemoryError`` naming them (the engine core stays up, and
    no other request is touched); the rest get every sample; the memory is given back, and
    the same twelve served again afterwards fit as they arrive. Twelve that may stop early (a stop
    token, as a talker ends) reserve nothing for ``max_tokens``: all of them fit together."""
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=12, args_cls=AsyncEngineArgs, disable_log_stats=True,
                              additional_config={"omni": {"pool_budget_bytes": 9 << 20}})
    frames = 69  # 132480 samples: a region of 2^18 (1 MiB of float32)

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            async def one(rid, **stop):
                params = SamplingParams(max_tokens=frames, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False,
                                        **stop)
                try:
                    async for out in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, request_id=rid):
                        last = out
                except MultimodalOutputError as exc:
                    return exc
                return last.outputs[0]

            together = await asyncio.gather(*(one(f"r{i}") for i in range(12)))
            stats = (await engine.collective_rpc("output_path_stats"))[0]
            one_by_one = [await one(f"again{i}") for i in range(12)]
            stopping = await asyncio.gather(*(one(f"s{i}", stop_token_ids=[stop]) for i in range(12)))
            return together, stats, one_by_one, stopping
        finally:
            engine.shutdown()

    rollout = tk.rollout(tk.ToyTalker(0), [5, 6, 7], frames)
    stop = int(rollout[3, 0]) + tk.TEXT_VOCAB  # the 4th frame's token (it appears first there)
    assert stop not in (rollout[:3, 0] + tk.TEXT_VOCAB).tolist()
    together, stats, one_by_one, stopping = asyncio.run(serve())
    want = tk.expected_audio(rollout)
    failed = [r for r in together if isinstance(r, MultimodalOutputError)]
    assert len(failed) == 3, failed
    for i, result in enumerate(together):
        if isinstance(result, MultimodalOutputError):
            assert isinstance(result, OutputMemoryError) and result.request_id == f"r{i}"
            assert "budget" in str(result) and result.key == "audio"
        else:
            assert result.finish_reason == "length" and result.multimodal_output.tensors["audio"].equal(want)
    assert all(p["slots_used"] == 0 for p in stats["accumulator"]["pools"].values())
    assert all(not isinstance(r, Exception) and r.multimodal_output.tensors["audio"].equal(want) for r in one_by_one)
    short = tk.expected_audio(rollout[:4])
    assert all(not isinstance(r, Exception) and r.finish_reason == "stop"
               and r.multimodal_output.tensors["audio"].equal(short) for r in stopping), stopping


def test_a_whole_file_no_slot_could_ever_hold_fails_at_once_and_is_not_told_to_retry(tmp_path):
    """1 MiB of audio memory, whole-file requests of 300 frames (2.3 MB of audio, no stop token):
    no retry could hold one, so each fails when it arrives, with an error that is not vLLM's
    retryable one (a speech client would be told 503, retry, for ever). One alone used to run 69
    frames before its growth found out, and two samples of n = 2, or two requests at once, growing
    together, spent the budget first and were told to retry. A streaming request of that length
    drains as it goes: it gets every sample, and so does a short whole file after the refusals."""
    from vllm.exceptions import RetryableRequestError

    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=2, args_cls=AsyncEngineArgs, disable_log_stats=True,
                              additional_config={"omni": {"pool_budget_bytes": 1 << 20}})

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            def params(kind, frames=300, n=1):
                return SamplingParams(max_tokens=frames, n=n, output_kind=kind, detokenize=False)

            whole = RequestOutputKind.FINAL_ONLY
            refused = [await _served(engine, "alone", [5, 6, 7], params(whole)),
                       await _served(engine, "samples", [5, 6, 7], params(whole, n=2)),
                       *await asyncio.gather(*(_served(engine, f"together{i}", [5, 6, 7], params(whole))
                                               for i in range(2)))]
            streamed = await _served(engine, "streamed", [5, 6, 7], params(RequestOutputKind.DELTA))
            short = await _served(engine, "short", [5, 6, 7], params(whole, frames=20))
            stats = (await engine.collective_rpc("output_path_stats"))[0]
            return refused, streamed, short, stats
        finally:
            engine.shutdown()

    refused, streamed, short, stats = asyncio.run(serve())
    for rid, exc in zip(("alone", "samples", "together0", "together1"), refused):
        assert isinstance(exc, OutputTooLargeError) and not isinstance(exc, RetryableRequestError), (rid, exc)
        # vLLM's validation error, which its routes answer with 400 naming the parameter
        assert isinstance(exc, VLLMValidationError) and exc.parameter == "max_tokens", exc
        assert exc.request_id == rid and "more than one request can hold" in str(exc), exc
    rollout = tk.rollout(tk.ToyTalker(0), [5, 6, 7], 300)
    for (reason, audio), frames in ((streamed, 300), (short, 20)):
        assert reason == "length" and audio.equal(tk.expected_audio(rollout[:frames]))
    assert stats["accumulator"]["requests"] == 0


BAD = 1  # the prompt token that makes the talker's second chunk malformed (the worker's ``bad_prompt_token``)
KINDS = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)


async def _served(engine, rid: str, prompt: list[int], params: SamplingParams):
    """(finish reason, the request's whole audio) of one request, or the error its generate() raised."""
    audio, last = [], None
    try:
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
            payload = getattr(out.outputs[0], "multimodal_output", None)
            if payload is not None:
                audio.append(payload.tensors["audio"])
            last = out.outputs[0]
    except MultimodalOutputError as exc:
        return exc
    whole = torch.cat(audio) if params.output_kind == RequestOutputKind.DELTA else audio[-1]
    return last.finish_reason, whole


def test_a_failure_past_a_stop_token_not_seen_yet_leaves_the_request_stopped_and_exact(tmp_path):
    """Under async scheduling the worker samples a request's next frame before it sees the token of
    the frame before. When that token ends the request and the next frame's chunk fails (here the
    talker's malformed second chunk; in serving, a region that cannot grow in a full output
    memory), the failure lies past the request's end: it finishes on its stop token with its audio
    exact, in every output kind, over ZMQ. The same request without the stop token fails visibly."""
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=8, args_cls=AsyncEngineArgs, disable_log_stats=True,
                              async_scheduling=True, additional_config={"omni": {"bad_prompt_token": BAD}})
    prompt = [5, BAD, 7]
    first = int(tk.rollout(tk.ToyTalker(0), prompt, 1)[0, 0]) + tk.TEXT_VOCAB  # the token of its first frame

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            asked = {(kind, stop): SamplingParams(max_tokens=6, output_kind=kind, detokenize=False,
                                                  stop_token_ids=[first] if stop else None)
                     for kind in KINDS for stop in (True, False)}
            got = await asyncio.gather(*(_served(engine, f"{kind.name}-{stop}", prompt, params)
                                         for (kind, stop), params in asked.items()))
            return dict(zip(asked, got))
        finally:
            engine.shutdown()

    results = asyncio.run(serve())
    want = tk.expected_audio(tk.rollout(tk.ToyTalker(0), prompt, 1))
    for kind in KINDS:
        assert not isinstance(results[kind, True], Exception), results[kind, True]
        reason, audio = results[kind, True]
        assert reason == "stop" and audio.equal(want), (kind, reason)
        failed = results[kind, False]
        assert isinstance(failed, MultimodalOutputError) and failed.key == "audio" and "dtype" in str(failed)


def test_the_shutdown_of_an_engine_whose_construction_failed_does_not_raise():
    """An engine whose constructor raised before it held anything (a refused model, a signal during
    start-up): its shutdown, which ``AsyncLLM.__del__`` calls too, has nothing to stop, and raises
    nothing (an AttributeError printed after the error that mattered hid it)."""
    OmniAsyncLLM.__new__(OmniAsyncLLM).shutdown()
    OmniLLM.__new__(OmniLLM).shutdown()


def test_a_shutdown_on_the_serving_loop_ends_the_streams_left_in_flight_with_an_error(tmp_path):
    """``OmniAsyncLLM.shutdown`` on the loop that serves the streams (which cannot wait for them)
    while long streams run: each stream's caller gets ``EngineShutDownError`` at its next read
    after the audio it had (vLLM's own shutdown left them waiting forever)."""
    from vllm_omni_kernels.vllm_integration.llm import EngineShutDownError

    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", max_num_seqs=4,
                              args_cls=AsyncEngineArgs, disable_log_stats=True)
    params = SamplingParams(max_tokens=4000, output_kind=RequestOutputKind.DELTA, detokenize=False)

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        streams = [engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7 + i]), params, request_id=f"s{i}")
                   for i in range(3)]
        try:
            for s in streams:
                await anext(s)
        finally:
            engine.shutdown()

        async def rest(s):
            try:
                async for _ in s:
                    pass
            except EngineShutDownError as exc:
                return exc
            return "finished"

        ended = await asyncio.wait_for(asyncio.gather(*(rest(s) for s in streams)), 30)
        with pytest.raises(EngineShutDownError):  # a request sent afterwards is told so too
            await anext(engine.generate(TokensPrompt(prompt_token_ids=[5, 6]), params, request_id="late"))
        return ended

    ended = asyncio.run(serve())
    assert all(isinstance(e, EngineShutDownError) for e in ended), ended


@pytest.mark.parametrize("how", ["shut down in process", "shut down", "killed"])
def test_a_sync_engine_that_stopped_raises_at_its_next_step_and_request(tmp_path, how):
    """``OmniLLM`` with streams in flight, once its engine core has stopped: shut down (in this
    process or its own, which aborts the requests in flight first) or killed (SIGKILL, as the OOM
    killer kills it). A step raises ``EngineShutDownError``, or vLLM's ``EngineDeadError`` for an
    engine that died, and so does a new request. vLLM's ``LLMEngine`` waited forever in ``step``
    (its client's output thread stops without a word), and in process went on stepping, its
    requests finishing as if nothing happened."""
    import os
    import signal
    import threading

    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_omni_kernels.vllm_integration.llm import EngineShutDownError

    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", max_num_seqs=4, disable_log_stats=True)
    engine = OmniLLM.from_engine_args(args, enable_multiprocessing=how != "shut down in process")
    expected = EngineDeadError if how == "killed" else EngineShutDownError
    params = SamplingParams(max_tokens=4000, output_kind=RequestOutputKind.DELTA, detokenize=False)
    try:
        for i in range(2):
            engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=[5, 6, 7 + i]), params)
        engine.step()
        if how == "killed":
            (core,) = engine.engine_core.resources.engine_manager.processes
            os.kill(core.pid, signal.SIGKILL)
        else:
            engine.shutdown()
        raised = []

        def steps():  # on past the requests' end (an engine core shut down aborts them): a step must raise
            try:
                while True:
                    engine.step()
            except EngineDeadError as exc:
                raised.append(exc)

        stepping = threading.Thread(target=steps, daemon=True)
        stepping.start()
        stepping.join(60)
        assert not stepping.is_alive() and [type(e) for e in raised] == [expected], raised
        with pytest.raises(EngineDeadError) as info:
            engine.add_request("late", TokensPrompt(prompt_token_ids=[5, 6]), params)
        assert type(info.value) is expected
        depths = []
        for _ in range(3):  # every later step raises too, each with a traceback of its own
            with pytest.raises(expected) as info:
                engine.step()
            depths.append(len(info.traceback))
        assert depths[0] == depths[2], depths
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_the_worker_fails_on_its_last_frame_ends_once(tmp_path, async_scheduling):
    """The worker fails a request on the frame at which vLLM finishes it (its ``max_tokens``): its
    caller gets the error, the other requests their audio, and the engine core sends nothing more
    for it (no second final output, which the client would count as late)."""
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=8, args_cls=AsyncEngineArgs, disable_log_stats=True,
                              async_scheduling=async_scheduling,
                              additional_config={"omni": {"bad_prompt_token": BAD}})

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            got = await asyncio.gather(*(_served(engine, f"{kind.name}-{bad}", [5, BAD if bad else 6, 7],
                                                 SamplingParams(max_tokens=2, output_kind=kind, detokenize=False))
                                         for kind in KINDS for bad in (True, False)))
            await asyncio.sleep(1.0)  # the engine core's steps after the last request (there are none to take)
            return got, engine.output_processor.accumulator_stats()
        finally:
            engine.shutdown()

    got, stats = asyncio.run(serve())
    want = tk.expected_audio(tk.rollout(tk.ToyTalker(0), [5, 6, 7], 2))
    for i, kind in enumerate(KINDS):
        failed, served = got[2 * i], got[2 * i + 1]
        assert isinstance(failed, MultimodalOutputError) and failed.request_id == f"{kind.name}-True"
        assert served[0] == "length" and served[1].equal(want)
    assert stats["late_outputs"] == 0 and stats["failed_by_worker"] == 3


def test_a_sync_client_that_ended_hands_out_the_outputs_that_came_before_its_error():
    """``OmniSyncMPClient.get_output`` after its engine core ended: the outputs already queued (a
    finished request's final audio among them) come first, in order, then ``EngineShutDownError``."""
    import queue
    from types import SimpleNamespace

    from vllm_omni_kernels.vllm_integration.client import EngineShutDownError, OmniSyncMPClient

    client = object.__new__(OmniSyncMPClient)  # (its queue and end alone: no engine core to start)
    client.outputs_queue = queue.Queue()
    step = SimpleNamespace(wave_complete=None, outputs=["the final output of a request"])
    client.outputs_queue.put_nowait(step)
    client._ended = EngineShutDownError()
    client.outputs_queue.put_nowait(client._ended)  # (what shutdown queues, to wake a waiting caller)
    assert client.get_output() is step
    with pytest.raises(EngineShutDownError):
        client.get_output()


def test_every_output_of_a_talker_request_has_multimodal_output_an_aborted_whole_file_too(tmp_path):
    """A whole-file (FINAL_ONLY) request aborted before its audio: its last output is still a
    ``MultimodalCompletionOutput``, ``multimodal_output`` None, as the README's loop reads it.
    Streaming input to the talker is refused with vLLM's validation error."""
    model = make_model_dir(tmp_path / "model")
    args = talker_engine_args(model, device="cpu", max_num_seqs=4, args_cls=AsyncEngineArgs, disable_log_stats=True)

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args)
        try:
            params = SamplingParams(max_tokens=4000, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
            outs = []

            async def whole():
                async for out in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7]), params, request_id="w"):
                    outs.append(out)

            task = asyncio.create_task(whole())
            t0 = time.time()
            while not (await engine.collective_rpc("output_path_stats"))[0]["requests_held"]:
                assert time.time() - t0 < 30
                await asyncio.sleep(0.02)
            await engine.abort("w")
            await asyncio.wait_for(task, 30)
            # streaming input (vLLM's resumable requests) is refused: the talker does not continue one
            from vllm.engine.protocol import StreamingInput

            async def chunks():
                yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=[5, 6, 7]))

            delta = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA, detokenize=False)
            with pytest.raises(VLLMValidationError, match="streaming input"):
                async for _ in engine.generate(chunks(), delta, request_id="s"):
                    pass
            return outs
        finally:
            engine.shutdown()

    outs = asyncio.run(serve())
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert all(isinstance(out.outputs[0], MultimodalCompletionOutput) for out in outs)
    assert outs[-1].outputs[0].multimodal_output is None


def test_an_output_memory_too_small_for_the_engines_streams_is_refused_at_start(tmp_path):
    """Every one of ``max_num_seqs`` streams takes a first slot of the audio arena at once (the
    server's warm-up does), twice per seat (``test_streams_that_end_on_a_stop_token_...``): an
    arena that cannot hold them is refused when the engine starts, saying how much it takes, not by
    the first burst of clients."""
    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", max_num_seqs=256,
                              disable_log_stats=True, additional_config={"omni": {"pool_budget_bytes": 32 << 20}})
    with pytest.raises(ValueError, match=r"max_num_seqs \(256\) streams twice over .*: 67108864 bytes at least"):
        OmniLLM.from_engine_args(args, enable_multiprocessing=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streams_that_end_on_a_stop_token_leave_room_for_the_next_in_their_seat(tmp_path, async_scheduling):
    """One seat and the least audio memory the engine starts with; requests that end on their stop
    token one after another, every output kind. A stopped stream gives its memory back a step after
    vLLM gave its seat to the next (its token is seen when its step resolves): the least memory
    holds both, and every request gets all its audio. The least used to be one first slot a seat,
    and every second request failed for memory."""
    model = make_model_dir(tmp_path / "model")

    def args(budget):
        return talker_engine_args(model, device="cpu", max_num_seqs=1, args_cls=AsyncEngineArgs,
                                  disable_log_stats=True, async_scheduling=async_scheduling,
                                  additional_config={"omni": {"pool_budget_bytes": budget}})

    with pytest.raises(ValueError, match=r"262144 bytes at least"):
        OmniLLM.from_engine_args(args(128 << 10), enable_multiprocessing=False)
    plans = _stopping_at_the_third_frame(6)

    async def serve():
        engine = OmniAsyncLLM.from_engine_args(args(256 << 10))
        try:
            return await asyncio.gather(*(
                _served(engine, f"r{i}", prompt, SamplingParams(max_tokens=10, output_kind=KINDS[i % 3],
                                                              detokenize=False, stop_token_ids=[stop]))
                for i, (prompt, stop) in enumerate(plans)))
        finally:
            engine.shutdown()

    for (prompt, _), result in zip(plans, asyncio.run(serve())):
        assert not isinstance(result, Exception), result
        reason, audio = result
        assert reason == "stop" and audio.equal(tk.expected_audio(tk.rollout(tk.ToyTalker(0), prompt, 3)))


@pytest.mark.parametrize("frames", [1, 16, 17, 69, 700, 2150, 8000])
def test_the_codes_arena_holds_whatever_the_audio_arena_holds(frames):
    """``key_budgets``: however many whole-file requests of a length the audio arena takes with
    their regions sized at once, the codes arena takes as many (its regions round up to a power of
    two by up to twice as much as the audio's)."""
    keys = talker_output_keys(4 * tk.FRAME_SAMPLES)
    acc = WorkerAccumulator(keys, "cpu", budget_bytes=key_budgets(keys, 1 << 30), max_requests=512)
    audio, codes = acc.pools
    held = 0
    while held < 512:
        try:
            acc.add_request(f"r{held}", EmitPolicy.FINAL_ONLY, frames={"audio": frames * tk.FRAME_SAMPLES,
                                                                        "codes": frames})
        except OutputMemoryError as exc:
            assert exc.key == "audio", exc  # the audio arena is what runs out
            break
        if audio.capacity_frames(f"r{held}") < frames * tk.FRAME_SAMPLES:  # the audio took a first slot only
            acc.abort(f"r{held}")
            break
        assert codes.capacity_frames(f"r{held}") >= frames, held
        held += 1
    assert held >= 1


def test_a_step_resolved_after_its_row_passed_to_a_new_request_judges_its_token_by_its_own(tmp_path):
    """Under async scheduling a request aborted while its step runs gives its row away before the
    step resolves: the step's token is compared with the eos its own request had when the step ran,
    not with the new owner's, so the worker counts no stop that did not happen."""
    import numpy as np
    from vllm_omni_kernels.vllm_integration.worker import _StepOutput
    worker = _talker_worker(tmp_path)
    row, token = np.array([0]), tk.TEXT_VOCAB + 7
    worker._eos[0], worker._stoppable[0] = tk.TEXT_VOCAB + 9, True  # the row's request when its step runs
    step = _StepOutput(worker, ["old"], np.array([0]), [], None, sampled=(["old"], row, np.array([3])),
                       stops=(worker._eos[row], worker._has_stop_ids[row]))
    worker._eos[0] = token  # the row's next request, whose eos the step's token is
    worker._resolve(step, [token])
    assert worker.stats["stopped"] == 0
    worker._resolve(_StepOutput(worker, ["new"], np.array([0]), [], None, sampled=(["new"], row, np.array([1])),
                                stops=(worker._eos[row], worker._has_stop_ids[row])), [token])
    assert worker.stats["stopped"] == 1


def test_a_request_resumed_past_the_tokens_the_worker_keeps_fails_and_its_row_starts_clean(tmp_path):
    """vLLM resumes a preempted request with the output tokens it kept. The worker samples again
    (replays) up to ``_KEPT_TOKENS`` dropped tokens, the most it keeps; with more dropped the
    request fails visibly (its audio cannot go on exactly). A request given the row afterwards
    starts with no replay and no failure of the row's former owner."""
    from vllm_omni_kernels.vllm_integration.worker import _KEPT_TOKENS
    worker = _talker_worker(tmp_path)
    row, produced = _admit(worker, "a"), 20
    worker._produced[row] = produced
    worker._resume("a", 3 + produced - _KEPT_TOKENS, produced - _KEPT_TOKENS)  # all it keeps: sampled again
    assert worker._replay[row] == produced - _KEPT_TOKENS and "a" not in worker._discarded and "a" in worker.acc
    worker._resume("a", 2 + produced - _KEPT_TOKENS, produced - _KEPT_TOKENS - 1)  # one more than it keeps
    assert "discarded more than" in str(worker._discarded["a"]) and "a" not in worker.acc and worker._done[row]
    del worker._row["a"]  # vLLM finishes it (what _update_requests does): the row is free again
    worker._free_rows.append(row)
    assert _admit(worker, "b") == row and worker._replay[row] == -1 and not worker._done[row] and "b" in worker.acc


def _talker_worker(tmp_path, **omni):
    from vllm_omni_kernels.vllm_integration.worker import TalkerWorker
    args = talker_engine_args(make_model_dir(tmp_path / "model"), device="cpu", max_num_seqs=4,
                              additional_config={"omni": omni} if omni else None)
    return TalkerWorker(args.create_engine_config())


def _admit(worker, rid: str) -> int:
    """The worker's admission of a new request as vLLM's scheduler hands it over; returns its row."""
    from vllm.v1.core.sched.output import NewRequestData
    worker._admit([NewRequestData(
        req_id=rid, prompt_token_ids=[5, 6, 7], mm_features=[], pooling_params=None, block_ids=([],),
        sampling_params=SamplingParams(max_tokens=40, output_kind=RequestOutputKind.DELTA, detokenize=False),
        num_computed_tokens=0, lora_request=None)])
    return worker._row[rid]


def test_rows_made_for_more_requests_are_every_one_free_or_held(tmp_path):
    """Out of rows, the worker makes twice as many: every row is then either held or free, once
    (none lost, which would make it grow again sooner and sooner), and the rows held stay."""
    worker = _talker_worker(tmp_path, rows=2)
    rows = [_admit(worker, f"r{i}") for i in range(5)]  # 2 rows, then 4, then 8
    assert worker.max_requests == 8 and rows == [worker._row[f"r{i}"] for i in range(5)]  # as admitted
    held = set(worker._row.values())
    assert len(held) == 5 and sorted(held | set(worker._free_rows)) == list(range(8))
    assert len(worker._free_rows) == 3 and not held & set(worker._free_rows)
