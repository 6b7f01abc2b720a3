"""Engine-core clients that receive the multimodal channel: ``OmniSyncMPClient``,
``OmniAsyncMPClient`` (the engine core in its own process, over ZMQ) and ``OmniInprocClient``.

vLLM's multiprocess clients decode every frame with ``MsgpackDecoder(EngineCoreOutputs)``, which
drops the multimodal fields without a word, and their output thread (sync) or task (async) takes
the decoder when it starts, inside or right after construction: a decoder set on a built client is
never used. Here the decoder is ``OmniMsgpackDecoder`` from construction on: ``OmniDecoding`` sits
between vLLM's ``SyncMPClient``/``AsyncMPClient`` and ``MPClient`` and sets it as soon as
``MPClient.__init__`` made vLLM's, before anything can take it. The in-process client gets the
scheduler's own objects, copies the step's buffer and cuts the regions of the copy into each
output's pieces.

``OmniLLM``/``OmniAsyncLLM`` (``llm.py``) build these; nothing else needs to.
"""

from __future__ import annotations

import asyncio

from vllm.v1.engine.core_client import AsyncMPClient, InprocClient, MPClient, SyncMPClient

from .wire import OmniEngineCoreOutputs, OmniMsgpackDecoder, resolve_regions


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
    handler lets the event loop run before it takes a step's outputs that were already waiting.

    ``AsyncLLM``'s output handler takes each step's outputs from this client and processes them;
    awaiting a queue that holds some returns at once, so a client that fell behind the engine
    processed every waiting step back to back while no stream ran: a stream's outputs of several
    steps piled up (``AsyncLLM`` merges a DELTA request's unread outputs, a copy of its audio each
    time), which made each step cost more, and the first audio of every request in flight waited
    for the whole backlog. With one turn of the loop before each waiting step, the streams take the
    last step's outputs before the next is processed."""

    async def get_output_async(self):
        if self.outputs_queue is not None and not self.outputs_queue.empty():
            await asyncio.sleep(0)
        return await super().get_output_async()


class OmniInprocClient(InprocClient):
    """vLLM's in-process client; the engine core's outputs get their pieces of a copy of the step's
    buffer, as a multiprocess client gets them of the message it received.

    The step's buffer is the worker's pinned memory, reused once nothing refers to it. Views of it
    in a caller's hands would keep every step's buffer (all of that step's requests' data) alive
    for as long as the caller keeps any one request's audio, and the worker would allocate pinned
    memory (about a millisecond, with the host waiting) on every step: the copy is one ``memcpy``
    of the step's due data."""

    def get_output(self):
        outputs = super().get_output()
        if isinstance(outputs, OmniEngineCoreOutputs):
            if outputs.multimodal_buffer is not None:
                outputs.multimodal_buffer = outputs.multimodal_buffer.clone()
            resolve_regions(outputs)
        return outputs
