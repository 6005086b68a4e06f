"""What a drafter version says it accepts, per domain, as the calibration's starting point.

Every published drafter version carries, in its manifest's ``eval.tau_by_domain``, the tau it
measured on held-out prompts of each domain at a whole block (the offline recipe's teacher-forced
blocks; a distillation round's decodes through the reference engine in mode dflash: the
manifest's ``eval.method`` says which). Without it a new engine, or one that just swapped a
version in, knows nothing of any domain: its first requests read the drafter once each (first
reads) before the plan has anything to price them by, and where drafting cannot pay at the batch
size those reads are pure cost (at in-domain c=32 on the embedded pair they were every row a run
drafted after its first: benchmarks/adaptive/first_reads/in_domain_c32.json).

The eval becomes a prior: each domain it names starts with `domain_weight` pseudo-trials at the
survival rate whose expected tau over a whole block is the eval's tau (the geometric process the
planner prices slots with, :func:`~sglang_adaflash.planner.lengths.survival_rate`). It is evidence
like any other (SurvivalPosterior.set_prior): live verification outweighs it within about ten
verify steps of the domain and the domain's decay fades it, so an eval that flatters the drafter
costs a few drafted steps, not a lock-in (the shipped drafter's teacher-forced eval reads 3.45 on
code and 3.09 on prose, where live decoding of those prompts in mode dflash reads 2.80:
benchmarks/adaptive/avx2/results_f47607e.json). Domains the eval does not name start cold, as
before. A domain the prior alone rates is not evidence that another domain's requests could pay
(SurvivalPosterior.best_known).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .lengths import survival_rate

__all__ = ["UNTAGGED", "acceptance_prior", "survival_from_tau"]

#: The eval's name for requests that carried no domain (training_job.opd.traffic.UNTAGGED): the
#: calibration pools those under None.
UNTAGGED = "untagged"


def survival_from_tau(tau: float, block_size: int) -> float:
    """The per-proposal survival a whose E[tau] over a whole block of `block_size` is `tau`."""
    return float(survival_rate(torch.tensor([tau / block_size]), block_size)[0])


def acceptance_prior(manifest: Mapping[str, Any] | None, block_size: int) -> dict[str | None, float]:
    """{domain: survival rate} from a drafter manifest's ``eval.tau_by_domain`` ({} without one);
    the eval's "untagged" becomes None, the calibration's pool of requests without a domain.

    A value that is not a finite number in [1, block_size] is skipped, not an error: the prior
    only saves first reads, and a version must not fail to serve over its eval's bookkeeping."""
    ev = (manifest or {}).get("eval") if isinstance(manifest, Mapping) else None
    taus = ev.get("tau_by_domain") if isinstance(ev, Mapping) else None
    if not isinstance(taus, Mapping) or block_size < 2:
        return {}
    out = {}
    for domain, tau in taus.items():
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not isinstance(domain, str):
            continue
        if math.isfinite(tau) and 1.0 <= tau <= block_size:
            out[None if domain == UNTAGGED else domain] = survival_from_tau(float(tau), block_size)
    return out
