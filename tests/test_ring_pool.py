"""RingPool semantics on CPU, for the reference and the Triton (interpreted) backends alike."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ALL_DTYPES, random_tensor
from ring_cases import check_complex_pool
from vllm_omni_kernels.errors import (OutputMemoryError, OutputTooLargeError, TensorAccumulationError,
                                      TensorConsolidationError)
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch, RingPool

BACKENDS = ["torch", "triton"]


def make_pool(strategy=S.CONCAT_LAST, frame=(), dtype=torch.float32, **kw):
    kw.setdefault("budget_bytes", 1 << 16)
    kw.setdefault("initial_frames", 8)
    return RingPool("audio", dtype, frame, "cpu", strategy, **kw)


def cat(chunks, last):
    return torch.cat(chunks, dim=-1 if last else 0)


@pytest.fixture(params=BACKENDS)
def backend(request, use_backend):
    use_backend(request.param)
    return request.param


@pytest.mark.parametrize("strategy, frame", [(S.CONCAT_LAST, ()), (S.CONCAT_LAST, (2,)), (S.CONCAT_DIM0, (3,)),
                                             (S.CONCAT_DIM0, (2, 2))])
def test_append_drain_consolidate_with_wrap_and_zero_lengths(backend, strategy, frame):
    last = strategy is S.CONCAT_LAST
    pool = make_pool(strategy, frame, growth=False)
    ids = ["a", "b"]
    for r in ids:
        pool.alloc(r)
    g = torch.Generator().manual_seed(1)
    kept = []
    # b drains every step with lengths that wrap its 8-frame ring many times; a keeps everything.
    for step in range(10):
        lens = [step % 2, [0, 3, 5, 7][step % 4]]
        shape = (2, *frame, 7) if last else (2, 7, *frame)
        data = random_tensor(shape, torch.float32, generator=g)
        res = pool.append(ids, PaddedBatch(data, lens))
        assert res.errors == () and res.appended == 2
        kept.append(data[0][..., : lens[0]] if last else data[0][: lens[0]])
        expect_b = data[1][..., : lens[1]] if last else data[1][: lens[1]]
        (got_b,) = pool.drain(["b"])
        assert torch.equal(got_b, expect_b)
        assert pool.unread_frames("b") == 0
    (got_a,) = pool.consolidate(["a"])
    assert torch.equal(got_a, cat(kept, last))
    assert torch.equal(pool.consolidate(["a"])[0], got_a), "consolidate must not advance"


def test_list_input_packs_and_matches(backend):
    pool = make_pool(S.CONCAT_DIM0, (4,), dtype=torch.int64)
    for r in "xyz":
        pool.alloc(r)
    g = torch.Generator().manual_seed(2)
    chunks = [random_tensor((n, 4), torch.int64, generator=g) for n in (3, 0, 5)]
    res = pool.append(list("xyz"), chunks)
    assert res.errors == ()
    more = [random_tensor((2, 4), torch.int64, generator=g), None, random_tensor((1, 4), torch.int64, generator=g)]
    pool.append(list("xyz"), more)
    x, y, z = pool.consolidate(list("xyz"))
    assert torch.equal(x, torch.cat([chunks[0], more[0]])) and y.shape == (0, 4)
    assert torch.equal(z, torch.cat([chunks[2], more[2]]))


def test_growth_keeps_unread_data_across_wrap(backend):
    pool = make_pool(S.CONCAT_LAST, (), initial_frames=4)
    pool.alloc("r")
    pool.append(["r"], [torch.arange(3.0)])
    pool.drain(["r"])  # tail now at 3: the next append wraps
    pool.append(["r"], [torch.arange(3.0, 6.0)])
    assert pool.capacity_frames("r") == 4
    pool.append(["r"], [torch.arange(6.0, 13.0)])  # 3 unread + 7 > 4: grows, copying the wrapped span
    assert pool.capacity_frames("r") >= 10 and pool.stats().growths == 1
    (out,) = pool.drain(["r"])
    assert torch.equal(out, torch.arange(3.0, 13.0))


def _other_intact(pool, ids, expected):
    outs = pool.drain(ids)
    for o, e in zip(outs, expected):
        assert torch.equal(o, e)


def test_errors_name_request_and_key_and_leave_others_intact(backend):
    pool = make_pool(S.CONCAT_LAST, (2,), growth=False)
    for r in ("good", "bad"):
        pool.alloc(r)
    good = torch.randn(2, 3)
    cases = [
        (torch.randn(2, 3, dtype=torch.float64), "dtype"),
        (torch.randn(3, 3), "frame shape"),
        (torch.randn(2), "of 1 dimension: chunks of this key have 2 ([*frame, n], frame shape (2,))"),
        (torch.tensor(1.0), "of 0 dimensions: chunks of this key have 2"),
        (torch.randn(2, 3, device="meta"), "pool is on cpu"),
        ("not a tensor", "expected a tensor"),
        (torch.randn(2, 9), "overwrite unread data"),
    ]
    expected_good = []
    for bad_value, message in cases:
        res = pool.append(["good", "bad"], [good, bad_value])
        expected_good.append(good)
        assert len(res.errors) == 1, message
        err = res.errors[0]
        assert isinstance(err, TensorAccumulationError) and err.request_id == "bad" and err.key == "audio"
        assert message in str(err) and "'bad'" in str(err)
        assert pool.unread_frames("bad") == 0
        pool.drain(["good"])
    res = pool.append(["good", "ghost"], [good, good])
    assert [e.request_id for e in res.errors] == ["ghost"] and "unknown" in str(res.errors[0])
    res = pool.append(["good", "good"], [good, good])
    assert len(res.errors) == 1 and "twice" in str(res.errors[0])
    _other_intact(pool, ["good"], [torch.cat([good, good], dim=-1)])
    assert pool.stats().rejected == 9


def test_padded_batch_errors_per_request(backend):
    pool = make_pool(S.CONCAT_LAST, (), growth=False)
    for r in "abc":
        pool.alloc(r)
    data = torch.randn(3, 6)
    res = pool.append(list("abc"), PaddedBatch(data, [2, 7, -1]))
    assert sorted(e.request_id for e in res.errors) == ["b", "c"]
    assert torch.equal(pool.consolidate(["a"])[0], data[0, :2])
    res = pool.append(list("abc"), PaddedBatch(data.double(), [1, 1, 1]))
    assert len(res.errors) == 3 and all("dtype" in str(e) for e in res.errors)
    with pytest.raises(TypeError):
        pool.append(["a"], PaddedBatch(data[:1], torch.ones(1, dtype=torch.int64, device="meta")))
    with pytest.raises(ValueError):
        pool.append(["a", "b"], PaddedBatch(data, [1, 1, 1]))
    for lengths in ([2.7, 1.0, 1.0], torch.tensor([2.7, 1.0, 1.0])):  # not cut to 2 frames
        with pytest.raises(TypeError, match="integers"):
            pool.append(list("abc"), PaddedBatch(data, lengths))
    assert torch.equal(pool.consolidate(["a"])[0], data[0, :2])



def test_unread_data_past_what_one_launch_copies_is_its_requests_error(backend):
    """A read copies a request's unread span in one launch, of at most 2**31 - 1 elements: data
    past that would stay in the slot for good, so the request gets an error when it would get
    there (here a 1 MiB frame: 2047 of them), and nothing of it is written."""
    pool = RingPool("video", torch.uint8, (1 << 20,), "cpu", S.CONCAT_DIM0, budget_bytes=4 << 20, initial_frames=2)
    pool.alloc("a")
    slots = pool.slots(["a"])
    pool.advance(slots, np.array([2000]))  # what 2000 frames appended would count (none is written here)
    errors = []
    keep = pool.make_room(["a"], slots, np.array([100]), errors)  # 100 frames fit one launch; 2100 do not
    assert not keep[0] and "one launch copies" in str(errors[0]) and errors[0].request_id == "a"
    assert pool.unread_frames("a") == 2000 and pool.stats().growths == 0


def test_a_step_that_repeats_the_last_stops_at_what_one_launch_copies(backend):
    """The repeated step launches from kept rows while the slots have room; a slot grown past
    ``max_unread_frames`` (capacities are powers of two) has room only up to it, so the step is
    planned and the request gets its error there (the limit is lowered to 100 frames here)."""
    pool = make_pool(initial_frames=64, budget_bytes=4 << 10)
    pool.max_unread_frames = 100
    pool.alloc("a")
    errors = []
    for _ in range(12):
        errors += pool.append(["a"], PaddedBatch(torch.ones(1, 10), [10])).errors
    assert pool.unread_frames("a") == 100 and len(errors) == 2 and pool.stats().repeated_launches

def test_free_double_free_and_freed_slot(backend):
    pool = make_pool()
    pool.alloc("a")
    pool.alloc("b")
    pool.append(["a", "b"], [torch.ones(3), torch.full((2,), 2.0)])
    pool.free("a")
    with pytest.raises(TensorAccumulationError, match="already freed") as info:
        pool.free("a")
    assert info.value.request_id == "a" and info.value.key == "audio"
    res = pool.append(["a", "b"], [torch.ones(1), torch.full((1,), 3.0)])
    assert [e.request_id for e in res.errors] == ["a"]
    with pytest.raises(TensorAccumulationError):
        pool.drain(["a"])
    assert torch.equal(pool.consolidate(["b"])[0], torch.tensor([2.0, 2.0, 3.0]))
    with pytest.raises(TensorAccumulationError, match="already holds"):
        pool.alloc("b")


def test_free_many_frees_all_or_nothing(backend):
    pool = make_pool()
    for r in "abcd":
        pool.alloc(r)
    pool.append(list("abcd"), [torch.full((3,), float(i)) for i in range(4)])
    used = pool.stats().bytes_used
    for bad, named, why in ((["a", "x"], "x", "already freed"), (["b", "a", "b"], "b", "named twice")):
        with pytest.raises(TensorAccumulationError, match=why) as info:
            pool.free_many(bad)
        assert info.value.request_id == named and len(pool) == 4 and pool.stats().bytes_used == used
    with pytest.raises(TensorAccumulationError, match="named twice in one call") as info:
        pool.drain(["b", "b"])  # (a read, as a free, takes each request once)
    assert info.value.request_id == "b" and pool.stats().unread_bytes == 4 * 3 * 4
    pool.free_many(["c", "a"])
    assert len(pool) == 2 and "a" not in pool and "c" not in pool
    assert pool.stats().unread_bytes == 2 * 3 * 4
    pool.alloc("a")  # a freed slot and region are taken again, empty
    pool.append(["a", "b"], [torch.ones(1), torch.full((1,), 5.0)])
    assert torch.equal(pool.consolidate(["a"])[0], torch.ones(1))
    assert torch.equal(pool.consolidate(["b"])[0], torch.tensor([1.0, 1.0, 1.0, 5.0]))
    pool.free_many([])


@pytest.mark.parametrize("frame", [(0,), (2, 0)])
def test_a_frame_that_holds_no_element_is_refused_naming_the_pool(frame):
    with pytest.raises(ValueError, match="'k'.*holds no element"):
        RingPool("k", torch.float32, frame, "cpu", S.CONCAT_DIM0, budget_bytes=1024)


def test_budget_spent_and_slot_limit():
    pool = make_pool(budget_bytes=8 * 4 * 2, initial_frames=8, max_slots=4)
    pool.alloc("a")
    pool.alloc("b")
    with pytest.raises(TensorAccumulationError, match="budget"):
        pool.alloc("c")
    res = pool.append(["a", "b"], [torch.ones(9), torch.ones(2)])
    assert [e.request_id for e in res.errors] == ["a"] and "budget" in str(res.errors[0])
    assert pool.unread_frames("a") == 0 and pool.unread_frames("b") == 2
    small = make_pool(max_slots=1)
    small.alloc("x")
    with pytest.raises(TensorAccumulationError, match="slots"):
        small.alloc("y")


def test_a_request_that_needs_more_than_the_budget_can_ever_give_it_is_not_told_to_retry():
    """A slot keeps its region while it grows into a new one: in an arena of one 32-frame block a
    request can hold at most 16 frames, however many others finish. Past that its error is not an
    OutputMemoryError (which says a retry can succeed: a speech client would be told 503, retry,
    for ever); short of it, with the others' regions in the way, it is."""
    pool = make_pool(budget_bytes=32 * 4, initial_frames=8, max_slots=4)
    pool.alloc("a")
    res = pool.append(["a"], [torch.ones(9)])  # grows to 16 frames
    assert not res.errors
    pool.alloc("b")
    res = pool.append(["a"], [torch.ones(8)])  # 17: a 32-frame region, the whole arena
    (err,) = res.errors
    assert type(err) is OutputTooLargeError and err.request_id == "a" and "more than one request can hold" in str(err)
    assert pool.unread_frames("a") == 9
    wide = make_pool(budget_bytes=64 * 4, initial_frames=8, max_slots=4)
    wide.alloc("a")
    wide.append(["a"], [torch.ones(9)])  # 16 frames
    for r in ("b", "c"):
        wide.alloc(r)
    wide.append(["b", "c"], [torch.ones(9), torch.ones(9)])  # 16 each: no 32-frame region free now
    (err,) = wide.append(["a"], [torch.ones(8)]).errors
    assert type(err) is OutputMemoryError and err.request_id == "a"
    wide.free("b")
    wide.free("c")
    assert not wide.append(["a"], [torch.ones(8)]).errors and wide.unread_frames("a") == 17
    # 48 frames: blocks of 32 and 16. A request's first regions are taken in the 32-frame block
    # (lowest address first), so it can never grow to 32, sent again or not: past 16 frames it needs
    # a block larger than its region's class.
    split = make_pool(budget_bytes=48 * 4, initial_frames=8, max_slots=4)
    split.alloc("a")
    assert not split.append(["a"], [torch.ones(9)]).errors
    (err,) = split.append(["a"], [torch.ones(8)]).errors
    assert type(err) is OutputTooLargeError and split.most_frames() == 16
    # A request that says what it will hold (``frames``: a whole file of known length) and could
    # never hold it is refused when it takes its slot, not after growing into the budget.
    known = make_pool(budget_bytes=32 * 4, initial_frames=8, max_slots=4)
    with pytest.raises(TensorAccumulationError, match="will hold 17 samples, more than one request can hold") as info:
        known.alloc("a", frames=17)
    assert type(info.value) is OutputTooLargeError and "a" not in known and known.allocator.used_frames == 0
    known.alloc("a", frames=16)  # grows to 16 in place of its first 8
    assert not known.append(["a"], [torch.ones(16)]).errors
    assert known.most_frames() == 16


