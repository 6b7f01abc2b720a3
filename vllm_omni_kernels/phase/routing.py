"""Routing of a step's rows to the model hooks and runner MTP: ``RoutingPlan``.

Rules (``shared/DESIGN.md``, "Phase metadata and routing"):

* a row goes to the batched decode hook only if the hook exists, its span is exactly 1 and it is
  not prefill; maximal runs of consecutive such rows form one hook call (``DecodeRun``);
* any other row is a ``ScalarRow`` for the normal ``preprocess`` hook; it ends the run before it
  (a row that schedules no token has no hook call);
* runner MTP takes only single-token decode rows (from either hook), packed densely in batch order;
  prefill rows, one-token prompt tails included, never reach MTP; decode spans longer than one token
  go to the scalar hook and not to MTP.

``RoutingPlan.build`` validates the step before anything runs and raises ``PhaseRoutingError``
naming the request: a request on two rows (its phase metadata and code slot are one), negative or
out-of-bounds spans, overlapping rows, and for a non-MTP batched run any gap, reversal or duplicate
(its rows are written as one contiguous block of tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import PhaseRoutingError
from .batch import PhaseBatch


@dataclass(frozen=True)
class DecodeRun:
    """Consecutive single-token decode rows for one ``preprocess_decode_batch`` call.

    ``rows``: batch rows; ``offsets``: their token offsets; ``mtp_index``: their positions in the
    packed MTP batch (``None`` without runner MTP).
    """

    rows: np.ndarray
    offsets: np.ndarray
    mtp_index: np.ndarray | None

    @property
    def contiguous(self) -> bool:
        return bool(np.all(np.diff(self.offsets) == 1))


@dataclass(frozen=True)
class ScalarRow:
    """One row for the normal ``preprocess`` hook: tokens ``[start, start + span)``.

    ``mtp_index``: its position in the packed MTP batch, or -1 when it is not an MTP row.
    """

    row: int
    start: int
    span: int
    mtp_index: int = -1


def check_distinct(request_ids: Sequence[str], why: str) -> None:
    """``PhaseRoutingError(why)`` naming the first request that comes a second time in ``request_ids``."""
    if len(set(request_ids)) != len(request_ids):
        seen: set[str] = set()
        for rid in request_ids:
            if rid in seen:
                raise PhaseRoutingError(why, request_id=rid)
            seen.add(rid)


@dataclass(frozen=True)
class RoutingPlan:
    """The hook calls of one step in batch order, and the packed MTP batch."""

    steps: tuple[DecodeRun | ScalarRow, ...]
    mtp_rows: np.ndarray     # batch rows of the MTP batch, in batch order
    mtp_offsets: np.ndarray  # their token offsets
    num_tokens: int

    @classmethod
    def build(cls, phase: PhaseBatch, request_ids: Sequence[str], *, num_tokens: int, batch_hook: bool,
              mtp: bool) -> RoutingPlan:
        """Plan the step; raise ``PhaseRoutingError`` (naming the request) on corrupt offsets."""
        rows = len(phase)
        if len(request_ids) != rows:
            raise ValueError(f"{len(request_ids)} request ids for {rows} rows")
        check_distinct(request_ids, "on two rows of one step (a request has one phase and one code slot)")
        _check_spans(phase, request_ids, num_tokens)
        decode = phase.single_token_decode
        in_mtp = decode if mtp else np.zeros(rows, dtype=bool)
        mtp_pos = np.cumsum(in_mtp) - 1
        batched = decode if batch_hook else np.zeros(rows, dtype=bool)

        steps: list[DecodeRun | ScalarRow] = []
        r = 0
        while r < rows:
            if batched[r]:
                end = r + 1
                while end < rows and batched[end]:
                    end += 1
                run_rows = np.arange(r, end, dtype=np.int64)
                run = DecodeRun(run_rows, phase.start[r:end].copy(), mtp_pos[r:end].copy() if mtp else None)
                if not mtp and not run.contiguous:
                    _raise_discontiguous(run, request_ids)
                steps.append(run)
                r = end
            else:
                if phase.span[r]:  # a row that schedules no token has no hook call (nothing of it moves on)
                    steps.append(ScalarRow(r, int(phase.start[r]), int(phase.span[r]),
                                           int(mtp_pos[r]) if in_mtp[r] else -1))
                r += 1
        mtp_rows = np.flatnonzero(in_mtp).astype(np.int64)
        return cls(tuple(steps), mtp_rows, phase.start[mtp_rows].copy(), int(num_tokens))


def _check_spans(phase: PhaseBatch, request_ids: Sequence[str], num_tokens: int) -> None:
    bad = np.flatnonzero((phase.start < 0) | (phase.span < 0))
    if bad.size:
        i = int(bad[0])
        raise PhaseRoutingError(f"negative token offset {int(phase.start[i])} or span {int(phase.span[i])}",
                                request_id=request_ids[i])
    bad = np.flatnonzero(phase.start + phase.span > num_tokens)
    if bad.size:
        i = int(bad[0])
        raise PhaseRoutingError(f"tokens [{int(phase.start[i])}, {int(phase.start[i] + phase.span[i])}) out of "
                                f"bounds for a step of {num_tokens} tokens", request_id=request_ids[i])
    live = np.flatnonzero(phase.span > 0)
    order = live[np.argsort(phase.start[live], kind="stable")]
    ends = phase.start[order] + phase.span[order]
    clash = np.flatnonzero(phase.start[order][1:] < ends[:-1])
    if clash.size:
        a, b = int(order[clash[0]]), int(order[clash[0] + 1])
        raise PhaseRoutingError(f"its tokens [{int(phase.start[b])}, {int(phase.start[b] + phase.span[b])}) "
                                f"overlap those of request {request_ids[a]!r}", request_id=request_ids[b])


def _raise_discontiguous(run: DecodeRun, request_ids: Sequence[str]) -> None:
    k = int(np.flatnonzero(np.diff(run.offsets) != 1)[0])
    prev, cur = int(run.offsets[k]), int(run.offsets[k + 1])
    kind = "duplicate" if cur == prev else ("reversed" if cur < prev else "gap in")
    raise PhaseRoutingError(f"{kind} token offsets of a batched decode run: {prev} then {cur} (a run without "
                            "MTP is written as one contiguous block)", request_id=request_ids[int(run.rows[k + 1])])
