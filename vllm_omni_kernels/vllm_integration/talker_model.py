"""The TTS talker as a vLLM model: ``OmniTalkerForTTS`` and ``make_model_dir``.

``make_model_dir(path)`` writes what vLLM loads a model from, made in code (no hub): a
``config.json`` (architecture, vocabulary, weight seed, voices) and a character-level tokenizer
(every printable ASCII character a token, ids below the talker's ``TEXT_VOCAB``). The project's
``vllm.general_plugins`` entry point (``plugin.py``) and this package's engines register the
architecture. Only ``worker.TalkerWorker`` builds the model: vLLM's own model loader (its model
runner, which has no audio path for it) is refused it, with the commands that serve it.

``OmniTalkerForTTS`` has vLLM's model interface, so vLLM's model inspection classifies it as a
generation model; its ``talker`` (``serving.talker.ToyTalker``) is what ``worker.TalkerWorker`` runs.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from torch import nn
from vllm.exceptions import VLLMValidationError

from ..serving import talker as tk

ARCHITECTURE = "OmniTalkerForTTS"
_SPECIALS = {"[UNK]": 0, "<s>": 1, "</s>": 2, "[PAD]": 3}
# A voice is the first token of a speech prompt: an id past the tokenizer's characters, below TEXT_VOCAB.
VOICES = {name: tk.TEXT_VOCAB - 1 - i for i, name in enumerate(("alloy", "ash", "coral", "echo", "fable", "nova",
                                                                 "onyx", "sage", "shimmer"))}


class OmniTalkerForTTS(nn.Module):
    """vLLM's face of the talker (module docstring); the weights come from ``talker_seed`` in the
    model's config."""

    def __init__(self, *, vllm_config, prefix: str = "", talker_worker: bool = False):
        if not talker_worker:  # vLLM's own model loader
            raise ValueError(f"{ARCHITECTURE} runs on this package's engine, whose worker runs the talker and keeps "
                             "its audio: serve the model directory with `python -m vllm_omni_kernels serve DIR`, or "
                             "run it with OmniLLM / OmniAsyncLLM and talker_engine_args "
                             "(vllm_omni_kernels.vllm_integration): vLLM's own model runner has no audio path for it")
        super().__init__()
        seed = int(getattr(vllm_config.model_config.hf_config, "talker_seed", 0))
        self.talker = tk.ToyTalker(seed)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.talker.embed[input_ids]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.tanh(self.embed_input_ids(input_ids) + self.talker.position[positions % tk._POSITIONS])

    @classmethod
    def validate_sampling_params(cls, params) -> None:
        """What the talker's sampling cannot honour, refused when a request arrives
        (``llm.OmniInputProcessor``: vLLM's validation error, a 400 in the API server). The talker
        picks each frame's codes itself, greedily (``serving.talker``): ``n``, ``seed`` and the
        temperature and penalty parameters change nothing; logprobs it has none of, it keeps to no
        constraint on its tokens (allowed tokens, bad words, a logit bias, a grammar), it does not hold back a
        stop token until ``min_tokens``, and it does not stop on repeated patterns (vLLM would end
        the request where the worker cannot see it, after all its frames were computed)."""
        for name in ("logprobs", "prompt_logprobs", "logprob_token_ids", "prompt_logprob_token_ids"):
            value = getattr(params, name, None)  # (the last two: logprobs of given tokens; an empty list asks none)
            if value is not None and not (isinstance(value, list) and not value):
                raise VLLMValidationError("the talker returns no logprobs", parameter=name)
        for name in ("allowed_token_ids", "bad_words", "logit_bias", "structured_outputs"):
            if getattr(params, name, None):
                raise VLLMValidationError("the talker picks its codes itself and keeps to no constraint on them",
                                          parameter=name)
        detect = getattr(params, "repetition_detection", None)
        if detect is not None and detect.max_pattern_size > 0:  # vLLM's end of it is one the worker cannot see
            raise VLLMValidationError("the talker does not end a request on a repeated pattern of its codes",
                                      parameter="repetition_detection")
        if params.min_tokens and any(tk.TEXT_VOCAB <= t < tk.VOCAB for t in params.stop_token_ids or ()):
            raise VLLMValidationError("the talker does not hold back a stop token until min_tokens",
                                      parameter="min_tokens", value=params.min_tokens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: the first codebook's, at the code token ids."""
        logits = hidden_states.new_full((hidden_states.shape[0], tk.VOCAB), float("-inf"))
        logits[:, tk.TEXT_VOCAB:] = torch.tanh(hidden_states @ self.talker.mix) @ self.talker.heads[0]
        return logits


def check_seed(seed: int) -> None:
    """ValueError for a seed vLLM cannot take: outside ``[0, 2**63)`` (its seed is an int64)."""
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed {seed}: at least 0 and below 2**63")


def make_model_dir(path: str | Path, seed: int = 0) -> Path:
    """Write the talker's config and tokenizer into ``path`` (created; a talker's directory there is
    rewritten); returns it. ValueError for a seed outside ``[0, 2**63)`` (vLLM's seed is an int64)
    and FileExistsError for a directory that holds another model's ``config.json`` (nothing is
    written then)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    check_seed(seed)
    path = Path(path)
    config = path / "config.json"
    if config.exists():
        try:
            found = json.loads(config.read_text()).get("architectures")
        except (ValueError, AttributeError, UnicodeDecodeError):
            found = "not a model's config"
        if found != [ARCHITECTURE]:
            raise FileExistsError(f"{config} is another model's ({found}); not overwritten")
    path.mkdir(parents=True, exist_ok=True)
    vocab = dict(_SPECIALS)
    for c in sorted(set(string.printable) - set("\x0b\x0c\r")):
        vocab[c] = len(vocab)
    assert len(vocab) <= tk.TEXT_VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                            pad_token="[PAD]").save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": tk.VOCAB,
        "max_position_embeddings": 16384, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 3, "talker_seed": seed, "sample_rate": tk.SAMPLE_RATE, "voices": VOICES,
    }, indent=2))
    return path
