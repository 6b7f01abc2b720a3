"""``POST /v1/audio/speech`` on vLLM's API server: OpenAI's request shape, audio streamed as the
engine delivers it.

Request (JSON): ``model`` (optional; the served name), ``input`` (text, 1 to ``max_input_chars``
characters, all of them spoken: a special token's string is its characters), ``voice`` (one of the
model's voices), ``response_format`` (``wav`` or ``pcm``), ``speed`` (0.25 to 4.0: fewer codec
frames per character when faster), ``stream`` (default false), and this server's
``sample_format``: ``s16`` (16-bit signed little-endian, what OpenAI's ``pcm`` is; the default) or
``f32`` (the talker's float32 samples, bit for bit).

- ``stream: true``: chunked transfer; every DELTA span the engine delivers is written as it arrives
  (``pcm``: raw samples; ``wav``: a header of unknown length first, then samples).
- ``stream: false``: one complete file (the engine delivers the audio once, at the end: FINAL_ONLY).
- ``stream_format: "sse"`` (OpenAI's): the same spans as server-sent events, each
  ``{"type": "speech.audio.delta", "audio": <base64>}``, then ``{"type": "speech.audio.done",
  "usage": {...}}`` (prompt tokens in, codec frames out); it streams without ``stream``, and with
  ``stream: false`` it is a 400. The deltas' bytes are what ``stream: true`` would send.
- A client that disconnects aborts its request in the engine (its worker slots are freed); so does
  one that takes none of a stream's bytes for ``stall_s`` seconds, whose connection is closed (a
  whole file goes out the same way, so a client that reads none of it does not keep it in memory).
- Over ``max_inflight`` requests in flight: ``503`` with ``Retry-After``; nothing is queued. The same
  for a request that fails before its first audio because the engine's output memory cannot hold it
  (``OutputMemoryError``: the worker's ``pool_budget_bytes``, which a FINAL_ONLY request fills with
  all its audio until it finishes), for one that vLLM refuses as retryable (a paused engine), and
  for one the engine itself aborts before its first audio (its shutdown, a pause that aborts); each
  counts as turned away, not served. A whole file longer than the output memory could ever hold
  (``SpeechLimits.file_frames``) is a 400 before the engine runs it: no retry would hold it.
- Bad requests: ``400`` with an OpenAI-style error body naming the parameter; the engine is not touched.
  A body longer than any request could need (``SpeechLimits.max_body_bytes``) is a ``413`` as it arrives.
  OpenAI's ``instructions`` (how to speak) is one: the talker's voices take none, and a request that
  asks for a manner of speech is refused rather than served without it (empty or white space is no
  instruction). So is a character the model's tokenizer knows only as its unknown token.
- Headers: ``Content-Type``, ``X-Audio-Format``, ``X-Audio-Sample-Rate``, ``X-Audio-Sample-Format``,
  ``X-Audio-Channels``, ``X-Request-Id``.

A stream that fails after its first bytes (a worker error for this request, or the engine aborting
it) ends without the final chunk of the chunked encoding, so a client sees a truncated response,
never a short one that looks complete. ``GET /v1/audio/speech/stats`` reports the requests in
flight and how those that left ended (served, rejected, failed, cancelled: ``Admission``), the
worker's pools, and where each streamed request's time to first audio went (``FirstAudio``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import socket
import struct
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from http import HTTPStatus
from typing import Literal

import numpy as np
import torch
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from vllm import SamplingParams, envs
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, OpenAIBaseModel
from vllm.entrypoints.serve.utils.request_logger import RequestLogger
from vllm.entrypoints.serve.utils.api_utils import validate_json_request, with_cancellation
from vllm.exceptions import RetryableRequestError, VLLMError, VLLMServerError
from vllm.inputs.engine import tokens_input
from vllm.logger import init_logger
from vllm.tokenizers.registry import cached_tokenizer_from_config
from vllm.sampling_params import RequestOutputKind
from vllm.utils import random_uuid

from ..errors import MultimodalOutputError, OutputMemoryError, OutputTooLargeError
from ..serving import talker as tk
from ..serving.wav import pcm16, wav_header
from .llm import EngineShutDownError

logger = init_logger("vllm.omni_kernels.speech")  # under "vllm.": vLLM's handler prints it

FRAMES_PER_CHAR = 1.0  # codec frames (80 ms each) per input character at speed 1.0
MEDIA = {"wav": "audio/wav", "pcm": "audio/pcm"}


class SpeechFailedError(Exception):
    """A speech request failed in the engine (a worker error for this request); names it."""


class SpeechRequest(OpenAIBaseModel):
    """The request body. Values are taken as JSON types, never converted: ``"2"`` for ``speed`` or
    ``"true"`` / ``1`` for ``stream`` is a 400, as OpenAI's schema has it (an integer ``speed`` is a
    number)."""

    model: str | None = Field(default=None, strict=True)
    input: str = Field(strict=True)
    voice: str = Field(default="alloy", strict=True)
    response_format: str = Field(default="wav", strict=True)
    speed: float = Field(default=1.0, ge=0.25, le=4.0, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_format: Literal["audio", "sse"] = "audio"
    sample_format: Literal["s16", "f32"] = "s16"
    instructions: str | None = Field(default=None, strict=True)  # OpenAI's; refused when given (``_validate``)


@dataclasses.dataclass
class SpeechLimits:
    """The endpoint's configuration (``server.py``'s options)."""

    max_inflight: int = 64
    max_input_chars: int = 4096
    retry_after_s: int = 1
    stall_s: float = 60.0  # a response gives its request up when its client takes no bytes this long
    request_id_headers: bool = False  # vLLM's --enable-request-id-headers: its middleware sets X-Request-Id
    file_frames: int | None = None  # the most codec frames of a whole file the worker can hold (None: no bound)

    @property
    def max_body_bytes(self) -> int:
        """The longest body a request this route could serve has: ``max_input_chars`` characters of
        12 bytes each (a character beyond the BMP escaped in JSON as two ``\\uXXXX``), and 64 KiB
        for the other fields. A longer one is refused as it arrives (``_BodyLimitedRoute``)."""
        return 65536 + 12 * self.max_input_chars


class FirstAudio:
    """Where the time to first audio of the latest streamed requests went, in the server (seconds,
    wall clock; the engine's share from vLLM's request metrics):

    - ``admit``: from the handler's start to the request's arrival in vLLM's engine client
      (validation, tokenization, the other requests the event loop served meanwhile);
    - ``engine``: from that arrival to the first output in vLLM's output processor
      (``first_token_latency``: queueing, the steps, the wire);
    - ``deliver``: from there to the handler holding the output's audio;
    - ``respond``: from there to the first bytes handed to the HTTP server.

    (With ``--disable-log-stats`` vLLM keeps no request metrics: ``admit`` and ``engine`` are 0 and
    ``deliver`` holds both.)
    """

    PHASES = ("admit", "engine", "deliver", "respond", "total")

    def __init__(self, observe: bool = True):
        self._rows: deque[tuple[float, ...]] = deque(maxlen=4096)
        self._observe = observe  # into vLLM's /metrics too (``vllm_omni:speech_time_to_first_audio_seconds``)

    def note(self, received: float, out_at: float, written: float, metrics) -> None:
        if self._observe:
            _instruments()[2].observe(written - received)
        arrival = getattr(metrics, "arrival_time", 0.0) or received
        engine = getattr(metrics, "first_token_latency", 0.0) or 0.0
        admit = max(arrival - received, 0.0)
        self._rows.append((admit, engine, max(out_at - received - admit - engine, 0.0), written - out_at,
                           written - received))

    def summary(self) -> dict:
        """p50 and p99 of every phase in ms, over the kept requests (``count``)."""
        if not self._rows:
            return {"count": 0}
        a = np.array(self._rows) * 1e3
        return {"count": len(a), **{f"{name}_ms_p{q}": float(np.percentile(a[:, i], q))
                                    for i, name in enumerate(self.PHASES) for q in (50, 99)}}


TTFA_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)  # seconds


@functools.cache
def _instruments():
    """The route's Prometheus instruments, made once per process in the default registry, which
    vLLM's ``/metrics`` serves (with several API server processes, through its multiprocess
    collector: their sum)."""
    from prometheus_client import Counter, Histogram

    return (Counter("vllm_omni:speech_requests", "Speech requests by how they ended: served, rejected "
                    "(turned away before they ran), failed, cancelled (the client left).", ["outcome"]),
            Counter("vllm_omni:speech_audio_seconds", "Seconds of audio the speech route took from the engine "
                    "for its responses."),
            Histogram("vllm_omni:speech_time_to_first_audio_seconds", "Streamed speech requests: from the "
                      "request's arrival to its first audio handed to the HTTP server.", buckets=TTFA_BUCKETS))


class Admission:
    """At most ``limit`` speech requests in flight, and how those that left ended (``OUTCOMES``):
    served (the whole response handed to the HTTP server), rejected (turned away before it ran:
    over the bound, no output memory before its first audio, or refused by vLLM), failed (an
    engine error) or cancelled (the client left first). The counts are this process's, or
    ``shared``: a ``multiprocessing`` int64 array ``[inflight, *OUTCOMES]`` with its lock, which
    the API server processes of one server share (``server.serve_multi``); they also go to vLLM's
    ``/metrics``. While ``counting`` is False (the server's own warm-up requests) only the bound is
    kept."""

    OUTCOMES = ("rejected", "served", "failed", "cancelled")

    def __init__(self, limit: int, shared=None):
        self.limit = limit
        self.counting = True
        self._counts = shared if shared is not None else [0] * (1 + len(self.OUTCOMES))
        self._lock = shared.get_lock() if shared is not None else contextlib.nullcontext()

    inflight = property(lambda self: self._counts[0])

    def counts(self) -> dict[str, int]:
        """Every outcome's count."""
        with self._lock:
            return dict(zip(self.OUTCOMES, self._counts[1:]))

    def try_acquire(self) -> bool:
        with self._lock:
            if self._counts[0] >= self.limit:
                self._count("rejected")
                return False
            self._counts[0] += 1
            return True

    def release(self, outcome: str = "served", audio_seconds: float = 0.0) -> None:
        """A request in flight is done, with one of ``OUTCOMES``, having sent ``audio_seconds``."""
        with self._lock:
            self._counts[0] -= 1
            self._count(outcome)
        if self.counting and audio_seconds:
            _instruments()[1].inc(audio_seconds)

    def _count(self, outcome: str) -> None:
        if self.counting:
            self._counts[1 + self.OUTCOMES.index(outcome)] += 1
            _instruments()[0].labels(outcome=outcome).inc()


def samples_bytes(audio: torch.Tensor, sample_format: str) -> bytes:
    """Float samples as little-endian bytes: 16-bit PCM (``serving.wav.pcm16``) or float32."""
    a = np.asarray(audio.numpy(), np.float32).reshape(-1)
    return pcm16(a) if sample_format == "s16" else a.astype("<f4").tobytes()


# A piece of more samples than this is converted in a thread (numpy lets the event loop run meanwhile):
# a whole file's or a slow reader's merged piece takes tens of milliseconds, which every other
# stream of the process would wait.
_LOOP_SAMPLES = 1 << 16


async def _samples_bytes(audio: torch.Tensor, sample_format: str) -> bytes:
    if audio.numel() > _LOOP_SAMPLES:
        return await asyncio.to_thread(samples_bytes, audio, sample_format)
    return samples_bytes(audio, sample_format)


class SpeechStream:
    """One request's engine stream and the slot it holds in ``Admission``; ``close()`` (idempotent)
    aborts the engine request if it has not finished and releases the slot, whatever happened to
    the HTTP response (a client gone before the body started included)."""

    def __init__(self, engine, admission: Admission, request_id: str, gen, sample_format: str, received: float):
        self.engine, self.admission, self.request_id, self.gen = engine, admission, request_id, gen
        self.load = None  # the app state whose server load counts this stream until it closes (create_speech)
        self.sample_format = sample_format
        self.received = received  # time.time() when the handler started
        self.first_metrics = None  # vLLM's request metrics and the time, at the first output with audio
        self.first_at = 0.0
        self.finished = False
        self.turned_away = False  # the engine let it go before its first audio, and a retry can be served (a 503):
        #                           no output memory, vLLM's retryable refusal (paused), the engine's own abort
        self.failed = False  # the engine failed it
        self.too_large = False  # before its first audio, as more than the output memory ever holds for one (a 400)
        self.delivered = False  # the whole response was handed to the HTTP server
        self.samples = 0  # audio samples handed to the response so far
        self.output_tokens = 0  # codec frames the engine produced for it so far
        self.output_logger: RequestLogger | None = None  # vLLM's, with --enable-log-outputs: logs how it ended
        self._closed = False

    async def next_audio(self) -> tuple[bytes | None, bool]:
        """The next output's audio samples as bytes of the stream's sample format (None when it has
        none) and whether it was the last."""
        try:
            out = await anext(self.gen)
        except (MultimodalOutputError, VLLMServerError) as exc:
            self.finished = self.failed = True  # the engine has let the request go
            # (vLLM's RetryableRequestError, a paused engine's say, is a 503 as vLLM's routes answer it,
            # and so is the end of a request in flight when the server stops: another can serve it)
            self.turned_away = isinstance(exc, (OutputMemoryError, RetryableRequestError, EngineShutDownError)) \
                and not self.first_at
            self.too_large = isinstance(exc, OutputTooLargeError) and not self.first_at
            detail = str(exc)
            if isinstance(exc, MultimodalOutputError):  # its reason and key, without the request's name again
                detail = exc.reason if exc.key is None else f"key {exc.key!r}: {exc.reason}"
            named = f"request {self.request_id}"
            raise SpeechFailedError(detail if detail.startswith(named) else f"{named} failed in the engine: {detail}") \
                from exc
        except VLLMError:  # vLLM refused it (its client errors, a full queue): its handlers answer
            self.finished = True
            self.turned_away = not self.first_at
            self.failed = not self.turned_away
            raise
        if out.finished:  # let vLLM's generate return: left suspended, it would be closed later as if
            await anext(self.gen, None)  # its client had gone, and vLLM would log a served request aborted
        comp = out.outputs[0]
        if comp.finish_reason in ("error", "abort"):
            # An abort here is the engine's own (its shutdown, a pause that aborts, ...): this route's
            # abort closes the stream and reads no further. The audio is not whole: before any of it,
            # a 503 (a retry can be served); after, a stream cut visibly.
            self.finished = self.failed = True
            self.turned_away = comp.finish_reason == "abort" and not self.first_at
            what = "was aborted by the engine" if comp.finish_reason == "abort" else "failed in the engine"
            why = "" if comp.stop_reason is None else f": {comp.stop_reason}"
            raise SpeechFailedError(f"request {self.request_id} {what}{why}")
        payload = getattr(comp, "multimodal_output", None)
        audio = None if payload is None else payload.tensors.get("audio")
        self.finished = out.finished
        self.output_tokens += len(comp.token_ids)
        if audio is None:
            return None, out.finished
        if not self.first_at:
            self.first_at, self.first_metrics = time.time(), out.metrics
        self.samples += audio.numel()
        return (await _samples_bytes(audio, self.sample_format) if audio.numel() else None), out.finished

    @property
    def outcome(self) -> str:
        """How the request ended, as ``Admission`` counts it (a response that closed before all of
        it was handed over: its client left)."""
        return "rejected" if self.turned_away or self.too_large else "failed" if self.failed else \
            "served" if self.delivered else "cancelled"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        outcome = self.outcome
        try:
            if not self.finished:
                await self.gen.aclose()  # vLLM's generate aborts the request on GeneratorExit
                await self.engine.abort(self.request_id)
        finally:
            self.admission.release(outcome, self.samples / tk.SAMPLE_RATE)
            if self.output_logger is not None:
                self.output_logger.log_outputs(self.request_id, f"{self.samples} samples of audio", None, outcome)
            if self.load is not None:
                self.load.server_load_metrics -= 1


class _ClientStalled(Exception):
    pass


# The connection of the request a task serves (its transport), where ``DroppableHTTP`` serves it.
_CONNECTION: contextvars.ContextVar[asyncio.Transport | None] = contextvars.ContextVar("omni_speech_connection",
                                                                                      default=None)


class DroppableHTTP(AutoHTTPProtocol):
    """uvicorn's HTTP protocol (the one its ``http="auto"`` picks) whose requests know their
    connection, so that a response whose client stopped reading can drop it (``_drop_connection``):
    uvicorn closes the connection of a response left incomplete, and a close waits for the unsent
    bytes to go, which a client that reads nothing never lets happen (its socket and buffers stayed
    for as long as it kept the connection open)."""

    def connection_made(self, transport) -> None:
        self._omni_transport = transport
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        _CONNECTION.set(self._omni_transport)  # (a request's task, made in this call, copies the context)
        super().data_received(data)


def _drop_connection() -> None:
    """Reset the current request's connection (``DroppableHTTP``): closed at once, its unsent bytes
    dropped. Nothing where the request came some other way (in process, the server's warm-up)."""
    transport = _CONNECTION.get()
    if transport is None or transport.is_closing():  # (its client has gone meanwhile)
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # a linger of 0: the socket's close resets the connection
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _end_incomplete(stall_s: float) -> None:
    """End the current request's response where it is (``DroppableHTTP``): the bytes sent so far
    go out, then the connection closes, and every later write to it is dropped, so the body never
    gets its end (the last chunk) and the client cannot take it for complete, whatever runs between
    the route and the HTTP server (a middleware of the function form ends a body that its app left
    open). A connection whose client takes none of those bytes for ``stall_s`` seconds is reset."""
    transport = _CONNECTION.get()
    if transport is None:
        return
    deadline = time.monotonic() + stall_s
    while transport.get_write_buffer_size() and not transport.is_closing():  # (a write now would go out)
        if time.monotonic() > deadline:
            _drop_connection()
            return
        await asyncio.sleep(0.005)
    transport.close()  # (nothing left unsent: the transport drops what is written from here on)
    await asyncio.sleep(0)  # (the HTTP server learns of the close before the route returns: no error logged)


# A streamed response's bytes go to the HTTP server at most this many at a time: the server takes
# each once the client has made room for the one before (its buffer past 64 KiB waits), so a send
# waits for about this many bytes of the client's reading, not for a whole merged span of audio.
# A server-sent event carries at most this many bytes of audio too (87 KiB as base64): a span
# merged while its client was behind (minutes of audio, megabytes) is many events, not one line
# past what SSE clients read as one (aiohttp's: 512 KiB). Whole samples each: 64 KiB and a wav
# header's 44 bytes are whole samples of either sample format.
_SEND_BYTES = 1 << 16


class _ClosingStreamingResponse(StreamingResponse):
    """A streamed response (or a whole file, sent the same way) that closes its ``SpeechStream``
    however the response ends (its body marks the stream delivered after its last piece was sent).
    A client that takes none of the next bytes for ``stall_s`` seconds (its connection open,
    nothing read: the HTTP server's send waits for room) loses its stream: the request is aborted
    (if it still runs), its slot given back, and the connection reset (``_drop_connection``), so that
    stalled clients cannot hold the server's slots, nor its sockets. The body goes out
    ``_SEND_BYTES`` at a time, and the server's connections keep little unsent in the kernel
    (``server.pace_sends``), so a client that plays the audio as it comes makes room for the next
    send within a few seconds of audio, however far ahead of it the engine is."""

    def __init__(self, stream: SpeechStream, body, stall_s: float, **kwargs):
        super().__init__(body, **kwargs)
        self.stream = stream
        self._stall_s = stall_s

    async def __call__(self, scope, receive, send) -> None:
        async def send_unless_stalled(message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_s)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await super().__call__(scope, receive, send_unless_stalled)
        except _ClientStalled:
            logger.warning("speech response %s: its client took no bytes for %g s; the response and its connection "
                           "are dropped (and the request aborted if it still runs)", self.stream.request_id,
                           self._stall_s)
            _drop_connection()
        except SpeechFailedError:  # logged by the body (raised on, it would log the route's frames)
            await _end_incomplete(self._stall_s)
        finally:
            await self.stream.close()


def _error(message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
           err_type: str = "BadRequestError", headers: dict | None = None) -> JSONResponse:
    err: ErrorResponse = create_error_response(message, err_type=err_type, status_code=status, param=param)
    return JSONResponse(err.model_dump(), status_code=err.error.code, headers=headers)


def _unavailable(message: str, limits: SpeechLimits) -> JSONResponse:
    """503 with ``Retry-After``: the request was turned away, nothing was queued."""
    return _error(message, status=HTTPStatus.SERVICE_UNAVAILABLE, err_type="ServiceUnavailableError",
                  headers={"Retry-After": str(limits.retry_after_s)})


def _voices(engine) -> dict[str, int]:
    return dict(getattr(engine.model_config.hf_config, "voices", None) or {})


def _validate(request: SpeechRequest, raw_request: Request, limits: SpeechLimits) -> JSONResponse | None:
    state = raw_request.app.state
    engine = state.engine_client
    if request.model and not envs.VLLM_SKIP_MODEL_NAME_VALIDATION and \
            not state.openai_serving_models.is_base_model(request.model):  # (as vLLM's routes check it)
        return _error(f"The model {request.model!r} does not exist.", "model", HTTPStatus.NOT_FOUND, "NotFoundError")
    if request.response_format not in MEDIA:
        return _error(f"response_format {request.response_format!r} is not supported; use one of "
                      f"{sorted(MEDIA)}", "response_format")
    voices = _voices(engine)
    if request.voice not in voices:
        return _error(f"voice {request.voice!r} is not one of this model's voices {sorted(voices)}", "voice")
    if request.instructions and not request.instructions.isspace():
        return _error("this model speaks its voices as they are and takes no instructions; leave instructions out",
                      "instructions")
    if len(request.input) > limits.max_input_chars:  # (first: the checks below read every character)
        return _error(f"input has {len(request.input)} characters; at most {limits.max_input_chars}", "input")
    try:
        request.input.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" is valid JSON): no text to speak
        return _error(f"input is not valid text: {exc.reason} at character {exc.start}", "input")
    if not any(ch.isprintable() and not ch.isspace() for ch in request.input):  # (control, format characters)
        return _error("input must not be empty: it has no character to speak", "input")
    return None


_TOO_LARGE_HINT = "stream it (stream true) or send less"  # a 400 for audio the output memory never holds


class UnspokenInputError(ValueError):
    """Input the model's tokenizer does not take as it is: a character it knows only as its unknown
    token (which every such character would be spoken as, alike)."""


def plan_request(tokenizer, voice_token: int, text: str, speed: float = 1.0) -> tuple[list[int], int]:
    """The prompt (the voice's token, then the text's) and the number of codec frames to speak. The
    input is all text: a special token's string in it (``"</s>"``, ``"[PAD]"``) is spoken as the
    characters it is, never taken for the token (a client cannot put control tokens in a prompt).
    ``UnspokenInputError`` for a character the tokenizer knows only as its unknown token."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is not None and unknown in ids:
        at = ids.index(unknown)
        what = f"token {at}"
        if getattr(tokenizer, "is_fast", False):  # where in the text it is
            start, end = tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                                   return_offsets_mapping=True)["offset_mapping"][at]
            what = f"character {text[start]!r} (U+{ord(text[start]):04X}) at {start}" if end == start + 1 else \
                f"text {text[start:end]!r} at {start}"
        raise UnspokenInputError(f"input's {what} is not in this model's vocabulary (its unknown token would be "
                                 "spoken for it, as for any other such character)")
    return _plan(voice_token, ids, speed)


class TextTokenizer:
    """The route's tokenizer: the model's, loaded by vLLM's loader with special-token strings split
    (``plan_request``; set at load, since a per-call setting changes the tokenizer's state for every
    thread that shares it, vLLM's renderer's among them), on a thread of its own: a long input
    (milliseconds) holds up no other stream of the event loop."""

    def __init__(self, model_config):
        self.tokenizer = cached_tokenizer_from_config(model_config, split_special_tokens=True)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-speech-tokenizer")

    async def plan(self, voice_token: int, text: str, speed: float = 1.0) -> tuple[list[int], int]:
        """``plan_request`` on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, plan_request, self.tokenizer, voice_token, text, speed)