@pytest.mark.parametrize("frames", [8, 24, 32, 40, 48, 72, 100, 288, 1000, 4096 + 24])
@pytest.mark.parametrize("step", [3, 1000])
def test_most_frames_is_what_a_request_that_says_its_length_can_hold(frames, step):
    """``most_frames``: the longest ``alloc(frames=...)`` takes, in an empty pool: so much is held,
    taken at once or grown into ``step`` frames at a time (as a worker appends), and one frame more
    is refused as no retry would hold it, as it arrives; one that did not say its length, alone in
    the pool, fails growing on with the same error (a retry could never be held either)."""
    pool = make_pool(budget_bytes=frames * 4, initial_frames=8, max_slots=4)
    most = pool.most_frames()
    assert 8 <= most <= pool.allocator.total_frames
    for rid, hint in (("sized", most), ("grown", 0)):
        pool.alloc(rid, frames=hint)
        for at in range(0, most, step):
            assert not pool.append([rid], [torch.ones(min(step, most - at))]).errors, (rid, at)
        assert pool.unread_frames(rid) == most
        if rid == "grown":  # alone in the pool: grown on, it fails as a request no retry would hold
            while not (errors := pool.append([rid], [torch.ones(step)]).errors):
                pass
            assert type(errors[0]) is OutputTooLargeError
        pool.free(rid)
    with pytest.raises(TensorAccumulationError, match="more than one request can hold") as info:
        pool.alloc("b", frames=most + 1)
    assert type(info.value) is OutputTooLargeError


