"""MultimodalAccumulator: strategies per key, emit policies, per-request errors (CPU; reference and Triton)."""

import pytest
import torch

from vllm_omni_kernels import ops
from vllm_omni_kernels.accumulator import AccumulatorConfig, EmitPolicy, MultimodalAccumulator
from vllm_omni_kernels.errors import TensorAccumulationError, TensorConsolidationError
from vllm_omni_kernels.modality import OutputModality as M, TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch


@pytest.fixture(params=["torch", "triton"])
def acc(request, use_backend):
    use_backend(request.param)
    cfg = AccumulatorConfig(modality=M.AUDIO, strategies={"codes": S.CONCAT_DIM0, "frames": S.APPEND_LIST},
                            pool_budget_bytes=1 << 16, initial_frames=8)
    return MultimodalAccumulator(cfg, "cpu")


def test_every_strategy_in_one_final_only_request(acc):
    acc.add_request("a")
    audio = [torch.randn(5), torch.randn(0), torch.randn(7)]
    codes = [torch.randint(0, 9, (2, 4)), torch.randint(0, 9, (1, 4)), torch.randint(0, 9, (0, 4))]
    for step in range(3):
        errs = acc.append_step(["a"], {"audio": [audio[step]], "codes": [codes[step]], "sr": [24000 + step],
                                       "frames": [torch.tensor([step, step])], "scale": [torch.tensor(0.5 * step)]})
        assert errs == []
        assert acc.collect(request_ids=["a"]) == {}  # FINAL_ONLY: nothing before finish
    (p,) = acc.collect(["a"]).values()
    assert torch.equal(p.tensors["audio"], torch.cat(audio)) and p.primary_tensor is p.tensors["audio"]
    assert torch.equal(p.tensors["codes"], torch.cat(codes))
    assert [t.tolist() for t in p.tensors["frames"]] == [[0, 0], [1, 1], [2, 2]]
    assert p.metadata["sr"] == 24002 and float(p.metadata["scale"]) == 1.0
    assert "a" not in acc and acc.stats()["bytes_used"] == 0


def test_delta_and_cumulative_streams_at_the_callers_interval(acc):
    acc.add_request("d", emit=EmitPolicy.DELTA)
    acc.add_request("c", emit=EmitPolicy.CUMULATIVE)
    chunks = [torch.randn(2, 3) for _ in range(5)]
    deltas, cumul = [], []
    for step, ch in enumerate(chunks):
        acc.append_step(["d", "c"], {"audio": PaddedBatch(torch.stack([ch, ch]), [3, 3])})
        out = acc.collect(["d", "c"] if step == 4 else [], request_ids=["d", "c"] if step % 2 else ["c"])
        if "d" in out:
            deltas.append(out["d"].tensors["audio"])
        cumul.append(out["c"].tensors["audio"])
    assert [d.shape[-1] for d in deltas] == [6, 6, 3]  # every 2 steps, then the rest at finish
    assert torch.equal(torch.cat(deltas, dim=-1), torch.cat(chunks, dim=-1))
    assert [c.shape[-1] for c in cumul] == [3, 6, 9, 12, 15] and torch.equal(cumul[-1], torch.cat(chunks, dim=-1))


def test_bad_values_are_skipped_for_that_request_only(acc):
    for r in "abcd":
        acc.add_request(r)
    good = torch.randn(4)
    # Each request's first value fixes its strategy for the key: b and c start with metadata.
    assert acc.append_step(["a", "b", "c"], {"audio": [good, "oops", torch.tensor(3.0)]}) == []
    errs = acc.append_step(["a", "b", "d"], {"audio": [good, good, good]})  # b now disagrees with itself
    assert [e.request_id for e in errs] == ["b"] and errs[0].key == "audio" and "replace" in str(errs[0])
    errs = acc.append_step(["a", "d"], {"audio": [good, good.double()]})  # dtype changes mid-stream for d
    assert [e.request_id for e in errs] == ["d"] and "dtype" in str(errs[0])
    errs = acc.append_step(["a", "ghost"], {"audio": [good, good]})
    assert [e.request_id for e in errs] == ["ghost"]
    assert acc.accumulation_errors == 3
    out = acc.collect(["a", "b", "c", "d"])
    assert torch.equal(out["a"].tensors["audio"], torch.cat([good, good, good, good]))
    assert out["b"].metadata["audio"] == "oops" and "audio" not in out["b"].tensors
    assert float(out["c"].metadata["audio"]) == 3.0 and torch.equal(out["d"].tensors["audio"], good)


