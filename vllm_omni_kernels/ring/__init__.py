"""Per-request ring buffers: ``RingPool`` (pool.py) with its planner, allocator, pinned staging and
CUDA-graph capture (planner.py, allocator.py, staging.py, graph.py)."""

from .pool import AppendResult, PaddedBatch, PoolStats, RingPool, host_lengths

__all__ = ["AppendResult", "PaddedBatch", "PoolStats", "RingPool", "host_lengths"]
