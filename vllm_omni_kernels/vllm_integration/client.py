"""Engine-core clients that receive the multimodal channel, built by ``OmniLLM``/``OmniAsyncLLM``:
``OmniSyncMPClient``, ``OmniAsyncMPClient`` (the engine core in its own process) and
``OmniInprocClient``.

vLLM's multiprocess clients decode with ``MsgpackDecoder(EngineCoreOutputs)``, which drops the
multimodal fields, and their output thread or task takes the decoder during construction: one set
on a built client is never used. ``OmniDecoding`` sits between vLLM's clients and ``MPClient`` and
sets ``OmniMsgpackDecoder`` as soon as ``MPClient.__init__`` made vLLM's.
"""

from __future__ import annotations

import asyncio
import time

from vllm.v1.engine.core_client import AsyncMPClient, InprocClient, MPClient, SyncMPClient

from .wire import OmniEngineCoreOutputs, OmniMsgpackDecoder, as_omni_outputs, resolve_regions


class OmniDecoding(MPClient):
    """``MPClient`` whose decoder is ``OmniMsgpackDecoder`` before any thread or task can take it."""

    decoder: OmniMsgpackDecoder

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoder = OmniMsgpackDecoder()


class OmniSyncMPClient(SyncMPClient, OmniDecoding):
    """vLLM's ``SyncMPClient`` (``LLMEngine``'s) decoding the multimodal channel."""


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

    def get_output(self):
        outputs = super().get_output()
        if isinstance(outputs, OmniEngineCoreOutputs):
            t0 = time.perf_counter()
            if outputs.multimodal_buffer is not None:
                outputs.multimodal_buffer = outputs.multimodal_buffer.clone()
            if outputs.multimodal_regions:
                as_omni_outputs(outputs)
                resolve_regions(outputs)
            self.multimodal_seconds += time.perf_counter() - t0
        return outputs