def test_consolidate_after_drain_is_a_consolidation_error():
    pool = make_pool()
    pool.alloc("a")
    pool.append(["a"], [torch.ones(2)])
    pool.drain(["a"])
    with pytest.raises(TensorConsolidationError) as info:
        pool.consolidate(["a"])
    assert info.value.request_id == "a"


def test_slots_are_reused_and_stats_track_high_water():
    pool = make_pool(initial_frames=8)
    for i in range(50):
        pool.alloc(f"r{i}")
        pool.append([f"r{i}"], [torch.ones(20)])
        pool.free(f"r{i}")
    st = pool.stats()
    assert st.slots_used == 0 and st.bytes_used == 0 and st.unread_bytes == 0
    assert st.high_water_bytes == 32 * 4 and st.growths == 50


def test_the_slots_a_caller_is_given_cannot_change_the_pools_own():
    pool = make_pool()
    for r in ("a", "b"):
        pool.alloc(r)
    pool.append(["a", "b"], [torch.ones(3), torch.ones(2)])  # the pool remembers this step's slots
    given = pool.slots(["a", "b"])
    with pytest.raises(ValueError):
        given[0] = given[1]
    pool.append(["a", "b"], [torch.full((1,), 2.0), torch.full((1,), 3.0)])
    a, b = pool.drain(["a", "b"])
    assert a.tolist() == [1, 1, 1, 2] and b.tolist() == [1, 1, 3]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(ALL_DTYPES),
       layout=st.sampled_from([(S.CONCAT_LAST, ()), (S.CONCAT_LAST, (2,)), (S.CONCAT_DIM0, (3,))]),
       growth=st.booleans())