def _plan(voice_token: int, ids: list[int], speed: float) -> tuple[list[int], int]:
    return [voice_token, *ids], max(1, speech_frames(len(ids), speed))


def speech_frames(chars: int, speed: float) -> int:
    """Codec frames for ``chars`` characters at ``speed``, in exact arithmetic on the decimal values
    as written (145 characters at 0.29 are 500 frames; in floats, 145 / 0.29 is a little over 500)."""
    return math.ceil(chars * Fraction(str(FRAMES_PER_CHAR)) / Fraction(str(speed)))


def _headers(request: SpeechRequest, request_id: str, ids_by_vllm: bool) -> dict[str, str]:
    """The response's headers: the audio's format, and the request's name unless vLLM's
    ``--enable-request-id-headers`` middleware sets X-Request-Id (the client's, or one of its own)."""
    return {**({} if ids_by_vllm else {"X-Request-Id": request_id}), "X-Audio-Format": request.response_format,
            "X-Audio-Sample-Rate": str(tk.SAMPLE_RATE), "X-Audio-Sample-Format": f"{request.sample_format}le",
            "X-Audio-Channels": "1"}


class _BodyLimitedRoute(APIRoute):
    """FastAPI's route, refusing a request whose body is longer than any the speech route serves
    (``SpeechLimits.max_body_bytes``) with 413 as it arrives: the route takes no more of it than
    that and parses none of it (the HTTP server discards the rest), where a body of hundreds of
    megabytes, gathered and parsed on the event loop, would hold up every stream the process serves
    for seconds. A declared length says so before any of the body is taken; a body sent in chunks
    is counted as it is taken (an ``HTTPException``, which FastAPI raises on from its body reading
    and vLLM's handler answers)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def limited(request: Request) -> Response:
            limit = request.app.state.omni_speech_limits.max_body_bytes
            message = f"the request body is longer than the {limit} bytes a speech request can need"
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                too_large = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
                return _error(message, status=too_large, err_type=too_large.phrase)
            got = 0

            async def counted():
                nonlocal got
                received = await request.receive()
                got += len(received.get("body", b""))
                if got > limit:
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE.value, message)
                return received

            return await handler(Request(request.scope, counted))

        return limited


router = APIRouter(route_class=_BodyLimitedRoute)


@router.post("/v1/audio/speech", dependencies=[Depends(validate_json_request)],
             responses={HTTPStatus.OK.value: {"content": {"audio/wav": {}, "audio/pcm": {}, "text/event-stream": {}}},
                        HTTPStatus.BAD_REQUEST.value: {"model": ErrorResponse},
                        HTTPStatus.SERVICE_UNAVAILABLE.value: {"model": ErrorResponse}})
@with_cancellation
async def create_speech(request: SpeechRequest, raw_request: Request):
    """The route, counted in vLLM's server load (``--enable-server-load-tracking``, ``/load``) as
    its ``load_aware_call`` counts its own routes: from the start until the response is sent (a
    stream: until it closes, however it ends); a request whose client left while the handler ran is
    counted off by vLLM's disconnect listener."""
    state = raw_request.app.state
    load = state if getattr(state, "enable_server_load_tracking", False) else None
    if load is None:
        return await _speech(request, raw_request)
    load.server_load_metrics = getattr(load, "server_load_metrics", 0) + 1
    response = None
    try:
        response = await _speech(request, raw_request)
    except asyncio.CancelledError:  # its client left: vLLM's listener counted it off
        load = None
        raise
    finally:
        if load is not None:
            if isinstance(response, _ClosingStreamingResponse):
                response.stream.load = load
            else:
                load.server_load_metrics -= 1
    return response


