"""The talker's model runner in the engine core: ``TalkerWorker``, and its executor ``TalkerExecutor``.

``TalkerExecutor`` is vLLM's ``UniProcExecutor`` running this worker instead of vLLM's GPU worker;
the model and every buffer live on the configured device (CUDA or CPU). A step (``execute_model``,
then ``sample_tokens``) is numpy over per-row arrays, nothing per request:

1. new requests get a row (device state, host counters, a slot of the ``WorkerAccumulator``);
   finished ones give it back. A preempted request that vLLM resumes recomputes its tokens and goes
   on where it stopped; when vLLM dropped a step in flight (a reset of running requests, as its pause
   and sleep do), it samples those frames again and gets the tokens sampled then (the latest
   ``_KEPT_TOKENS`` of a row are kept), so its audio goes on exactly and a stop token among them
   ends it there;
2. the requests that sample this step: one talker forward (codes ``[B, CODEBOOKS]``), the token ids
   written into the head of the step's output buffer, the frames' audio decoded;
3. ``WorkerAccumulator.append`` and ``collect``: what is due, with the token ids, in one
   asynchronous copy to the host. A request's last frame closes its output in the same step;
4. ``sample_tokens`` returns an ``AsyncModelRunnerOutput`` whose ``get_output`` waits for that copy
   (under async scheduling, a step later: the copy overlaps the next step).

Stop tokens (the request's eos or ``stop_token_ids``, vLLM's ``check_stop``) are seen on the host only
in ``get_output``. The worker then stops sampling the request and closes its output at the next step,
up to the stopping frame (``collect(ends=...)``); the scheduler's final output waits for that
(``scheduler.MultimodalChannel``). A step already run past the stop leaves the extra frame out of its
data (``PackedStep.drop_newest``). There are twice as many rows as vLLM has seats to start with, since
vLLM gives a finished request's seat away before its output has closed here; a request that finds
none free makes twice as many (the requests vLLM preempted hold theirs, and priority scheduling
preempts running requests for every arrival that outranks them).

``additional_config["omni"]`` (``WorkerOptions``): ``device`` ("auto", "cuda", "cpu"); ``cadence``
(audio samples a streaming request gets at a time; 0: every step); ``output_path`` ("worker", or
"upstream": the comparison path, every key copied to the host each step and sliced per request);
``bad_prompt_token`` (a prompt token that makes the talker emit a malformed output, for tests: on
the worker path its audio chunk of another dtype at frame k (from 0) where the prompt holds the token
k times (once: the second frame), which the accumulator fails;
on the upstream path its sample rate as a numpy int, which vLLM's wire cannot carry and the
scheduler fails);
``sync_debug`` (CUDA's sync-debug mode "error" around ``execute_model``: any host sync raises);
``pool_budget_bytes`` (the audio's ring arena on the device, 1 GiB by default: a FINAL_ONLY request
holds all its audio, 7.5 KiB a frame; a request it cannot hold while others hold theirs fails alone
with ``OutputMemoryError``, a 503 before its first audio, and one that needs more than the budget
could ever give it (a slot grows into a new region before it gives up its old one: about half the
budget at most) with ``TensorAccumulationError``, a 500;
it must hold the first slots of ``max_num_seqs`` streams twice over: ``__init__``);
``cpu_threads`` (torch's threads for a CPU talker; None: half the cores unless ``OMP_NUM_THREADS`` is
set, since idle OpenMP threads spin and would slow the API servers beside the engine; an engine in
the caller's process gives the caller's count back when it shuts down); ``rows``
(request rows to start with; None: twice ``max_num_seqs``).
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.sampling_params import RequestOutputKind
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

from ..accumulator import EmitPolicy
from ..errors import TensorAccumulationError
from ..modality import TensorAccumulationStrategy as Strategy
from ..profiling import nvtx_range
from ..ring import PaddedBatch
from ..ring.pool import more_slots
from ..serving import talker as tk
from ..serving.worker_accumulator import OutputKey, PackedStep, WorkerAccumulator
from ..ring.staging import PinnedStaging
from .outputs import OmniModelRunnerOutput
from .talker_model import OmniTalkerForTTS
from .upstream_style import upstream_worker_outputs

logger = init_logger("vllm.omni_kernels.worker")  # under "vllm.": vLLM's handler prints it in the engine core

_HISTORY = 100_000  # steps (and first-chunk times) kept for the statistics
_KEPT_TOKENS = 8  # a row's latest sampled tokens, for vLLM to sample again (_replay): it drops a step or two
# Every request's state by row (as vLLM's persistent batch keeps it): the step is numpy over these.
# name: (dtype, shape of a row's entry, what a free row holds)
_ROW_ARRAYS = {
    "_prompt_len": (np.int64, (), 0),
    "_max_tokens": (np.int64, (), 0),
    "_computed": (np.int64, (), 0),  # tokens computed, by this worker's count
    "_produced": (np.int64, (), 0),  # frames (sampled tokens) produced
    "_done": (bool, (), False),  # the last frame was produced
    "_bad": (np.int64, (), 0),  # the frame (from 0) whose chunk is malformed (0: none; ``bad_prompt_token``)
    "_eos": (np.int64, (), -1),  # the sampled token that ends the request (-1: none can)
    "_has_stop_ids": (bool, (), False),  # the row's request is in _stop_ids
    "_stoppable": (bool, (), False),  # a sampled token can end the request (module docstring)
    "_tokens": (np.int64, (_KEPT_TOKENS,), 0),  # the latest sampled tokens, by frame index
    "_replay": (np.int64, (), -1),  # the next frame whose token vLLM samples again (-1: none)
}
_STEP_FRAMES = {"audio": tk.FRAME_SAMPLES, "codes": 1}  # ring frames a step appends per request, by key


@dataclass
class WorkerOptions:
    device: str = "auto"
    cadence: int = tk.STREAM_CADENCE
    output_path: str = "worker"
    bad_prompt_token: int | None = None
    sync_debug: bool = False
    pool_budget_bytes: int = 1 << 30
    cpu_threads: int | None = None
    rows: int | None = None  # request rows to start with (None: twice max_num_seqs); more are made when needed

    @classmethod
    def from_config(cls, vllm_config) -> WorkerOptions:
        extra = vllm_config.additional_config
        opts = dict(extra.get("omni", {})) if isinstance(extra, dict) else {}
        unknown = set(opts) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"additional_config['omni'] has unknown options {sorted(unknown)}; "
                             f"known: {sorted(cls.__dataclass_fields__)}")
        if opts.get("output_path", "worker") not in ("worker", "upstream"):
            raise ValueError(f"output_path must be 'worker' or 'upstream', got {opts['output_path']!r}")
        for name, least in (("cadence", 0), ("pool_budget_bytes", 1), ("cpu_threads", 1), ("rows", 1)):
            value = opts.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"additional_config['omni']['{name}'] must be a whole number of at least {least}, "
                                 f"got {value!r}")
        return cls(**opts)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


class _StepOutput(AsyncModelRunnerOutput):
    """A step's output, resolved when its copy to the host has landed (``get_output``), which is
    also when the worker learns the step's tokens (``TalkerWorker._resolve``). ``sampled``: (request
    ids, rows, frames produced) of the step's sampling requests; ``stops``: their rows' (eos, has stop
    ids) as they were when the step ran (a row can pass to a new request before the step resolves),
    None when no sampled token can end one of them; ``replayed``: (positions in ``req_ids``, rows,
    frame indices) of the requests whose token vLLM samples again (``_replay``)."""

    def __init__(self, worker: TalkerWorker, req_ids: list[str], sampling: np.ndarray, opened: list[str], replayed,
                 *, packed: PackedStep | None = None, tokens_cpu: torch.Tensor | None = None, failed=None, plain=None,
                 sampled: tuple[list[str], np.ndarray, np.ndarray] | None = None, stops=None):
        self.worker, self.req_ids, self.sampling, self.opened = worker, req_ids, sampling, opened
        self.packed, self.tokens_cpu, self.failed, self.plain = packed, tokens_cpu, failed or {}, plain
        self.sampled, self.stops, self.replayed = sampled, stops, replayed
        self.ended: set[str] = set()  # requests whose end an earlier step's token was

    def drop_past(self, request_id: str, end: int) -> None:
        """Leave out of this step's data the request's frames past its ``end`` (frames produced),
        found after the step ran."""
        self.ended.add(request_id)
        if self.packed is None or self.stops is None or request_id not in self.sampled[0]:
            return
        ids, _, produced = self.sampled
        extra = int(produced[ids.index(request_id)]) - end
        if extra > 0:
            self.packed.drop_newest(request_id, {key: extra * n for key, n in _STEP_FRAMES.items()})

    def get_output(self) -> OmniModelRunnerOutput:
        if self.packed is not None:
            host = self.packed.wait()
            tokens = host[:self.packed.head_bytes].view(torch.int64).tolist()
        else:
            tokens = self.tokens_cpu.tolist() if self.tokens_cpu is not None else []
        self.worker._resolve(self, tokens)
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        for b, i in enumerate(self.sampling.tolist()):
            sampled[i] = [tokens[b]]
        if self.replayed is not None:  # every earlier step is resolved: their tokens are in the history
            at, rows, frames = self.replayed
            for i, token in zip(at.tolist(), self.worker._tokens[rows, frames % _KEPT_TOKENS].tolist()):
                sampled[i] = [token]
        return OmniModelRunnerOutput(
            req_ids=self.req_ids, req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
            sampled_token_ids=sampled, multimodal_outputs=self.plain or None, packed=self.packed,
            multimodal_opened=self.opened or None, multimodal_errors=self.failed or None)

    def get_kv_connector_output(self):
        return None


class TalkerWorker:
    """The talker's model runner; see the module docstring. Method names are vLLM's worker RPCs."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.options = WorkerOptions.from_config(vllm_config)
        self.device = self.options.torch_device()
        sched = vllm_config.scheduler_config
        # What the engine core steps with (its batch queue is set from it next). An engine core in its
        # own process runs vLLM's config checks again once it is built, which on vLLM's CPU platform
        # reset the flag; read later, it would no longer say how the engine runs.
        self.async_scheduling = bool(sched.async_scheduling)
        # rows: twice vLLM's seats to start with (module docstring)
        self.max_requests = self.options.rows or 2 * int(sched.max_num_seqs)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.model = OmniTalkerForTTS(vllm_config=vllm_config, talker_worker=True).to(self.device)
        self._size_rows(0, self.max_requests)  # the per-row state (_ROW_ARRAYS and the talker's)
        self._row: dict[str, int] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}  # requests that stop_token_ids of their own can end
        self._stopped: dict[str, int] = {}  # request -> its frames when a token ended it (seen a step late)
        self._in_flight: deque[_StepOutput] = deque()  # step outputs handed to vLLM, not yet resolved
        self._discarded: dict[str, TensorAccumulationError] = {}  # failures for the next step output (_discard)
        # failures of a frame that may lie past a stop token not seen yet, until it is (_judge_held_failures):
        # request -> (its error, the step whose append failed, the failing frame's count of frames produced)
        self._held_failures: dict[str, tuple[TensorAccumulationError, _StepOutput, int]] = {}
        self._keep_rows: set[str] = set()  # this step's closing requests that keep their rows (_update_requests)
        keys = talker_output_keys(self.options.cadence)
        # (the upstream path keeps no audio in the worker: its arenas are the least there is)
        worker_path = self.options.output_path == "worker"
        self.acc = WorkerAccumulator(keys, self.device, max_requests=self.max_requests, budget_bytes=key_budgets(
            keys, self.options.pool_budget_bytes if worker_path else 1 << 20))
        # Every stream takes its smallest region at once (the server's warm-up does), twice per seat: a
        # stream that ends on a stop token gives its regions back a step after vLLM gave its seat away
        # (the token is seen when its step resolves; its rest is read in the step after), and the
        # request in its seat takes its own in that step.
        audio = self.acc.pools[0]
        floor = 2 * int(sched.max_num_seqs) * audio.allocator.min_frames * audio.frame_bytes
        if worker_path and self.options.pool_budget_bytes < floor:
            raise ValueError(f"pool_budget_bytes {self.options.pool_budget_bytes} cannot hold the first slots of "
                             f"max_num_seqs ({sched.max_num_seqs}) streams twice over (a stream that ends on a stop "
                             f"token holds its own while the next one in its seat starts): {floor} bytes at least "
                             f"(serve --audio-memory-mib {-(-floor >> 20)})")
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
        self._pending: _StepOutput | None = None
        self.stats = {"steps": 0, "output_steps": 0, "host_bytes": 0, "samples": 0, "resumed": 0, "replayed": 0,
                      "stopped": 0}
        self._upstream_copies = 0
        self._output_path_us: deque[float] = deque(maxlen=_HISTORY)  # the latest steps: a server runs for long
        self._step_starts: deque[float] = deque(maxlen=_HISTORY)
        self.first_chunk_at: OrderedDict[str, float] = OrderedDict()  # request id (no vLLM suffix) -> monotonic
        # vLLM adds "-" and 8 random characters to the caller's request id unless told not to
        self._ids_as_given = bool(envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)
        threads = talker_cpu_threads(self.options.cpu_threads) if self.device.type == "cpu" else None
        self._threads_taken = threads is not None  # (last: a worker that failed to start changed nothing)
        if threads is not None:
            _take_threads(threads)

    # ------------------------------------------------------------------ vLLM's worker RPCs

    def get_kv_cache_spec(self):
        cache = self.vllm_config.cache_config
        return {"talker.attn": FullAttentionSpec(block_size=cache.block_size, num_kv_heads=1, head_size=8,
                                                 dtype=torch.float32)}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        pass  # the talker keeps no KV cache: its state is per request (context, last token, frame)

    def determine_available_memory(self) -> int:
        return int(self.vllm_config.cache_config.kv_cache_memory_bytes or 64 << 20)

    def initialize_from_config(self, kv_cache_configs) -> None:
        pass  # vLLM's blocks are bookkeeping only here

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self):
        return ("generate",)

    def reset_mm_cache(self) -> None:
        pass  # no multimodal inputs, so no caches of them (vLLM's pause and sleep reset them)

    def reset_encoder_cache(self) -> None:
        pass

    def take_draft_token_ids(self):
        return None

    def synchronize_device(self) -> None:
        """Wait for the talker's device work (vLLM's pause, before it reports the engine paused)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        self.synchronize_device()
        if self._threads_taken:
            self._threads_taken = False
            _give_back_threads()

    def sleep(self, level: int = 1) -> None:
        """Refused: levels 1 and 2 free the weights and the KV cache, while the talker keeps its
        weights and output rings resident. Level 0 (vLLM pauses scheduling, calls no worker) is served."""
        raise NotImplementedError(f"sleep level {level}: the talker keeps its weights and output rings resident; "
                                  "use level 0 (pause scheduling only); wake_up() resumes the paused scheduler")

    def add_lora(self, lora_request) -> bool:
        """Refused: the talker serves no LoRA adapters (a request that names one is refused by
        vLLM's input processing)."""
        raise NotImplementedError(f"LoRA adapter {lora_request.lora_name!r}: the talker serves no LoRA adapters")

    def list_loras(self) -> set[int]:
        return set()

    def output_path_stats(self, first_chunks: bool = False) -> dict:
        """What the output path cost: host time per step that had output (median, p99, mean, in
        us), device-to-host copies and their bytes, pool statistics (an RPC for the frontend); with
        ``first_chunks``, when each request's first chunk was produced (up to the latest
        ``_HISTORY`` requests: a long-running server's are megabytes of RPC)."""
        us = np.array(self._output_path_us or [0.0])
        steps = np.diff(self._step_starts) * 1e6 if len(self._step_starts) > 1 else np.zeros(1)
        copies = self.acc.copies if self.options.output_path == "worker" else self._upstream_copies
        return {**self.stats, "copies": copies, "device": str(self.device), "output_path": self.options.output_path,
                "async_scheduling": self.async_scheduling,
                "output_path_us_median": float(np.median(us)), "output_path_us_p99": float(np.percentile(us, 99)),
                "output_path_us_mean": float(us.mean()), "step_us_median": float(np.median(steps)),
                **({"first_chunk_at": dict(self.first_chunk_at)} if first_chunks else {}),
                "accumulator": self.acc.stats(), "requests_held": len(self._row), "rows": self.max_requests}

    def whole_file_frames(self) -> int | None:
        """The most frames a whole file can have: a FINAL_ONLY request holds all of them until it
        finishes (a longer one fails as it arrives, ``RingPool.alloc``, or, with a stop token, as it
        grows past them). None: no bound (the upstream path keeps no audio in the worker). An RPC
        for the speech route, which refuses a longer whole file before the engine runs it."""
        if self.options.output_path != "worker":
            return None
        return min(pool.most_frames() // _STEP_FRAMES[pool.key] for pool in self.acc.pools)

    def reset_output_path_stats(self) -> None:
        self._output_path_us.clear()
        self._step_starts.clear()
        self.first_chunk_at.clear()
        self.stats = dict.fromkeys(self.stats, 0)
        self.acc.copies = self._upstream_copies = 0

    # ------------------------------------------------------------------ the step

    def execute_model(self, scheduler_output):
        if self.options.sync_debug and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                return self._execute(scheduler_output)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return self._execute(scheduler_output)

    def _execute(self, scheduler_output):
        so = scheduler_output
        with nvtx_range("worker.step"):
            opened, flush = self._update_requests(so)
            if so.total_num_scheduled_tokens == 0 and not flush and not self._discarded:
                return EMPTY_MODEL_RUNNER_OUTPUT  # (failures go out at once, with a step of their own)
            req_ids = list(so.num_scheduled_tokens)
            sampling, rows, replayed = self._sampling_rows(so, req_ids)
            step = self._run(req_ids, sampling, rows, opened, flush, replayed)
        if self._discarded:  # requests failed since the last step output go with this one
            step.failed, self._discarded = {**self._discarded, **step.failed}, {}
        self._in_flight.append(step)  # until it is resolved
        if so.total_num_scheduled_tokens == 0:  # vLLM samples nothing after such a step: the output is this
            return step
        self._pending = step
        return None

    def sample_tokens(self, grammar_output) -> _StepOutput:
        pending, self._pending = self._pending, None
        return pending

    def _update_requests(self, so) -> tuple[list[str], dict[str, int]]:
        """Rows of the step's new, finished and resumed requests; returns the requests whose output
        the accumulator now holds, and those whose output closes this step, now that their end is
        seen (module docstring), each with the frames it ends at. A request closed on a stop token
        that vLLM has not finished (it dropped the token: below) keeps its row until it does."""
        flush = {rid: end for rid, end in self._stopped.items() if rid in self.acc}
        self._stopped.clear()
        for rid in so.finished_req_ids:  # finished or aborted: give everything back
            self._stop_ids.pop(rid, None)
            if rid in flush:
                continue  # its rest goes this step
            row = self._row.pop(rid, None)
            if row is not None:
                self.acc.abort(rid)
                self._free_rows.append(row)
        self._keep_rows = {rid for rid in flush if rid not in so.finished_req_ids}  # closed, vLLM goes on
        new = []
        for req in so.scheduled_new_reqs:  # with vLLM's Model Runner V2 a resumed request comes as new
            if req.req_id in self._row and req.prefill_token_ids is not None:  # (all its tokens, as V2 sends)
                self._resume(req.req_id, req.num_computed_tokens, len(req.prefill_token_ids) - req.prompt_len)
            else:
                new.append(req)
        opened = self._admit(new) if new else []
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids and rid in self._row:
                self._resume(rid, cached.num_computed_tokens[i], cached.num_output_tokens[i])
        return opened, flush

    def _resume(self, rid: str, computed: int, outputs: int) -> None:
        """A request vLLM preempted and now recomputes, from ``computed`` tokens, with ``outputs``
        output tokens. vLLM drops the tokens of a step in flight when it preempts (a reset of
        running requests): it samples those frames again, and gets the tokens the worker sampled
        (their audio has gone or is in the rings)."""
        row = self._row[rid]
        self._computed[row] = computed
        self.stats["resumed"] += 1
        dropped = int(self._produced[row]) - outputs
        if 0 < dropped <= _KEPT_TOKENS:
            self._replay[row] = outputs
            self.stats["replayed"] += dropped
        elif dropped > 0:
            self._discard(rid)

    def _discard(self, rid: str, error: TensorAccumulationError | None = None) -> None:
        """Fail the request, visibly, with the step's output; it samples no more. ``error``: why
        (default: vLLM resumed it without more tokens than the worker keeps)."""
        self._discarded[rid] = error or TensorAccumulationError(
            f"vLLM discarded more than {_KEPT_TOKENS} sampled tokens whose audio the worker had produced; the audio "
            "cannot continue exactly", request_id=rid)
        row = self._row.get(rid)
        if row is not None:
            self._done[row] = True
        self.acc.abort(rid)

    def _admit(self, new_reqs) -> list[str]:
        """Rows and talker state for the step's new requests: their prompts go to the device in one
        asynchronous copy and their contexts come from one batched forward. Returns the requests
        whose output the accumulator now holds."""
        opened, rows, prompts = [], [], []
        for new in new_reqs:
            prompt = new.prompt_token_ids
            params = new.sampling_params  # (None for a pooling request: the getattr defaults below)
            if not prompt:  # prompt embeddings (OmniInputProcessor refuses them where vLLM's frontend runs)
                self._discard(new.req_id, TensorAccumulationError("the talker speaks token ids and was given none",
                                                                  request_id=new.req_id))
                continue
            if not self._free_rows and not self._grow_rows():  # (module docstring: rows)
                self._discard(new.req_id, TensorAccumulationError(f"all {self.max_requests} request rows are in use",
                                                                  request_id=new.req_id))
                continue
            row = self._free_rows.pop()
            self._row[new.req_id] = row
            self._prompt_len[row] = len(prompt)
            max_tokens = getattr(params, "max_tokens", None)
            self._max_tokens[row] = self.max_model_len if max_tokens is None else max_tokens
            self._computed[row] = new.num_computed_tokens  # a prefix-cache hit arrives with computed tokens
            self._produced[row] = 0
            self._replay[row] = -1
            self._done[row] = False
            self._bad[row] = list(prompt).count(self.options.bad_prompt_token)
            eos = getattr(params, "eos_token_id", None)
            self._eos[row] = eos if eos is not None and tk.TEXT_VOCAB <= eos < tk.VOCAB else -1
            stop = frozenset(t for t in getattr(params, "stop_token_ids", None) or () if tk.TEXT_VOCAB <= t < tk.VOCAB)
            if stop:
                self._stop_ids[new.req_id] = stop
            self._has_stop_ids[row] = bool(stop)
            self._stoppable[row] = self._eos[row] >= 0 or bool(stop)
            if self.options.output_path == "worker":
                kind = getattr(params, "output_kind", RequestOutputKind.FINAL_ONLY)
                # A FINAL_ONLY request holds all its audio: its slots are sized for all of it at once
                # when that is known (no stop token can end it early; a reservation for max_tokens
                # would let a few requests that stop early take the whole budget), else they grow.
                frames = int(min(self._max_tokens[row], self.max_model_len - len(prompt)))
                sized = kind == RequestOutputKind.FINAL_ONLY and not self._stoppable[row]
                held = {"audio": frames * tk.FRAME_SAMPLES, "codes": frames} if sized else None
                try:
                    self.acc.add_request(new.req_id, EmitPolicy[kind.name], row=row, frames=held)
                    opened.append(new.req_id)
                except TensorAccumulationError as exc:  # its output does not fit (OutputMemoryError): it fails
                    self._discard(new.req_id, exc)
            rows.append(row)
            prompts.append(prompt)
        if not prompts:
            return opened
        # one host table: [row, prompt length, last token, prompt ids (padded)] per new request
        width = max(len(p) for p in prompts)
        table = np.zeros((len(prompts), 3 + width), np.int64)
        table[:, 0] = rows
        for i, p in enumerate(prompts):
            table[i, 1], table[i, 2] = len(p), p[-1]
            table[i, 3:3 + len(p)] = p
        host = torch.from_numpy(table)
        if self.device.type == "cuda":  # an asynchronous copy: the step never waits for the device
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        rows_dev = dev[:, 0]
        self.context.index_copy_(0, rows_dev, self.model.talker.prompt_context(dev[:, 3:], dev[:, 1]))
        self.last_token.index_copy_(0, rows_dev, dev[:, 2])
        self.frame.index_fill_(0, rows_dev, 0)
        return opened

    def _grow_rows(self) -> bool:
        """Twice the rows (at most a pool's ``MAX_SLOTS``; False when there are as many already): the
        per-row state and the accumulator's rows grow together; the rows held keep their index and
        state."""
        old = self.max_requests
        rows = more_slots(old)
        if rows == old:
            return False
        logger.info("worker: %d request rows held (requests vLLM preempted keep theirs); now %d", old, rows)
        self._size_rows(old, rows)
        self.acc.grow_rows(rows)
        self._free_rows.extend(range(rows - 1, old - 1, -1))
        return True

    def _size_rows(self, old: int, rows: int) -> None:
        """Make the per-row state hold ``rows`` rows, the first ``old`` as they are: the arrays of
        ``_ROW_ARRAYS``, the talker's device state (context, last token, frame index) and the
        staging of the step's row index."""
        for name, (dtype, shape, fill) in _ROW_ARRAYS.items():
            a = np.full((rows, *shape), fill, dtype)
            if old:
                a[:old] = getattr(self, name)
            setattr(self, name, a)
        for name, shape, dtype in (("context", (self.model.talker.hidden_size,), None),
                                   ("last_token", (), torch.int64), ("frame", (), torch.int64)):
            t = torch.zeros(rows, *shape, dtype=dtype, device=self.device)
            if old:
                t[:old].copy_(getattr(self, name))
            setattr(self, name, t)
        self._index = PinnedStaging(1, rows, self.device)
        self._index_dev = torch.zeros(1, rows, dtype=torch.int64, device=self.device)
        self.max_requests = rows

    def _sampling_rows(self, so, req_ids: list[str]):
        """Positions (in ``req_ids``) of the requests that sample a frame this step, and their rows;
        and (positions, rows, frame indices) of those whose token vLLM samples again (None: none)."""
        rows = np.fromiter(map(self._row.get, req_ids, repeat(-1)), np.int64, len(req_ids))
        scheduled = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(req_ids))
        at = np.flatnonzero(rows >= 0)  # requests this worker holds (rows are distinct)
        rows = rows[at]
        computed = self._computed[rows] = self._computed[rows] + scheduled[at]
        prompt = self._prompt_len[rows]
        # not a prefill chunk, nor a step scheduled past the request's last frame
        samples = ~self._done[rows] & (computed >= prompt + self._produced[rows])
        replayed = None
        replay = self._replay[rows]
        again = (replay >= 0) & (computed >= prompt + replay)  # vLLM samples a frame the worker has (_replay)
        if again.any():
            again_rows = rows[again]
            replayed = (at[again], again_rows, replay[again])
            nxt = replay[again] + 1
            self._replay[again_rows] = np.where(nxt < self._produced[again_rows], nxt, -1)
        return at[samples], rows[samples], replayed

    def _run(self, req_ids: list[str], sampling: np.ndarray, state_rows: np.ndarray, opened: list[str],
             flush: dict[str, int], replayed=None) -> _StepOutput:
        """The step: a frame of each request at ``state_rows`` (``req_ids[sampling]``), and its output."""
        B = len(state_rows)
        self.stats["steps"] += 1
        now = time.monotonic()
        self._step_starts.append(now)
        if B == 0:  # (the rest of requests that ended on a stop token, and nothing sampled)
            t0 = time.perf_counter()
            packed = self._collect([], flush, 0) if flush else None
            if packed is not None:  # a step with output (and its copy) as any other
                self._note_output_path(t0, packed.host.numel())
            return _StepOutput(self, req_ids, sampling, opened, replayed, packed=packed)
        ids = [req_ids[i] for i in sampling.tolist()]
        produced = self._produced[state_rows]
        for b in np.flatnonzero(produced == 0).tolist():
            self.first_chunk_at[ids[b] if self._ids_as_given else ids[b].rsplit("-", 1)[0]] = now
        while len(self.first_chunk_at) > _HISTORY:  # a long-running server: the newest only
            self.first_chunk_at.popitem(last=False)
        i, host = self._index.host()
        host[0, :B] = state_rows  # the accumulator's rows too
        rows = self._index.upload(i, 1, self._index_dev, cols=B)[0, :B]
        codes = self.model.talker(self.last_token[rows], self.frame[rows], self.context[rows])
        bad_at = self._bad[state_rows]
        bad = np.flatnonzero((bad_at > 0) & (bad_at == produced)).tolist()
        produced += 1
        self._produced[state_rows] = produced
        ending = (produced >= self._max_tokens[state_rows]) | \
            (self._prompt_len[state_rows] + produced >= self.max_model_len)
        self._done[state_rows[ending]] = True
        self.stats["samples"] += B * tk.FRAME_SAMPLES
        upstream = self.options.output_path == "upstream"
        tokens = torch.empty(B, dtype=torch.int64, device=self.device) if upstream else self.acc.head(B, torch.int64)
        torch.add(codes[:, 0], tk.TEXT_VOCAB, out=tokens)
        self.last_token[rows] = tokens
        audio = tk.decode_frames(codes, self.frame[rows])
        self.frame[rows] += 1
        sampled = (ids, state_rows, produced)
        t0 = time.perf_counter()
        if upstream:  # the comparison path (upstream_style): every key's batch copied to the host, sliced
            with nvtx_range("worker.output_path"):
                tokens_cpu = tokens.cpu()
                plain = upstream_worker_outputs(ids, {"audio": audio, "codes": codes.unsqueeze(1)})
                for b in bad:  # the malformed output of a test request: a value the wire cannot carry
                    plain[ids[b]]["sr"] = np.int64(tk.SAMPLE_RATE)
            if self.device.type == "cuda":
                self._upstream_copies += 3
            self._note_output_path(t0, audio.numel() * 4 + codes.numel() * 8 + tokens_cpu.numel() * 8)
            return _StepOutput(self, req_ids, sampling, opened, replayed, tokens_cpu=tokens_cpu, plain=plain,
                               sampled=sampled)
        finishing = [ids[b] for b in np.flatnonzero(ending).tolist()]
        with nvtx_range("worker.output_path"):
            chunks = {"audio": PaddedBatch(audio, np.full(B, _STEP_FRAMES["audio"], np.int64)),
                      "codes": PaddedBatch(codes.unsqueeze(1), np.full(B, _STEP_FRAMES["codes"], np.int64))}
            if bad:  # the malformed chunk of a test request: one request's audio of another dtype
                chunks["audio"] = [audio[b].double() if b in bad else audio[b] for b in range(B)]
            failed = self.acc.append(ids, chunks, rows=state_rows, keep=self._may_have_stopped)
            held = [rid for rid in failed if rid in self.acc]  # (kept: judged once the earlier steps resolve)
            packed = self._collect(finishing, flush, 8 * B, held)
        for rid in failed:  # the scheduler finishes it with the error; it samples no more
            self._done[self._row[rid]] = True
        self._note_output_path(t0, packed.host.numel())  # (never None: the head is there)
        stops = (self._eos[state_rows], self._has_stop_ids[state_rows]) if self._stoppable[state_rows].any() else None
        step = _StepOutput(self, req_ids, sampling, opened, replayed, packed=packed, failed=failed, sampled=sampled,
                           stops=stops)
        for rid in held:
            self._held_failures[rid] = (failed.pop(rid), step, int(produced[ids.index(rid)]))
        return step

    def _may_have_stopped(self, rid: str) -> bool:
        """Whether a step still in flight sampled a token that may end the request: under async
        scheduling the worker samples a frame before it sees the token of the frame before, so a
        failure of the newest frame may lie past the request's end (``_judge_held_failures``)."""
        return bool(self._stoppable[self._row[rid]]) and any(
            step.stops is not None and step.sampled is not None and rid in step.sampled[0] for step in self._in_flight)

    def _collect(self, finishing: list[str], flush: dict[str, int], head_bytes: int,
                 held: list[str] = ()) -> PackedStep | None:
        """The accumulator's collect; ``flush`` closes each of its requests at the frames it ends at
        (what it produced after that is never read), and their rows are free afterwards unless vLLM
        has not finished the request (``_keep_rows``: it samples the row's tokens again). Nothing
        is read of the requests whose failure is held (``_held_failures``, and ``held``, this step's):
        their data ends where a stop token says, or they fail."""
        ends = None
        if flush:
            ends = [np.full(self.max_requests, np.iinfo(np.int64).max, np.int64) for _ in self.acc.keys]
            for end, key in zip(ends, self.acc.keys):
                for rid, frames in flush.items():
                    end[self._row[rid]] = frames * _STEP_FRAMES[key.name]
        packed = self.acc.collect(finishing + list(flush), head_bytes=head_bytes, ends=ends,
                                  hold={*self._held_failures, *held})
        for rid in flush:
            if rid not in self._keep_rows:
                self._free_rows.append(self._row.pop(rid))
        return packed

    def _resolve(self, step: _StepOutput, tokens: list[int]) -> None:
        """A step's tokens, seen once its copy has landed. A request whose token ends it (vLLM's
        ``check_stop``: its eos token, or one of its ``stop_token_ids``) samples no more; the steps
        that ran before the token was seen (under async scheduling) leave out its frames past the
        end, and its output closes at the next step, up to this step's frame."""
        if step in self._in_flight:
            while self._in_flight.popleft() is not step:
                pass  # (a step vLLM never resolved)
        self._see_stops(step, tokens)
        if self._held_failures:
            self._judge_held_failures()

    def _see_stops(self, step: _StepOutput, tokens: list[int]) -> None:
        """``_resolve``'s stop tokens: the request's end, its frames past it left out of later steps."""
        if step.sampled is None:
            return
        ids, rows, produced = step.sampled
        self._tokens[rows, (produced - 1) % _KEPT_TOKENS] = tokens[:len(rows)]  # for vLLM to sample again (_replay)
        if step.stops is None:
            return
        eos, has_stop_ids = step.stops
        hit = np.asarray(tokens[:len(rows)], np.int64) == eos
        if self._stop_ids:  # (no loop over every row of the step)
            for b in np.flatnonzero(has_stop_ids).tolist():
                if tokens[b] in self._stop_ids.get(ids[b], ()):
                    hit[b] = True
        for b in np.flatnonzero(hit).tolist():
            rid, end = ids[b], int(produced[b])
            if rid in step.ended:
                continue  # a frame past its end, already left out
            self.stats["stopped"] += 1
            for later in self._in_flight:
                later.drop_past(rid, end)
            if rid in self.acc:  # (else closed by its length in this step)
                self._stopped[rid] = end
                self._done[self._row[rid]] = True

    def _judge_held_failures(self) -> None:
        """Failures held back (``_may_have_stopped``) whose earlier steps have all resolved: a request
        that a stop token ended before the failing frame closes there as any stopped request does
        (its data is held unread until then: ``collect``'s ``hold``), and the failure is void; any
        other fails now, with the next step output."""
        for rid, (error, failing, frame) in list(self._held_failures.items()):
            if failing in self._in_flight and self._in_flight[0] is not failing:
                continue  # an earlier step has not resolved: its token may end the request
            del self._held_failures[rid]
            if rid not in self.acc or self._stopped.get(rid, frame) < frame:
                continue  # ended on a stop token before the failing frame (or finished or aborted since)
            self._discard(rid, error)

    def _note_output_path(self, t0: float, nbytes: int) -> None:
        self._output_path_us.append((time.perf_counter() - t0) * 1e6)
        self.stats["output_steps"] += 1
        self.stats["host_bytes"] += nbytes


def talker_cpu_threads(option: int | None, environ=os.environ, cores: int | None = None) -> int | None:
    """torch's threads for a talker on the CPU: ``option`` when given, else half the cores (at
    least one), unless ``OMP_NUM_THREADS`` is set (None: leave torch's own setting)."""
    if option is not None:
        return max(1, int(option))
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, (cores or os.cpu_count() or 1) // 2)


# torch's intra-op threads as the process had them before its first talker on the CPU took its own,
# then one entry per talker on the CPU running in this process (an engine in the caller's process)
_threads_before: list[int] = []


def _take_threads(threads: int) -> None:
    _threads_before.append(torch.get_num_threads())
    torch.set_num_threads(threads)


def _give_back_threads() -> None:
    """The process's own thread count back once the last talker on the CPU in it shuts down."""
    before = _threads_before[0]
    _threads_before.pop()
    if not _threads_before:
        torch.set_num_threads(before)


def talker_output_keys(cadence: int) -> list[OutputKey]:
    """What the talker produces each step and the worker accumulates: the frame's audio (the pace:
    a streaming request gets ``cadence`` samples at a time) and its codes (along with the audio)."""
    return [OutputKey("audio", Strategy.CONCAT_LAST, torch.float32, (), cadence=cadence,
                      initial_frames=16 * tk.FRAME_SAMPLES),
            OutputKey("codes", Strategy.CONCAT_DIM0, torch.int64, (tk.CODEBOOKS,), cadence=None, initial_frames=16)]


def key_budgets(keys: list[OutputKey], audio_bytes: int) -> dict[str, int]:
    """Each key's arena: ``audio_bytes`` for the audio, and for every other key room for as many
    codec frames (what a step appends per request, ``_STEP_FRAMES``) twice over, at least 1 MiB: a
    region is a power of two of ring frames, so a request's region of a key with fewer ring frames
    per codec frame can round up by twice as much as its audio region."""
    step = {k.name: _STEP_FRAMES[k.name] * math.prod(k.frame_shape) * k.dtype.itemsize for k in keys}
    return {name: audio_bytes if name == "audio" else max(2 * audio_bytes * nbytes // step["audio"], 1 << 20)
            for name, nbytes in step.items()}


class TalkerExecutor(UniProcExecutor):
    """vLLM's one-process executor, running ``TalkerWorker`` (module docstring)."""

    def _init_executor(self) -> None:
        self.driver_worker = TalkerWorker(self.vllm_config)

    def discard(self, tags: tuple[str, ...]) -> None:
        """Refused (vLLM's ``release_kv_cache_memory``): the talker keeps no KV cache, and its output
        rings stay resident. Refused here, before vLLM's executor would count the tags as released
        whatever its worker said, after which no ``wake_up`` could succeed."""
        raise NotImplementedError(f"discarding {', '.join(tags)}: the talker keeps no KV cache and its output rings "
                                  "stay resident; nothing is released (wake_up() resumes the paused engine)")
