"""The talker's model runner in the engine core: ``TalkerWorker``, and its executor ``TalkerExecutor``.

``TalkerExecutor`` is vLLM's ``UniProcExecutor`` with this worker in place of vLLM's GPU worker
(which needs vLLM's compiled kernels); vLLM drives it through its worker RPCs (KV-cache spec and
memory, ``execute_model``, ``sample_tokens``, ...). The model and every buffer live on the
configured device, CUDA or CPU, whatever vLLM's own platform is.

A step (``execute_model`` then ``sample_tokens``, as vLLM's GPU runner does):

1. bookkeeping from the scheduler output: new requests get a row of the persistent device state
   (prompt context, last token, frame index) and slots in the worker accumulator, their output kind
   taken from their sampling parameters; finished and aborted requests give both back;
2. the requests whose tokens are all computed after this step sample: one talker forward over them
   (codes ``[B, CODEBOOKS]``), the sampled token ids written straight into the head of the step's
   output buffer, the frames' audio decoded (``[B, FRAME_SAMPLES]``);
3. the output path: ``WorkerAccumulator.append`` (one launch per key) and ``collect`` (what is due,
   packed, and one asynchronous copy to the host carrying the token ids too). A request whose last
   frame this was (its ``max_tokens``, or the model's length) is closed in the same step, so its
   last data travels with its last token;
4. ``sample_tokens`` returns an ``AsyncModelRunnerOutput`` whose ``get_output`` waits for that copy
   (vLLM calls it a step later under async scheduling: the copy overlaps the next step).

``additional_config["omni"]`` configures it: ``device`` ("auto", "cuda", "cpu"), ``cadence``
(audio samples a streaming request gets at a time; 0: every step), ``output_path`` ("worker", or
"upstream": the comparison path, where each key's batched output is copied to the host every step
and sliced per request, as upstream vllm-omni does), ``bad_prompt_token`` (a prompt token that
makes the talker emit a malformed chunk, for tests of the failure path) and ``sync_debug`` (run
``execute_model`` under CUDA's sync-debug mode "error": any host synchronisation in the step raises).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from vllm.sampling_params import RequestOutputKind
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

from ..accumulator import EmitPolicy
from ..modality import TensorAccumulationStrategy as Strategy
from ..profiling import nvtx_range
from ..ring import PaddedBatch
from ..serving import talker as tk
from ..serving.worker_accumulator import OutputKey, PackedStep, WorkerAccumulator
from ..ring.staging import PinnedStaging
from .outputs import OmniModelRunnerOutput
from .talker_model import OmniTalkerForTTS

_HISTORY = 100_000  # steps (and first-chunk times) kept for the statistics
_EMIT = {RequestOutputKind.DELTA: EmitPolicy.DELTA, RequestOutputKind.CUMULATIVE: EmitPolicy.CUMULATIVE,
         RequestOutputKind.FINAL_ONLY: EmitPolicy.FINAL_ONLY}


@dataclass
class WorkerOptions:
    device: str = "auto"
    cadence: int = 4 * tk.FRAME_SAMPLES
    output_path: str = "worker"
    bad_prompt_token: int | None = None
    sync_debug: bool = False
    pool_budget_bytes: int = 128 << 20

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
        return cls(**opts)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class _Request:
    row: int
    prompt_len: int
    max_tokens: int
    computed: int = 0  # tokens computed, by this worker's count
    produced: int = 0  # frames (sampled tokens) produced
    done: bool = False  # the last frame was produced
    bad: bool = False


class _StepOutput(AsyncModelRunnerOutput):
    """A step's output, resolved when its copy to the host has landed (``get_output``)."""

    def __init__(self, req_ids, sampling: np.ndarray, packed: PackedStep | None, tokens_cpu, opened, failed, plain):
        self.req_ids, self.sampling, self.packed, self.tokens_cpu = req_ids, sampling, packed, tokens_cpu
        self.opened, self.failed, self.plain = opened, failed, plain

    def get_output(self) -> OmniModelRunnerOutput:
        if self.packed is not None:
            host = self.packed.wait()
            tokens = host[:self.packed.head_bytes].view(torch.int64).tolist()
        else:
            tokens = self.tokens_cpu.tolist() if self.tokens_cpu is not None else []
        sampled: list[list[int]] = [[] for _ in self.req_ids]
        for b, i in enumerate(self.sampling.tolist()):
            sampled[i] = [tokens[b]]
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
        self.max_requests = int(sched.max_num_seqs)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.model = OmniTalkerForTTS(vllm_config=vllm_config).to(self.device)
        talker = self.model.talker
        self.context = torch.zeros(self.max_requests, talker.hidden_size, device=self.device)
        self.last_token = torch.zeros(self.max_requests, dtype=torch.int64, device=self.device)
        self.frame = torch.zeros(self.max_requests, dtype=torch.int64, device=self.device)
        self._index = PinnedStaging(1, self.max_requests, self.device)
        self._index_dev = torch.zeros(1, self.max_requests, dtype=torch.int64, device=self.device)
        self.acc = WorkerAccumulator([
            OutputKey("audio", Strategy.CONCAT_LAST, torch.float32, (), cadence=self.options.cadence,
                      initial_frames=16 * tk.FRAME_SAMPLES),
            OutputKey("codes", Strategy.CONCAT_DIM0, torch.int64, (tk.CODEBOOKS,), cadence=None, initial_frames=16),
        ], self.device, budget_bytes=self.options.pool_budget_bytes, max_requests=self.max_requests)
        self.requests: dict[str, _Request] = {}
        self._free_rows = list(range(self.max_requests - 1, -1, -1))
        self._pending: _StepOutput | None = None
        self.stats = {"steps": 0, "output_steps": 0, "host_bytes": 0, "samples": 0}
        self._upstream_copies = 0
        self._output_path_us: deque[float] = deque(maxlen=_HISTORY)  # the latest steps: a server runs for long
        self._step_starts: deque[float] = deque(maxlen=_HISTORY)
        self.first_chunk_at: dict[str, float] = {}  # request id (without vLLM's suffix) -> time.time()

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
        pass

    def take_draft_token_ids(self):
        return None

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def output_path_stats(self) -> dict:
        """What the output path cost: host time per step that had output (median, p99, mean, in
        us), device-to-host copies and their bytes, pool statistics (an RPC for the frontend)."""
        us = np.array(self._output_path_us or [0.0])
        steps = np.diff(self._step_starts) * 1e6 if len(self._step_starts) > 1 else np.zeros(1)
        copies = self.acc.copies if self.options.output_path == "worker" else self._upstream_copies
        return {**self.stats, "copies": copies, "device": str(self.device), "output_path": self.options.output_path,
                "output_path_us_median": float(np.median(us)), "output_path_us_p99": float(np.percentile(us, 99)),
                "output_path_us_mean": float(us.mean()), "step_us_median": float(np.median(steps)),
                "first_chunk_at": dict(self.first_chunk_at), "accumulator": _plain(self.acc.stats()),
                "requests_held": len(self.requests)}

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
            opened = self._update_requests(so)
            if so.total_num_scheduled_tokens == 0:
                return EMPTY_MODEL_RUNNER_OUTPUT
            req_ids = list(so.num_scheduled_tokens)
            sampling, ids = self._sampling_rows(so, req_ids)
            self._pending = self._run(req_ids, np.array(sampling, np.int64), ids, opened)
        return None

    def sample_tokens(self, grammar_output) -> _StepOutput:
        pending, self._pending = self._pending, None
        return pending

    def _update_requests(self, so) -> list[str]:
        for rid in so.finished_req_ids:  # finished or aborted: give everything back
            req = self.requests.pop(rid, None)
            if req is not None:
                self.acc.abort(rid)
                self._free_rows.append(req.row)
        opened = []
        for new in so.scheduled_new_reqs:
            prompt = new.prompt_token_ids or [0]
            params = new.sampling_params
            max_tokens = params.max_tokens if params is not None and params.max_tokens is not None else \
                self.max_model_len
            row = self._free_rows.pop()
            # a prefix-cache hit arrives as num_computed_tokens > 0
            self.requests[new.req_id] = _Request(row, len(prompt), max_tokens, computed=new.num_computed_tokens,
                                                 bad=self.options.bad_prompt_token in prompt)
            ids = torch.tensor(prompt, dtype=torch.int64)
            if self.device.type == "cuda":  # an asynchronous copy: the step never waits for the device
                ids = ids.pin_memory().to(self.device, non_blocking=True)
            self.context[row] = self.model.talker.prompt_context(ids)
            # device-side writes: a Python scalar assigned into a CUDA tensor is a blocking copy
            self.last_token[row:row + 1].copy_(ids[-1:])
            self.frame[row:row + 1].zero_()
            if self.options.output_path == "worker":
                kind = params.output_kind if params is not None else RequestOutputKind.FINAL_ONLY
                self.acc.add_request(new.req_id, _EMIT[kind])
                opened.append(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids and rid in self.requests:  # preempted, now recomputed
                self.requests[rid].computed = cached.num_computed_tokens[i]
        return opened

    def _sampling_rows(self, so, req_ids: list[str]) -> tuple[list[int], list[str]]:
        """Positions (in ``req_ids``) of the requests that sample a frame this step, and their ids."""
        sampling, ids = [], []
        for i, rid in enumerate(req_ids):
            req = self.requests.get(rid)
            if req is None:
                continue
            req.computed += so.num_scheduled_tokens[rid]
            if req.done or req.computed < req.prompt_len + req.produced:
                continue  # a prefill chunk, or a step scheduled past the request's last frame
            sampling.append(i)
            ids.append(rid)
        return sampling, ids

    def _run(self, req_ids: list[str], sampling: np.ndarray, ids: list[str], opened: list[str]) -> _StepOutput:
        B = len(ids)
        self.stats["steps"] += 1
        now = time.time()
        self._step_starts.append(now)
        if B == 0:
            return _StepOutput(req_ids, sampling, None, None, opened, {}, {})
        reqs = [self.requests[r] for r in ids]
        for r, rid in zip(reqs, ids):
            if r.produced == 0:
                self.first_chunk_at[rid.rsplit("-", 1)[0]] = now
        if len(self.first_chunk_at) > _HISTORY:  # a long-running server: keep the newest half
            for old in list(self.first_chunk_at)[:_HISTORY // 2]:
                del self.first_chunk_at[old]
        i, host = self._index.host()
        host[0, :B] = [r.row for r in reqs]
        rows = self._index.upload(i, 1, self._index_dev, cols=B)[0, :B]
        codes = self.model.talker(self.last_token[rows], self.frame[rows], self.context[rows])
        bad = [b for b, r in enumerate(reqs) if r.bad and r.produced == 1]
        finishing = []
        for r, rid in zip(reqs, ids):
            r.produced += 1
            if r.produced >= r.max_tokens or r.prompt_len + r.produced >= self.max_model_len:
                r.done = True
                finishing.append(rid)
        self.stats["samples"] += B * tk.FRAME_SAMPLES
        if self.options.output_path == "upstream":
            return self._run_upstream(req_ids, sampling, ids, opened, rows, codes, bad)
        tokens = self.acc.head(B, torch.int64)
        torch.add(codes[:, 0], tk.TEXT_VOCAB, out=tokens)
        audio = self._advance(rows, codes, tokens)
        t0 = time.perf_counter()
        with nvtx_range("worker.output_path"):
            chunks = {"audio": PaddedBatch(audio, np.full(B, tk.FRAME_SAMPLES, np.int64)),
                      "codes": PaddedBatch(codes.unsqueeze(1), np.ones(B, np.int64))}
            if bad:  # the malformed chunk of a test request: one request's audio of another dtype
                chunks["audio"] = [audio[b].double() if b in bad else audio[b] for b in range(B)]
            failed = self.acc.append(ids, chunks)
            packed = self.acc.collect(finishing, head_bytes=8 * B)
        for rid in failed:  # the scheduler finishes it with the error; it samples no more
            self.requests[rid].done = True
        self._note_output_path(t0, packed.host.numel() if packed is not None else 0)
        return _StepOutput(req_ids, sampling, packed, None, opened, failed, {})

    def _run_upstream(self, req_ids, sampling, ids, opened, rows, codes, bad) -> _StepOutput:
        """The comparison path: every key's batched output copied to the host each step (one blocking
        copy per key, as ``tensor.cpu()`` does) and sliced per request into plain per-step chunks."""
        tokens = codes[:, 0] + tk.TEXT_VOCAB
        audio = self._advance(rows, codes, tokens)
        t0 = time.perf_counter()
        with nvtx_range("worker.output_path"):
            tokens_cpu = tokens.cpu()
            audio_cpu, codes_cpu = audio.cpu(), codes.cpu()
            plain = {rid: {"audio": audio_cpu[b], "codes": codes_cpu[b:b + 1]} for b, rid in enumerate(ids)}
        if self.device.type == "cuda":
            self._upstream_copies += 3
        self._note_output_path(t0, audio_cpu.numel() * 4 + codes_cpu.numel() * 8 + tokens_cpu.numel() * 8)
        return _StepOutput(req_ids, sampling, None, tokens_cpu, opened, {}, plain)

    def _advance(self, rows: torch.Tensor, codes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The frame's audio, and the requests' state moved past it (last token, frame index)."""
        self.last_token[rows] = tokens
        audio = tk.decode_frames(codes, self.frame[rows])
        self.frame[rows] += 1
        return audio

    def _note_output_path(self, t0: float, nbytes: int) -> None:
        self._output_path_us.append((time.perf_counter() - t0) * 1e6)
        self.stats["output_steps"] += 1
        self.stats["host_bytes"] += nbytes


def _plain(stats: dict) -> dict:
    """Pool statistics as plain values (they cross the RPC as msgpack)."""
    return {**stats, "pools": {k: vars(v) for k, v in stats["pools"].items()}}


class TalkerExecutor(UniProcExecutor):
    """vLLM's one-process executor, running ``TalkerWorker`` (module docstring)."""

    def _init_executor(self) -> None:
        self.driver_worker = TalkerWorker(self.vllm_config)