async def _speech(request: SpeechRequest, raw_request: Request) -> Response:
    received = time.time()
    state = raw_request.app.state
    limits: SpeechLimits = state.omni_speech_limits
    admission: Admission = state.omni_speech_admission
    if (bad := _validate(request, raw_request, limits)) is not None:
        return bad
    engine = state.engine_client
    try:
        prompt, frames = await state.omni_speech_text.plan(_voices(engine)[request.voice], request.input,
                                                           request.speed)
    except UnspokenInputError as exc:
        return _error(str(exc), "input")
    if len(prompt) + frames > engine.model_config.max_model_len:
        return _error(f"input needs {len(prompt) + frames} positions at speed {request.speed}; this model serves "
                      f"{engine.model_config.max_model_len}", "input")
    streamed = request.stream or request.stream_format == "sse"
    if request.stream_format == "sse" and "stream" in request.model_fields_set and not request.stream:
        return _error("stream_format 'sse' streams the audio; stream false asks for one file", "stream")
    if not streamed and limits.file_frames is not None and frames > limits.file_frames:
        # (the worker holds a whole file's audio until it ends: a retry would fail the same way)
        seconds = lambda n: n * tk.FRAME_SAMPLES / tk.SAMPLE_RATE  # noqa: E731
        return _error(f"input makes {seconds(frames):g} s of audio at speed {request.speed}; this server's audio "
                      f"memory holds at most {seconds(limits.file_frames):g} s of one file: {_TOO_LARGE_HINT}",
                      "input")
    if not admission.try_acquire():
        return _unavailable(f"{admission.inflight} speech requests in flight, the most this server takes; "
                            "retry later", limits)
    # as vLLM's routes, named after the client's X-Request-Id when it sends one (and unique: an
    # abort by this name must not reach another request that came with the same header)
    client_id = raw_request.headers.get("X-Request-Id")
    request_id = f"speech-{random_uuid()}" if client_id is None else f"speech-{client_id}-{random_uuid()[:8]}"
    kind = RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY
    # made for this request alone, so vLLM's engine need not deep-copy it (as its chat route does)
    params = SamplingParams(max_tokens=frames, output_kind=kind, detokenize=False, skip_clone=True)
    request_logger = state.serving_tokenization.request_logger  # vLLM's routes' one (--enable-log-requests)
    if request_logger is not None:  # (as vLLM's routes log theirs)
        request_logger.log_inputs(request_id, request.input, prompt, None, params, None)
    stream = SpeechStream(engine, admission, request_id,
                          engine.generate(tokens_input(prompt), params, request_id=request_id),
                          request.sample_format, received)
    if request_logger is not None and getattr(state.args, "enable_log_outputs", False):
        stream.output_logger = request_logger
    handed_over = False
    try:
        response = await _respond(stream, request, streamed, state.omni_speech_first_audio, limits, len(prompt))
        handed_over = isinstance(response, _ClosingStreamingResponse)
        return response
    finally:
        if not handed_over:
            await stream.close()