def test_undeclared_key_strategy_is_per_request(acc):
    """A request that sends an undeclared key as metadata does not turn another request's chunks of
    that key into metadata (or the other way round)."""
    acc.add_request("a")
    acc.add_request("b")
    assert acc.append_step(["a"], {"wave": [torch.tensor(0.5)]}) == []
    chunks = [torch.randn(3), torch.randn(2)]
    for c in chunks:
        assert acc.append_step(["a", "b"], {"wave": [torch.tensor(0.25), c]}) == []
    out = acc.collect(["a", "b"])
    assert float(out["a"].metadata["wave"]) == 0.25 and "wave" not in out["a"].tensors
    assert torch.equal(out["b"].tensors["wave"], torch.cat(chunks)) and "wave" not in out["b"].metadata


def test_batch_with_one_unknown_request_still_appends_the_others(acc):
    acc.add_request("a")
    data = torch.randn(2, 6)
    errs = acc.append_step(["a", "nobody"], {"audio": PaddedBatch(data, [4, 6])})
    assert [e.request_id for e in errs] == ["nobody"]
    assert torch.equal(acc.collect(["a"])["a"].tensors["audio"], data[0, :4])


def test_consolidation_error_fails_only_that_request(acc):
    acc.add_request("a")
    acc.add_request("b")
    acc.append_step(["a", "b"], {"audio": [torch.ones(2), torch.ones(3)]})
    acc.pools()[0].drain(["a"])  # someone drained behind the accumulator's back
    with pytest.raises(TensorConsolidationError) as info:
        acc.collect(["a", "b"])
    assert info.value.request_id == "a" and "a" not in acc and "b" in acc
    assert torch.equal(acc.collect(["b"])["b"].tensors["audio"], torch.ones(3))


def test_lifecycle_errors_and_abort(acc):
    acc.add_request("a")
    with pytest.raises(TensorAccumulationError):
        acc.add_request("a")
    acc.append_step(["a"], {"audio": [torch.ones(3)]})
    acc.abort("a")
    with pytest.raises(TensorAccumulationError):
        acc.abort("a")
    with pytest.raises(TensorAccumulationError):
        acc.collect(["a"])
    with pytest.raises(ValueError):
        acc.append_step(["x"], {"audio": torch.ones(3)})
    assert acc.stats()["bytes_used"] == 0


def test_image_rows_default_to_concat_dim0():
    acc = MultimodalAccumulator(AccumulatorConfig(modality=M.IMAGE, initial_frames=4), "cpu")
    acc.add_request("i")
    rows = [torch.randn(2, 3, 4), torch.randn(1, 3, 4)]
    for r in rows:
        acc.append_step(["i"], {"image": [r]})
    assert torch.equal(acc.collect(["i"])["i"].tensors["image"], torch.cat(rows))


def test_initial_frames_per_key():
    cfg = AccumulatorConfig(strategies={"codes": S.CONCAT_DIM0}, initial_frames={"audio": 64, "codes": 4})
    acc = MultimodalAccumulator(cfg, "cpu")
    acc.add_request("r")
    acc.append_step(["r"], {"audio": [torch.ones(10)], "codes": [torch.ones(2, 16, dtype=torch.int64)]})
    caps = {p.key: p.capacity_frames("r") for p in acc.pools()}
    assert caps == {"audio": 64, "codes": 4}


def test_a_consolidation_error_costs_no_other_request_its_unread_data(acc):
    acc.add_request("d", emit=EmitPolicy.DELTA)
    acc.add_request("f")
    acc.append_step(["d", "f"], {"audio": [torch.ones(3), torch.full((2,), 2.0)]})
    acc.pools()[0].drain(["f"])  # f's data drained behind the accumulator's back: it cannot consolidate
    with pytest.raises(TensorConsolidationError) as info:
        acc.collect(["f"], request_ids=["d"])
    assert info.value.request_id == "f" and "f" not in acc
    assert torch.equal(acc.collect(["d"])["d"].tensors["audio"], torch.ones(3))


