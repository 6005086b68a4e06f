"""The demo's sizes: one table, read by the loop and by ``adaflash demo --help``.

A module of its own so the command line can print the defaults without importing the loop (its
HTTP client and plotting), and so each default is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import CLIError


@dataclass(frozen=True)
class Plan:
    """Sizes of one run; ``--quick`` picks the small column."""

    first_requests: int
    min_records: int
    max_records: int
    rounds: int
    epochs: int
    lr: float  # the distillation rounds' AdamW learning rate
    head_steps: int
    eval_records: int
    eval_tokens: int
    standing_eval: int  # earlier rounds' held-out records per domain in a round's evaluation
    per_version: int
    budget_s: float
    max_tokens: int
    check_prompts: int
    replay: int  # first-phase prompts sent again after the last round
    baseline_every: int  # every n-th prompt also goes to plain decoding


DEFAULT = Plan(first_requests=32, min_records=96, max_records=256, rounds=3, epochs=4, lr=6e-4,
               head_steps=50, eval_records=16, eval_tokens=64, standing_eval=4, per_version=48,
               budget_s=720, max_tokens=64, check_prompts=12, replay=16, baseline_every=2)
QUICK = Plan(first_requests=8, min_records=32, max_records=48, rounds=1, epochs=2, lr=3e-4,
             head_steps=10, eval_records=4, eval_tokens=32, standing_eval=2, per_version=8,
             budget_s=140, max_tokens=48, check_prompts=6, replay=4, baseline_every=2)

#: Sizes that may be 0 (no length-head refit, no replay); every other size is at least 1.
MAY_BE_ZERO = ("head_steps", "replay")


def defaults(name: str) -> str:
    """``"default D; --quick Q"`` for a size's help text (one figure where both agree)."""
    d, q = getattr(DEFAULT, name), getattr(QUICK, name)
    d, q = (f"{v:g}" if isinstance(v, float) else str(v) for v in (d, q))
    return f"default {d}" + ("" if d == q else f"; --quick {q}")


def plan_for(args) -> Plan:
    """The run's sizes: each flag given, else the default (``--quick``'s where it is set)."""
    base = QUICK if args.quick else DEFAULT
    given = {f.name: getattr(args, f.name, None) for f in fields(Plan)}
    plan = Plan(**{k: (v if v is not None else getattr(base, k)) for k, v in given.items()})
    for k, v in vars(plan).items():
        flag = "--" + k.replace("_", "-")
        if k == "lr":
            if not (0 < v < float("inf")):  # NaN too
                raise CLIError(f"{flag} must be a positive number, got {v}")
            continue
        least = 0 if k in MAY_BE_ZERO else 1
        if not v >= least:
            raise CLIError(f"{flag} must be >= {least}, got {v}")
    return plan
