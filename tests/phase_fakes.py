"""A deterministic fake talker model and a minimal runner around ``OmniPhaseRunnerMixin``.

Every value the fake model produces is a small integer (exact in fp32, bf16 and fp16), a function of
the request and its position, so tests can state the exact expected buffers. The runner has only the
attributes the mixin reads (no vLLM runner is constructed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from vllm_omni_kernels.phase import PHASE_KEYS
from vllm_omni_kernels.phase.runner import OmniPhaseRunnerMixin

Q = 4  # codes per MTP row


def rid_code(rid: str) -> int:
    return sum(map(ord, rid)) % 13


def prompt_embed(rid: str, pos: np.ndarray, h: int) -> np.ndarray:
    return ((rid_code(rid) * 5 + pos[:, None] + np.arange(h)[None, :] % 3) % 50 + 1).astype(np.float32)


def decode_embed(rid: str, computed: int, h: int) -> np.ndarray:
    return ((rid_code(rid) * 3 + computed + np.arange(h) % 5) % 40 + 60).astype(np.float32)[None, :]


def mtp_hidden(rid: str, h: int) -> np.ndarray:
    return np.full((1, h), rid_code(rid) + 1, np.float32)


def mtp_text(rid: str, computed: int, h: int) -> np.ndarray:
    return np.full((1, h), computed % 7 + 2, np.float32)


def mtp_embed(e, hid, txt):
    return e * 2 + hid + txt  # at most 2*99 + 14 + 8: exact in every float dtype


def decode_id(rid: str, computed: int) -> int:
    return 1000 + rid_code(rid) * 100 + computed


def codes_of(ids: np.ndarray) -> np.ndarray:
    return ids.astype(np.int64)[:, None] * 10 + np.arange(Q)[None, :]


@dataclass
class FakeTalker:
    """``preprocess`` / ``preprocess_decode_batch`` / ``talker_mtp`` with exact, known outputs."""

    hidden: int
    dtype: torch.dtype
    mtp: bool = True
    batch_hook: bool = True
    has_preprocess: bool = True
    calls: list = field(default_factory=list)  # ("scalar", rid, span, info) / ("batch", [rids], [infos])
    mtp_calls: list = field(default_factory=list)
    break_batch: str | None = None  # make preprocess_decode_batch return something wrong

    def __post_init__(self):
        if self.mtp:
            self.talker_mtp = self._talker_mtp
        if self.batch_hook:
            self.preprocess_decode_batch = self._preprocess_decode_batch

    def _t(self, a, device):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=self.dtype)

    def preprocess(self, input_ids, input_embeds, **info):
        rid = info["request_id"]
        self.calls.append(("scalar", rid, int(input_ids.numel()), {k: info[k] for k in PHASE_KEYS}))
        dev = input_ids.device
        c, span = info["_omni_num_computed_tokens"], int(input_ids.numel())
        if info["_omni_is_prefill"]:
            emb = self._t(prompt_embed(rid, np.arange(c, c + span), self.hidden), dev)
            return input_ids, emb, {"meta": {"prefill_offset": c + span}}
        ids = torch.tensor([decode_id(rid, c + k) for k in range(span)], dtype=torch.int64, device=dev)
        emb = self._t(np.concatenate([decode_embed(rid, c + k, self.hidden) for k in range(span)]), dev)
        update = {"meta": {"decode_step": c}}
        if self.mtp and span == 1:
            update["mtp_inputs"] = (self._t(mtp_hidden(rid, self.hidden), dev),
                                    self._t(mtp_text(rid, c, self.hidden), dev))
        return ids, emb, update

    def _preprocess_decode_batch(self, input_ids, req_infos):
        rids = [i["request_id"] for i in req_infos]
        self.calls.append(("batch", rids, [{k: i[k] for k in PHASE_KEYS} for i in req_infos]))
        dev = input_ids.device
        cs = [i["_omni_num_computed_tokens"] for i in req_infos]
        ids = torch.tensor([decode_id(r, c) for r, c in zip(rids, cs)], dtype=torch.int64, device=dev)
        emb = self._t(np.concatenate([decode_embed(r, c, self.hidden) for r, c in zip(rids, cs)]), dev)
        updates = [{"meta": {"decode_step": c}} for c in cs]
        if self.break_batch == "rows":
            emb = emb[:-1]
        elif self.break_batch == "ids":
            ids = ids[:-1]
        elif self.break_batch == "updates":
            updates = updates[:-1]
        elif self.break_batch == "update type":  # the last row's update is not a dict
            updates[-1] = 5
        elif self.break_batch == "update key":  # the last row's update has a key preprocess takes itself
            updates[-1]["input_embeds"] = None
        elif self.break_batch == "update key not str":  # no keyword can name it
            updates[-1][1] = None
        elif self.break_batch == "update key self":  # the bound method's own first parameter
            updates[-1]["self"] = None
        elif self.break_batch == "arity":
            return ids, emb
        if not self.mtp:
            return ids, emb, updates
        hid = self._t(np.concatenate([mtp_hidden(r, self.hidden) for r in rids]), dev)
        txt = self._t(np.concatenate([mtp_text(r, c, self.hidden) for r, c in zip(rids, cs)]), dev)
        return ids, emb, hid, txt, updates

    def _talker_mtp(self, ids, embeds, hidden, text):
        self.mtp_calls.append(int(ids.shape[0]))
        codes = torch.from_numpy(codes_of(ids.cpu().numpy())).to(ids.device)
        return mtp_embed(embeds, hidden, text), codes


class FakeRunner(OmniPhaseRunnerMixin):
    """The attributes of a ``GPUModelRunner`` the mixin reads, with real buffers on ``device``."""

    def __init__(self, model: FakeTalker, *, device="cpu", max_rows=16, max_tokens=64):
        self.model = model
        self.requests: dict = {}
        self.model_intermediate_buffer: dict = {}
        self.max_tokens = max_tokens
        self.input_batch = SimpleNamespace(req_ids=[], num_computed_tokens_cpu=np.zeros(max_rows, np.int32))
        self.query_start_loc = SimpleNamespace(np=np.zeros(max_rows + 1, np.int32))
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.inputs_embeds = torch.zeros(max_tokens, model.hidden, dtype=model.dtype, device=device)
        self._omni_init_phase_routing(hidden_size=model.hidden, dtype=model.dtype, device=device,
                                      max_num_reqs=max_rows, max_num_tokens=max_tokens)

    def add_request(self, rid: str, prompt_len: int, embeds: bool = False) -> None:
        """A request's state as vLLM's runner keeps it (``embeds``: a prompt of embeddings, no ids)."""
        ids = None if embeds else list(range(prompt_len))
        self.requests[rid] = SimpleNamespace(prompt_token_ids=ids, num_prompt_tokens=prompt_len)

    def schedule(self, rows: list[tuple[str, int, int]], offsets: list[int] | None = None):
        """Lay out a step: rows of (request id, computed before the step, span); token buffers get
        sentinel values (ids 7, embeddings -1) so untouched positions are visible."""
        self.input_batch.req_ids = [r for r, _, _ in rows]
        self.input_batch.num_computed_tokens_cpu[:len(rows)] = [c for _, c, _ in rows]
        spans = np.array([s for _, _, s in rows], np.int64)
        starts = np.concatenate(([0], np.cumsum(spans)[:-1])) if offsets is None else np.array(offsets)
        self.query_start_loc.np[:len(rows)] = starts
        self.input_ids.fill_(7)
        self.inputs_embeds.fill_(-1)
        return spans

    def step(self, rows: list[tuple[str, int, int]], offsets: list[int] | None = None) -> None:
        spans = self.schedule(rows, offsets)
        self._omni_preprocess(self.input_ids, self.inputs_embeds, spans)
