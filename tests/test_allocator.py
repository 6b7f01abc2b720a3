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
