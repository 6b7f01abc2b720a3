"""Output types of the separated multimodal channel on vLLM (RFC parts I, IV, V): the runner's
output, vLLM's completion, pooling and request outputs carrying payloads, and ``OmniRequestOutput``,
one non-nestable shape for every stage."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from vllm.v1.outputs import ModelRunnerOutput

from ..errors import TensorAccumulationError
from ..modality import OutputModality
from ..payload import MultimodalPayload
from ..serving.worker_accumulator import PackedStep


def recast(base: Any, cls: type) -> Any:
    """``base`` itself, made an instance of its subclass ``cls`` (which adds only fields with class
    defaults): every field keeps its value, the subclass's read their defaults, and whoever else holds
    ``base`` sees the same object."""
    base.__class__ = cls
    return base


@dataclass
class OmniModelRunnerOutput(ModelRunnerOutput):
    """``ModelRunnerOutput`` with a dedicated multimodal channel: ``multimodal_outputs`` (request id
    -> ``{key: tensor or metadata}``, what a producer sends as plain per-step chunks), ``packed`` (the
    worker's data due this step, already on the host: ``PackedStep``), ``multimodal_opened``
    (requests whose output the worker started to hold this step), ``multimodal_errors`` (requests
    whose output the worker failed; the scheduler finishes them). ``pooler_output`` keeps vLLM's
    meaning: pooling tensors or None per request (``TypeError`` for anything else)."""

    multimodal_outputs: dict[str, dict[str, Any]] | None = None
    packed: PackedStep | None = None
    multimodal_opened: list[str] | None = None
    multimodal_errors: dict[str, TensorAccumulationError] | None = None

    def __post_init__(self):
        for value in self.pooler_output or ():
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"pooler_output carries pooling tensors only, got {type(value).__name__}; "
                                "multimodal data goes in multimodal_outputs")


@dataclass
class MultimodalCompletionOutput(CompletionOutput):
    """A ``CompletionOutput`` (every vLLM consumer accepts it) with the request's multimodal output
    per its output kind: DELTA what is new, CUMULATIVE everything so far, FINAL_ONLY everything at
    finish."""

    multimodal_output: MultimodalPayload | None = None


class MultimodalRequestOutput(RequestOutput):
    """vLLM's ``RequestOutput`` whose ``add`` (AsyncLLM merging DELTA outputs that the consumer has not
    read yet) merges the completions' multimodal payloads too (``MultimodalPayload.merge``), where
    vLLM's would keep only the first one's. Every other field and behaviour is vLLM's."""

    @classmethod
    def adopt(cls, base):
        """``base`` as this class (a ``PoolingRequestOutput`` is returned as it is)."""
        if not isinstance(base, RequestOutput) or isinstance(base, cls):
            return base
        return recast(base, cls)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        merged = {}
        if aggregate:
            mine = {c.index: c for c in self.outputs}
            for nxt in next_output.outputs:
                first = mine.get(nxt.index)
                later = getattr(nxt, "multimodal_output", None)
                if first is not None and later:
                    before = getattr(first, "multimodal_output", None)
                    merged[nxt.index] = before.merge(later) if before else later
        super().add(next_output, aggregate)
        for i, completion in enumerate(self.outputs):
            payload = merged.get(completion.index)
            if payload is None:
                continue
            if not isinstance(completion, MultimodalCompletionOutput):  # the first had no payload
                completion = self.outputs[i] = recast(completion, MultimodalCompletionOutput)
            completion.multimodal_output = payload


@dataclass(eq=False)  # vLLM's PoolingOutput equality (data only) is kept
class MultimodalPoolingOutput(PoolingOutput):
    """A ``PoolingOutput`` that also carries the multimodal output of a request with pooling params
    (a generation stage whose request ends with its pooling output)."""

    multimodal_output: MultimodalPayload | None = None


# vLLM's RequestOutput fields that an OmniRequestOutput reads from the output it wraps
_READ_THROUGH = frozenset(inspect.signature(RequestOutput.__init__).parameters) - {"self", "kwargs"}


