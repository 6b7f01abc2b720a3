"""The prefill/decode phase contract through the runner mixin: metadata, routing, hooks, MTP, codes.

Each test runs on the torch reference and on the Triton gather (interpreted on CPU), and compares
the runner's buffers with ``phase_expect.expected_step``, built from the contract alone.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phase_expect import expected_step, hook_calls
from phase_fakes import FakeRunner, FakeTalker
from vllm_omni_kernels.errors import PhaseRoutingError
from vllm_omni_kernels.phase import IS_PREFILL, NUM_COMPUTED, PROMPT_LEN, PhaseBatch

H = 8
BACKENDS = ["torch", "triton"]


def make_runner(use_backend, backend, *, dtype=torch.float32, mtp=True, batch_hook=True, prompts=None, **kw):
    use_backend(backend)
    runner = FakeRunner(FakeTalker(H, dtype, mtp=mtp, batch_hook=batch_hook), **kw)
    for rid, p in (prompts or {}).items():
        runner.add_request(rid, p)
    return runner


def check_step(runner, rows, offsets=None):
    """Run one step and assert buffers, hook grouping and codes against the contract."""
    runner.model.calls.clear()
    runner.step(rows, offsets)
    ids, emb, calls, codes = expected_step(runner, rows, offsets)
    np.testing.assert_array_equal(runner.input_ids.cpu().numpy(), ids)
    np.testing.assert_array_equal(runner.inputs_embeds.float().cpu().numpy(), emb)
    assert hook_calls(runner.model) == calls
    for rid, want in codes.items():
        got = runner.model_intermediate_buffer[rid]["codes"]["audio"]
        np.testing.assert_array_equal(got.cpu().numpy(), want)
    if runner.has_talker_mtp:  # by batch row, every row past the batch 0 (an earlier step's too)
        valid = runner._omni_gather.code_valid.cpu().numpy()
        want = [int(r in codes) for r, _, _ in rows]
        np.testing.assert_array_equal(valid, want + [0] * (len(valid) - len(want)))
    return codes


# ------------------------------------------------------------------- the contract's table

CONTRACT = [  # prompt length, computed before step, span, prefill?, MTP eligible?
    (5, 0, 4, True, False),
    (5, 4, 1, True, False),   # one-token prefill tail
    (5, 5, 1, False, True),
    (5, 6, 1, False, True),
    (1, 0, 1, True, False),   # one-token prompt
    (5, 5, 2, False, False),  # decode span of two: scalar hook, no MTP
    (8, 4, 3, True, False),   # cached prefill
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt,computed,span,prefill,mtp", CONTRACT)
def test_contract_table_row_phase_and_mtp_eligibility(use_backend, backend, prompt, computed, span, prefill, mtp):
    runner = make_runner(use_backend, backend, prompts={"r": prompt})
    codes = check_step(runner, [("r", computed, span)])
    kind, rid, got_span, info = runner.model.calls[0] if runner.model.calls[0][0] == "scalar" else (
        "batch", "r", 1, runner.model.calls[0][2][0])
    assert info == {PROMPT_LEN: prompt, NUM_COMPUTED: computed, IS_PREFILL: prefill}
    assert type(info[PROMPT_LEN]) is int and type(info[NUM_COMPUTED]) is int and type(info[IS_PREFILL]) is bool
    assert ("r" in codes) is mtp
    assert runner._omni_last_plan.mtp_rows.tolist() == ([0] if mtp else [])
    assert kind == ("batch" if mtp else "scalar")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompt_of_embeddings_is_prefill_until_computed_and_a_row_without_state_is_refused(use_backend, backend):
    runner = make_runner(use_backend, backend)
    runner.add_request("e", 4, embeds=True)
    check_step(runner, [("e", 0, 3)])
    assert runner.model.calls[0][:2] == ("scalar", "e") and runner.model.calls[0][3][IS_PREFILL] is True
    assert runner.model.calls[0][3][PROMPT_LEN] == 4
    spans = runner.schedule([("e", 3, 1), ("gone", 1, 1)])
    with pytest.raises(PhaseRoutingError) as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id == "gone" and runner.model.calls[1:] == []


def test_phase_batch_is_vectorized_and_exact():
    p = PhaseBatch.compute([5, 5, 5, 1, 8], [0, 4, 5, 0, 4], [4, 1, 1, 1, 3])
    assert p.is_prefill.tolist() == [True, True, False, True, True]
    assert p.start.tolist() == [0, 4, 5, 6, 7]
    assert p.single_token_decode.tolist() == [False, False, True, False, False]
    empty = PhaseBatch.compute([], [], [])  # a start per row: none
    assert len(empty) == 0 and empty.start.shape == empty.span.shape == (0,)


# ------------------------------------------------------------------- mixed batches

PROMPTS = {"a": 5, "b": 3, "c": 6, "d": 2, "e": 4}
MIXED = {
    "interleaved": [("a", 0, 4), ("b", 3, 1), ("c", 5, 1), ("d", 1, 1), ("e", 4, 1)],
    "reversed": [("e", 4, 1), ("d", 1, 1), ("c", 5, 1), ("b", 3, 1), ("a", 0, 4)],
    "adjacent": [("b", 3, 1), ("c", 6, 1), ("e", 5, 1), ("a", 0, 4), ("d", 0, 2)],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", sorted(MIXED))
@pytest.mark.parametrize("mtp", [True, False])
def test_mixed_batch_routing_with_stale_phase_values(use_backend, backend, order, mtp):
    runner = make_runner(use_backend, backend, mtp=mtp, prompts=PROMPTS)
    for rid in PROMPTS:  # stale values from an earlier step must be overwritten
        runner.model_intermediate_buffer[rid] = {PROMPT_LEN: 99, NUM_COMPUTED: 99, IS_PREFILL: True}
    rows = MIXED[order]
    check_step(runner, rows)
    for call in runner.model.calls:
        infos = [call[3]] if call[0] == "scalar" else call[2]
        rids = [call[1]] if call[0] == "scalar" else call[1]
        for rid, info in zip(rids, infos):
            c = next(c for r, c, _ in rows if r == rid)
            assert info == {PROMPT_LEN: PROMPTS[rid], NUM_COMPUTED: c, IS_PREFILL: c < PROMPTS[rid]}
    batch_calls = [c for c in runner.model.calls if c[0] == "batch"]
    if order == "adjacent":
        assert [c[1] for c in batch_calls] == [["b", "c", "e"]]  # one call for adjacent decode rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_split_with_one_token_tail_then_decode(use_backend, backend):
    runner = make_runner(use_backend, backend, prompts={"p": 5, "q": 3})
    codes = check_step(runner, [("p", 0, 4), ("q", 3, 1)])
    assert "p" not in codes and "q" in codes
    tail = check_step(runner, [("q", 4, 1), ("p", 4, 1)])  # p's tail: keeps its prompt embedding
    assert "p" not in tail
    p_codes_before = runner.model_intermediate_buffer["p"].get("codes")
    assert p_codes_before is None
    decode = check_step(runner, [("p", 5, 1), ("q", 5, 1)])
    assert set(decode) == {"p", "q"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_launches_per_step(use_backend, backend):
    runner = make_runner(use_backend, backend, prompts=PROMPTS)
    runner.step(MIXED["interleaved"])
    assert runner._omni_gather.launches == 2  # one before MTP, one after
    plain = make_runner(use_backend, backend, mtp=False, prompts=PROMPTS)
    plain.step(MIXED["interleaved"])
    assert plain._omni_gather.launches == 1


# ------------------------------------------------------------------- non-MTP batched decode

@pytest.mark.parametrize("backend", BACKENDS)
def test_non_mtp_batched_decode_lands_in_buffers_and_leaves_pad_rows(use_backend, backend):
    runner = make_runner(use_backend, backend, mtp=False, prompts={"x": 2, "y": 2, "z": 2})
    check_step(runner, [("x", 2, 1), ("y", 3, 1), ("z", 9, 1)])
    assert runner.model.calls[0][:2] == ("batch", ["x", "y", "z"])
    assert (runner.inputs_embeds[3:] == -1).all() and (runner.input_ids[3:] == 7).all()  # pad rows
    assert runner.model_intermediate_buffer["y"]["meta"] == {"decode_step": 3}


BAD_OFFSETS = {"gap": [0, 2, 3], "reversed": [1, 0, 2], "duplicate": [0, 0, 1], "negative": [-1, 0, 1],
               "out of bounds": [61, 62, 64]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
def test_invalid_offsets_raise_before_any_hook(use_backend, backend, case):
    runner = make_runner(use_backend, backend, mtp=False, prompts={"x": 2, "y": 2, "z": 2})
    spans = runner.schedule([("x", 2, 1), ("y", 2, 1), ("z", 2, 1)], BAD_OFFSETS[case])
    before = runner.inputs_embeds.clone(), runner.input_ids.clone()
    with pytest.raises(PhaseRoutingError) as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id in {"x", "y", "z"}
    assert runner.model.calls == []
    assert torch.equal(runner.inputs_embeds, before[0]) and torch.equal(runner.input_ids, before[1])
    assert "meta" not in runner.model_intermediate_buffer.get("x", {})


def test_gaps_between_decode_rows_are_refused_only_where_one_block_is_written():
    """A batched decode run with a gap in its token offsets is one contiguous write without MTP
    (refused, naming the request), but with MTP every row is written at its own offset (planned).
    A row that schedules no token lies nowhere, whatever its offset."""
    from vllm_omni_kernels.phase import RoutingPlan
    decode = PhaseBatch.compute([3, 3], [3, 3], [1, 1], start=[0, 2])  # two decode rows, one token apart
    with pytest.raises(PhaseRoutingError, match="gap") as err:
        RoutingPlan.build(decode, ["a", "b"], num_tokens=3, batch_hook=True, mtp=False)
    assert err.value.request_id == "b"
    plan = RoutingPlan.build(decode, ["a", "b"], num_tokens=3, batch_hook=True, mtp=True)
    assert plan.mtp_offsets.tolist() == [0, 2]
    empty = PhaseBatch.compute([5, 3], [0, 3], [3, 0], start=[0, 1])  # no token: inside the other's span
    plan = RoutingPlan.build(empty, ["p", "q"], num_tokens=3, batch_hook=True, mtp=True)
    assert [step.row for step in plan.steps] == [0] and plan.mtp_rows.size == 0  # and no hook call for it


@pytest.mark.parametrize("mtp", [True, False])
def test_a_request_on_two_rows_of_a_step_is_refused_before_any_hook(use_backend, mtp):
    """One request, two single-token decode rows: its phase metadata (one dict per request) and its
    code slot are one, so the batched hook would tell both rows the second row's phase. Refused,
    naming the request, with nothing written."""
    runner = make_runner(use_backend, "torch", mtp=mtp, prompts={"a": 5, "b": 5})
    spans = runner.schedule([("a", 5, 1), ("b", 5, 1), ("a", 6, 1)], [0, 1, 2])
    before = runner.inputs_embeds.clone()
    with pytest.raises(PhaseRoutingError, match="two rows") as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id == "a" and runner.model.calls == [] and torch.equal(runner.inputs_embeds, before)


@pytest.mark.parametrize("embeds", ["fewer rows", "other width", "flat"])
def test_an_embedding_buffer_without_a_row_of_the_width_for_each_token_is_refused_before_any_hook(use_backend,
                                                                                                 embeds):
    """The step's ``inputs_embeds`` must hold a row of the hidden size for every token of
    ``input_ids``: a kernel writes a decode row at its token offset (past a shorter buffer's end).
    Refused, naming a request, with no hook called and nothing written."""
    runner = make_runner(use_backend, "triton", mtp=False, prompts={"a": 5, "b": 5})
    spans = runner.schedule([("a", 5, 1), ("b", 0, 5)])
    whole = runner.inputs_embeds.clone()
    bad = {"fewer rows": runner.inputs_embeds[:5], "other width": runner.inputs_embeds[:, :H - 1],
           "flat": runner.inputs_embeds.reshape(-1)}[embeds]
    with pytest.raises(PhaseRoutingError, match="inputs_embeds") as err:
        runner._omni_preprocess(runner.input_ids[:6], bad, spans)
    assert err.value.request_id == "a" and runner.model.calls == [] and torch.equal(runner.inputs_embeds, whole)


@pytest.mark.parametrize("case", ["other dtype", "strided rows", "more tokens", "more requests"])
def test_a_step_the_gather_was_not_set_up_for_is_refused_before_any_hook(use_backend, case):
    """An ``inputs_embeds`` of another dtype than the gather's, or whose rows are not contiguous,
    and a step of more tokens or requests than ``_omni_init_phase_routing`` was given: refused,
    naming the step's first request, before any hook runs and with nothing written (found while
    recording, it came after the hooks and the first launch, and blamed a request's hook)."""
    runner = make_runner(use_backend, "torch", dtype=torch.bfloat16, prompts={"a": 5, "b": 5, "c": 5}, max_tokens=8)
    runner._omni_init_phase_routing(hidden_size=H, dtype=torch.bfloat16, device="cpu", max_num_reqs=2,
                                    max_num_tokens=8)
    rows = {"more tokens": [("a", 0, 5), ("b", 0, 5)], "more requests": [("a", 5, 1), ("b", 5, 1), ("c", 5, 1)]}
    spans = runner.schedule(rows.get(case, [("a", 5, 1), ("b", 5, 1)]))
    ids, embeds = runner.input_ids, runner.inputs_embeds
    if case == "other dtype":
        embeds = torch.zeros(8, H, dtype=torch.float32)
    elif case == "strided rows":
        embeds = torch.zeros(8, 2 * H, dtype=torch.bfloat16)[:, ::2]
    elif case == "more tokens":
        ids, embeds = torch.full((10,), 7, dtype=torch.int32), torch.full((10, H), -1.0, dtype=torch.bfloat16)
    before = (ids.clone(), embeds.clone())
    with pytest.raises(PhaseRoutingError, match="inputs_embeds|set up for") as err:
        runner._omni_preprocess(ids, embeds, spans)
    assert err.value.request_id == "a" and runner.model.calls == []
    assert torch.equal(ids, before[0]) and torch.equal(embeds, before[1])


def test_a_text_only_models_rows_reach_its_hooks_and_the_model_as_their_token_embeddings(use_backend):
    """vLLM's runner embeds no token for a text-only model (it passes ids): with ``embedded=False``
    the step's token embeddings are written first, so a hook reads them and a row it leaves in
    place goes to the model as its tokens' embeddings, not as what the buffer held from the step
    before (-1 here); the buffer past the step's tokens is left alone."""
    use_backend("torch")
    model = FakeTalker(H, torch.float32, mtp=False, batch_hook=False)
    table = torch.randn(64, H, generator=torch.Generator().manual_seed(0))
    model.embed_input_ids = lambda ids: table[ids.long()]
    seen = []

    def in_place(input_ids, input_embeds, **info):
        seen.append(input_embeds.clone())
        return input_ids, input_embeds, None

    model.preprocess = in_place
    runner = FakeRunner(model)
    runner.add_request("a", 5)
    runner.add_request("b", 2)
    spans = runner.schedule([("a", 0, 3), ("b", 0, 2)])
    tokens = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    runner.input_ids[:5] = tokens
    runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans, embedded=False)
    want = table[tokens.long()]
    assert torch.equal(seen[0], want[:3]) and torch.equal(seen[1], want[3:])
    assert torch.equal(runner.inputs_embeds[:5], want) and (runner.inputs_embeds[5:] == -1).all()