def test_property_pool_matches_python_lists(backend, seed, dtype, layout, growth):
    """Random lifecycles: appends of random lengths (0 included), drains, frees vs a list model."""
    strategy, frame = layout
    last = strategy is S.CONCAT_LAST
    rng = np.random.default_rng(seed)
    pool = RingPool("k", dtype, frame, "cpu", strategy, budget_bytes=4096 * 8, initial_frames=4, growth=growth)
    model: dict[str, list] = {}
    g = torch.Generator().manual_seed(seed)
    for step in range(6):
        if len(model) < 4:
            rid = f"r{step}"
            pool.alloc(rid)
            model[rid] = []
        ids = list(model)
        lens = rng.integers(0, 7, size=len(ids))
        shape = (len(ids), *frame, 6) if last else (len(ids), 6, *frame)
        data = random_tensor(shape, dtype, generator=g)
        res = pool.append(ids, PaddedBatch(data, lens))
        failed = {e.request_id for e in res.errors}
        assert growth is False or not failed
        for b, rid in enumerate(ids):
            if rid not in failed:
                model[rid].append(data[b][..., : lens[b]] if last else data[b][: lens[b]])
        action = rng.integers(0, 3)
        rid = ids[int(rng.integers(0, len(ids)))]
        if action == 0:
            (out,) = pool.drain([rid])
            assert torch.equal(out, cat(model[rid], last) if model[rid] else out)
            model[rid] = []
        elif action == 1:
            pool.free(rid)
            del model[rid]
    if model:
        outs = pool.drain(list(model))
        for rid, out in zip(model, outs):
            if model[rid]:
                assert torch.equal(out, cat(model[rid], last))
            else:
                assert out.numel() == 0


def test_padded_batch_view_with_a_storage_offset_is_read_from_its_own_rows(backend):
    pool = make_pool(S.CONCAT_LAST, ())
    pool.alloc("x")
    pool.alloc("y")
    big = torch.arange(12.0).reshape(3, 4)
    assert pool.append(["x", "y"], PaddedBatch(big[1:], [4, 4])).errors == ()
    got = pool.consolidate(["x", "y"])
    assert torch.equal(got[0], big[1]) and torch.equal(got[1], big[2])


@pytest.mark.parametrize("max_rows", [256, 4])
@pytest.mark.parametrize("lengths_as", ["tensor", "list"])
def test_batches_of_more_rows_than_the_pool_was_sized_for(max_rows, lengths_as, use_backend):
    """300 requests in one PaddedBatch (CPU lengths, a non-contiguous batch): every row its own data."""
    use_backend("torch")
    pool = make_pool(S.CONCAT_LAST, (), budget_bytes=1 << 20, initial_frames=8, max_slots=400, max_rows=max_rows)
    ids = [f"r{i}" for i in range(300)]
    for r in ids:
        pool.alloc(r)
    big = torch.arange(300 * 6.0).reshape(300, 6)
    data = big[:, 1:5]  # a view: strided rows
    lengths = torch.full((300,), 4) if lengths_as == "tensor" else [4] * 300
    res = pool.append(ids, PaddedBatch(data, lengths))
    assert res.errors == () and res.appended == 300
    assert all(torch.equal(got, data[i]) for i, got in enumerate(pool.consolidate(ids)))


def test_chunks_that_require_grad_are_accepted_as_data(backend):
    pool = make_pool(S.CONCAT_LAST, ())
    pool.alloc("a")
    pool.alloc("b")
    w = torch.ones(3, requires_grad=True)
    res = pool.append(["a", "b"], [w * 2, torch.ones(2)])
    assert res.errors == ()
    res = pool.append(["a", "b"], PaddedBatch(torch.stack([w, w]) * 3, [3, 1]))
    assert res.errors == ()
    a, b = pool.consolidate(["a", "b"])
    assert not a.requires_grad and torch.equal(a, torch.tensor([2.0] * 3 + [3.0] * 3))
    assert torch.equal(b, torch.tensor([1.0, 1.0, 3.0]))


@pytest.mark.parametrize("strategy, frame", [(S.CONCAT_LAST, ()), (S.CONCAT_DIM0, (3,))])
def test_repeated_steps_launch_from_kept_rows_and_match_concatenation(backend, strategy, frame):
    """A step that repeats the last one (requests, shape, strides, lengths) launches from the rows
    kept for it; drains, growth, a changed length, a new slot and a freed one in between all leave
    every request's data equal to the concatenation of its chunks."""
    last = strategy is S.CONCAT_LAST
    pool = make_pool(strategy, frame, initial_frames=16, budget_bytes=1 << 15)
    g = torch.Generator().manual_seed(7)
    want: dict[str, list] = {}

    def step(ids, lengths, width=5):
        shape = (len(ids), *frame, width) if last else (len(ids), width, *frame)
        data = torch.randn(shape, generator=g)
        result = pool.append(ids, PaddedBatch(data, lengths))
        assert result.errors == ()
        for b, r in enumerate(ids):
            want.setdefault(r, []).append(data[b][..., :lengths[b]] if last else data[b][:lengths[b]])

    def check(ids):  # drains: everything appended since the last check
        for r, got in zip(ids, pool.drain(ids)):
            assert torch.equal(got, cat(want[r], last)), r
            want[r] = []

    ids = ["a", "b", "c"]
    for r in ids:
        pool.alloc(r)
    for _ in range(6):  # step 1 plans (new heads), 2 repeats it and keeps its rows, 3 to 5 launch from
        step(ids, [2, 3, 1])  # them, 6 finds "b" full (15 of 16 frames): planned again, "b" grows
    assert pool.stats().repeated_launches == 3 and pool.stats().growths == 1
    assert pool.unread_frames("b") == 18
    check(ids)
    step(ids, [2, 3, 2])  # another length: planned again
    step(ids, [2, 3, 2])
    before = pool.stats().repeated_launches
    check(["a"])
    step(ids, [2, 3, 2])  # a drain moves no slot: still a repeat
    assert pool.stats().repeated_launches == before + 1
    pool.alloc("d")  # a new slot elsewhere: planned again
    step(ids, [2, 3, 2])
    step(ids, [2, 3, 2])
    pool.free("c")
    del want["c"]
    ids = ["a", "b", "d"]
    for _ in range(3):
        step(ids, [1, 0, 4])
    assert pool.stats().unread_bytes == sum(pool.unread_frames(r) for r in ids) * pool.frame_bytes
    check(ids)
    assert pool.stats().unread_bytes == 0



