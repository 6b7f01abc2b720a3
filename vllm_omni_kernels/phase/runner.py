"""The runner's preprocess and MTP-forward on the phase contract: ``OmniPhaseRunnerMixin``.

A mixin for a vLLM ``GPUModelRunner`` subclass (``vllm_integration.phase_runner`` builds one). It
reads only what such a runner has, so tests drive it with CPU buffers and a fake model:

* ``self.model``: ``preprocess(input_ids, input_embeds, **info) -> (ids, embeds, update)``; optional
  ``preprocess_decode_batch(input_ids=, req_infos=)`` returning ``(ids, embeds, updates)`` without
  runner MTP and ``(ids, embeds, hidden_states, text_step, updates)`` with it; optional
  ``talker_mtp(ids, embeds, last_hidden, text_step) -> (embeds, codes)`` and
  ``talker_mtp_output_key`` (default ``("codes", "audio")``);
* ``self.input_batch.req_ids`` and ``.num_computed_tokens_cpu`` (before this step);
* ``self.requests[req_id].num_prompt_tokens`` (vLLM's, token ids or prompt embeddings);
  ``self.query_start_loc.np`` (token offsets);
* ``self.model_intermediate_buffer``: per-request info dicts, which the hooks receive (with
  ``request_id`` and the three phase keys refreshed) and which ``updates`` are merged into.

A step (``_omni_preprocess``): phase metadata for every row; the routing plan, validated before any
hook runs; the hooks in batch order, each output validated as it returns, copies recorded, not done
(a decode run's at once, the scalar rows' collected and recorded together after the last hook): a
hook's outputs are read after the step's last hook, so a model must not rewrite, in a later hook
call of the same step, memory it returned earlier (a scratch buffer reused per call would give
every row the last call's values; a constant it never rewrites is fine);
then one fused launch (ids, non-MTP embeddings, packed MTP inputs, code flags), with MTP
``_talker_mtp_forward`` (MTP model, one fused launch: MTP embeddings to their token offsets, codes
to the per-request code buffer), and the updates merged. On any ``PhaseRoutingError`` no update has
been merged, and nothing has been written to a runner buffer unless the error is in MTP's outputs
(MTP reads the packed inputs that the first launch writes along with the step's ids and embeddings)
or comes from a hook (a text-only model's token embeddings, written before the hooks, are there).

Code updates are ``{key: {sub: codes_view}}`` with ``codes_view`` the request's row of the
persistent code buffer ``[1, Q]``: it always holds that request's latest codes (copy it to keep a
step's codes past the next step).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import ops
from ..gather.decode import DecodeGather
from ..errors import PhaseRoutingError
from .batch import PhaseBatch
from ..profiling import nvtx_range
from .routing import DecodeRun, RoutingPlan, ScalarRow, check_distinct

_RECORD_ERRORS = (TypeError, ValueError, IndexError)


def _check_plain(request_id: str, what: str, t: torch.Tensor) -> None:
    """A hook's tensor that the gather kernels cannot read (sparse, nested, quantized) fails its
    request, before the runner reads its memory."""
    why = ops.not_plain(t)
    if why:
        raise PhaseRoutingError(f"{what}: {why}", request_id=request_id)


def _shape_error(request_id: str, what: str, got: Any, want: tuple) -> PhaseRoutingError:
    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
    return PhaseRoutingError(f"{what} has shape {shape}, expected {want}", request_id=request_id)


_HOOK_ARGUMENTS = ("self", "input_ids", "input_embeds")  # what preprocess takes besides the request's info


def _check_update(hook: str, request_id: str, update: Any) -> None:
    """A hook's update: None or a dict, merged into the request's info, which ``preprocess`` takes
    as keywords besides its own arguments (a key named as one of them could never be passed)."""
    if update is None:
        return
    if not isinstance(update, dict):
        raise PhaseRoutingError(f"{hook} update must be a dict, got {type(update).__name__}", request_id=request_id)
    not_str = [k for k in update if not isinstance(k, str)]
    if not_str:
        raise PhaseRoutingError(f"{hook} update has the key {not_str[0]!r}: the request's info goes to preprocess as "
                                "keywords, which are strings", request_id=request_id)
    clash = [k for k in _HOOK_ARGUMENTS if k in update]
    if clash:
        raise PhaseRoutingError(f"{hook} update has the key {clash[0]!r}, an argument of preprocess: the request's "
                                "info goes to preprocess as keywords", request_id=request_id)


class _ScalarRows:
    """The copies of a step's scalar rows, collected while their hooks run and recorded into the
    gather with one call per destination (a mixed batch has one hook run per row: one record call
    per row would cost more than the copies). Errors name the request of the offending output."""

    def __init__(self):
        self.ids: tuple[list, list, list] = ([], [], [])     # request ids, first tokens, ids [n]
        self.embeds: tuple[list, list, list] = ([], [], [])  # request ids, first tokens, embeddings [n, H]
        self.mtp: tuple[list, ...] = ([], [], [], [], [], [])  # request ids, MTP positions, ids, embeds, hidden, text

    @staticmethod
    def add(cols: tuple[list, ...], *values) -> None:
        """Append one hook output's values to ``cols`` (``ids``, ``embeds`` or ``mtp``), one per column."""
        for col, v in zip(cols, values, strict=True):
            col.append(v)

    def record(self, gather: DecodeGather, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> None:
        calls = ((self.ids, lambda c: gather.pre.jobs.ints_each(input_ids, c[1], c[2])),
                 (self.embeds, lambda c: gather.pre.jobs.rows_each(inputs_embeds, c[1], c[2])),
                 (self.mtp, lambda c: gather.add_mtp_inputs_each(c[1], *c[2:])))
        for cols, call in calls:
            if not cols[0]:
                continue
            try:
                call(cols)
            except _RECORD_ERRORS as exc:
                rid = cols[0][getattr(exc, "index", 0)]
                raise PhaseRoutingError(f"preprocess outputs: {exc}", request_id=rid) from exc


class OmniPhaseRunnerMixin:
    """Production ``_preprocess``/``_talker_mtp_forward`` logic; see the module docstring."""

    model: Any
    input_batch: Any
    requests: dict
    query_start_loc: Any
    model_intermediate_buffer: dict[str, dict[str, Any]]

    # ---------------------------------------------------------------- setup

    def _omni_init_phase_routing(self, *, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                                 max_num_reqs: int, max_num_tokens: int) -> None:
        """Allocate the decode gather's buffers once (call after the model is loaded)."""
        if not hasattr(self, "model_intermediate_buffer"):
            self.model_intermediate_buffer = {}
        self.has_talker_mtp = getattr(self.model, "talker_mtp", None) is not None
        self._omni_gather = DecodeGather(hidden_size=hidden_size, dtype=dtype, device=device,
                                         max_rows=max_num_reqs, max_tokens=max_num_tokens, mtp=self.has_talker_mtp)
        self._omni_last_plan: RoutingPlan | None = None

    def _omni_release_request(self, request_id: str) -> None:
        """Forget a finished request's code slot (the runner calls this when it removes a request)."""
        self._omni_gather.release(request_id)

    # ---------------------------------------------------------------- step

    def _omni_phase_batch(self, num_scheduled_tokens: np.ndarray) -> PhaseBatch:
        req_ids = self.input_batch.req_ids
        rows = len(req_ids)
        prompt_len = []
        for r in req_ids:
            state = self.requests.get(r)
            if state is None:
                raise PhaseRoutingError("a row of the batch whose request the runner holds no state for",
                                        request_id=r)
            prompt_len.append(state.num_prompt_tokens)  # token ids or prompt embeddings
        return PhaseBatch.compute(prompt_len, self.input_batch.num_computed_tokens_cpu[:rows],
                                  num_scheduled_tokens[:rows], self.query_start_loc.np[:rows])

    def _omni_check_step(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_ids: list[str],
                         phase: PhaseBatch) -> None:
        """The step's buffers and size against what the gather was set up for, before any hook runs
        (a mismatch found while recording would come after hooks ran and a launch wrote, and name
        a request for the runner's fault): PhaseRoutingError naming the step's first request."""
        gather = self._omni_gather
        h, first = gather.hidden_size, req_ids[0] if req_ids else None
        if inputs_embeds.dim() != 2 or inputs_embeds.shape[0] < input_ids.shape[0] or inputs_embeds.shape[1] != h:
            raise PhaseRoutingError(f"the step's inputs_embeds of shape {tuple(inputs_embeds.shape)} has no row of "
                                    f"{h} for each of its {input_ids.shape[0]} tokens", request_id=first)
        if inputs_embeds.dtype != gather.dtype or inputs_embeds.stride(1) != 1:
            raise PhaseRoutingError(f"the step's inputs_embeds is {inputs_embeds.dtype} with a row stride of "
                                    f"{inputs_embeds.stride(1)}; the decode gather writes contiguous {gather.dtype} rows",
                                    request_id=first)
        tokens = int(phase.span.sum())
        if len(req_ids) > gather.max_rows or tokens > gather.max_tokens:
            raise PhaseRoutingError(f"a step of {len(req_ids)} requests and {tokens} tokens; the decode gather was set "
                                    f"up for {gather.max_rows} and {gather.max_tokens}", request_id=first)

    def _omni_row_info(self, request_id: str, phase: PhaseBatch, row: int) -> dict[str, Any]:
        info = self.model_intermediate_buffer.setdefault(request_id, {})
        info["request_id"] = request_id
        return phase.refresh(row, info)

    def _omni_preprocess(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor,
                         num_scheduled_tokens: np.ndarray, embedded: bool = True) -> None:
        """Run the model's hooks for every row of the step and fill ``input_ids``/``inputs_embeds``.

        Args:
            input_ids: the runner's ``[num_tokens]`` token buffer (int32) for this step.
            inputs_embeds: the runner's ``[num_tokens, H]`` embedding buffer.
            num_scheduled_tokens: host ``[rows]`` span of each row of ``input_batch.req_ids``.
            embedded: whether ``inputs_embeds`` holds the step's token embeddings (vLLM writes them
                for multimodal models and prompt embeddings only); if not, they are written first,
                with the model's ``embed_input_ids``, once the offsets are checked: the hooks read
                them, and a row a hook leaves in place goes to the model as it is.

        Raises:
            PhaseRoutingError: corrupt offsets, or buffers or a step size the gather was not set up
                for (``_omni_check_step``), before any hook; or a hook output that does not match
                its rows (after that hook); no update merged, buffers unchanged (but for the token
                embeddings written when ``embedded`` is False, before the hooks).
        """
        with nvtx_range("omni.preprocess"):
            model = self.model
            req_ids = list(self.input_batch.req_ids)
            phase = self._omni_phase_batch(np.asarray(num_scheduled_tokens))
            self._omni_check_step(input_ids, inputs_embeds, req_ids, phase)
            batch_hook = callable(getattr(model, "preprocess_decode_batch", None))
            plan = RoutingPlan.build(phase, req_ids, num_tokens=int(input_ids.shape[0]), batch_hook=batch_hook,
                                     mtp=self.has_talker_mtp)
            self._omni_last_plan = plan
            if not embedded and len(req_ids):
                n = int((phase.start + phase.span).max())
                inputs_embeds[:n].copy_(model.embed_input_ids(input_ids[:n]))
            gather = self._omni_gather
            pending: list[tuple[str, Any]] = []
            scalar = _ScalarRows()
            try:
                for step in plan.steps:
                    if isinstance(step, DecodeRun):
                        pending.extend(self._omni_decode_run(step, phase, req_ids, input_ids, inputs_embeds))
                    else:
                        pending.append(self._omni_scalar_row(step, phase, req_ids, input_ids, inputs_embeds, scalar))
                scalar.record(gather, input_ids, inputs_embeds)
                if self.has_talker_mtp:
                    flags = np.zeros(gather.max_rows, dtype=np.int32)
                    flags[plan.mtp_rows] = 1
                    gather.add_flags(flags)
            except BaseException:
                gather.pre.jobs.clear()
                raise
            gather.pre.launch()
            if self.has_talker_mtp:
                pending += self._omni_mtp([req_ids[r] for r in plan.mtp_rows], inputs_embeds, plan.mtp_offsets)
            for request_id, update in pending:
                self._update_intermediate_buffer(request_id, update)

    def _omni_decode_run(self, run: DecodeRun, phase: PhaseBatch, req_ids: list[str], input_ids: torch.Tensor,
                         inputs_embeds: torch.Tensor) -> list[tuple[str, Any]]:
        rows = len(run.rows)
        rids = [req_ids[r] for r in run.rows]
        first = int(run.offsets[0])
        if run.contiguous:
            ids_in = input_ids[first:first + rows]
        else:  # only an MTP run can get here (the plan rejects others); one small gather
            ids_in = input_ids[torch.from_numpy(run.offsets).to(input_ids.device)]
        infos = [self._omni_row_info(rid, phase, int(r)) for rid, r in zip(rids, run.rows)]
        out = self.model.preprocess_decode_batch(input_ids=ids_in, req_infos=infos)
        mtp = run.mtp_index is not None
        want = 5 if mtp else 3
        if not isinstance(out, tuple | list) or len(out) != want:
            raise PhaseRoutingError(f"preprocess_decode_batch must return {want} results "
                                    f"({'with' if mtp else 'without'} runner MTP), got {type(out).__name__}"
                                    f"{'' if not isinstance(out, tuple | list) else f' of {len(out)}'}",
                                    request_id=rids[0])
        ids, embeds, updates = out[0], out[1], out[-1]
        h = inputs_embeds.shape[1]
        tensors = [("embeddings", embeds)] + ([("hidden_states", out[2]), ("text_step", out[3])] if mtp else [])
        for what, t in tensors:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows, h):
                raise _shape_error(rids[0], f"preprocess_decode_batch {what}", t, (rows, h))
        same_ids = ids is ids_in and run.contiguous  # (a gap run's ids are a copy: a hook may rewrite it)
        if not same_ids:
            if not isinstance(ids, torch.Tensor) or ids.numel() != rows:
                raise _shape_error(rids[0], "preprocess_decode_batch input_ids", ids, (rows,))
            _check_plain(rids[0], "preprocess_decode_batch input_ids", ids)
        if not isinstance(updates, list | tuple) or len(updates) != rows:
            raise PhaseRoutingError(f"preprocess_decode_batch must return one update per row ({rows}), got "
                                    f"{len(updates) if isinstance(updates, list | tuple) else type(updates).__name__}",
                                    request_id=rids[0])
        for rid, update in zip(rids, updates):
            _check_update("preprocess_decode_batch", rid, update)
        try:
            if not same_ids:
                self._omni_gather.pre.jobs.ints(input_ids, run.offsets, ids.reshape(-1))
            if mtp:
                self._omni_gather.add_mtp_inputs(run.mtp_index, ids, embeds, out[2], out[3])
            else:
                self._omni_gather.pre.jobs.rows(inputs_embeds, run.offsets, embeds)
        except _RECORD_ERRORS as exc:
            raise PhaseRoutingError(f"preprocess_decode_batch outputs: {exc}", request_id=rids[0]) from exc
        return list(zip(rids, updates))

    def _omni_scalar_row(self, step: ScalarRow, phase: PhaseBatch, req_ids: list[str], input_ids: torch.Tensor,
                         inputs_embeds: torch.Tensor, scalar: _ScalarRows) -> tuple[str, Any]:
        rid = req_ids[step.row]
        s, e = step.start, step.start + step.span
        ids_in, embed_slice = input_ids[s:e], inputs_embeds[s:e]
        info = self._omni_row_info(rid, phase, step.row)
        out = self.model.preprocess(input_ids=ids_in, input_embeds=embed_slice, **info)
        if not isinstance(out, tuple | list) or len(out) != 3:
            raise PhaseRoutingError("preprocess must return (input_ids, inputs_embeds, update)", request_id=rid)
        ids, embeds, update = out
        h = inputs_embeds.shape[1]
        if not isinstance(embeds, torch.Tensor) or tuple(embeds.shape) != (step.span, h):
            raise _shape_error(rid, "preprocess embeddings", embeds, (step.span, h))
        _check_plain(rid, "preprocess embeddings", embeds)
        _check_update("preprocess", rid, update)
        new_ids = ids is not None and ids is not ids_in
        # The copies are collected here and recorded for all scalar rows at once (_ScalarRows).
        if new_ids:
            if not isinstance(ids, torch.Tensor) or ids.numel() != step.span:
                raise _shape_error(rid, "preprocess input_ids", ids, (step.span,))
            _check_plain(rid, "preprocess input_ids", ids)
            scalar.add(scalar.ids, rid, s, ids.reshape(-1))
        if step.mtp_index >= 0:
            update = dict(update or {})
            mtp_inputs = update.pop("mtp_inputs", None)
            if not isinstance(mtp_inputs, tuple | list) or len(mtp_inputs) != 2:
                raise PhaseRoutingError("a single-token decode row of an MTP runner needs "
                                        "update['mtp_inputs'] = (last_hidden, text_step)", request_id=rid)
            for what, t in zip(("mtp_inputs last_hidden", "mtp_inputs text_step"), mtp_inputs):
                if not isinstance(t, torch.Tensor) or t.numel() != h:  # [1, H] or any shape of H elements
                    raise _shape_error(rid, what, t, (1, h))
                _check_plain(rid, what, t)
            hidden, text = (t.reshape(1, h) for t in mtp_inputs)
            scalar.add(scalar.mtp, rid, step.mtp_index, (ids if new_ids else ids_in).reshape(-1), embeds, hidden, text)
        else:
            in_place = embeds.data_ptr() == embed_slice.data_ptr() and embeds.stride() == embed_slice.stride()
            if step.span and not in_place:
                scalar.add(scalar.embeds, rid, s, embeds)
        return rid, update

    # ---------------------------------------------------------------- MTP

    def _omni_call_talker_mtp(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                              text: torch.Tensor, request_ids: list[str]):
        """Call the model's MTP on the packed rows; a vLLM runner overrides this to set its forward
        context and CUDA-graph padding."""
        return self.model.talker_mtp(ids, embeds, hidden, text)

    def _talker_mtp_forward(self, decode_req_ids: list[str], inputs_embeds: torch.Tensor, start_offsets) -> None:
        """Run MTP on the first ``len(decode_req_ids)`` packed rows and scatter its outputs.

        ``start_offsets``: each row's token offset in ``inputs_embeds``; any order, gaps allowed, no
        duplicates. An empty batch is a no-op. One fused launch: embeddings to their offsets, codes to
        the requests' code slots; each request's info gets ``{key: {sub: codes_view}}``.
        """
        for request_id, update in self._omni_mtp(decode_req_ids, inputs_embeds, start_offsets):
            self._update_intermediate_buffer(request_id, update)

    def _omni_mtp(self, decode_req_ids: list[str], inputs_embeds: torch.Tensor, start_offsets) -> list:
        """``_talker_mtp_forward`` without the merge: returns the code updates, (request, update)."""
        m = len(decode_req_ids)
        if m == 0:
            return []
        with nvtx_range("omni.talker_mtp"):
            gather = self._omni_gather
            offsets = np.asarray(start_offsets, dtype=np.int64).reshape(-1)
            if offsets.size != m:
                raise ValueError(f"{offsets.size} offsets for {m} MTP rows")
            bad = np.flatnonzero((offsets < 0) | (offsets >= inputs_embeds.shape[0]))
            if bad.size or np.unique(offsets).size != m:
                if bad.size:
                    i = int(bad[0])
                else:  # a repeat: the later of two equal offsets, by its position in the batch
                    order = np.argsort(offsets, kind="stable")
                    i = int(order[np.flatnonzero(np.diff(offsets[order]) == 0)[0] + 1])
                raise PhaseRoutingError(f"MTP token offsets {offsets.tolist()} are out of bounds or repeat",
                                        request_id=decode_req_ids[i])
            check_distinct(decode_req_ids, "the request is on two MTP rows")  # (they would write its one code slot)
            out = self._omni_call_talker_mtp(gather.mtp_input_ids[:m], gather.mtp_inputs_embeds[:m],
                                             gather.last_hidden[:m], gather.text_step[:m], decode_req_ids)
            if not isinstance(out, tuple | list) or len(out) != 2:
                raise PhaseRoutingError("talker_mtp must return (inputs_embeds, codes)", request_id=decode_req_ids[0])
            embeds, codes = out
            h = inputs_embeds.shape[1]
            if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[0] < m or embeds.shape[1] != h:
                raise _shape_error(decode_req_ids[0], "talker_mtp embeddings", embeds, (m, h))
            if codes is not None and (not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[0] < m):
                raise _shape_error(decode_req_ids[0], "talker_mtp codes", codes, (m, "Q"))
            key, sub = getattr(self.model, "talker_mtp_output_key", ("codes", "audio"))
            slots = self._omni_code_slots(decode_req_ids, key, sub)
            try:
                gather.add_mtp_outputs(inputs_embeds, offsets, embeds, codes, slots)
            except BaseException as exc:  # what was recorded before the failure must not run at the next launch
                gather.post.jobs.clear()
                if isinstance(exc, _RECORD_ERRORS):
                    raise PhaseRoutingError(f"talker_mtp outputs: {exc}", request_id=decode_req_ids[0]) from exc
                raise
            if codes is None:  # no row got codes this step (the first launch flagged the MTP rows)
                gather.post.jobs.values(gather.code_valid, np.zeros(gather.max_rows, np.int32))
            gather.post.launch()
            if codes is None:
                return []
            return [(rid, {key: {sub: gather.codes[slot:slot + 1]}}) for rid, slot in zip(decode_req_ids, slots)]

    def _omni_code_slots(self, request_ids: list[str], key: str, sub: str) -> np.ndarray:
        """The code slots of the step's MTP rows. vLLM keeps preempted requests, and those it did not
        schedule this step, in ``self.requests``, so they keep their slots; when a request of the
        step finds none free, one of them gives its slot up, and its info's view of its latest
        codes becomes a copy of its own (its info shows the same codes)."""
        gather = self._omni_gather

        def evict(request_id: str, slot: int) -> None:
            held = self.model_intermediate_buffer.get(request_id, {}).get(key)
            view = held.get(sub) if isinstance(held, dict) else None
            if isinstance(view, torch.Tensor) and gather.codes is not None \
                    and view.data_ptr() == gather.codes[slot].data_ptr():
                held[sub] = view.clone()

        return np.array([gather.code_slot(r, live=self.requests, keep=request_ids, evict=evict) for r in request_ids],
                        dtype=np.int64)

    # ---------------------------------------------------------------- updates

    def _update_intermediate_buffer(self, request_id: str, update: dict | None) -> None:
        """Merge a hook's update into the request's info: one level of nested dicts (a dict replaces
        a value that is not one), values as given (device tensors stay where they are: no copy, no
        sync)."""
        if not update:
            return
        info = self.model_intermediate_buffer.setdefault(request_id, {})
        for k, v in update.items():
            held = info.get(k)
            if isinstance(v, dict) and isinstance(held, dict):
                held.update(v)
            else:  # (a dict where the info held None or a value: the dict, a copy the info owns)
                info[k] = dict(v) if isinstance(v, dict) else v
