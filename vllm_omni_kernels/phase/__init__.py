"""The runner's prefill/decode phase contract: the phase metadata of a batch (batch.py:
``PhaseBatch``), the routing plan and its offset checks (routing.py: ``RoutingPlan``), and the
runner mixin that runs the hooks and the fused gather on them (runner.py: ``OmniPhaseRunnerMixin``)."""

from .batch import IS_PREFILL, NUM_COMPUTED, PHASE_KEYS, PROMPT_LEN, PhaseBatch
from .routing import DecodeRun, RoutingPlan, ScalarRow

__all__ = ["IS_PREFILL", "NUM_COMPUTED", "PHASE_KEYS", "PROMPT_LEN", "DecodeRun", "PhaseBatch", "RoutingPlan",
           "ScalarRow"]
