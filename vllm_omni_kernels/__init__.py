"""vllm-omni-kernels: GPU ring-buffer accumulation of multimodal outputs and fused decode gathers.

Kernels, accumulation and phase routing need only torch (and triton for that backend); everything that
imports vLLM lives in ``vllm_omni_kernels.vllm_integration``.
"""

from .errors import MultimodalOutputError, TensorAccumulationError, TensorConsolidationError
from .modality import OutputModality, TensorAccumulationStrategy
from .payload import MultimodalPayload

__version__ = "0.1.0"

__all__ = [
    "MultimodalOutputError",
    "MultimodalPayload",
    "OutputModality",
    "TensorAccumulationError",
    "TensorAccumulationStrategy",
    "TensorConsolidationError",
]
