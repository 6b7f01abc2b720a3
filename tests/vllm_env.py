"""Real vLLM objects for the integration tests, built offline: a word-level tokenizer trained in the
test, a tiny model config directory, vLLM's v1 scheduler constructed as vLLM's own scheduler tests
do, and engine-core requests. Nothing of vLLM is mocked."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

WORDS = ("the quick brown fox jumps over a lazy dog and then sings one long happy song about audio "
         "codes frames voices tones").split()
EOS = 2


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on a few sentences (milliseconds); ids 0..2 are specials."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "</s>"])
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainer)
    from tokenizers import decoders
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>")


def word_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def model_dir(tmp: Path) -> Path:
    """A config-only OPT checkpoint directory (no weights: the scheduler reads only the config)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "ffn_dim": 128, "vocab_size": 512, "max_position_embeddings": 512,
        "word_embed_proj_dim": 64, "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": EOS,
        "pad_token_id": 1}))
    return tmp


def scheduler(cls, tmp: Path, *, max_num_seqs: int = 16, block_size: int = 16, num_blocks: int = 1000):
    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=512,
                                enable_chunked_prefill=True, is_encoder_decoder=False)
    model_cfg = ModelConfig(model=str(model_dir(tmp)), dtype="float16", seed=42, skip_tokenizer_init=True)
    cache_cfg = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto")
    vllm_cfg = VllmConfig(scheduler_config=sched_cfg, model_config=model_cfg, cache_config=cache_cfg,
                          device_config=DeviceConfig(device="cpu"))
    kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    cache_cfg.num_gpu_blocks = num_blocks
    return cls(vllm_config=vllm_cfg, kv_cache_config=kv_cfg, log_stats=True,
               structured_output_manager=StructuredOutputManager(vllm_cfg), block_size=block_size)


def sampling(kind=RequestOutputKind.DELTA, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 8)
    return SamplingParams(output_kind=kind, **kw)


def core_request(rid: str, prompt: list[int], params: SamplingParams | PoolingParams) -> EngineCoreRequest:
    is_pool = isinstance(params, PoolingParams)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), mm_features=None,
                             sampling_params=None if is_pool else params, pooling_params=params if is_pool else None,
                             arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
                             external_req_id=rid)


def sched_request(rid: str, prompt: list[int], params: SamplingParams | PoolingParams) -> Request:
    return Request.from_engine_core_request(core_request(rid, prompt, params), block_hasher=None)


def logprobs_for(token: int, k: int = 2) -> LogprobsLists:
    """Top-k logprobs of one sampled token (the sampled one first), deterministic."""
    ids = np.array([[token] + [(token + j) % 40 + 3 for j in range(1, k + 1)]], dtype=np.int64)
    lps = -np.arange(k + 1, dtype=np.float32)[None, :] * 0.5 - 0.25
    return LogprobsLists(ids, lps, np.array([1], dtype=np.int64))


def token_output(rid: str, token: int, *, finish=None, stop_reason=None, logprobs: bool = False,
                 cls=EngineCoreOutput, **kw) -> EngineCoreOutput:
    return cls(request_id=rid, new_token_ids=[token], new_logprobs=logprobs_for(token) if logprobs else None,
               finish_reason=finish, stop_reason=stop_reason, **kw)