def _failed(exc: SpeechFailedError, stream: SpeechStream, limits: SpeechLimits) -> Response:
    """A request that failed before its response started: 503 with ``Retry-After`` when it was
    turned away (``SpeechStream.turned_away``), 400 when it asks for more than the output memory
    ever holds for one (no retry would be served), else 500."""
    if stream.turned_away:
        return _unavailable(f"{exc}; retry later", limits)
    if stream.too_large:
        return _error(f"{exc}: {_TOO_LARGE_HINT}", "input")
    return _error(str(exc), status=HTTPStatus.INTERNAL_SERVER_ERROR, err_type="InternalServerError")


async def _respond(stream: SpeechStream, request: SpeechRequest, streamed: bool, first_audio: FirstAudio,
                   limits: SpeechLimits, prompt_tokens: int) -> Response:
    """Wait for all the audio (one file) or, ``streamed``, its first piece (a failure until then is
    still a JSON error), then stream the rest: the bytes as they are, or as server-sent events
    (``stream_format`` "sse")."""
    pieces, finished = [], False
    try:
        while not finished and not (streamed and pieces):
            piece, finished = await stream.next_audio()
            if piece:
                pieces.append(piece)
    except SpeechFailedError as exc:
        return _failed(exc, stream, limits)
    f32 = request.sample_format == "f32"
    headers = _headers(request, stream.request_id, limits.request_id_headers)

    async def sent(body):  # resumed after its last yield only once the server has sent that piece
        async for piece in body:
            for at in range(0, len(piece), _SEND_BYTES):
                yield piece[at:at + _SEND_BYTES]
        stream.delivered = True

    if not streamed:  # one file of known length, sent as a stream is (a client that takes none of it is let go)
        if request.response_format == "wav":
            pieces.insert(0, wav_header(tk.SAMPLE_RATE, float32=f32, data_bytes=sum(map(len, pieces))))

        async def whole():
            for piece in pieces:
                yield piece

        return _ClosingStreamingResponse(stream, sent(whole()), limits.stall_s,
                                         media_type=MEDIA[request.response_format],
                                         headers={**headers, "Content-Length": str(sum(map(len, pieces)))})
    first = b"".join(pieces)  # (at most one)
    if request.response_format == "wav":
        first = wav_header(tk.SAMPLE_RATE, float32=f32) + first

    async def audio():
        if first:
            if stream.first_at:  # (a wav header alone is no audio: a request that ended with none)
                first_audio.note(stream.received, stream.first_at, time.time(), stream.first_metrics)
            yield first
        done = finished
        while not done:
            try:
                piece, done = await stream.next_audio()
            except SpeechFailedError as exc:  # (its message says why; the response closes the stream)
                logger.error("%s after %d samples of audio; the response is cut", exc, stream.samples)
                raise
            if piece:
                yield piece

    async def events():  # a piece in events of at most _SEND_BYTES of audio each (see _SEND_BYTES)
        async for piece in audio():
            for at in range(0, len(piece), _SEND_BYTES):
                delta = base64.b64encode(piece[at:at + _SEND_BYTES]).decode("ascii")
                yield _event({"type": "speech.audio.delta", "audio": delta})
        usage = {"input_tokens": prompt_tokens, "output_tokens": stream.output_tokens,
                 "total_tokens": prompt_tokens + stream.output_tokens}
        yield _event({"type": "speech.audio.done", "usage": usage})

    if request.stream_format == "sse":
        return _ClosingStreamingResponse(stream, sent(events()), limits.stall_s, media_type="text/event-stream",
                                         headers={**headers, "Cache-Control": "no-cache"})
    return _ClosingStreamingResponse(stream, sent(audio()), limits.stall_s, media_type=MEDIA[request.response_format],
                                     headers=headers)


