"""Typed errors of the multimodal output layer; none of them affects another request than the one
it names."""

from __future__ import annotations


class MultimodalOutputError(Exception):
    """Base class of every error this package raises on purpose; the message names the request and
    the key, where known, so that an operator can find the offending producer."""

    def __init__(self, message: str, *, request_id: str | None = None, key: str | None = None):
        self.reason = message
        self.request_id = request_id
        self.key = key
        where = []
        if request_id is not None:
            where.append(f"request {request_id!r}")
        if key is not None:
            where.append(f"key {key!r}")
        prefix = f"[{', '.join(where)}] " if where else ""
        super().__init__(prefix + message)

    def for_request(self, request_id: str, key: str | None = None) -> "MultimodalOutputError":
        """The same error, of the same type, attributed to ``request_id`` (and ``key``, else this one's).

        Used where one cause (a whole batch of the wrong dtype, say) fails several requests.
        """
        return type(self)(self.reason, request_id=request_id, key=key if key is not None else self.key)


class TensorAccumulationError(MultimodalOutputError):
    """A step's tensor could not be accumulated (bad dtype/shape/device, unknown slot, overflow).
    Nothing of that request's step was written, its earlier data is intact, and the other requests'
    values were written; the request's data now lacks that value, so a server fails the request
    (the output processors do)."""


class OutputMemoryError(TensorAccumulationError):
    """The output memory (a ring pool's preallocated budget) cannot hold the request's data now. It
    frees as other requests finish: the request can be retried, or the budget raised."""


class OutputTooLargeError(TensorAccumulationError):
    """The request needs more output memory than the budget could ever give one request, however
    many others finish: no retry holds it (it must ask for less, or have its data read as it goes:
    streamed; or the budget must be raised)."""


class TensorConsolidationError(MultimodalOutputError):
    """A request's accumulated output cannot be produced; the request must fail visibly."""


class PhaseRoutingError(MultimodalOutputError, ValueError):
    """A step of the prefill/decode routing cannot run: corrupt token offsets, or a hook returned
    outputs that do not match its rows. Raised before any runner buffer is written, except for MTP's
    outputs, which exist only after the step's first launch, and a text-only model's token
    embeddings, which its hooks read (``phase.runner``)."""