def test_static_append_refuses_a_source_it_cannot_read_in_place(backend):
    """Rows of a transposed buffer are not of unit stride: their view would be a copy taken when
    the append is made, and every launch would append that copy, not the step's chunks."""
    pool = make_pool(initial_frames=8, budget_bytes=1 << 16)
    for r in "ab":
        pool.alloc(r)
    with pytest.raises(ValueError, match="in place"):
        pool.static_append(["a", "b"], torch.zeros(6, 2).t(), [3, 3])


def test_a_static_append_prepared_after_eager_appends_finds_the_room_they_took():
    """Eager appends between static launches take room of the slot: each prepare sees them (the
    pool's writes), grows the slot when the next launch would not fit, and nothing is overwritten."""
    pool = make_pool()
    pool.alloc("a")
    src = torch.arange(3.0).view(1, 3) + 100
    sa = pool.static_append(["a"], src, [3])
    want = []
    sa.prepare(1)
    sa.launch()
    want.append(src[0])
    for _ in range(3):
        chunk = torch.randn(1, 4)
        pool.append(["a"], PaddedBatch(chunk, [4]))
        want.append(chunk[0])
        sa.prepare(1)
        sa.launch()
        want.append(src[0])
    assert torch.equal(pool.drain(["a"])[0], torch.cat(want))


def test_static_append_prepares_from_what_changed_and_matches_concatenation(backend):
    """A fixed-shape append (``StaticAppend``: prepare, then launch from resident rows; what a graph
    replays) between eager appends of the same slots, drains, growth, another request's slot and a
    free: every request's data is its chunks concatenated, and prepare grows a slot when its room
    runs out."""
    pool = make_pool(initial_frames=8, budget_bytes=1 << 16)
    ids = ["a", "b"]
    for r in ids:
        pool.alloc(r)
    src = torch.arange(12.0).view(2, 6)
    lens = [3, 5]
    sa = pool.static_append(ids, src, lens)
    want = {r: [] for r in ids}

    def static(times=1):
        for _ in range(times):
            sa.prepare(1)
            sa.launch()
            for b, r in enumerate(ids):
                want[r].append(src[b, :lens[b]])

    def eager():
        data = torch.randn(2, 4)
        pool.append(ids, PaddedBatch(data, [4, 1]))
        want["a"].append(data[0, :4])
        want["b"].append(data[1, :1])

    def check(rids):
        for r, got in zip(rids, pool.drain(rids)):
            assert torch.equal(got, torch.cat(want[r])), r
            want[r] = []

    static(3)  # 15 frames for "b": grown twice by prepare
    eager()
    static(2)
    check(["a"])
    pool.alloc("c")
    static(2)
    eager()
    pool.free("c")
    static(4)
    assert pool.stats().growths >= 2
    check(ids)
    eager()  # a signature, then its rows kept, then repeats around a static launch
    eager()
    static(1)
    eager()
    eager()
    assert pool.stats().repeated_launches == 2
    check(ids)
    assert pool.stats().unread_bytes == 0


def test_a_repeated_step_after_another_write_to_its_slots_checks_their_room_again(backend):
    """Room known to a kept step is a bound only while nothing else writes its slots: after a list
    append fills the slot, the repeat grows it instead of overwriting unread data."""
    pool = make_pool(initial_frames=16)
    pool.alloc("a")
    chunks = []
    for width in (4, 4, 6, 4):  # the second 4 keeps its rows; 6 comes as a list; the last 4 repeats
        data = torch.randn(1, width)
        pool.append(["a"], PaddedBatch(data, [width]) if width == 4 else [data[0]])
        chunks.append(data[0])
    assert pool.stats().growths == 1
    assert torch.equal(pool.drain(["a"])[0], torch.cat(chunks))


def test_a_staging_buffer_waits_for_an_event_recorded_after_its_last_reader():
    """A pinned staging buffer read in place by a kernel is handed out before that kernel is
    launched, so the event recorded at that hand-out does not cover it: reuse must wait for an event
    recorded at a later hand-out (with the event of the same hand-out, a kernel still queued behind
    a long one could read metadata the host had already rewritten)."""
    from vllm_omni_kernels.ring.staging import _free_after

    events = [(16, "a"), (32, "b"), (48, "c"), (64, "d")]
    assert _free_after(events, 15) == (16, "a")
    events = [(16, "a"), (32, "b"), (48, "c"), (64, "d")]
    assert _free_after(events, 16) == (32, "b")  # not the event recorded when buffer 16 was handed out
    assert events == [(48, "c"), (64, "d")]
    assert _free_after(events, 70) is None and events == []


def test_a_staging_ring_of_the_least_depth_always_has_an_event_after_a_buffers_last_use():
    """With ``MIN_DEPTH`` buffers (the gather's tables), every reuse finds an event recorded after the
    buffer's last hand-out and at least ``_EVENT_EVERY`` hand-outs old (events every
    ``_EVENT_EVERY`` hand-outs, recorded before the hand-out that counts them): the host waits only
    when the device is that far behind. A shallower ring is refused."""
    from vllm_omni_kernels.ring.staging import _EVENT_EVERY, MIN_DEPTH, PinnedStaging, _free_after

    for count in range(MIN_DEPTH, 300):  # the hand-out about to reuse buffer count % MIN_DEPTH
        events = [(k, k) for k in range(_EVENT_EVERY, count, _EVENT_EVERY)]
        found = _free_after(events, count - MIN_DEPTH)
        assert found is not None and count - MIN_DEPTH < found[0] <= count - _EVENT_EVERY
    with pytest.raises(ValueError, match="at least"):
        PinnedStaging(1, 4, torch.device("cpu"), depth=MIN_DEPTH - 1)