def test_an_mtp_without_codes_leaves_no_row_flagged_as_having_codes(use_backend):
    """``talker_mtp`` may return no codes: the rows its first launch flagged are cleared, and no
    request's info gets a codes view (the code buffer holds an earlier step's codes)."""
    runner = make_runner(use_backend, "torch", prompts={"a": 5, "b": 5})
    check_step(runner, [("a", 5, 1), ("b", 6, 1)])  # codes for both
    mtp = runner.model.talker_mtp
    runner.model.talker_mtp = lambda *args: (mtp(*args)[0], None)
    runner.model_intermediate_buffer.clear()
    runner.step([("a", 6, 1), ("b", 7, 1)])
    assert runner._omni_gather.code_valid[:2].tolist() == [0, 0]
    assert all("codes" not in runner.model_intermediate_buffer[r] for r in "ab")


def test_gather_rows_must_be_integers():
    """Row indices that are not integers are refused (2.7 would be cut to row 2, a mask taken for
    rows 0 and 1)."""
    from vllm_omni_kernels.gather import GatherJobs

    dst, src = torch.zeros(4, H), torch.ones(2, H)
    for rows in (np.array([0.9, 2.7]), np.array([True, False])):
        jobs = GatherJobs(torch.float32, H, "cpu")
        with pytest.raises(TypeError, match="integers"):
            jobs.rows(dst, rows, src)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("broken", ["rows", "ids", "updates", "update type", "update key", "update key not str",
                                    "update key self", "arity"])
