import numpy as np
import pytest

from vllm_omni_kernels.ring.allocator import BuddyAllocator


def test_alloc_rounds_to_power_of_two_blocks_and_merges_on_free():
    a = BuddyAllocator(64, 8)
    assert a.total_frames == 64
    r1 = a.alloc(5)
    assert r1 == (0, 8)
    r2 = a.alloc(9)
    assert r2[1] == 16 and r2[0] % 16 == 0
    r3 = a.alloc(32)
    assert r3 == (32, 32)
    assert a.alloc(8) is not None  # the buddy of r1
    assert a.alloc(1) is None  # full
    a.free(r3[0])
    a.free(r2[0])
    assert a.alloc(32) is not None
    assert a.used_frames == 8 + 8 + 32


def test_free_everything_restores_one_block():
    a = BuddyAllocator(1000, 4)
    assert a.total_frames == 1000
    regions = [a.alloc(4) for _ in range(250)]
    assert a.alloc(4) is None and len({off for off, _ in regions}) == 250
    for off, _ in regions:
        a.free(off)
    assert a.used_frames == 0 and a.alloc(512) == (0, 512)
    assert a.alloc(512) is None and a.alloc(256) == (512, 256)  # 1000 = 512 + 256 + 128 + 64 + 32 + 8


def test_invalid_configuration():
    with pytest.raises(ValueError):
        BuddyAllocator(64, 3)
    with pytest.raises(ValueError):
        BuddyAllocator(2, 8)
    assert BuddyAllocator(64, 8).alloc(65) is None


def _trees(total_blocks, min_frames):
    out, off = [], 0
    for order in range(total_blocks.bit_length() - 1, -1, -1):
        if total_blocks >> order & 1:
            out.append((off, min_frames << order))
            off += min_frames << order
    return out


def _model_has_block(live, size, trees):
    for t0, tsize in trees:
        if tsize < size:
            continue
        for o in range(t0, t0 + tsize, size):
            if all(o + size <= a or a + s <= o for a, s in live.items()):
                return True
    return False


@pytest.mark.parametrize("seed", range(30))
def test_random_allocs_and_frees_match_a_model_of_the_arena(seed):
    """Every region lies in one initial block, aligned to its size, apart from every live one; an
    alloc fails only when no free aligned block of its size exists in the model; all freed, the
    arena merges back."""
    rng = np.random.default_rng(seed)
    min_frames = int(rng.choice([1, 2, 4, 8]))
    blocks = int(rng.integers(1, 70))
    a = BuddyAllocator(blocks * min_frames + int(rng.integers(0, min_frames)), min_frames)
    trees = _trees(blocks, min_frames)
    live: dict[int, int] = {}
    for _ in range(400):
        if live and rng.random() < 0.45:
            off = list(live)[int(rng.integers(0, len(live)))]
            a.free(off)
            del live[off]
        else:
            frames = int(rng.integers(1, 3 * min_frames * 8))
            order = a.order_for(frames)
            size = min_frames << order
            got = a.alloc(frames)
            if got is None:
                assert not _model_has_block(live, size, trees) or order > a.max_order, (seed, frames, live)
                continue
            off, sz = got
            assert sz == size and sz >= frames and off % sz == 0
            assert any(t0 <= off and off + sz <= t0 + ts for t0, ts in trees)
            for o, s in live.items():
                assert off + sz <= o or o + s <= off, (seed, got, o, s)
            live[off] = sz
        assert a.used_frames == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.is_merged() and a.used_frames == 0


@pytest.mark.parametrize("total, least", [(64, 8), (96, 8), (1000, 16), (56, 8), (8, 8), (8, 2), (72, 8), (288, 8)])
def test_ever_fits_and_grows_to_are_what_the_allocator_does_in_an_empty_arena(total, least):
    """``ever_fits``: a region taken at once; ``grows_to``: reached from the smallest region by
    doubling, each larger region taken before the one before is given back (regions past half the
    largest initial block never are, and a smaller initial block can hold the first ones)."""
    def grown(frames):
        a = BuddyAllocator(total, least)
        region = a.alloc(least)
        while region[1] < frames:
            larger = a.alloc(2 * region[1])
            if larger is None:
                return False
            a.free(region[0])
            region = larger
        return True

    sizes = sorted({f for k in range(12) for f in ((least << k) - 1, least << k, (least << k) + 1)})
    for frames in sizes:
        assert BuddyAllocator(total, least).ever_fits(frames) == (BuddyAllocator(total, least).alloc(frames)
                                                                  is not None)
        assert BuddyAllocator(total, least).grows_to(frames) == grown(frames), frames
    assert BuddyAllocator(64, 8).grows_to(32) and not BuddyAllocator(64, 8).grows_to(33)  # one block: half
    assert BuddyAllocator(24, 8).grows_to(16)  # its first region in the 8-frame block, then the 16-frame one


def test_a_region_given_back_is_handed_out_first_to_its_size():
    """A freed region is kept for the next request of its size, not merged and split again
    elsewhere: the arena stays whole enough to serve the sequence below (splitting anew left no
    2-frame region free)."""
    a = BuddyAllocator(16, 1)
    first = a.alloc(1)
    a.free(first[0])
    a.alloc(4)
    a.alloc(4)
    assert a.alloc(1)[0] == first[0]
    a.alloc(4)
    a.alloc(1)
    assert a.alloc(2) is not None