def test_padded_batch_for_a_list_key_is_an_error_for_its_requests_only(acc):
    acc.add_request("a")
    acc.add_request("b")
    errs = acc.append_step(["a", "b"], {"frames": PaddedBatch(torch.ones(2, 3), [3, 3]),
                                        "audio": [torch.ones(2), torch.ones(1)], "sr": [16000, 24000]})
    assert sorted((e.request_id, e.key) for e in errs) == [("a", "frames"), ("b", "frames")]
    assert all(isinstance(e, TensorAccumulationError) for e in errs)
    out = acc.collect(["a", "b"])
    assert torch.equal(out["a"].tensors["audio"], torch.ones(2)) and out["b"].metadata["sr"] == 24000


def test_chunk_that_requires_grad_does_not_cost_later_keys(acc):
    acc.add_request("a")
    w = torch.ones(2, requires_grad=True)
    assert acc.append_step(["a"], {"audio": [w * 2], "codes": [torch.ones(1, 4, dtype=torch.int64)]}) == []
    p = acc.collect(["a"])["a"]
    assert torch.equal(p.tensors["audio"], torch.full((2,), 2.0)) and p.tensors["codes"].shape == (1, 4)


@pytest.mark.parametrize("codes", [
    [torch.ones(1, 4), torch.ones(1, 4)],  # two values for one request
    PaddedBatch(torch.ones(2, 1, 4, dtype=torch.int64), [1]),  # two rows for one request
    PaddedBatch(torch.ones(0, 1, 4, dtype=torch.int64), []),  # no row
    PaddedBatch(torch.ones(1, 1, 4, dtype=torch.int64), [1, 1]),  # two lengths
    PaddedBatch(torch.ones(1, 1, 4, dtype=torch.int64), [1.0]),  # a length that is no integer
])
def test_structural_errors_are_raised_before_anything_is_appended(acc, codes):
    acc.add_request("a")
    with pytest.raises((ValueError, TypeError)):
        acc.append_step(["a"], {"audio": [torch.ones(2)], "codes": codes})
    assert "audio" not in acc.collect(["a"])["a"].tensors


def test_a_padded_batch_of_other_rows_is_refused_when_a_request_of_it_is_rejected(acc):
    """Rows are taken by position when some request is rejected: a batch of three rows for two
    requests is as wrong then as otherwise."""
    acc.add_request("a", EmitPolicy.DELTA)
    with pytest.raises(ValueError):
        acc.append_step(["a", "unknown"], {"audio": PaddedBatch(torch.arange(9.0).view(3, 3), [3, 3])})


def test_a_pool_stays_within_its_budget_and_a_frame_past_it_fails_its_request():
    """A budget smaller than ``initial_frames`` frames holds fewer frames a slot (the arena is never
    larger than the budget); a frame larger than the whole budget is that request's error."""
    acc = MultimodalAccumulator(AccumulatorConfig(modality=M.IMAGE, pool_budget_bytes=1 << 20), "cpu")
    for rid in "ab":
        acc.add_request(rid)
    assert acc.append_step(["a"], {"image": [torch.ones(1, 3, 64, 64)]}) == []
    assert acc.stats()["bytes_reserved"] <= 1 << 20
    errors = acc.append_step(["a", "b"], {"image": [torch.ones(2, 3, 64, 64), torch.ones(1, 3, 512, 512)]})
    assert [(e.request_id, e.key) for e in errors] == [("b", "image")]
    assert acc.collect(["a"])["a"].tensors["image"].shape == (3, 3, 64, 64)


