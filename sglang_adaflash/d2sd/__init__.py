"""D2SD: dual-diffusion prefix-tree drafting with tree verification (mode `d2sd`).

See docs/d2sd.md. The first drafter is the DFlash drafter unchanged; the recovery drafter is a
variable-prefix DFlash drafter (recovery_drafter.py); trees, their verify forward, acceptance
and the branch plan live in their own modules; D2SDEngine puts them in SpecEngine's step.
"""

TREE_RULES = ("load_aware", "fixed")
BRANCH_DRAFTERS = ("recovery", "first", "auto", "joint")
