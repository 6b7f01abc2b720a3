"""Random accumulation episodes against per-request lists and ``torch.cat``, bit for bit
(``accumulation_model.py``): 2,000 on the torch reference and 100 on Triton (interpreter) on CPU,
10,000 per kernel backend on CUDA (``-m gpu``). Seeds are plain integers: a failure names its seed,
and ``run_episode(seed)`` replays it."""

import pytest
import torch

from accumulation_model import run_episode
from vllm_omni_kernels import backend

CHUNK = 250


@pytest.mark.parametrize("chunk", range(8))
def test_reference_episodes(chunk, use_backend):
    use_backend("torch")
    for seed in range(chunk * CHUNK, (chunk + 1) * CHUNK):
        run_episode(seed)


@pytest.mark.parametrize("seed", range(8))
def test_reference_batches_of_more_than_256_requests(seed, use_backend):
    use_backend("torch")
    run_episode(10_000 + seed, big_batch=True)


@pytest.mark.parametrize("chunk", range(4))
def test_triton_episodes(chunk, use_backend):
    use_backend("triton")
    for seed in range(20_000 + chunk * 25, 20_000 + (chunk + 1) * 25):
        run_episode(seed)


def test_triton_batch_of_more_than_256_requests(use_backend):
    use_backend("triton")
    run_episode(30_000, big_batch=True, steps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", backend.KERNEL_BACKENDS)
@pytest.mark.parametrize("chunk", range(10))
def test_cuda_episodes(name, chunk, use_backend):
    if name not in backend.kernel_backends():
        pytest.skip(f"{name} is not available here")
    use_backend(name)
    for seed in range(40_000 + chunk * 1000, 40_000 + (chunk + 1) * 1000):
        run_episode(seed, "cuda", max_requests=8, steps=6)
    run_episode(50_000 + chunk, "cuda", big_batch=True)
    torch.cuda.synchronize()
