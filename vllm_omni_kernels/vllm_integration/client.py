"""Engine-core clients that receive the multimodal channel, built by ``OmniLLM``/``OmniAsyncLLM``:
``OmniSyncMPClient``, ``OmniAsyncMPClient`` (the engine core in its own process) and
``OmniInprocClient``; and ``EngineShutDownError``.

vLLM's multiprocess clients decode with ``MsgpackDecoder(EngineCoreOutputs)``, which drops the
multimodal fields, and their output thread or task takes the decoder during construction: one set
on a built client is never used. ``OmniDecoding`` sits between vLLM's clients and ``MPClient`` and
sets ``OmniMsgpackDecoder`` as soon as ``MPClient.__init__`` made vLLM's.
"""

from __future__ import annotations

import asyncio
import time

from vllm.v1.engine.core_client import AsyncMPClient, InprocClient, MPClient, SyncMPClient
from vllm.v1.engine.exceptions import EngineDeadError

from .wire import OmniEngineCoreOutputs, OmniMsgpackDecoder, as_omni_outputs, resolve_regions, resolve_token_times


class EngineShutDownError(EngineDeadError):
    """What a request gets once its engine was shut down: one still in flight (nothing more can come
    for it; an engine that died gives vLLM's ``EngineDeadError``), or one sent afterwards. vLLM's
    ``generate`` raises it as it raises ``EngineDeadError``, sending no abort; after vLLM's own
    shutdown such a request's caller waited forever. The speech route answers it as a request the
    engine let go of: 503 before the request's first audio."""

    ENGINE_DEAD_MESSAGE = "the engine was shut down: the requests in flight and any sent since are not served"


class OmniDecoding(MPClient):
    """``MPClient`` whose decoder is ``OmniMsgpackDecoder`` before any thread or task can take it."""

    decoder: OmniMsgpackDecoder

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoder = OmniMsgpackDecoder()


class OmniSyncMPClient(SyncMPClient, OmniDecoding):
    """vLLM's ``SyncMPClient`` (``LLMEngine``'s) decoding the multimodal channel. Once it is shut
    down, which vLLM's monitor does when the engine core dies, a caller waiting for outputs, and
    every later one, gets the error (``EngineShutDownError``, or vLLM's ``EngineDeadError`` for an
    engine that died): vLLM's output thread stops without a word, and ``get_output`` waited forever."""

    _ended: EngineDeadError | None = None

    def shutdown(self, timeout: float | None = None) -> None:
        died = self.resources.engine_dead  # (vLLM's monitor marks it before it shuts the client down)
        try:
            super().shutdown(timeout)
        finally:
            if self._ended is None:
                self._ended = EngineDeadError(suppress_context=True) if died else EngineShutDownError()
                self.outputs_queue.put_nowait(self._ended)  # (wakes a caller waiting)

    def get_output(self):
        if self._ended is not None and self.outputs_queue.empty():
            raise self._ended.with_traceback(None)  # (each raise its own traceback, not one grown by every call)
        return super().get_output()

    def ensure_alive(self) -> None:
        if isinstance(self._ended, EngineShutDownError):  # (vLLM's would say the engine core failed)
            raise EngineShutDownError()
        super().ensure_alive()

    def _format_exception(self, e: Exception) -> Exception:
        return e if isinstance(e, EngineShutDownError) else super()._format_exception(e)


class OmniAsyncMPClient(AsyncMPClient, OmniDecoding):
    """vLLM's ``AsyncMPClient`` (``AsyncLLM``'s) decoding the multimodal channel, whose output
    handler lets the event loop run once before it takes a step's outputs that were already waiting.

    Awaiting a queue that holds outputs returns at once, so a client that fell behind the engine
    processed every waiting step back to back while no stream ran: a stream's outputs piled up
    (``AsyncLLM`` merges a DELTA request's unread outputs, copying its audio each time), each step
    cost more, and every first audio waited for the whole backlog."""

    async def get_output_async(self):
        if self.outputs_queue is not None and not self.outputs_queue.empty():
            await asyncio.sleep(0)
        return await super().get_output_async()


class OmniInprocClient(InprocClient):
    """vLLM's in-process client; the outputs get their pieces of a copy of the step's buffer.

    The buffer is the worker's pinned memory, reused once nothing refers to it: views of it in a
    caller's hands would keep each step's buffer alive as long as any one request's audio, and the
    worker would allocate pinned memory (about a millisecond, the host waiting) every step. The
    copy is one ``memcpy`` of the step's due data. ``multimodal_seconds``: the time spent on the
    multimodal channel here, the copy and the pieces (what ``OmniMsgpackDecoder`` counts of a
    message from an engine core in its own process)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.multimodal_seconds = 0.0
        self._shut = False  # shut down: a step or a request raises EngineShutDownError, as over ZMQ

    def shutdown(self, timeout: float | None = None) -> None:
        self._shut = True
        super().shutdown(timeout)

    def add_request(self, request) -> None:
        if self._shut:
            raise EngineShutDownError()
        super().add_request(request)

    def get_output(self):
        if self._shut:
            raise EngineShutDownError()
        outputs = super().get_output()
        if isinstance(outputs, OmniEngineCoreOutputs):
            t0 = time.perf_counter()
            if outputs.multimodal_buffer is not None:
                outputs.multimodal_buffer = outputs.multimodal_buffer.clone()
            if outputs.multimodal_regions or outputs.token_times:
                as_omni_outputs(outputs)
                resolve_regions(outputs)
                resolve_token_times(outputs)
            self.multimodal_seconds += time.perf_counter() - t0
        return outputs