def _event(data: dict) -> bytes:
    """One server-sent event carrying ``data`` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


@router.get("/v1/audio/speech/stats")
async def speech_stats(raw_request: Request) -> JSONResponse:
    """Admission counters (of every API server process), the most frames of a whole file
    (``SpeechLimits.file_frames``), the answering process's index and the first-audio phases of the
    streamed requests it served (``FirstAudio``; ``?reset=1`` clears them after reading), and the
    worker's output-path and pool statistics."""
    state = raw_request.app.state
    admission: Admission = state.omni_speech_admission
    worker = (await state.engine_client.collective_rpc("output_path_stats"))[0]
    first_audio: FirstAudio = state.omni_speech_first_audio
    phases = first_audio.summary()
    if raw_request.query_params.get("reset") == "1":
        state.omni_speech_first_audio = FirstAudio()
    return JSONResponse({"inflight": admission.inflight, "max_inflight": admission.limit, **admission.counts(),
                         "file_frames": state.omni_speech_limits.file_frames,
                         "api_server": dict(zip(("index", "count"), state.omni_api_server)), "first_audio": phases,
                         "worker": worker})


async def warm_up_route(app, api_key: str | None = None) -> None:
    """One streamed and one whole-file speech request through the app itself (in process, no
    socket) before it serves, so that the first clients do not pay for what runs once per process
    on first use; the engine was warmed already (``llm.warm_up``). They count neither in
    ``Admission`` nor in ``FirstAudio``, and speak one character in the model's first voice, with
    ``api_key`` when the server asks for one. A 400 (the server's limits: a model without voices,
    say) is logged and ends the warm-up, as it shows the route running; so does a 503 (other API
    server processes warming under the same bound)."""
    import httpx

    voice = next(iter(_voices(app.state.engine_client)), "")
    body = {"input": "a", "voice": voice, "response_format": "pcm", "stream": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    admission: Admission = app.state.omni_speech_admission
    admission.counting = False
    app.state.omni_speech_first_audio = FirstAudio(observe=False)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up",
                                     headers=headers, timeout=120) as client:
            for payload in (body, {**body, "stream": False}):
                r = await client.post("/v1/audio/speech", json=payload)
                if r.status_code == HTTPStatus.SERVICE_UNAVAILABLE:
                    logger.info("speech route warm-up skipped: the bound is taken by other API server processes")
                    break
                if r.status_code == HTTPStatus.BAD_REQUEST:
                    logger.warning("speech route warm-up refused by this server's limits: %s", r.text[:500])
                    break
                if HTTPStatus.BAD_REQUEST < r.status_code < HTTPStatus.INTERNAL_SERVER_ERROR:  # (a middleware's)
                    logger.warning("speech route warm-up answered %d by this server's middleware: skipped, the "
                                   "first requests pay for what it would have run: %s", r.status_code, r.text[:500])
                    break
                if r.status_code != HTTPStatus.OK:
                    raise RuntimeError(f"the speech route's warm-up request failed ({r.status_code}): {r.text[:500]}")
    finally:
        admission.counting = True
        app.state.omni_speech_first_audio = FirstAudio()


def install(app, model_config, limits: SpeechLimits, shared_counts=None, api_server: tuple[int, int] = (0, 1)) -> None:
    """Add the speech routes to vLLM's app (after ``build_app``) and their state for the engine's
    model (``model_config``: its tokenizer; ``shared_counts``: the admission counts the server's API
    server processes share, as ``Admission`` takes them; ``api_server``: this process's index among
    them, and their number)."""
    app.include_router(router)
    app.state.omni_speech_text = TextTokenizer(model_config)
    app.state.omni_api_server = api_server
    app.state.omni_speech_limits = limits
    app.state.omni_speech_admission = Admission(limits.max_inflight, shared_counts)
    app.state.omni_speech_first_audio = FirstAudio()
    requests = _instruments()[0]  # on /metrics from the start, every outcome at 0
    for outcome in Admission.OUTCOMES:
        requests.labels(outcome=outcome)


__all__ = ["DroppableHTTP", "SpeechFailedError", "SpeechLimits", "SpeechRequest", "TextTokenizer",
           "UnspokenInputError", "install", "plan_request", "router", "samples_bytes", "speech_frames", "warm_up_route"]