def test_a_padded_batch_whose_dtype_changes_mid_stream_fails_its_request_and_keeps_its_data(acc):
    """A request's key in a ``PaddedBatch`` of another dtype than its earlier chunks: that step's
    chunk is an error for the request (naming the change), and what it appended before stays,
    whole, in its slot; the other request of the batch is appended."""
    acc.add_request("a")
    acc.add_request("b")
    first = torch.randn(2, 4)
    assert acc.append_step(["a", "b"], {"audio": PaddedBatch(first, [4, 4])}) == []
    acc.abort("b")
    acc.add_request("b")
    errs = acc.append_step(["a", "b"], {"audio": PaddedBatch(torch.ones(2, 3, dtype=torch.float64), [3, 3])})
    assert [e.request_id for e in errs] == ["a"] and "changed mid-stream" in str(errs[0])
    payloads = acc.collect(["a", "b"])
    assert torch.equal(payloads["a"].tensors["audio"], first[0])
    assert torch.equal(payloads["b"].tensors["audio"], torch.ones(3, dtype=torch.float64))
    assert acc.stats()["bytes_used"] == 0


def test_a_batch_with_a_rejected_request_appends_the_others_with_their_own_lengths(acc):
    """Rows of a ``PaddedBatch`` that go on after a request of it is rejected keep each its own
    length: no request gets another's frames or padding."""
    for rid in ("a", "c"):
        acc.add_request(rid)
    data = torch.arange(15.0).view(3, 5)
    errs = acc.append_step(["a", "ghost", "c"], {"audio": PaddedBatch(data, [1, 2, 4])})
    assert [e.request_id for e in errs] == ["ghost"]
    payloads = acc.collect(["a", "c"])
    assert torch.equal(payloads["a"].tensors["audio"], data[0, :1])
    assert torch.equal(payloads["c"].tensors["audio"], data[2, :4])


def test_a_delta_request_gets_each_list_item_once_and_a_cumulative_one_all_so_far(acc):
    """APPEND_LIST keys: a DELTA emission holds the items since the last one (none twice), a
    CUMULATIVE one every item so far."""
    acc.add_request("d", emit=EmitPolicy.DELTA)
    acc.add_request("c", emit=EmitPolicy.CUMULATIVE)
    items = [torch.tensor([i, i]) for i in range(3)]
    got = {"d": [], "c": []}
    for step, item in enumerate(items):
        assert acc.append_step(["d", "c"], {"frames": [item, item]}) == []
        out = acc.collect(["d", "c"] if step == 2 else [], request_ids=["d", "c"])
        for rid in got:
            got[rid].append([t.tolist() for t in out[rid].tensors["frames"]])
    assert got["d"] == [[[0, 0]], [[1, 1]], [[2, 2]]]
    assert got["c"] == [[[0, 0]], [[0, 0], [1, 1]], [[0, 0], [1, 1], [2, 2]]]


def test_a_chunk_whose_frames_have_no_elements_fails_its_request_only(acc):
    """A chunk of frames without elements (``[0, n]`` of audio) is an error for its request and
    key; the other request of the step is appended."""
    acc.add_request("bad")
    acc.add_request("ok")
    errs = acc.append_step(["bad", "ok"], {"audio": [torch.ones(0, 5), torch.ones(3)]})
    assert [(e.request_id, e.key) for e in errs] == [("bad", "audio")] and "no elements" in str(errs[0])
    assert torch.equal(acc.collect(["ok"])["ok"].tensors["audio"], torch.ones(3))


def test_an_emitted_payloads_metadata_is_its_own(acc):
    """A payload handed out keeps the metadata it was emitted with: a later REPLACE value of its
    request (or a change to the later payload) does not reach it."""
    acc.add_request("d", emit=EmitPolicy.DELTA)
    acc.append_step(["d"], {"audio": [torch.ones(2)], "sr": [16000]})
    first = acc.collect(request_ids=["d"])["d"]
    acc.append_step(["d"], {"audio": [torch.ones(1)], "sr": [24000]})
    second = acc.collect(["d"])["d"]
    second.metadata["note"] = "mine"
    assert first.metadata == {"sr": 16000} and second.metadata == {"sr": 24000, "note": "mine"}


