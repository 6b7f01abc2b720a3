"""The project's ``vllm.general_plugins`` entry point: vLLM runs ``register`` in every process it
starts (frontend, engine core, workers), so each of them knows the talker's architecture. This
package's engines register it themselves too, where vLLM's config is made (``llm.omni_vllm_config``;
the engine core and the client processes take that config as it is): an environment's
``VLLM_PLUGINS`` may leave the plugin out of vLLM's own serving."""

from __future__ import annotations


def register() -> None:
    """Register the talker's architecture with vLLM (once; a class another package registered under
    its name stays)."""
    from vllm import ModelRegistry

    from .talker_model import ARCHITECTURE, OmniTalkerForTTS

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, OmniTalkerForTTS)
