"""The project's ``vllm.general_plugins`` entry point: vLLM runs ``register`` in every process it
starts (frontend, engine core, workers), so each of them knows the talker's architecture."""

from __future__ import annotations


def register() -> None:
    from vllm import ModelRegistry

    from .talker_model import ARCHITECTURE, OmniTalkerForTTS

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, OmniTalkerForTTS)
