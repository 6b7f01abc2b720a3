"""Prefill/decode phase metadata of a runner's batch, vectorized: ``PhaseBatch``.

The contract (``shared/seeds/002``): for each row of the current input batch,

* ``_omni_prompt_len``: the prompt's length in the request's current state (``int``): vLLM's
  ``num_prompt_tokens``, ``len(prompt_token_ids)`` or the prompt embeddings' rows;
* ``_omni_num_computed_tokens``: the row's computed tokens *before* this step, cached progress
  included (``int``);
* ``_omni_is_prefill``: exactly ``num_computed < prompt_len`` (``bool``).

They are recomputed every step from current values and overwrite whatever an earlier step left in
the request's info, so a resumed or streaming request is classified afresh. Values handed to models
are Python ``int``/``bool`` (not numpy scalars).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PROMPT_LEN = "_omni_prompt_len"
NUM_COMPUTED = "_omni_num_computed_tokens"
IS_PREFILL = "_omni_is_prefill"
PHASE_KEYS = (PROMPT_LEN, NUM_COMPUTED, IS_PREFILL)


def _int_array(values, name: str, rows: int | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=np.int64).reshape(-1)
    if rows is not None and a.size != rows:
        raise ValueError(f"{name} has {a.size} entries for {rows} rows")
    return a


@dataclass(frozen=True)
class PhaseBatch:
    """Per-row phase of one step (all arrays ``[rows]``; ``int64`` except ``is_prefill``).

    ``start``/``span``: the row's scheduled tokens are ``[start, start + span)`` of the flattened
    step (vLLM's ``query_start_loc`` and ``num_scheduled_tokens``).
    """

    prompt_len: np.ndarray
    num_computed: np.ndarray
    span: np.ndarray
    start: np.ndarray
    is_prefill: np.ndarray

    @classmethod
    def compute(cls, prompt_len: Sequence[int] | np.ndarray, num_computed: Sequence[int] | np.ndarray,
                span: Sequence[int] | np.ndarray, start: Sequence[int] | np.ndarray | None = None) -> PhaseBatch:
        """Phase of every row. ``start`` defaults to the running sum of ``span`` (rows back to back)."""
        p = _int_array(prompt_len, "prompt_len")
        rows = p.size
        c = _int_array(num_computed, "num_computed", rows)
        s = _int_array(span, "span", rows)
        st = (np.cumsum(s) - s).astype(np.int64) if start is None else _int_array(start, "start", rows)
        return cls(p, c, s, st, c < p)

    def __len__(self) -> int:
        return int(self.prompt_len.size)

    @property
    def single_token_decode(self) -> np.ndarray:
        """Rows that may take the batched decode hook and runner MTP: span 1 and not prefill."""
        return (self.span == 1) & ~self.is_prefill

    def info(self, row: int) -> dict[str, Any]:
        """The three contract keys of ``row`` as Python values."""
        return {PROMPT_LEN: int(self.prompt_len[row]), NUM_COMPUTED: int(self.num_computed[row]),
                IS_PREFILL: bool(self.is_prefill[row])}

    def refresh(self, row: int, req_infos: dict[str, Any]) -> dict[str, Any]:
        """Overwrite ``row``'s contract keys in ``req_infos`` (stale values included); return it."""
        req_infos.update(self.info(row))
        return req_infos