def test_a_step_that_repeats_the_last_but_on_another_device_fails_its_requests_by_name():
    """A batch of the last step's shape and requests but on the meta device (whose index, -1, is a
    CPU tensor's) is not launched as a repeat: the planning path fails each request with its typed
    error."""
    pool = RingPool("audio", torch.float32, (), "cpu", S.CONCAT_LAST, budget_bytes=1 << 20, initial_frames=1024,
                    max_slots=4)
    ids = ["a", "b"]
    for rid in ids:
        pool.alloc(rid)
    for _ in range(3):
        assert not pool.append(ids, PaddedBatch(torch.randn(2, 16), [16, 16])).errors
    assert pool.repeated_launches == 1
    errors = pool.append(ids, PaddedBatch(torch.empty(2, 16, device="meta"), [16, 16])).errors
    assert [(e.request_id, "on meta" in str(e)) for e in errors] == [("a", True), ("b", True)]
    assert pool.repeated_launches == 1


def test_staging_uploads_into_another_tensor_at_the_same_address_by_its_own_layout():
    """The staging ring keeps the views of an upload; a later destination at the same address with
    another row stride or dtype gets views of its own (a cached view wrote the rows at the old
    stride and width). The upload path runs here on host tensors standing in for device ones."""
    from vllm_omni_kernels.ring.staging import PinnedStaging

    staging = PinnedStaging(2, 8, torch.device("cpu"))
    staging.pinned = True  # (the device path: upload copies through its cached views)
    staging._host = [torch.arange(16, dtype=torch.int64).view(2, 8) + 1]
    buf = torch.zeros(64, dtype=torch.int64)
    staging.upload(0, 2, buf.view(8, 8))
    buf.zero_()
    wide = buf.view(4, 16)
    staging.upload(0, 2, wide)
    assert torch.equal(wide[:2, :8], staging._host[0])
    buf.zero_()
    narrow = buf.view(torch.int32).view(4, 32)
    staging.upload(0, 2, narrow)
    assert narrow[:2, :8].flatten().tolist() == list(range(1, 17))


def test_staging_uploads_of_any_row_count_share_a_few_views():
    """Each upload copies at least its rows and columns, whatever their count, through views made
    for the next power of two of each: the views made once serve the steps after (every step's
    count of due requests differs). The upload path runs here on host tensors."""
    from vllm_omni_kernels.ring.staging import PinnedStaging

    staging = PinnedStaging(16, 8, torch.device("cpu"))
    staging.pinned = True  # (the device path)
    dst = torch.zeros(16, 8, dtype=torch.int64)
    for rows, cols in [(3, None), (5, None), (6, None), (7, None), (16, None), (1, 3), (2, 4), (12, 8)]:
        i, host = staging.host()
        host[:] = torch.randint(0, 1 << 40, (16, 8)).numpy()
        dst.fill_(-1)
        staging.upload(i, rows, dst, cols=cols)
        width = 8 if cols is None else cols
        assert torch.equal(dst[:rows, :width], torch.from_numpy(host[:rows, :width]))
    assert sorted(k[1:] for k in staging._views) == [(1, 4), (2, 4), (4, 8), (8, 8), (16, 8)]


def test_a_list_append_that_fills_a_slot_exactly_needs_no_growth(backend):
    """A chunk that fills the slot to its last frame fits: it is written without growing (with
    growth off, without an error), and reads back whole."""
    pool = make_pool(initial_frames=8, growth=False)
    pool.alloc("a")
    res = pool.append(["a"], [torch.arange(5.0)])
    res2 = pool.append(["a"], [torch.arange(5.0, 8.0)])
    assert res.errors == () and res2.errors == ()
    assert pool.stats().growths == 0 and pool.capacity_frames("a") == 8 and pool.unread_frames("a") == 8
    assert torch.equal(pool.drain(["a"])[0], torch.arange(8.0))


def test_a_repeated_step_checks_its_room_again_after_a_list_write_since_it_was_known(backend):
    """Room a repeated step found is a bound only while nothing else writes its slots: a list
    append after a repeat fills the slot, and the next repeat grows it instead of overwriting the
    oldest unread frames."""
    pool = make_pool(initial_frames=16)
    pool.alloc("a")
    chunks = []
    # 2 plans, 2 keeps its rows, 2 repeats (finds room 12); 9 comes as a list (15 of 16); 2 repeats
    for width in (2, 2, 2, 9, 2):
        data = torch.randn(1, width)
        pool.append(["a"], PaddedBatch(data, [width]) if width == 2 else [data[0]])
        chunks.append(data[0])
    assert pool.stats().repeated_launches >= 1 and pool.stats().growths == 1
    assert torch.equal(pool.drain(["a"])[0], torch.cat(chunks))


def test_a_step_of_the_same_shape_for_other_requests_writes_their_slots(backend):
    """A step with the shape, strides and lengths of the kept one but other requests (or the same
    ones in another order) is not a repeat of it: each chunk goes to its own request."""
    pool = make_pool(initial_frames=16)
    for r in "abc":
        pool.alloc(r)
    want = {r: [] for r in "abc"}
    for ids in (["a", "b"], ["a", "b"], ["a", "b"], ["b", "a"], ["c", "a"]):
        data = torch.randn(2, 3)
        assert pool.append(ids, PaddedBatch(data, [3, 3])).errors == ()
        for b, r in enumerate(ids):
            want[r].append(data[b])
    for r, got in zip("abc", pool.drain(list("abc"))):
        assert torch.equal(got, torch.cat(want[r])), r


def test_a_step_of_the_same_shape_with_other_strides_reads_its_own_rows(backend):
    """A source of the kept step's shape and lengths but other strides (a slice of a wider
    buffer) is read through its own strides, not the kept step's."""
    pool = make_pool(initial_frames=16)
    pool.alloc("a")
    pool.alloc("b")
    want = {"a": [], "b": []}
    for wide in (False, False, False, True):
        data = torch.randn(2, 8)[:, :4] if wide else torch.randn(2, 4)
        assert pool.append(["a", "b"], PaddedBatch(data, [4, 4])).errors == ()
        want["a"].append(data[0])
        want["b"].append(data[1])
    for r, got in zip("ab", pool.drain(["a", "b"])):
        assert torch.equal(got, torch.cat(want[r])), r


