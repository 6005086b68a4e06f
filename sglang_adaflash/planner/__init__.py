"""Verify-length planning shared by the reference engine and the SGLang plugin.

It depends on torch only, so the engine, the target and the plugin can all sit above it.
"""

from .calibration import SurvivalPosterior
from .lengths import (
    LENGTH_RULES,
    PlanCost,
    expected_tau,
    paper_lengths,
    plan_lengths,
    survival_rate,
)

__all__ = [
    "LENGTH_RULES",
    "PlanCost",
    "SurvivalPosterior",
    "expected_tau",
    "paper_lengths",
    "plan_lengths",
    "survival_rate",
]
