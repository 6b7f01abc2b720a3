"""``HeldTokens``: a paced request's token outputs wait for its data (marker vllm)."""

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import EngineCoreOutput, FinishReason  # noqa: E402

from vllm_omni_kernels.vllm_integration.scheduler import HOLDABLE, HeldTokens, _holdable  # noqa: E402

pytestmark = pytest.mark.vllm


def eco(rid, token, **fields):
    return EngineCoreOutput(request_id=rid, new_token_ids=[token], **fields)


def test_a_paced_stream_gets_every_token_in_order_with_its_data():
    held, paced = HeldTokens(), {"a", "b"}
    got = {"a": [], "b": [], "text": []}
    due_at = {"a": {4, 8}, "b": {6}}  # steps at which the worker has data for them
    for step in range(10):
        ecos = [eco("a", 100 + step), eco("b", 200 + step, events=[f"b{step}"] if step in (2, 6) else None),
                eco("text", 300 + step)]
        if step == 9:
            ecos[0].finish_reason = ecos[1].finish_reason = FinishReason.LENGTH
        due = {rid for rid, steps in due_at.items() if step in steps}
        for out in held.thin(ecos, paced if step < 9 else set(), due):
            got[out.request_id].append((step, out.new_token_ids, out.events))
    # the first output at once, then with data, then the final one: nothing lost, nothing reordered
    assert [(s, t) for s, t, _ in got["a"]] == [(0, [100]), (4, [101, 102, 103, 104]),
                                                (8, [105, 106, 107, 108]), (9, [109])]
    assert [(s, t) for s, t, _ in got["b"]] == [(0, [200]), (6, [201, 202, 203, 204, 205, 206]),
                                                (9, [207, 208, 209])]
    assert got["b"][1][2] == ["b2", "b6"]  # its scheduling events travel with the tokens, in order
    assert [t for _, t, _ in got["text"]] == [[300 + s] for s in range(10)]  # not paced: every step
    assert not held.active and len(held) == 0


def test_an_output_that_carries_more_than_tokens_goes_with_what_was_held():
    held = HeldTokens()
    held.thin([eco("a", 1)], {"a"}, set())
    assert held.thin([eco("a", 2)], {"a"}, set()) == [] and len(held) == 1
    (out,) = held.thin([eco("a", 3, kv_transfer_params={"k": 1})], {"a"}, set())
    assert out.new_token_ids == [2, 3] and out.kv_transfer_params == {"k": 1}


def test_a_dropped_request_leaves_nothing_behind():
    held = HeldTokens()
    held.thin([eco("a", 1)], {"a"}, set())
    held.thin([eco("a", 2)], {"a"}, set())
    held.drop("a")  # aborted: its held tokens go with it
    assert not held.active
    (out,) = held.thin([eco("a", 3)], {"a"}, set())  # a new request under the same id starts afresh
    assert out.new_token_ids == [3]


def test_every_field_of_vllms_output_is_either_holdable_or_checked():
    """A field vLLM adds later is not held silently: this fails until ``_holdable`` checks it."""
    fields = EngineCoreOutput.__struct_fields__
    defaulted = fields[len(fields) - len(EngineCoreOutput.__struct_defaults__):]
    assert set(fields) - set(defaulted) <= HOLDABLE
    for name in set(defaulted) - HOLDABLE:
        out = eco("a", 1)
        setattr(out, name, 1 if name == "num_nans_in_logits" else object())
        assert not _holdable(out), name
    for name in set(defaulted) & HOLDABLE:
        out = eco("a", 1)
        setattr(out, name, [object()])
        assert _holdable(out), name


def test_an_output_with_nans_in_its_logits_goes_at_once_and_vllm_counts_it():
    """vLLM marks a request corrupted from the output that reports NaNs in its logits: that output
    is not held (its count would be lost with the held output), and takes what was held."""
    held = HeldTokens()
    held.thin([eco("a", 1)], {"a"}, set())
    assert held.thin([eco("a", 2)], {"a"}, set()) == []
    (out,) = held.thin([eco("a", 3, num_nans_in_logits=2)], {"a"}, set())
    assert out.new_token_ids == [2, 3] and out.num_nans_in_logits == 2 and len(held) == 0


def test_what_take_gave_is_held_again_by_restore_events_without_tokens_too():
    """``restore`` holds again whatever ``take`` gave (the scheduler takes a failing request's held
    tokens and events, then restores them for its error output), events with no token among them."""
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType

    held = HeldTokens()
    event = EngineCoreEvent.new_event(EngineCoreEventType.PREEMPTED)
    held.restore({"a": ([], [event], [])})
    assert held.take("a") == ([], [event], []) and held.take("a") == ([], [], [])