def test_more_requests_than_a_pool_had_slots_for_get_more_and_keep_every_chunk(use_backend):
    """A pool starts with ``max_slots`` slots and takes twice as many each time another request
    needs one (on the list path and the batched path alike); every request keeps its data."""
    use_backend("torch")
    acc = MultimodalAccumulator(AccumulatorConfig(modality=M.AUDIO, pool_budget_bytes=1 << 16, initial_frames=8,
                                                  max_slots=2), "cpu")
    ids = [f"r{i}" for i in range(7)]
    for rid in ids:
        acc.add_request(rid)
    assert acc.append_step(ids[:3], {"audio": [torch.full((3,), float(i)) for i in range(3)]}) == []
    batch = PaddedBatch(torch.arange(16.0).view(4, 4), [4, 2, 1, 3])
    assert acc.append_step(ids[3:], {"audio": batch}) == []
    (pool,) = acc.pools()
    assert pool.stats().slots_capacity == 8 and pool.stats().slots_used == 7
    got = acc.collect(ids)
    for i in range(3):
        assert torch.equal(got[f"r{i}"].tensors["audio"], torch.full((3,), float(i)))
    for b, n in enumerate([4, 2, 1, 3]):
        assert torch.equal(got[f"r{b + 3}"].tensors["audio"], torch.arange(16.0).view(4, 4)[b, :n])


def test_a_pool_that_starts_with_no_slots_makes_one_for_its_first_request(use_backend):
    use_backend("torch")
    acc = MultimodalAccumulator(AccumulatorConfig(pool_budget_bytes=1 << 16, initial_frames=8, max_slots=0), "cpu")
    acc.add_request("a")
    assert acc.append_step(["a"], {"audio": [torch.ones(3)]}) == []
    assert torch.equal(acc.collect(["a"])["a"].tensors["audio"], torch.ones(3))


def test_a_key_declared_append_list_collects_any_value(acc):
    """Strings, numbers and 0-d tensors of a key declared APPEND_LIST are items of its list, not
    metadata that each step replaces (an undeclared key's such values are metadata)."""
    acc.add_request("a")
    items = ["w0", 7, torch.tensor(3), torch.tensor([1, 2])]
    for item in items:
        assert acc.append_step(["a"], {"frames": [item], "sr": [24000]}) == []
    (p,) = acc.collect(["a"]).values()
    assert p.tensors["frames"][:2] == ["w0", 7] and all(x is y for x, y in zip(p.tensors["frames"], items))
    assert "frames" not in p.metadata and p.metadata == {"sr": 24000}


def test_a_tensor_that_is_not_plain_strided_memory_fails_its_request_only(acc):
    """A nested or sparse chunk is an error for its request and key; the other request of the
    step keeps every chunk."""
    acc.add_request("a")
    acc.add_request("b")
    for bad in (torch.nested.nested_tensor([torch.randn(3), torch.randn(2)]), torch.randn(4).to_sparse()):
        errs = acc.append_step(["a", "b"], {"audio": [bad, torch.arange(4.0)]})
        assert [(e.request_id, e.key) for e in errs] == [("a", "audio")] and "strided" in str(errs[0])
        errs = acc.append_step(["a", "b"], {"audio": PaddedBatch(bad.unsqueeze(0) if bad.is_sparse else bad, [2, 2])})
        assert [e.request_id for e in errs] == ["a", "b"] and "strided" in str(errs[0])
    assert torch.equal(acc.collect(["b"])["b"].tensors["audio"], torch.arange(4.0).repeat(2))


def test_complex_chunks_accumulate_and_those_no_kernel_copies_fail_their_request_only(acc):
    """complex64 goes through every backend as its bits; complex128 through the torch reference,
    and on a kernel backend it fails the request that sends it, naming the key."""
    acc.add_request("a")
    acc.add_request("b")
    spec = torch.randn(3, 2, dtype=torch.complex64)
    assert acc.append_step(["a", "b"], {"spec": [spec, spec[:1]]}) == []
    wide = torch.randn(2, dtype=torch.complex128)
    errs = acc.append_step(["a", "b"], {"wide": [wide, torch.arange(2.0)]})
    kernel = ops.uses_kernel(False)
    assert [(e.request_id, e.key, "16 bytes" in str(e)) for e in errs] == ([("a", "wide", True)] if kernel else [])
    got = acc.collect(["a", "b"])
    assert torch.equal(got["a"].tensors["spec"], spec) and torch.equal(got["b"].tensors["spec"], spec[:1])
    assert torch.equal(got["b"].tensors["wide"], torch.arange(2.0))
    assert kernel or torch.equal(got["a"].tensors["wide"], wide)