@pytest.mark.parametrize("mtp", [True, False])
def test_incomplete_hook_outputs_raise_with_buffers_unchanged(use_backend, backend, broken, mtp):
    runner = make_runner(use_backend, backend, mtp=mtp, prompts={"p": 4, "x": 2, "y": 2})
    runner.model.break_batch = broken
    spans = runner.schedule([("p", 0, 3), ("x", 2, 1), ("y", 2, 1)])
    before = runner.inputs_embeds.clone(), runner.input_ids.clone()
    with pytest.raises(PhaseRoutingError) as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id == ("y" if broken.startswith("update ") else "x")
    assert torch.equal(runner.inputs_embeds, before[0]) and torch.equal(runner.input_ids, before[1])
    assert "meta" not in runner.model_intermediate_buffer["p"]  # no update merged, not even row p's
    runner.model.break_batch = None  # the runner is usable again
    check_step(runner, [("p", 0, 3), ("x", 2, 1), ("y", 2, 1)])


# ------------------------------------------------------------------- MTP forward

@pytest.mark.parametrize("backend", BACKENDS)
def test_mtp_forward_empty_batch_is_noop(use_backend, backend):
    runner = make_runner(use_backend, backend, prompts={"a": 1})
    before = runner.inputs_embeds.clone()
    runner._talker_mtp_forward([], runner.inputs_embeds, [])
    assert torch.equal(runner.inputs_embeds, before) and runner._omni_gather.launches == 0
    assert runner.model.mtp_calls == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_mtp_forward_scatters_to_non_contiguous_offsets(use_backend, backend):
    runner = make_runner(use_backend, backend, prompts={"a": 1, "b": 1})
    g = runner._omni_gather
    g.mtp_input_ids[:2] = torch.tensor([11, 12], dtype=torch.int32)
    g.mtp_inputs_embeds[:2] = torch.tensor([[1.0], [2.0]]).expand(2, H)
    g.last_hidden[:2] = 3
    g.text_step[:2] = 4
    runner.inputs_embeds.fill_(-1)
    runner._talker_mtp_forward(["a", "b"], runner.inputs_embeds, [0, 3])
    got = runner.inputs_embeds.float()
    assert (got[0] == 1 * 2 + 7).all() and (got[3] == 2 * 2 + 7).all()
    assert (got[[1, 2, 4]] == -1).all()
    assert runner.model_intermediate_buffer["a"]["codes"]["audio"].tolist() == [[110, 111, 112, 113]]
    assert runner.model_intermediate_buffer["b"]["codes"]["audio"].tolist() == [[120, 121, 122, 123]]


