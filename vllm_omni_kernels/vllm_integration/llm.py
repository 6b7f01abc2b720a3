"""The entry points a user calls: ``OmniLLM`` (vLLM's ``LLMEngine``) and ``OmniAsyncLLM`` (vLLM's
``AsyncLLM``), and ``talker_engine_args`` for the TTS talker.

Each builds vLLM's engine with this package's scheduler class (``OmniScheduler``, or
``OmniAsyncScheduler`` under async scheduling), ``MultimodalOutputProcessor`` and an engine-core
client that decodes the multimodal channel from construction (``client.py``). vLLM 0.33 has no hook
for the processor or the client class (its engines build them in ``__init__``, where the client's
output thread takes its decoder), so the two ``__init__`` below are vLLM's own, step for step, with
those two objects made here. The engine core runs in its own process (vLLM's default) or, for
``OmniLLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, in this one.

Async scheduling: as the engine arguments say; by default on for a talker on CUDA, where a step's
kernels run while the engine core schedules the next, and off for one on the CPU, where the forward
runs inside ``execute_model`` and scheduling ahead only holds every output back by one step (vLLM's
platform decides for vLLM's own worker, not for where ``TalkerExecutor`` puts the talker).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import socket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm
import vllm.envs as envs
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.exceptions import RetryableRequestError, VLLMValidationError
from vllm.logger import configure_logging_if_needed, init_logger
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.profiler.wrapper import create_frontend_profiler
from vllm.renderers import renderer_from_config
from vllm.renderers.inputs.preprocess import prompt_to_seq
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tracing import init_tracer
from vllm.transformers_utils.config import maybe_register_config_serialize_by_value
from vllm.usage.usage_lib import UsageContext
from vllm.utils import random_uuid
from vllm.utils.async_utils import cancel_task_threadsafe
from vllm.v1.engine.admission_control import SharedAdmissionStats
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor import Executor
from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories

from ..accumulator import AccumulatorConfig
from ..modality import OutputModality, TensorAccumulationStrategy
from ..serving import talker as tk
from .client import EngineShutDownError, OmniAsyncMPClient, OmniInprocClient, OmniSyncMPClient
from .output_processor import MultimodalOutputProcessor
from .outputs import OmniRequestOutput, wrap_output
from .plugin import register
from .scheduler import MultimodalChannel, OmniAsyncScheduler, OmniScheduler
from .talker_model import ARCHITECTURE, OmniTalkerForTTS
from .upstream_style import UpstreamStyleOutputProcessor
from .worker import TalkerExecutor, WorkerOptions

logger = init_logger("vllm.omni_kernels.llm")  # under "vllm.": vLLM's handler prints it


_PROCESS_INPUTS = inspect.signature(InputProcessor.process_inputs)


class OmniInputProcessor(InputProcessor):
    """vLLM's ``InputProcessor`` that, for this package's talker, also asks the model class whether
    it can honour a request's sampling parameters (``OmniTalkerForTTS.validate_sampling_params``,
    raising vLLM's ``VLLMValidationError``: it refuses logprobs, say) before vLLM's own checks, and
    refuses streaming input (vLLM's resumable requests), which the talker does not continue, and
    prompt embeddings (``enable_prompt_embeds``): its context comes from token ids alone.
    (Other models' classes are not imported here: vLLM keeps them out of the frontend process.)

    For every model, a prompt's token ids must be Python ints (``check_token_ids``)."""

    def __init__(self, vllm_config: VllmConfig, renderer=None):
        super().__init__(vllm_config, renderer)
        talker = ARCHITECTURE in (vllm_config.model_config.architectures or ())
        self._model_check = OmniTalkerForTTS.validate_sampling_params if talker else None

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        if isinstance(prompt, Mapping) and prompt.get("prompt_token_ids") is not None:
            check_token_ids(request_id, prompt["prompt_token_ids"])
        if self._model_check is not None:
            if isinstance(params, SamplingParams):
                self._model_check(params)
            if _PROCESS_INPUTS.bind(self, request_id, prompt, params, *args, **kwargs).arguments.get("resumable"):
                raise VLLMValidationError("the talker does not take streaming input (its frames follow from the whole "
                                          "prompt): send the whole text in one request", parameter="prompt")
        request = super().process_inputs(request_id, prompt, params, *args, **kwargs)
        if self._model_check is not None and request.prompt_embeds is not None:
            raise VLLMValidationError(f"request {request_id}: the talker speaks token ids and takes no prompt "
                                      "embeddings: send the text or its token ids", parameter="prompt_embeds")
        return request


def check_token_ids(request_id: str, ids: Sequence) -> None:
    """Refuse token ids that are not Python ints with vLLM's ``VLLMValidationError``. vLLM compares
    them with its vocabulary only: a float or a bool passed, and in an engine core of its own the
    msgpack decoding of the request (``list[int]``) raised on its input thread, which ended, so that
    every later request waited forever; a string raised an untyped ``TypeError``, numpy's integers
    were served in process and refused by the encoder otherwise."""
    if set(map(type, ids)) <= {int}:
        return
    at, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int)
    hint = " (numpy's: pass ids.tolist())" if type(bad).__module__ == "numpy" else ""
    raise VLLMValidationError(f"request {request_id}: prompt token ids must be Python ints; the one at position "
                              f"{at} is a {type(bad).__name__}{hint}", parameter="prompt_token_ids")


@dataclass
class ProcessorOptions:
    """How the frontend treats multimodal output (``MultimodalOutputProcessor``'s own arguments)."""

    output_modality: OutputModality | str = "text+audio"
    strategies: Mapping[str, TensorAccumulationStrategy | str] | None = None
    key_aliases: Mapping[str, str] | None = None
    accumulator_config: AccumulatorConfig | None = None
    processor_cls: type[MultimodalOutputProcessor] = MultimodalOutputProcessor


TALKER_MAX_MODEL_LEN = 8192  # tokens of a request, prompt and frames (talker_engine_args' default)


def talker_engine_args(model: str | Path, *, device: str = "auto", cadence: int | None = None,
                       output_path: str = "worker", max_num_seqs: int = 256, args_cls=AsyncEngineArgs,
                       **kwargs) -> EngineArgs:
    """Engine arguments that serve the talker of ``model`` (a ``talker_model.make_model_dir``) with
    ``TalkerExecutor`` (or the ``distributed_executor_backend`` given: a subclass) on ``device``.
    ``cadence``: audio samples a streaming request gets at a time; ``output_path``: "worker" (this
    package) or "upstream" (the comparison path). Other keywords go to vLLM's ``AsyncEngineArgs``
    (an ``EngineArgs``: ``OmniAsyncLLM`` and ``OmniLLM`` take it); what ``additional_config["omni"]``
    says of the talker wins over these keywords, as in the server; vLLM's ``stream_interval``
    defaults to the cadence in frames (``talker_stream_interval``)."""
    omni: dict[str, Any] = {"device": device, "output_path": output_path}
    if cadence is not None:
        omni["cadence"] = int(cadence)
    extra = with_talker_options(kwargs.pop("additional_config", None), omni)
    kwargs.setdefault("stream_interval", talker_stream_interval(extra["omni"].get("cadence")))
    kwargs.setdefault("max_model_len", TALKER_MAX_MODEL_LEN)
    kwargs.setdefault("max_num_batched_tokens", max(TALKER_MAX_MODEL_LEN, kwargs["max_model_len"]))
    kwargs.setdefault("distributed_executor_backend", TalkerExecutor)
    return args_cls(model=str(model), tokenizer=str(model), dtype="float32", enforce_eager=True,
                     max_num_seqs=max_num_seqs, additional_config=extra, **kwargs)


def with_talker_options(additional_config: dict | None, options: dict[str, Any]) -> dict:
    """vLLM's ``additional_config`` with the talker's ``options`` under ``"omni"`` (what
    ``TalkerWorker`` reads), where it does not say otherwise: what it says of the talker wins."""
    extra = dict(additional_config or {})
    extra["omni"] = {**options, **extra.get("omni", {})}
    return extra


def talker_stream_interval(cadence: int | None) -> int:
    """vLLM's ``stream_interval`` that matches the talker's ``cadence`` (samples; None: the worker's
    default): a stream's output goes out with its first frame, then when its audio is due and at
    finish, not with every token that carries no audio (a chunk that arrives between two outputs
    waits for the next one)."""
    samples = WorkerOptions.cadence if cadence is None else int(cadence)
    return max(1, samples // tk.FRAME_SAMPLES)


def talker_processor_options(output_path: str = "worker") -> ProcessorOptions:
    """The frontend for the talker's output: audio CONCAT_LAST, codes CONCAT_DIM0; for the
    upstream-style path (``output_path="upstream"``) its per-request concatenating processor."""
    strategies = {"audio": TensorAccumulationStrategy.CONCAT_LAST, "codes": TensorAccumulationStrategy.CONCAT_DIM0}
    cls = UpstreamStyleOutputProcessor if output_path == "upstream" else MultimodalOutputProcessor
    return ProcessorOptions("audio", strategies, processor_cls=cls)


async def warm_up(engine: AsyncLLM, requests: int | None = None, share: tuple[int, int] = (0, 1)) -> None:
    """Streamed requests through ``engine`` before serving, as many at once as the engine schedules
    (``max_num_seqs`` by default), request i producing i + 2 tokens: the batch shrinks by one each
    step, so every batch size a server will see has run once (kernels load and pick their variants
    per shape on first use) and the device and pinned host buffers have grown to a full batch's
    size before the first client arrives. ``share``: (index, count) of this client among the
    clients of one engine core that warm it together, each its share of the requests (by default
    ``max_num_seqs / count``, rounded up; request i of client k producing i * count + k + 2 tokens:
    together, still one fewer each step)."""
    index, count = share
    if requests is None:
        requests = math.ceil(engine.vllm_config.scheduler_config.max_num_seqs / count)
    longest = max(2, engine.vllm_config.model_config.max_model_len - 4)

    async def one(i: int) -> None:
        params = SamplingParams(max_tokens=min(i * count + index + 2, longest), output_kind=RequestOutputKind.DELTA,
                                detokenize=False, skip_clone=True)
        async for _ in engine.generate(tokens_input([5, 6, 7 + i % 64]), params,
                                       request_id=f"warm-up-{i}"):
            pass

    await asyncio.gather(*(one(i) for i in range(requests)))


def omni_vllm_config(engine_args: EngineArgs, usage_context: UsageContext,
                     api_process: tuple[int, int] | None = None) -> VllmConfig:
    """vLLM's config for ``engine_args`` with this package's scheduler class and, for
    ``TalkerExecutor`` and its subclasses, async scheduling decided as the module docstring says.
    ``api_process``: (count, rank) of the client processes that share one engine core (rank -1:
    their launcher), as ``vllm serve --api-server-count`` sets them."""
    register()  # (vLLM loads the plugin only where VLLM_PLUGINS names it)
    if api_process is not None:
        engine_args._api_process_count, engine_args._api_process_rank = api_process
    config = engine_args.create_engine_config(usage_context)
    sched = config.scheduler_config
    if issubclass(Executor.get_class(config), TalkerExecutor):
        wanted = engine_args.async_scheduling
        sched.async_scheduling = (WorkerOptions.from_config(config).torch_device().type == "cuda"
                                  if wanted is None else bool(wanted))
    _use_channel(config)
    _check_one_device(config)
    return config


def _check_one_device(config: VllmConfig) -> None:
    """ValueError for a ``TalkerExecutor`` config of more than one device (tensor or pipeline
    parallel): it runs one worker in one process, and vLLM's one-process executor would serve on one
    device and leave the others unused without a word."""
    parallel, executor = config.parallel_config, Executor.get_class(config)
    if parallel.world_size > 1 and issubclass(executor, TalkerExecutor):
        raise ValueError(f"{executor.__name__} runs the talker on one device: tensor_parallel_size "
                         f"{parallel.tensor_parallel_size} and pipeline_parallel_size "
                         f"{parallel.pipeline_parallel_size} are not supported (1 each)")


def _use_channel(config: VllmConfig) -> None:
    """This package's scheduler class on ``config`` unless it names one with the multimodal channel
    already (vLLM's own would drop every sample: no error, no audio)."""
    sched = config.scheduler_config
    if not issubclass(sched.get_scheduler_cls(), MultimodalChannel):
        sched.scheduler_cls = OmniAsyncScheduler if sched.async_scheduling else OmniScheduler


def _processor(renderer, config: VllmConfig, log_stats: bool, options: ProcessorOptions | None,
               **kwargs) -> MultimodalOutputProcessor:
    o = options or ProcessorOptions()
    return o.processor_cls(renderer.tokenizer, log_stats=log_stats,
                           stream_interval=config.scheduler_config.stream_interval,
                           output_modality=o.output_modality, strategies=o.strategies, key_aliases=o.key_aliases,
                           accumulator_config=o.accumulator_config, **kwargs)


def _take_config(engine, vllm_config: VllmConfig) -> str | None:
    """What both engines' constructors do first, as vLLM's do: vLLM's logging, the one-engine-core
    and one-device checks, this package's scheduler class (``_use_channel``), the configs on
    ``engine``, tracing.
    Returns the tracing endpoint (None: off)."""
    configure_logging_if_needed(vllm_config.logging_config)
    if vllm_config.parallel_config.data_parallel_size > 1:
        raise ValueError(f"{type(engine).__name__} serves one engine core (data_parallel_size 1)")
    _use_channel(vllm_config)  # (a config made by vLLM's own from_vllm_config path, say)
    _check_one_device(vllm_config)
    engine.vllm_config = vllm_config
    engine.model_config = vllm_config.model_config
    engine.observability_config = vllm_config.observability_config
    endpoint = engine.observability_config.otlp_traces_endpoint
    if endpoint is not None:
        init_tracer("vllm.llm_engine", endpoint)
    return endpoint


def refuse_deep_sleep(level: int) -> None:
    """Sleep levels 1 and 2 free the weights and the KV cache, while the talker keeps its weights and
    output rings resident: ``ValueError`` before vLLM pauses anything (its engine core pauses the
    scheduler, aborting the requests in flight by default, before it asks the worker, which
    refuses too: the engine stayed paused, every later request waiting, until ``wake_up``)."""
    if level >= 1:
        raise ValueError(f"sleep level {level}: the talker keeps its weights and output rings resident; use level 0 "
                         "(pause scheduling only); nothing was paused")


class OmniLLM(LLMEngine):
    """vLLM's ``LLMEngine`` with the multimodal channel (module docstring). ``generate`` runs
    prompts to completion and returns one ``OmniRequestOutput`` each."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor], log_stats: bool,
                 aggregate_engine_logging: bool = False, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                 stat_loggers=None, mm_registry=MULTIMODAL_REGISTRY, multiprocess_mode: bool = False,
                 processor_options: ProcessorOptions | None = None):
        tracing_endpoint = _take_config(self, vllm_config)
        self.log_stats = log_stats
        self.external_launcher_dp = False
        self.dp_group = None
        self.should_execute_dummy_batch = False
        self.renderer = renderer = renderer_from_config(vllm_config)
        self.input_processor = OmniInputProcessor(vllm_config, renderer)
        self.output_processor = _processor(renderer, vllm_config, log_stats, processor_options,
                                           tracing_enabled=tracing_endpoint is not None)
        if multiprocess_mode:
            self.engine_core = OmniSyncMPClient(vllm_config=vllm_config,
                                                executor_class=executor_class, log_stats=log_stats,
                                                renderer=renderer)
        else:
            self.engine_core = OmniInprocClient(vllm_config, executor_class, log_stats)
        self._profile_session_active = False
        self.logger_manager = None
        if log_stats:
            self.logger_manager = StatLoggerManager(vllm_config=vllm_config, custom_stat_loggers=stat_loggers,
                                                    enable_default_loggers=log_stats,
                                                    aggregate_engine_logging=aggregate_engine_logging)
            self.logger_manager.log_engine_initialized()
        if not multiprocess_mode:
            self.model_executor = self.engine_core.engine_core.model_executor
            model = self._get_driver_model_for_cleanup()
            if model is not None:
                self._finalizer = weakref.finalize(self, LLMEngine._cleanup_instance_caches, weakref.ref(model))
        self.reset_mm_cache()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
                         stat_loggers=None, enable_multiprocessing: bool | None = None,
                         processor_options: ProcessorOptions | None = None) -> OmniLLM:
        """``enable_multiprocessing``: the engine core in its own process (default: vLLM's
        ``VLLM_ENABLE_V1_MULTIPROCESSING``, on unless set to 0) or in this one."""
        config = omni_vllm_config(engine_args, usage_context)
        multiprocess = envs.VLLM_ENABLE_V1_MULTIPROCESSING if enable_multiprocessing is None else enable_multiprocessing
        return cls(config, Executor.get_class(config), log_stats=not engine_args.disable_log_stats,
                   usage_context=usage_context, stat_loggers=stat_loggers, multiprocess_mode=bool(multiprocess),
                   processor_options=processor_options)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's ``sleep`` at level 0 (a pause); deeper levels refused before anything pauses
        (``refuse_deep_sleep``)."""
        refuse_deep_sleep(level)
        super().sleep(level, mode)

    def shutdown(self) -> None:
        """Stop the engine core (its process, with the multiprocess engine), as ``OmniAsyncLLM.shutdown``
        stops the async engine's; vLLM's ``LLMEngine`` leaves that to its ``engine_core``."""
        if (engine_core := getattr(self, "engine_core", None)) is not None:  # (None: a construction that failed)
            engine_core.shutdown()

    def generate(self, prompts: Any, sampling_params=None, *, use_tqdm: bool | Callable[..., Any] = True,
                 lora_request=None, priority: int | Sequence[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[OmniRequestOutput]:
        """Run ``prompts`` (one prompt, or a sequence of them; with one ``SamplingParams`` or one
        each: ValueError for another count; None: the model's defaults, as vLLM's ``LLM.generate``
        takes them) to completion on an idle engine (its own requests take every output ``step``
        returns: RuntimeError while others are in flight); returns each request's final output, in
        order: its whole result, as vLLM's ``LLM.generate`` returns it (a DELTA request runs
        CUMULATIVE: its data leaves the worker's output memory as it is made, where FINAL_ONLY would
        hold all of it there until the end). A prompt vLLM refuses raises, and the requests added
        before it are aborted.

        The keywords are vLLM's ``LLM.generate``'s: ``use_tqdm`` (a progress bar of the finished
        prompts; a callable makes the bar, as ``tqdm`` does), ``lora_request`` and ``priority`` (one,
        or one per prompt: ValueError for another count) and ``tokenization_kwargs``, for every
        request."""
        if self.has_unfinished_requests():
            raise RuntimeError("generate() runs on an idle engine: requests added with add_request() are in flight "
                               "(step() returns their outputs)")
        # one prompt (a string, a dict, a list of token ids, as vLLM's LLM.generate tells them) or several
        prompts = [prompts] if isinstance(prompts, Mapping) or not isinstance(prompts, Sequence) else \
            prompt_to_seq(prompts)
        if sampling_params is None:
            defaults = self.model_config.get_diff_sampling_param()
            sampling_params = SamplingParams.from_optional(**defaults) if defaults else SamplingParams()
        params = [_cumulative(p) if p.output_kind == RequestOutputKind.DELTA else p
                  for p in _per_prompt(sampling_params, len(prompts), "sampling params")]
        loras = _per_prompt(lora_request, len(prompts), "LoRA requests")
        priorities = _per_prompt(0 if priority is None else priority, len(prompts), "priorities")
        ids = [f"generate-{random_uuid()}-{i}" for i in range(len(prompts))]
        added = 0
        try:
            for rid, prompt, p, lora, rank in zip(ids, prompts, params, loras, priorities):
                self.add_request(rid, prompt, p, lora_request=lora, tokenization_kwargs=tokenization_kwargs,
                                 priority=rank)
                added += 1
        finally:
            if added < len(ids):  # a prompt was refused: the ones before it go too
                self.abort_request(ids[:added])
        final: dict[str, OmniRequestOutput] = {}
        samples: dict[str, dict[int, Any]] = {}  # n > 1: each sample's latest completion (its own outputs)
        modality = self.output_processor.output_modality
        bar = None
        if use_tqdm:
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(ids), desc="Processed prompts",
                                                             dynamic_ncols=True)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    latest = samples.setdefault(out.request_id, {})
                    latest.update((c.index, c) for c in out.outputs)
                    if out.finished:
                        out.outputs = [latest[i] for i in sorted(latest)]
                        final[out.request_id] = wrap_output(out, None, modality)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            if len(final) < len(ids):  # step() raised: nothing of this call stays in flight
                self.abort_request([rid for rid in ids if rid not in final])
        return [final[rid] for rid in ids if rid in final]


def _per_prompt(value: Any, prompts: int, what: str) -> list:
    """``value`` for every prompt: itself, or its items when it is a sequence of one per prompt
    (ValueError for another count)."""
    if not isinstance(value, Sequence):
        return [value] * prompts
    if len(value) != prompts:
        raise ValueError(f"{len(value)} {what} for {prompts} prompts")
    return list(value)


def _cumulative(params: SamplingParams) -> SamplingParams:
    """A copy of ``params`` with the CUMULATIVE output kind (the caller's stays as it is)."""
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    return params


class ShuttingDownError(RetryableRequestError):
    """A request that came while the server lets its requests in flight finish before it stops
    (``OmniAsyncLLM.shutdown``): vLLM's API server answers it with 503, so a client retries it on
    another server."""


_ENGINE_STOP_S = 5.0  # what OmniAsyncLLM.shutdown leaves the engine core at least to stop (it takes about 2 s)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class OmniAsyncLLM(AsyncLLM):
    """vLLM's ``AsyncLLM`` with the multimodal channel (module docstring); vLLM's API server, its
    ``generate`` and everything else work on it unchanged."""

    def __init__(self, vllm_config: VllmConfig, executor_class: type[Executor], log_stats: bool,
                 usage_context: UsageContext = UsageContext.ENGINE_CONTEXT, mm_registry=MULTIMODAL_REGISTRY,
                 log_requests: bool = True, start_engine_loop: bool = True, stat_loggers=None,
                 aggregate_engine_logging: bool = False, client_addresses: dict[str, Any] | None = None,
                 client_count: int = 1, client_index: int = 0, profiler=None,
                 processor_options: ProcessorOptions | None = None):
        tracing_endpoint = _take_config(self, vllm_config)
        maybe_register_config_serialize_by_value()
        self._elastic_ep_lock = asyncio.Lock()
        self.scheduler_config = vllm_config.scheduler_config
        self.log_requests = log_requests
        custom_stat_loggers = list(stat_loggers or [])
        custom_stat_loggers.extend(load_stat_logger_plugin_factories())
        self.log_stats = log_stats or bool(custom_stat_loggers)
        self.renderer = renderer = renderer_from_config(vllm_config)
        self.input_processor = OmniInputProcessor(vllm_config, renderer)
        self.admission_stats = (SharedAdmissionStats(client_addresses, client_count, client_index)
                                if client_addresses is not None and "mp_admission_counters" in client_addresses
                                else None)
        self.output_processor = _processor(renderer, vllm_config, self.log_stats, processor_options,
                                           tracing_enabled=tracing_endpoint is not None,
                                           admission_stats=self.admission_stats)
        self.engine_core = OmniAsyncMPClient(vllm_config=vllm_config,
                                             executor_class=executor_class, log_stats=self.log_stats,
                                             client_addresses=client_addresses, client_count=client_count,
                                             client_index=client_index, renderer=renderer)
        self.logger_manager = None
        if self.log_stats:
            self.logger_manager = StatLoggerManager(vllm_config=vllm_config,
                                                    engine_idxs=self.engine_core.engine_ranks_managed,
                                                    custom_stat_loggers=custom_stat_loggers,
                                                    enable_default_loggers=log_stats, client_count=client_count,
                                                    aggregate_engine_logging=aggregate_engine_logging)
            self.logger_manager.log_engine_initialized()
        self._client_count = client_count
        self._draining = False  # shutdown lets the requests in flight finish: new ones are refused
        self.shutdown_requested = False  # shutdown was called (not an engine core that died on its own)
        self._adding = 0  # add_request calls past the refusal, not yet registered (shutdown waits for them)
        self.output_handler = None
        try:
            asyncio.get_running_loop()  # in the event loop: start the output handler now, as vLLM does
            self._run_output_handler()
        except RuntimeError:
            pass
        self.profiler = profiler
        self._frontend_profiler_injected = profiler is not None
        self._profile_lock = asyncio.Lock()
        self._profile_session_guard_enabled = client_count == 1
        self._profile_session_active = False
        if not self._frontend_profiler_injected and vllm_config.profiler_config.should_profile_frontend \
                and self._profile_session_guard_enabled:
            self._frontend_profiler_worker_name = f"{socket.gethostname()}_{os.getpid()}.async_llm"
            self.profiler = create_frontend_profiler(vllm_config.profiler_config,
                                                     worker_name=self._frontend_profiler_worker_name)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's ``sleep`` at level 0 (a pause); deeper levels refused before anything pauses
        (``refuse_deep_sleep``)."""
        refuse_deep_sleep(level)
        await super().sleep(level, mode)

    async def add_request(self, request_id: str, *args, **kwargs):
        """vLLM's; refused with ``ShuttingDownError`` from the start of a ``shutdown`` that lets the
        requests in flight finish (as vLLM's engine core aborts one that comes while it drains; a
        503 on vLLM's routes), and with ``EngineShutDownError`` after one that does not wait."""
        self._adding += 1  # (before the check: a drain that began meanwhile sees it and waits for it)
        try:
            if self.shutdown_requested and not self._draining:  # (vLLM's would say the engine core failed)
                raise EngineShutDownError()
            if self._draining:
                raise ShuttingDownError(f"request {request_id}: this API server is shutting down")
            return await super().add_request(request_id, *args, **kwargs)
        finally:
            self._adding -= 1

    def shutdown(self, timeout: float | None = None) -> None:
        """vLLM's, after a drain of this client's own. With a ``timeout`` (``--shutdown-timeout``),
        called off the running event loop that serves the requests (vLLM's API server calls it from
        a worker thread on SIGTERM), it first lets this client's requests in flight finish, those
        still being added included, for at most ``timeout`` seconds, refusing new ones with
        ``ShuttingDownError`` (a 503 on every route); once none is left it stops its output handler
        (nothing more can come), and vLLM's shutdown gets what is left of the timeout, at least
        ``_ENGINE_STOP_S`` for the engine core to stop. In vLLM's order a client would shut its
        tokenizer's pool before the drain (a request that came meanwhile was a 500 on vLLM's routes)
        and log the engine core's exit as its output handler's failure; and a client that shares
        the engine with other API server processes (``--api-server-count``) would not drain at all:
        vLLM's engine core drains only when the client that owns it shuts it down, and the others
        stop taking outputs at once, their streams hanging until vLLM's process manager kills them.
        On the serving loop, or with that loop stopped, it does not wait: nothing could finish.
        The requests still in flight then raise ``EngineShutDownError`` to their callers."""
        core = getattr(self, "engine_core", None)  # (None: a construction that failed first)
        died = core is not None and core.resources.engine_dead  # (before vLLM's shutdown marks it so)
        handler = getattr(self, "output_handler", None)
        loop = handler.get_loop() if handler is not None and not handler.done() else None
        drain = bool(timeout) and loop is not None and loop.is_running() and _running_loop() is not loop
        if drain:  # (first: a request that comes meanwhile is refused as during the drain)
            self._draining = True
        self.shutdown_requested = True
        if drain:
            deadline = time.monotonic() + timeout
            logger.info("[shutdown] OmniAsyncLLM: letting %d requests in flight finish (at most %s s)",
                        self.output_processor.get_num_unfinished_requests(), timeout)
            while self._adding or self.output_processor.has_unfinished_requests():
                if time.monotonic() >= deadline or self.errored:
                    break  # requests are left: the handler takes their outputs until vLLM's shutdown stops it
                time.sleep(0.01)
            else:  # none left: stopped now, the engine core's exit is no failure of it. (Left None,
                # vLLM's ``errored`` follows the engine alone: its API server's watchdog, which stops
                # the server when a client has errored, lets the shutdown finish.)
                self.output_handler = None
                cancel_task_threadsafe(handler)
            timeout = max(deadline - time.monotonic(), _ENGINE_STOP_S)
        super().shutdown(timeout=timeout)
        processor = getattr(self, "output_processor", None)  # (None: a construction that failed first)
        if processor is not None and processor.has_unfinished_requests():  # their callers would wait forever
            # an engine that died: vLLM's error (a 500); one stopped: a retry can be served elsewhere
            end, error = processor.propagate_error, EngineDeadError() if died else EngineShutDownError()
            owner = handler.get_loop() if handler is not None else None  # (the loop their callers wait on)
            if owner is not None and owner.is_running() and _running_loop() is not owner:
                owner.call_soon_threadsafe(end, error)  # (their queues wake the loop's tasks)
            else:
                end(error)

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, start_engine_loop: bool = True,
                         usage_context: UsageContext = UsageContext.ENGINE_CONTEXT, stat_loggers=None,
                         processor_options: ProcessorOptions | None = None) -> OmniAsyncLLM:
        config = omni_vllm_config(engine_args, usage_context)
        return cls(config, Executor.get_class(config), log_requests=engine_args.enable_log_requests,
                   log_stats=not engine_args.disable_log_stats, start_engine_loop=start_engine_loop,
                   usage_context=usage_context, stat_loggers=stat_loggers, processor_options=processor_options)