def test_pools_that_hold_no_request_are_kept_for_a_few_shapes_of_each_key(acc):
    """Each frame shape has a pool (an arena of its own): a stage whose shapes vary, images of many
    sizes, would keep an arena for every shape it ever saw. Of each key's pools that hold no
    request, those of the four shapes used last are kept (a shape that comes again finds its
    pool); another key's pools do not count; a pool no request could join goes the same way."""
    from vllm_omni_kernels.accumulator import _IDLE_POOLS

    def shapes():
        return sorted(p.frame_shape for p in acc.pools() if p.key == "codes")

    acc.add_request("voice")
    assert acc.append_step(["voice"], {"audio": [torch.arange(3.0)]}) == []  # another key, held throughout
    for width in range(4, 12):
        rid = f"image-{width}"
        acc.add_request(rid)
        chunk = torch.arange(2 * width).view(2, width)
        assert acc.append_step([rid], {"codes": [chunk]}) == []
        assert torch.equal(acc.collect([rid])[rid].tensors["codes"], chunk)
    assert shapes() == [(8,), (9,), (10,), (11,)] and _IDLE_POOLS == 4
    kept = {p.frame_shape: p for p in acc.pools()}[(10,)]
    acc.add_request("again")
    assert acc.append_step(["again"], {"codes": [torch.zeros(1, 10, dtype=torch.int64)]}) == []
    assert acc.collect(["again"]) and {p.frame_shape: p for p in acc.pools()}[(10,)] is kept
    # a pool made for a request that cannot join it (its key's frame changed mid-stream) is let go too
    acc.add_request("changing")
    assert acc.append_step(["changing"], {"codes": [torch.zeros(1, 4, dtype=torch.int64)]}) == []
    for width in range(20, 26):
        errs = acc.append_step(["changing"], {"codes": PaddedBatch(torch.zeros(1, 1, width, dtype=torch.int64), [1])})
        assert [e.request_id for e in errs] == ["changing"]
    assert len(shapes()) == _IDLE_POOLS + 1  # the four kept and the one "changing" holds
    assert [p.key for p in acc.pools()].count("audio") == 1


def test_a_request_moves_to_another_accumulator_only_while_it_holds_no_data(acc):
    """``move`` hands a request without a slot (metadata and list items only) to another accumulator
    (its first tensor is on that one's device), all it holds with it; once it holds a slot, or the
    other holds the id, nothing moves."""
    other = MultimodalAccumulator(acc.config, "cpu")
    for rid in "ab":
        acc.add_request(rid)
    assert acc.append_step(["a", "b"], {"sr": [24000, 16000], "frames": ["w", None],
                                        "audio": [None, torch.arange(3.0)]}) == []
    assert acc.move("a", other) and "a" not in acc and "a" in other
    assert not acc.move("b", other) and not acc.move("x", other) and "b" in acc
    assert other.append_step(["a"], {"audio": [torch.arange(2.0)]}) == []
    (p,) = other.collect(["a"]).values()
    assert torch.equal(p.tensors["audio"], torch.arange(2.0)) and p.tensors["frames"] == ["w"]
    assert p.metadata == {"sr": 24000}


def test_a_frame_as_large_as_the_pool_budget_fits():
    """A key's frame of exactly ``pool_budget_bytes`` fits its pool (a 64-byte frame in 64 bytes)."""
    acc = MultimodalAccumulator(AccumulatorConfig(strategies={"img": S.CONCAT_DIM0}, pool_budget_bytes=64,
                                                  initial_frames=1))
    acc.add_request("r", EmitPolicy.FINAL_ONLY)
    x = torch.arange(16, dtype=torch.float32).reshape(1, 4, 4)
    assert acc.append_step(["r"], {"img": [x]}) == []
    assert torch.equal(acc.collect(finished=["r"])["r"].tensors["img"], x)

