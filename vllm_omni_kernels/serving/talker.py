"""A small TTS talker to serve: text tokens in, codec codes out, and a decoder from codes to audio.

Weights are random, made from a seed (nothing is downloaded). Every engine step the talker turns
each sampling request's last token, frame index and prompt context into one codec frame of
``CODEBOOKS`` codes; the first code, offset by ``TEXT_VOCAB``, is the step's sampled token (so a
text id, EOS included, is never sampled: a request runs for its ``max_tokens`` frames).

Weights and activations are small integers held in float32, every sum stays below 2**24, the
nonlinearity is a remainder and every logit is distinct: each step is exact, whatever the device,
the batch or the order a matmul sums in (TF32 included), so a request's codes are the same on a
GPU server as in ``rollout`` on the CPU.

``decode_frames`` turns codes into ``FRAME_SAMPLES`` samples per frame with integer arithmetic only
(a sum of sawtooth waves whose steps come from the codes, scaled by a power of two), so the audio of
a frame is the same bits on every device: a test knows every sample from the codes alone
(``expected_audio``).
"""

from __future__ import annotations

import torch
from torch import nn

SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920  # one 12.5 Hz codec frame at 24 kHz
STREAM_CADENCE = 4 * FRAME_SAMPLES  # samples a streaming request gets at a time, by default (320 ms)
CODEBOOKS = 8
CODEBOOK_SIZE = 1024
TEXT_VOCAB = 1024  # ids below this are text (the tokenizer's); codes are sampled as TEXT_VOCAB + code
VOCAB = TEXT_VOCAB + CODEBOOK_SIZE
_HIDDEN = 64
_POSITIONS = 4096
_SCALE = 2.0 ** -18  # |sum of CODEBOOKS sawtooth values| < 2**18: samples in [-1, 1), exact in float32
_FOLD = 17  # activations folded into [-8, 8]; weights in [-4, 4]: |a dot product| <= 64 * 8 * 4 = 2**11


class ToyTalker(nn.Module):
    """The talker's weights and one step's forward (module docstring): ``forward(last_token [B] int64,
    frame [B] int64, context [B, H]) -> codes [B, CODEBOOKS] int64``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def weights(*shape: int, bound: int) -> nn.Parameter:
            return nn.Parameter(torch.randint(-bound, bound + 1, shape, generator=g).float(), requires_grad=False)

        self.embed = weights(VOCAB, _HIDDEN, bound=8)
        self.position = weights(_POSITIONS, _HIDDEN, bound=8)
        self.mix = weights(_HIDDEN, _HIDDEN, bound=4)
        heads = weights(CODEBOOKS, _HIDDEN, CODEBOOK_SIZE, bound=4)
        # kept as one [H, CODEBOOKS * CODEBOOK_SIZE] matrix: a step's logits are one matmul, with no
        # permutation of the weights (integer sums are exact in any order); ``heads`` views it
        self.heads_flat = nn.Parameter(heads.detach().permute(1, 0, 2).reshape(_HIDDEN, -1).contiguous(),
                                       requires_grad=False)
        # logit * CODEBOOK_SIZE + a rank of its own per code: no two logits tie (all below 2**22)
        self.register_buffer("rank", torch.randperm(CODEBOOK_SIZE, generator=g).float(), persistent=False)

    @property
    def heads(self) -> torch.Tensor:
        """The per-codebook heads ``[CODEBOOKS, H, CODEBOOK_SIZE]`` (a view of ``heads_flat``)."""
        return self.heads_flat.view(_HIDDEN, CODEBOOKS, CODEBOOK_SIZE).permute(1, 0, 2)

    @property
    def hidden_size(self) -> int:
        return _HIDDEN

    def prompt_context(self, prompt_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Contexts of a batch of prompts, each its summed embedding, folded: ``prompt_ids`` ``[B, L]``
        int64 (row b's first ``lengths[b]`` are its prompt, the rest padding) -> ``[B, H]``."""
        valid = torch.arange(prompt_ids.shape[1], device=prompt_ids.device) < lengths[:, None]
        return _fold((self.embed[prompt_ids.clamp(0, VOCAB - 1)] * valid[..., None]).sum(1))

    @torch.no_grad()
    def forward(self, last_token: torch.Tensor, frame: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        h = _fold(self.embed[last_token] + self.position[frame % _POSITIONS] + context)
        h = _fold(h @ self.mix)
        logits = (h @ self.heads_flat).view(-1, CODEBOOKS, CODEBOOK_SIZE)
        return (logits * CODEBOOK_SIZE + self.rank).argmax(-1)


def _fold(x: torch.Tensor) -> torch.Tensor:
    """The talker's nonlinearity: integers folded into [-8, 8] (exact in float32)."""
    return torch.remainder(x, _FOLD) - _FOLD // 2


def decode_frames(codes: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
    """Audio of codec frames: ``codes`` ``[B, CODEBOOKS]`` int64 at frame indices ``frame`` ``[B]``
    -> ``[B, FRAME_SAMPLES]`` float32. Integer arithmetic, then one exact scaling: the same bits on
    any device. Sample t of codebook q is ``(t * step_q) mod 2**16 - 2**15``, computed in int32 from
    ``t mod 2**16`` (the product stays below 2**31) with masks for the modulo."""
    t = frame[:, None] * FRAME_SAMPLES + torch.arange(FRAME_SAMPLES, device=codes.device)  # [B, T] absolute
    step = 1 + (codes * 37 + torch.arange(CODEBOOKS, device=codes.device) * 101) % 2039  # [B, Q], below 2**11
    t16 = (t & 0xFFFF).to(torch.int32)
    saw = ((t16[:, None, :] * step.to(torch.int32)[:, :, None]) & 0xFFFF) - 32768  # [B, Q, T]
    return saw.sum(1, dtype=torch.int32).to(torch.float32) * _SCALE


def expected_audio(codes: torch.Tensor) -> torch.Tensor:
    """A request's whole audio from its codes ``[frames, CODEBOOKS]`` (frames 0, 1, ...): what the
    server must deliver, sample for sample. ``[frames * FRAME_SAMPLES]`` float32."""
    frames = torch.arange(codes.shape[0], device=codes.device)
    return decode_frames(codes, frames).reshape(-1)


@torch.no_grad()
def rollout(talker: ToyTalker, prompt_ids, frames: int) -> torch.Tensor:
    """The codes ``[frames, CODEBOOKS]`` the engine produces for one request, computed alone: the
    prompt's context, then one forward per frame, each fed the last frame's first code as its token
    (what ``TalkerWorker`` does for a batch). ``expected_audio`` of them is the request's audio."""
    device = talker.embed.device
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.int64, device=device)
    context = talker.prompt_context(ids[None], torch.tensor([len(ids)], device=device))
    last = ids[-1:].clone()
    out = torch.empty(frames, CODEBOOKS, dtype=torch.int64, device=device)
    for f in range(frames):
        out[f] = talker(last, torch.tensor([f], device=device), context)[0]
        last = out[f, :1] + TEXT_VOCAB
    return out