def test_a_drain_of_at_most_some_frames_leaves_the_rest_unread(backend):
    """``read_into(..., frames=)`` drains each request's oldest frames only; the rest stays unread
    and the next drain returns it, in order."""
    pool = make_pool(initial_frames=8)
    pool.alloc("a")
    pool.alloc("b")
    pool.append(["a", "b"], [torch.arange(5.0), torch.arange(10.0, 13.0)])
    out = torch.empty(5)
    starts, n = pool.read_into(["a", "b"], out, drain=True, frames=np.array([2, 2], np.int64))
    assert n.tolist() == [2, 2] and torch.equal(out[:4], torch.tensor([0.0, 1.0, 10.0, 11.0]))
    assert pool.unread_frames("a") == 3 and pool.unread_frames("b") == 1
    rest = pool.drain(["a", "b"])
    assert torch.equal(rest[0], torch.arange(2.0, 5.0)) and torch.equal(rest[1], torch.tensor([12.0]))


def test_a_drain_of_more_frames_than_a_request_holds_reads_what_it_holds(backend):
    """``frames`` is at most: a count past what a request holds reads its unread span and no
    older ring memory, and leaves it nothing unread (not a negative count)."""
    pool = make_pool(initial_frames=8)
    pool.alloc("a")
    pool.alloc("b")
    pool.append(["a", "b"], [torch.arange(5.0), torch.arange(10.0, 13.0)])
    out = torch.full((16,), -1.0)
    starts, n = pool.read_into(["a", "b"], out, drain=True, frames=np.array([2, 5], np.int64))
    assert n.tolist() == [2, 3] and starts.tolist() == [0, 2]
    assert torch.equal(out[:6], torch.tensor([0.0, 1.0, 10.0, 11.0, 12.0, -1.0]))
    assert pool.unread_frames("a") == 3 and pool.unread_frames("b") == 0


def test_read_into_an_out_too_short_writes_nothing_and_moves_nothing(backend):
    """An ``out`` shorter than every unread span: ValueError naming the pool before anything is
    copied; the data stays unread, whole."""
    pool = make_pool(initial_frames=8)
    pool.alloc("a")
    pool.alloc("b")
    pool.append(["a", "b"], [torch.arange(3.0), torch.arange(10.0, 14.0)])
    out = torch.full((6,), -1.0)
    with pytest.raises(ValueError, match="no room for every unread span"):
        pool.read_into(["a", "b"], out, drain=True)
    assert torch.equal(out, torch.full((6,), -1.0))
    assert pool.unread_frames("a") == 3 and pool.unread_frames("b") == 4
    got = pool.drain(["a", "b"])
    assert torch.equal(got[0], torch.arange(3.0)) and torch.equal(got[1], torch.arange(10.0, 14.0))


def test_a_slot_freed_after_repeated_steps_is_taken_again_empty(backend):
    """Frames of repeated steps not yet counted when their request is freed are not counted later
    on the slot's next owner: it starts empty and reads back only its own data."""
    pool = make_pool(initial_frames=16)
    pool.alloc("a")
    pool.alloc("b")
    for _ in range(3):  # plans, keeps its rows, repeats them (its frames counted when read)
        assert pool.append(["a", "b"], PaddedBatch(torch.ones(2, 3), [3, 3])).errors == ()
    assert pool.repeated_launches == 1  # (stats() would count them: here they are not yet)
    pool.free("b")
    assert pool.alloc("c") == 1  # b's slot
    assert pool.unread_frames("c") == 0 and pool.unread_frames("a") == 9
    pool.append(["c"], [torch.full((2,), 5.0)])
    assert torch.equal(pool.drain(["c"])[0], torch.full((2,), 5.0))


def test_consolidate_after_draining_a_single_frame_is_a_consolidation_error():
    pool = make_pool()
    pool.alloc("a")
    pool.append(["a"], [torch.ones(1)])
    pool.drain(["a"])
    pool.append(["a"], [torch.full((2,), 2.0)])
    with pytest.raises(TensorConsolidationError, match="1 samples were already drained") as info:
        pool.consolidate(["a"])
    assert info.value.request_id == "a"


def test_more_slots_keep_every_held_slots_data_and_repeated_steps_go_on(backend):
    """``grow_slots``: the slots held keep their indices, unread data and device heads (a repeated
    step launched from kept rows before and after); new slots take data like any other. A pool does
    not grow while a ``StaticAppend`` of it lives (its graph would write the old head words)."""
    pool = make_pool(initial_frames=64, max_slots=2)
    g = torch.Generator().manual_seed(3)
    want = {"a": [], "b": [], "c": []}

    def step(ids, lengths):
        data = torch.randn(len(ids), 5, generator=g)
        assert pool.append(ids, PaddedBatch(data, lengths)).errors == ()
        for b, r in enumerate(ids):
            want[r].append(data[b, :lengths[b]])

    pool.alloc("a")
    pool.alloc("b")
    sa = pool.static_append(["a"], torch.ones(1, 2), [2])
    with pytest.raises(TensorAccumulationError, match="all 2 slots"):
        pool.alloc("c")
    for _ in range(3):
        step(["a", "b"], [2, 3])  # the third launches from kept rows
    with pytest.raises(RuntimeError, match="while a StaticAppend reads its head words"):
        pool.grow_slots(5)
    del sa  # (its graph, if it had one, would go with it)
    pool.grow_slots(5)
    assert pool.stats().slots_capacity == 5 and pool.slot_of("a") == 0 and pool.slot_of("b") == 1
    for _ in range(3):
        step(["a", "b"], [2, 3])
    assert pool.alloc("c") == 2
    step(["a", "b", "c"], [1, 4, 5])
    assert pool.unread()[:3].tolist() == [sum(len(t) for t in want[r]) for r in ("a", "b", "c")]
    assert pool.stats().repeated_launches == 2  # one before the growth, one after
    for r, got in zip(want, pool.drain(list(want))):
        assert torch.equal(got, torch.cat(want[r])), r
    with pytest.raises(ValueError, match="at most 65535 rows"):
        pool.grow_slots(1 << 16)


