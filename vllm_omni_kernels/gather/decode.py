"""The fused decode gather of a runner: ``DecodeGather`` (persistent buffers + two launches).

Around the decode hooks and runner MTP a step needs, per row, copies of token ids, embeddings, MTP
inputs and outputs and codes. Here they are recorded as jobs while the hooks run and carried out in
at most two launches per step, whatever the batch:

* ``pre`` (launched before MTP): hook token ids into ``input_ids``; non-MTP embeddings (scalar rows,
  and batched decode rows of a model without MTP) into ``inputs_embeds``; the MTP inputs (ids,
  embeddings, last hidden state, text step) packed densely into the MTP buffers; the per-row
  validity flags of the codes (which rows get codes this step is known from the plan);
* ``post`` (launched after MTP): the MTP embeddings into ``inputs_embeds`` at their token offsets,
  and codes into the persistent per-request code buffer.

A model without MTP has only the first. Copies into a caller's buffers are recorded on
``pre.jobs``/``post.jobs`` (``GatherJobs``) directly, copies into this class's buffers through its
``add_*`` methods; ``pre.launch()`` and ``post.launch()`` carry them out. Rows come from the
runner's validated routing plan, so the launches skip the per-row range and overlap checks
(``check_rows=False``). Buffers are allocated once (the code buffer on the first MTP output, when
its width is known); token offsets travel in the launch's persistent device table.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import PhaseRoutingError
from .launcher import RowGather


class DecodeGather:
    """Persistent MTP/code buffers and the two fused launches of a step.

    Args:
        hidden_size, dtype, device: embeddings and MTP buffers are ``[*, hidden_size]`` of ``dtype``.
        max_rows: most requests in a step (MTP buffers, flags and code slots are this many rows).
        max_tokens: most tokens in a step (bounds the rows one launch copies).
        mtp: whether the runner manages MTP (allocates its buffers).

    Buffers (valid rows ``[:M]`` after ``pre.launch()``; ``M`` = MTP rows of the step):
        ``mtp_input_ids`` int32 ``[max_rows]``; ``mtp_inputs_embeds``, ``last_hidden``, ``text_step``
        ``[max_rows, hidden_size]``; ``codes`` int64 ``[max_rows, Q]`` indexed by a request's code
        slot (``code_slot``); ``code_valid`` int32 ``[max_rows]`` by batch row, 1 where that row got
        codes this step (the first launch flags the MTP rows; an MTP that returns no codes clears them).
    """

    def __init__(self, *, hidden_size: int, dtype: torch.dtype, device: torch.device | str, max_rows: int,
                 max_tokens: int, mtp: bool):
        self.device = torch.device(device)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.max_rows = int(max_rows)
        self.max_tokens = int(max_tokens)
        self.mtp = mtp
        cap_f = self.max_tokens + 4 * self.max_rows
        self.pre = RowGather(dtype, hidden_size, self.device, max_float_rows=cap_f,
                             max_int_rows=self.max_tokens + 2 * self.max_rows + 1, max_values=self.max_rows,
                             check_rows=False)
        self.post = RowGather(dtype, hidden_size, self.device, max_float_rows=self.max_rows,
                              max_int_rows=self.max_rows, max_values=self.max_rows if mtp else 0, check_rows=False)
        if mtp:
            self.mtp_input_ids = torch.zeros(self.max_rows, dtype=torch.int32, device=self.device)
            self.mtp_inputs_embeds = torch.zeros(self.max_rows, hidden_size, dtype=dtype, device=self.device)
            self.last_hidden = torch.zeros(self.max_rows, hidden_size, dtype=dtype, device=self.device)
            self.text_step = torch.zeros(self.max_rows, hidden_size, dtype=dtype, device=self.device)
            self.code_valid = torch.zeros(self.max_rows, dtype=torch.int32, device=self.device)
        self.codes: torch.Tensor | None = None
        self._slot_of: dict[str, int] = {}
        self._free = list(range(self.max_rows - 1, -1, -1))

    # ---------------------------------------------------------------- code slots

    def code_slot(self, request_id: str, live, keep=(), evict=None) -> int:
        """The request's row of ``codes`` (assigned on first use). ``live``: request ids still running,
        used to reclaim slots of requests that ended without ``release`` when none is free. Then, with
        ``evict``, a request not in ``keep`` gives its slot up: ``evict(request_id, slot)`` runs first
        (to save what the row holds for it)."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            for rid in [r for r in self._slot_of if r not in live]:
                self.release(rid)
        if not self._free and evict is not None:
            other = next((r for r in self._slot_of if r not in keep), None)
            if other is not None:
                evict(other, self._slot_of[other])
                self.release(other)
        if not self._free:
            raise PhaseRoutingError(f"all {self.max_rows} code slots are held", request_id=request_id)
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Give back the request's code slot (no-op for a request without one)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    # ---------------------------------------------------------------- before MTP

    def add_mtp_inputs(self, index, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                       text: torch.Tensor) -> None:
        """Pack rows of MTP inputs (``[n]``, ``[n, H]`` x3) at MTP positions ``index`` (array, or an
        int for one row)."""
        jobs = self.pre.jobs
        jobs.ints(self.mtp_input_ids, index, ids if ids.dim() == 1 else ids.reshape(-1))
        jobs.rows(self.mtp_inputs_embeds, index, embeds)
        jobs.rows(self.last_hidden, index, hidden)
        jobs.rows(self.text_step, index, text)

    def add_mtp_inputs_each(self, index, ids: list[torch.Tensor], embeds: list[torch.Tensor],
                            hidden: list[torch.Tensor], text: list[torch.Tensor]) -> None:
        """``add_mtp_inputs`` for many one-row hook outputs at once: element k (``[1]``, ``[1, H]`` x3)
        goes to MTP position ``index[k]``."""
        jobs = self.pre.jobs
        jobs.ints_each(self.mtp_input_ids, index, ids)
        jobs.rows_each(self.mtp_inputs_embeds, index, embeds)
        jobs.rows_each(self.last_hidden, index, hidden)
        jobs.rows_each(self.text_step, index, text)

    def add_flags(self, flags: np.ndarray) -> None:
        """``code_valid = flags``: ``max_rows`` int32 flags, 1 for the batch rows that get codes this
        step, 0 for the others and every row past the batch (a captured step's padding)."""
        self.pre.jobs.values(self.code_valid, flags)

    # ---------------------------------------------------------------- after MTP

    def add_mtp_outputs(self, inputs_embeds: torch.Tensor, offsets: np.ndarray, embeds: torch.Tensor,
                        codes: torch.Tensor | None, slots: np.ndarray) -> None:
        """MTP embeddings (``[>=M, H]``) to their token offsets; codes (``[>=M, Q]``) to the
        requests' code slots (rows past ``M``, padding of a captured MTP, are ignored)."""
        # Sources as given: a block without source rows reads the leading len(offsets) rows.
        self.post.jobs.rows(inputs_embeds, offsets, embeds)
        if codes is not None:
            q = codes.shape[1]
            if self.codes is None:
                self.codes = torch.zeros(self.max_rows, q, dtype=torch.int64, device=self.device)
            self.post.jobs.ints(self.codes, slots, codes)

    @property
    def launches(self) -> int:
        return self.pre.launches + self.post.launches