def test_mtp_forward_rejects_repeated_offsets_naming_a_request_that_repeats():
    runner = FakeRunner(FakeTalker(H, torch.float32))
    for rid in "abc":
        runner.add_request(rid, 1)
    with pytest.raises(PhaseRoutingError) as err:
        runner._talker_mtp_forward(["a", "b", "c"], runner.inputs_embeds, [5, 2, 2])
    assert err.value.request_id == "c"


def test_mtp_forward_rejects_a_request_on_two_rows_before_the_model_runs():
    """Two rows of one request would write its one code slot twice (two programs racing on one
    row on the GPU), and both would get the same codes view: refused, naming it, as
    ``_omni_preprocess`` refuses a request on two rows of a step."""
    runner = FakeRunner(FakeTalker(H, torch.float32))
    for rid in "ab":
        runner.add_request(rid, 1)
    with pytest.raises(PhaseRoutingError, match="two MTP rows") as err:
        runner._talker_mtp_forward(["a", "b", "a"], runner.inputs_embeds, [0, 1, 2])
    assert err.value.request_id == "a" and runner.model.mtp_calls == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_mtp_outputs_merge_no_update(use_backend, backend):
    """MTP's outputs exist only after the step's first launch: a bad one fails the step with no
    update merged (the prefill row's own included)."""
    runner = make_runner(use_backend, backend, prompts={"p": 4, "x": 2})
    runner.model.talker_mtp = lambda ids, embeds, hidden, text: (embeds[:, :-1], None)  # one column short
    spans = runner.schedule([("p", 0, 3), ("x", 2, 1)])
    with pytest.raises(PhaseRoutingError, match="talker_mtp embeddings") as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id == "x" and "meta" not in runner.model_intermediate_buffer["p"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_whose_mtp_codes_fail_leaves_no_copy_for_the_next_step(use_backend, backend):
    """MTP's embeddings are recorded before its codes are checked: codes the kernels cannot read
    (sparse) fail the step naming a request, and the embeddings' copies recorded for it are dropped;
    the next step, with other rows at those offsets, is exactly the contract's."""
    runner = make_runner(use_backend, backend, prompts={"a": 3, "b": 3, "n": 6, "m": 3})
    mtp = runner.model.talker_mtp
    runner.model.talker_mtp = lambda *args: (mtp(*args)[0], mtp(*args)[1].to_sparse())
    with pytest.raises(PhaseRoutingError, match="strided") as err:
        runner.step([("a", 3, 1), ("b", 3, 1)])
    assert err.value.request_id == "a"
    runner.model.talker_mtp = mtp
    check_step(runner, [("n", 0, 2), ("m", 3, 1)])


@pytest.mark.parametrize("hook", ["scalar", "batch", "batch ids", "mtp_inputs"])
def test_hook_tensors_the_kernels_cannot_read_fail_their_request(use_backend, hook):
    """A sparse tensor of the right shape from a hook fails the step with a ``PhaseRoutingError``
    naming the request, before the runner reads its memory (the layout had no check: an untyped
    RuntimeError)."""
    runner = make_runner(use_backend, "triton", batch_hook=hook.startswith("batch"), prompts={"p": 4, "x": 2, "y": 2})
    if hook.startswith("batch"):
        batch = runner.model.preprocess_decode_batch
        runner.model.preprocess_decode_batch = lambda input_ids, req_infos: (
            lambda out: (out[0].to_sparse(), *out[1:]) if hook == "batch ids" else
            (out[0], out[1].to_sparse(), *out[2:]))(batch(input_ids, req_infos))
        rows, named = [("x", 2, 1), ("y", 2, 1)], "x"
    else:
        scalar = runner.model.preprocess

        def sparse(input_ids, input_embeds, **info):
            ids, embeds, update = scalar(input_ids, input_embeds, **info)
            if hook == "scalar":
                return ids, embeds.to_sparse(), update
            hidden, text = update["mtp_inputs"]
            return ids, embeds, {**update, "mtp_inputs": (hidden.to_sparse(), text)}
        runner.model.preprocess = sparse
        rows, named = ([("p", 0, 3)], "p") if hook == "scalar" else ([("x", 2, 1)], "x")
    with pytest.raises(PhaseRoutingError, match="strided") as err:
        runner.step(rows)
    assert err.value.request_id == named


def test_an_update_brings_a_dict_where_the_info_held_another_value(use_backend):
    """A prefill hook that sets ``codes`` to None, then MTP's ``{"codes": {"audio": view}}``: the
    dict takes the key's place (a merge into None raised an AttributeError after the step's copies,
    with some requests' updates merged and others not)."""
    runner = make_runner(use_backend, "torch", batch_hook=False, prompts={"a": 2, "b": 2})
    scalar = runner.model.preprocess

    def none_yet(input_ids, input_embeds, **info):
        ids, embeds, update = scalar(input_ids, input_embeds, **info)
        return ids, embeds, ({**update, "codes": None} if info["_omni_is_prefill"] else update)
    runner.model.preprocess = none_yet
    runner.step([("a", 0, 2)])
    assert runner.model_intermediate_buffer["a"]["codes"] is None
    codes = check_step(runner, [("b", 2, 1), ("a", 2, 1)])
    assert set(codes) == {"a", "b"} and runner.model_intermediate_buffer["a"]["meta"]["decode_step"] == 2


@pytest.mark.parametrize("offsets", [None, [0, 2]])
def test_ids_a_batch_hook_rewrites_in_place_reach_the_step(use_backend, offsets):
    """A hook that writes its new ids into the tensor it was given and returns it: with a gap
    between the rows (runner MTP allows one) that tensor is a gathered copy, whose ids must still
    reach the step's buffer, as a contiguous run's view does by itself."""
    runner = make_runner(use_backend, "torch", prompts={"a": 1, "b": 1})
    batch = runner.model.preprocess_decode_batch

    def in_place(input_ids, req_infos):
        out = batch(input_ids, req_infos)
        input_ids.copy_(out[0])
        return (input_ids, *out[1:])
    runner.model.preprocess_decode_batch = in_place
    check_step(runner, [("a", 1, 1), ("b", 1, 1)], offsets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_mtp_inputs_of_another_size_name_their_request(use_backend, backend):
    runner = make_runner(use_backend, backend, batch_hook=False, prompts={"a": 1})
    hook = runner.model.preprocess

    def bad(input_ids, input_embeds, **info):
        ids, embeds, update = hook(input_ids, input_embeds, **info)
        update["mtp_inputs"] = (torch.zeros(H + 1), update["mtp_inputs"][1])
        return ids, embeds, update

    runner.model.preprocess = bad
    spans = runner.schedule([("a", 3, 1)])
    with pytest.raises(PhaseRoutingError, match="last_hidden") as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id == "a"


def test_an_evicted_code_slot_never_belongs_to_a_request_of_the_step():
    """With every code slot taken, a new request of the step evicts a request not in the step (``keep``:
    the step's requests), never one the step still writes codes for."""
    from vllm_omni_kernels.gather import DecodeGather
    g = DecodeGather(hidden_size=4, dtype=torch.float32, device="cpu", max_rows=2, max_tokens=8, mtp=True)
    live = {"a", "b", "c"}
    g.code_slot("b", live)
    g.code_slot("c", live)
    evicted = []
    step = ["b", "a"]
    slots = [g.code_slot(r, live, keep=step, evict=lambda r, s: evicted.append(r)) for r in step]
    assert len(set(slots)) == 2 and evicted == ["c"]


def test_code_slots_of_requests_that_ended_unreleased_are_taken_back_before_any_eviction():
    """With every code slot held, the slots of requests no longer live (ended without a release) are
    freed for new requests: without ``evict`` none is refused, and with it no live request (one
    preempted, not in the step) is evicted while an ended one holds a slot."""
    from vllm_omni_kernels.gather import DecodeGather
    g = DecodeGather(hidden_size=4, dtype=torch.float32, device="cpu", max_rows=2, max_tokens=8, mtp=True)
    g.code_slot("a", {"a", "b"})
    g.code_slot("b", {"a", "b"})
    assert {g.code_slot("c", {"c", "d"}), g.code_slot("d", {"c", "d"})} == {0, 1}
    g = DecodeGather(hidden_size=4, dtype=torch.float32, device="cpu", max_rows=2, max_tokens=8, mtp=True)
    g.code_slot("preempted", {"preempted", "ended"})
    g.code_slot("ended", {"preempted", "ended"})
    evicted = []
    g.code_slot("new", {"preempted", "new"}, keep=["new"], evict=lambda r, s: evicted.append(r))
    assert evicted == []
    assert g.code_slot("preempted", {"preempted", "new"}) is not None and evicted == []


def test_a_hook_that_broadcasts_one_row_of_its_slice_has_its_embeddings_used():
    """A prefill hook may return a view of its own slice with other strides (the first token's row
    for every token, ``expand``): that is new embeddings, copied in, not the slice as it was."""
    runner = FakeRunner(FakeTalker(H, torch.float32, batch_hook=False))
    runner.add_request("a", 4)
    runner.model.preprocess = lambda input_ids, input_embeds, **info: (
        input_ids, input_embeds[:1].expand(input_embeds.shape[0], H), {})
    spans = runner.schedule([("a", 0, 3)])
    runner.inputs_embeds[:3] = torch.arange(3 * H, dtype=torch.float32).view(3, H)
    runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert torch.equal(runner.inputs_embeds[:3], torch.arange(H, dtype=torch.float32).expand(3, H))


def test_a_step_of_exactly_the_most_tokens_runs():
    """vLLM fills a step up to ``max_num_batched_tokens`` (a long prompt's chunk): a step of exactly
    that many tokens is routed, not refused."""
    runner = FakeRunner(FakeTalker(H, torch.float32, mtp=False), max_tokens=16)
    runner.add_request("a", 16)
    runner.step([("a", 0, 16)])
    assert "a" in runner.model_intermediate_buffer


def test_a_hooks_nested_updates_merge_into_a_copy_the_request_owns():
    """A hook's ``{key: dict}`` update merges one level deep into the request's info (what the
    prefill set stays when a decode step adds to it), and the info keeps a copy: a dict the model
    hands to several requests (a module default) is neither changed nor shared by a later update."""
    from vllm_omni_kernels.phase.runner import OmniPhaseRunnerMixin

    class Runner(OmniPhaseRunnerMixin):
        def __init__(self):
            self.model_intermediate_buffer = {}

    defaults = {"voice": "alloy"}
    r = Runner()
    r._update_intermediate_buffer("a", {"style": defaults, "meta": {"prefill_offset": 3}})
    r._update_intermediate_buffer("b", {"style": defaults})
    r._update_intermediate_buffer("a", {"style": {"speed": 2.0}, "meta": {"decode_step": 3}})
    info = r.model_intermediate_buffer
    assert info["a"]["meta"] == {"prefill_offset": 3, "decode_step": 3}
    assert info["a"]["style"] == {"voice": "alloy", "speed": 2.0}
    assert info["b"]["style"] == {"voice": "alloy"} and defaults == {"voice": "alloy"}


def test_scalar_hook_wrong_embedding_rows_names_request():
    runner = FakeRunner(FakeTalker(H, torch.float32, batch_hook=False))
    runner.add_request("a", 4)
    runner.model.preprocess = lambda input_ids, input_embeds, **info: (input_ids, input_embeds[:1], {})
    spans = runner.schedule([("a", 0, 3)])
    with pytest.raises(PhaseRoutingError, match="preprocess embeddings") as err:
        runner._omni_preprocess(runner.input_ids, runner.inputs_embeds, spans)
    assert err.value.request_id == "a"


def test_code_slots_are_reused_after_release():
    runner = FakeRunner(FakeTalker(H, torch.float32), max_rows=2)
    for rid in "abc":
        runner.add_request(rid, 1)
    check_step(runner, [("a", 1, 1), ("b", 1, 1)])
    del runner.requests["a"]  # finished without an explicit release: reclaimed when needed
    check_step(runner, [("c", 1, 1), ("b", 2, 1)])
    runner._omni_release_request("b")
    check_step(runner, [("c", 2, 1)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_vllm_keeps_but_did_not_schedule_give_their_code_slots_to_the_step(use_backend, backend):
    """vLLM keeps a preempted request, and one it did not schedule this step, in its requests:
    with two code slots, a and b decode, a waits, and the step of b and c still runs; a's info
    still shows a's latest codes, in a tensor of its own now."""
    runner = make_runner(use_backend, backend, max_rows=2, prompts={"a": 1, "b": 1, "c": 1})
    check_step(runner, [("a", 1, 1), ("b", 1, 1)])
    codes = runner.model_intermediate_buffer["a"]["codes"]["audio"].clone()
    check_step(runner, [("b", 2, 1), ("c", 1, 1)])
    now = runner.model_intermediate_buffer["a"]["codes"]["audio"]
    assert torch.equal(now, codes) and all(now.data_ptr() != row.data_ptr() for row in runner._omni_gather.codes)
    check_step(runner, [("a", 2, 1), ("c", 2, 1)])  # a back: b gives its slot up


# ------------------------------------------------------------------- property test

ROW = st.tuples(st.integers(1, 6), st.integers(0, 8), st.integers(1, 3))


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(ROW, min_size=1, max_size=7), mtp=st.booleans(), batch_hook=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), triton=st.booleans())
def test_random_batches_match_the_contract(rows, mtp, batch_hook, dtype, triton):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_OMNI_KERNELS_BACKEND", "triton" if triton else "torch")
        runner = FakeRunner(FakeTalker(H, dtype, mtp=mtp, batch_hook=batch_hook))
        step = []
        for i, (prompt, computed, span) in enumerate(rows):
            runner.add_request(f"r{i}", prompt)
            step.append((f"r{i}", computed, span))
        check_step(runner, step)
        assert runner._omni_gather.launches <= (2 if mtp else 1)