def test_a_lazily_negated_batch_is_appended_with_its_sign_on_the_planned_and_the_repeated_path(backend):
    """A ``PaddedBatch`` whose data is a lazy view (``.imag`` of a conjugated complex tensor carries
    a negative bit, not negated memory) is appended as it reads, as ``torch.cat`` would take it,
    also when it repeats a kept step's shape and strides."""
    def lazy(values):  # float32 [1, 4, 1], strides (8, 2, 1), negative bit set
        return torch.complex(torch.zeros(1, 4), values.reshape(1, 4)).conj().imag[..., None]

    def plain(values):  # the same shape and strides, no negative bit
        buf = torch.zeros(8)
        buf[1::2] = values
        return torch.as_strided(buf, (1, 4, 1), (8, 2, 1), 1)

    for makes in ([lazy], [plain, plain, plain, lazy]):
        pool = make_pool(S.CONCAT_DIM0, (1,), initial_frames=16)
        pool.alloc("a")
        want = []
        for k, make in enumerate(makes):
            data = make(torch.arange(1.0, 5.0) + 10 * k)
            assert data.is_neg() == (make is lazy)
            want.append(data[0].resolve_neg().clone())
            assert pool.append(["a"], PaddedBatch(data, [4])).errors == ()
        assert torch.equal(pool.consolidate(["a"])[0], torch.cat(want))


def test_a_batch_that_is_not_plain_strided_memory_fails_each_of_its_requests(backend):
    """Nested and sparse (CSR too, once a step of its shape was kept) batches, and a numpy array
    instead of a tensor: one ``TensorAccumulationError`` per request, naming it, and nothing
    appended."""
    for data in (torch.nested.nested_tensor([torch.ones(4, 1), torch.ones(4, 1)]),
                 torch.ones(2, 4).to_sparse_csr(), np.ones((2, 4), np.float32)):
        pool = make_pool(S.CONCAT_LAST, (), initial_frames=16)
        for rid in "ab":
            pool.alloc(rid)
        for _ in range(3):
            assert pool.append(["a", "b"], PaddedBatch(torch.ones(2, 4), [4, 4])).errors == ()
        errors = pool.append(["a", "b"], PaddedBatch(data, [4, 4])).errors
        assert [e.request_id for e in errors] == ["a", "b"]
        assert ("expected a tensor" if isinstance(data, np.ndarray) else "plain strided") in str(errors[0])
        assert pool.unread_frames("a") == pool.unread_frames("b") == 12


@pytest.mark.parametrize("frames", [np.array([-2]), np.array([2.7]), np.array([3], np.uint64), [2],
                                    np.array([1, 1])], ids=["negative", "float", "uint64", "list", "two"])
def test_a_read_of_counts_that_are_not_int64_frames_is_refused_with_nothing_moved(backend, frames):
    """Float or uint64 counts would be planned as floats and cut, the tail moved by them while the
    unread count is not: the next drain would return memory never appended to."""
    pool = make_pool(S.CONCAT_LAST, (), initial_frames=16)
    pool.alloc("a")
    pool.append(["a"], [torch.arange(4.0)])
    out = torch.full((8,), -1.0)
    with pytest.raises(ValueError, match="int64 counts, none negative"):
        pool.read_into(["a"], out, drain=True, frames=frames)
    assert pool.unread_frames("a") == 4 and torch.equal(pool.drain(["a"])[0], torch.arange(4.0))
    assert (out == -1).all()


@pytest.mark.parametrize("strategy, frame", [(S.CONCAT_LAST, (2,)), (S.CONCAT_DIM0, (3,))])
def test_complex_chunks_are_kept_bit_for_bit_and_wider_elements_are_refused_naming_the_pool(backend, strategy,
                                                                                          frame):
    """The kernels copy elements of 1, 2, 4 or 8 bytes: a complex64 chunk goes as its bits, on every
    backend; complex128 is refused when a pool of a kernel backend is made (the torch reference
    copies it)."""
    check_complex_pool("cpu", strategy, frame, wide_refused=backend != "torch")


def test_a_budget_past_what_a_head_word_addresses_is_refused_before_anything_is_allocated():
    with pytest.raises(ValueError, match="head word"):
        RingPool("audio", torch.uint8, (), "cpu", S.CONCAT_LAST, budget_bytes=1 << 40)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_compiled_caller_appends_and_drains_as_an_eager_one(compiler, backend):
    """A function that ``torch.compile`` compiles (as vLLM compiles its model runner's code) and that
    appends a step, as a ``PaddedBatch`` and as a list, and drains: the pool's host planning and the
    CPU reference copies run as they are (the compiler does not trace them: it turned the bit copies
    into value conversions under aot_eager, and failed on the planning's numpy arrays), so the data
    is bit for bit the eager caller's."""
    def step(pool, x, ids):
        pool.append(ids, PaddedBatch(x * 2, [5, 3]))
        pool.append(ids, [x[0, :2] + 1, x[1, :1]])
        return pool.drain(ids)

    x = torch.arange(10, dtype=torch.float32).view(2, 5) + 0.5
    got = {}
    for how, run in (("eager", step), ("compiled", torch.compile(step, backend=compiler))):
        torch._dynamo.reset()
        pool = make_pool(S.CONCAT_LAST, ())
        for r in ("a", "b"):
            pool.alloc(r)
        got[how] = [t.clone() for t in run(pool, x, ["a", "b"])]
    expected = [torch.cat([x[0] * 2, x[0, :2] + 1]), torch.cat([x[1, :3] * 2, x[1, :1]])]
    for kind in ("eager", "compiled"):
        assert all(torch.equal(g, e) for g, e in zip(got[kind], expected)), (kind, got[kind])