@dataclass
class OmniRequestOutput:
    """The output of one request of one stage. Never nested: wrapping one returns it.

    ``request_output``: vLLM's ``RequestOutput`` / ``PoolingRequestOutput`` (engine stages);
    ``multimodal``: the payload of its multimodal completion output, if any; ``images``: diffusion
    results.
    """

    request_id: str
    finished: bool = True
    output_modality: OutputModality = OutputModality.TEXT
    request_output: RequestOutput | PoolingRequestOutput | None = None
    multimodal: MultimodalPayload | None = None
    images: list[Any] = field(default_factory=list)
    stage_id: int | None = None
    prompt: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.request_output, OmniRequestOutput):
            raise TypeError("OmniRequestOutput does not nest; use wrap_output")

    @classmethod
    def from_engine_output(cls, request_output: RequestOutput | PoolingRequestOutput, stage_id: int | None,
                           output_modality: OutputModality | str) -> OmniRequestOutput:
        """From an engine stage's output; ``multimodal`` is the first completion's payload."""
        modality = OutputModality.from_string(output_modality)
        multimodal, prompt = None, None
        if isinstance(request_output, PoolingRequestOutput) and isinstance(request_output.outputs,
                                                                           MultimodalPoolingOutput):
            multimodal = request_output.outputs.multimodal_output
        if isinstance(request_output, RequestOutput):
            prompt = request_output.prompt
            for completion in request_output.outputs:
                if isinstance(completion, MultimodalCompletionOutput) and completion.multimodal_output:
                    multimodal = completion.multimodal_output
                    break
        return cls(request_id=request_output.request_id, finished=request_output.finished,
                   output_modality=modality, request_output=request_output, multimodal=multimodal,
                   stage_id=stage_id, prompt=prompt)

    @classmethod
    def from_diffusion(cls, request_id: str, images: list[Any], *, stage_id: int | None = None, prompt: Any = None,
                       metrics: dict[str, Any] | None = None) -> OmniRequestOutput:
        """From a diffusion stage: images, finished, modality IMAGE (no inner output to wrap)."""
        return cls(request_id=request_id, finished=True, output_modality=OutputModality.IMAGE, images=list(images),
                   stage_id=stage_id, prompt=prompt, metrics=dict(metrics or {}))

    def __getattr__(self, name: str) -> Any:
        """The wrapped output's fields that this one has not (``prompt_token_ids``,
        ``num_cached_tokens``, ``kv_transfer_params``...: ``_READ_THROUGH``), so that code written for
        what vLLM's ``LLM.generate`` returns reads them here too (``metrics`` is this output's own).
        Its methods are not: ``add`` on the wrapped output would leave this one's fields behind."""
        inner = self.__dict__.get("request_output")
        if inner is None or name not in _READ_THROUGH:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    @property
    def text(self) -> str | None:
        if isinstance(self.request_output, RequestOutput) and self.request_output.outputs:
            return self.request_output.outputs[0].text
        return None

    @property
    def outputs(self) -> list:
        """The wrapped output's completion outputs (``outputs[0].multimodal_output``, as vLLM's
        ``RequestOutput`` has them; a pooling output's as a one-item list), or none."""
        inner = self.request_output
        if inner is None:
            return []
        return inner.outputs if isinstance(inner.outputs, list) else [inner.outputs]


def wrap_output(engine_output: RequestOutput | PoolingRequestOutput | OmniRequestOutput, stage_id: int | None,
                output_modality: OutputModality | str) -> OmniRequestOutput:
    """The one wrapping function of sync and async orchestration: an ``OmniRequestOutput`` is
    returned as it is (its stage id set), anything else is wrapped once."""
    if isinstance(engine_output, OmniRequestOutput):
        engine_output.stage_id = stage_id
        return engine_output
    return OmniRequestOutput.from_engine_output(engine_output, stage_id, output_modality)
