"""What the demo sends: the shipped held-out prompts, in two phases.

Phase ``code+prose`` alternates the code and prose files: the domains the shipped drafter was
trained on. Phase ``math`` is the deployment's shift: the shipped math prompts, then, past their
count, fresh word problems from the same generator (``training_job.data.math_problems``, seeded,
none equal to a shipped one), so no prompt is sent twice and the drafter never meets a
repeated prompt it could memorise. Phase ``code+prose again`` sends the first phase's first
prompts once more after the last round (nothing trains on them then), so the same prompts show
what the math rounds did to the first domains.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass

from ..assets import workload_path

FIRST_PHASE = "code+prose"
SHIFT_PHASE = "math"
#: After the last round: the first phase's first prompts again, on the final version.
REPLAY_PHASE = "code+prose again"
#: Seed of the extra math problems (not the seed of the shipped held-out set).
EXTRA_MATH_SEED = 7331


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    text: str


def shipped(domain: str) -> list[Prompt]:
    out = []
    with open(workload_path(domain)) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(Prompt(rec["id"], domain, rec["prompt"]))
    return out


def first_phase(n: int) -> list[Prompt]:
    """``n`` prompts, code and prose in turn."""
    pairs = itertools.chain.from_iterable(zip(shipped("code"), shipped("prose")))
    return list(itertools.islice(pairs, n))


def math_stream() -> Iterator[Prompt]:
    """The shipped math prompts, then as many generated ones as asked for (never a repeat)."""
    held = shipped("math")
    yield from held
    try:
        from training_job.data.math_problems import generate
    except ImportError:  # an install without the training job: the shipped prompts only
        return
    seen = {p.text for p in held}
    batch = 0
    while True:
        problems = generate(200, seed=EXTRA_MATH_SEED + batch, exclude=seen)
        for i, p in enumerate(problems):
            seen.add(p.question)
            yield Prompt(f"math/generated/{batch:03d}/{i:03d}", "math", p.question)
        batch += 1
