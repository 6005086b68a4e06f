"""Online calibration of the length head from what verification has shown, per request and domain.

Why. The head is trained on some domains and meets others: on math it predicted an acceptance
ratio three times the real one, with no correlation, and the rule kept paying for drafts it
believed in. Verification tells us, every step, how each request's proposals actually fared.

Model. A request's proposals survive with probability a (the geometric process the planner
prices slots with). A step that verified L > 1 slots and accepted n proposals is n survivals and,
if n < L - 1, one failure. Per request we keep exponentially discounted counts (S survivals,
F failures) and H, the head's own survival summed over the same trials. The observed rate has a
Beta posterior mean

    r = (S + k_head * hbar) / (S + F + k_head),        hbar = H / (S + F),

that is, the head's average opinion counts as k_head pseudo-trials. The head still ranks steps
within a request (one block is easier than the next), so its reading is corrected in log-odds by
the offset the history shows rather than replaced:

    a = sigmoid(logit(a_head) + logit(r) - logit(hbar)).

With no history the offset is 0 and a is the head's. A request's counts start from its domain's
(a pooled, more slowly discounted version of the same counts, capped at k_domain pseudo-trials), so
a new request of a domain the drafter fails on starts calibrated. Requests without a domain share
one pool.

Before drafting there is no fresh head reading; :meth:`estimate` gives the planner r alone, which
decides whether drafting the request is worth its cost at all.

Profile along the block. One rate per request overrates the tail of a chain: on the embedded
pair a proposal is accepted 69% of the time at the first slot once reached, 49% at the third
and 23% at the fifth, so a plan priced with one rate verifies slots that rarely pay. Each domain
therefore also keeps, per slot, how often a reached proposal was accepted (discounted like the
domain counts); :meth:`per_slot` scales a request's rate by its domain's profile relative to
the domain's mean (a flat profile, or no evidence yet, leaves the rate as it is).

All state lives in tensors indexed by cache slot on the engine's device; every method is a few
vector operations with no host synchronisation.
"""

from __future__ import annotations

import numpy as np
import torch

_EPS = 1e-4


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(_EPS, 1 - _EPS)
    return torch.log(p) - torch.log1p(-p)


class SurvivalPosterior:
    def __init__(
        self,
        num_slots: int,
        *,
        device: torch.device | str = "cpu",
        decay: float = 0.9,
        domain_decay: float = 0.98,
        head_weight: float = 1.0,
        domain_weight: float = 6.0,
        max_domains: int = 256,
        max_block: int = 64,
        profile_weight: float = 2.0,
        profile_decay: float = 0.998,
        idle_decay: float = 1.0,
    ):
        if not 0 < idle_decay <= 1:
            raise ValueError(f"idle_decay must be in (0, 1], got {idle_decay}")
        self.decay, self.domain_decay, self.idle_decay = decay, domain_decay, idle_decay
        self.head_weight, self.domain_weight = head_weight, domain_weight
        z = dict(dtype=torch.float32, device=device)
        self._counts = torch.zeros(num_slots, 3, **z)  # per slot: S, F, H (read through counts)
        # steps on which slots 0.._idle_rows-1 all went undrafted, not yet folded into _counts (idle)
        self._idle_steps, self._idle_rows = 0, 0
        self.evidence = 0  # observe() calls and forget()s so far: what a cached reading is keyed by
        self.domain_counts = torch.zeros(max_domains, 3, **z)
        self.slot_domain = torch.zeros(num_slots, dtype=torch.long, device=device)
        # per domain and proposal slot: accepted, reached (the proposals before it were accepted)
        self.slot_counts = torch.zeros(max_domains, max_block, 2, **z)
        self.profile_weight, self.profile_decay = profile_weight, profile_decay
        self._domains: dict[str | None, int] = {None: 0}
        self.host = torch.device(device).type == "cpu"  # update in numpy on views (observe)
        self.prior: dict[str | None, float] = {}  # domain -> survival rate the drafter's eval gave (set_prior)

    @property
    def observed(self) -> np.ndarray:
        """[max_domains] bool, on the host: whether verification has shown anything of each
        domain since the last forget (set_prior does not count). It is the profile's count of
        first proposals reached, which every verify of a proposal adds to and only forget
        clears (its decay takes tens of thousands of steps without the domain to reach 0)."""
        return self.slot_counts[:, 0, 1].cpu().numpy() > 0

    @property
    def counts(self) -> torch.Tensor:
        """[num_slots, 3] each slot's own (S, F, H), with every idle step's fade folded in."""
        if self._idle_steps:
            self._fold_idle()
        return self._counts

    def _fold_idle(self) -> None:
        steps, n = self._idle_steps, self._idle_rows
        self._idle_steps = 0
        keep = np.float32(self.idle_decay) ** np.float32(steps)
        if self.host:
            self._counts.numpy()[:n] *= keep
        else:
            self._counts[:n] *= float(keep)

    def fresh(self) -> SurvivalPosterior:
        """A posterior with the same settings, its drafter's prior and no evidence beyond it (a
        benchmark's cold start: the prior is what the drafter version says of itself, not
        history the engine gathered)."""
        out = SurvivalPosterior(
            self.counts.shape[0], device=self.counts.device, decay=self.decay, domain_decay=self.domain_decay,
            head_weight=self.head_weight, domain_weight=self.domain_weight,
            max_domains=self.domain_counts.shape[0], max_block=self.slot_counts.shape[1],
            profile_weight=self.profile_weight, profile_decay=self.profile_decay, idle_decay=self.idle_decay)
        out.set_prior(self.prior)
        return out

    def set_prior(self, rates: dict[str | None, float]) -> None:
        """Start each named domain from `domain_weight` pseudo-trials at its survival rate
        (planner.prior: the drafter version's own eval), on top of whatever evidence the domain
        holds; replaces the prior kept for :meth:`fresh` and :meth:`forget`. The head's summed
        survival is set to the same rate, so the prior moves the estimate a plan reads before
        drafting (:meth:`estimate`) and leaves the head's own reading of a drafted block as it is
        (:meth:`calibrate`'s offset is unchanged by it)."""
        self.prior = {d: float(a) for d, a in rates.items()}
        if not self.prior:
            return
        self.evidence += 1
        k = float(self.domain_weight)
        for domain, a in self.prior.items():
            i = self.domain_id(domain)
            if i == 0 and domain is not None:
                continue  # beyond max_domains: the shared unknown pool takes no domain's prior
            a = min(max(a, 0.0), 1.0 - _EPS)
            self.domain_counts[i] += torch.tensor([a * k, (1.0 - a) * k, a * k], device=self.domain_counts.device)

    def domain_id(self, domain: str | None) -> int:
        """A stable small id per domain name; beyond max_domains names share the unknown pool."""
        if domain not in self._domains:
            nxt = len(self._domains)
            self._domains[domain] = nxt if nxt < self.domain_counts.shape[0] else 0
        return self._domains[domain]

    def reset(self, slots: torch.Tensor, domains: list[str | None]) -> None:
        """New requests in these slots: no history of their own."""
        self.counts[slots] = 0
        ids = torch.tensor([self.domain_id(d) for d in domains], dtype=torch.long)
        self.slot_domain[slots] = ids.to(self.slot_domain.device)

    def forget(self, prior: dict[str | None, float] | None = None) -> None:
        """Drop every request's and domain's evidence (a new drafter now serves: what the old
        one's proposals did says little about the new one's) and start from `prior`, the new
        version's own eval (planner.prior; None or {}: no prior, every domain cold). Slots keep
        their domains."""
        self.evidence += 1
        self.counts.zero_()
        self.domain_counts.zero_()
        self.slot_counts.zero_()
        self.set_prior(prior or {})

    def move(self, src: int, dst: int) -> None:
        self.counts[dst] = self.counts[src]
        self.slot_domain[dst] = self.slot_domain[src]

    def _pooled(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, 3] the request's counts plus its domain's, the latter capped at domain_weight trials."""
        own = self.counts[slots]
        dom = self.domain_counts[self.slot_domain[slots]]
        trials = dom[:, 0] + dom[:, 1]
        scale = self.domain_weight / trials.clamp(min=self.domain_weight)
        return own + dom * scale[:, None]

    def _rate(self, pooled: torch.Tensor, head_mean: torch.Tensor) -> torch.Tensor:
        s, f = pooled[:, 0], pooled[:, 1]
        return (s + self.head_weight * head_mean) / (s + f + self.head_weight)

    def estimate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(survival r [n], known [n] bool) for the planner's draft-or-not decision."""
        pooled = self._pooled(slots)
        trials = pooled[:, 0] + pooled[:, 1]
        known = trials > 0.5
        head_mean = pooled[:, 2] / trials.clamp(min=_EPS)
        return self._rate(pooled, head_mean), known

    def estimate_on_host(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`estimate` of cache slots 0..n-1 in numpy, on views of the state (a CPU only):
        the same float32 operations, without torch's per-call overhead."""
        own = self.counts.numpy()[:n]
        dom = self.domain_counts.numpy()[self.slot_domain.numpy()[:n]]
        trials = dom[:, 0] + dom[:, 1]
        scale = np.float32(self.domain_weight) / np.maximum(trials, np.float32(self.domain_weight))
        pooled = own + dom * scale[:, None]
        s, f = pooled[:, 0], pooled[:, 1]
        trials = s + f
        head_mean = pooled[:, 2] / np.maximum(trials, np.float32(_EPS))
        hw = np.float32(self.head_weight)
        return (s + hw * head_mean) / (s + f + hw), trials > 0.5

    def per_slot_on_host(self, n: int, rate: np.ndarray, width: int) -> np.ndarray:
        """:meth:`per_slot` of cache slots 0..n-1 in numpy (a CPU only)."""
        c = self.slot_counts.numpy()[self.slot_domain.numpy()[:n], :width]
        acc, reached = c[..., 0], c[..., 1]
        mean = acc.sum(1) / np.maximum(reached.sum(1), np.float32(_EPS))
        k = np.float32(self.profile_weight)
        prof = (acc + k * mean[:, None]) / (reached + k)
        shape = np.where(reached.sum(1, keepdims=True) > 0.5, prof / np.maximum(mean, np.float32(_EPS))[:, None],
                         np.float32(1.0))
        return np.clip(rate.astype(np.float32)[:, None] * shape, np.float32(0.0), np.float32(1 - _EPS))

    def best_known(self, n: int, width: int) -> np.ndarray | None:
        """[width] float32: the best evidence held, per proposal along the block; None if none.

        The highest survival rate of any domain verification has shown something of, or of
        cache slots 0..n-1 (a request can do better than its domain; a row of a domain the prior
        alone rates is read at that rate), shaped by that domain's profile as :meth:`per_slot`
        shapes a request's. What a request would have to beat for drafting it to be a long shot
        (draft_choice.could_pay). A domain rated by the drafter's eval alone (set_prior) and not
        in the batch does not count: what the drafter says of code is no reason to probe math
        requests at full credit and replan a batch nothing pays in every few steps, where
        nothing served here has shown it (benchmarks/adaptive/README.md, "The drafter's own
        eval as the calibration's prior"). Read on the host."""
        dom = self.domain_counts.cpu().numpy()  # no copy on a CPU
        trials = dom[:, 0] + dom[:, 1]
        hw = np.float32(self.head_weight)
        head_mean = dom[:, 2] / np.maximum(trials, np.float32(_EPS))
        domain_rate = np.where((trials > 0.5) & self.observed, (dom[:, 0] + hw * head_mean) / (trials + hw), -1.0)
        if self.host:
            rate, known = self.estimate_on_host(n)
        else:
            r, k = self.estimate(torch.arange(n, device=self.counts.device))
            rate, known = r.float().cpu().numpy(), k.cpu().numpy()
        row_rate = np.where(known, rate, -1.0)
        best_domain = int(domain_rate.argmax())
        if n and row_rate.max() > domain_rate[best_domain]:
            best, domain = float(row_rate.max()), int(self.slot_domain.cpu().numpy()[int(row_rate.argmax())])
        else:
            best, domain = float(domain_rate[best_domain]), best_domain
        if best < 0:
            return None
        c = self.slot_counts.cpu().numpy()[domain, :width]
        acc, reached = c[:, 0], c[:, 1]
        mean = acc.sum() / max(float(reached.sum()), _EPS)
        k = np.float32(self.profile_weight)
        shape = (acc + k * mean) / (reached + k) / max(mean, _EPS) if reached.sum() > 0.5 else np.ones(width)
        return np.clip(np.float32(best) * shape, 0.0, 1 - _EPS).astype(np.float32)

    def sample(self, slots: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A draw of each slot's survival from its posterior (normal with the Beta's mean and
        variance, clipped to [0, 1)): planning with draws instead of means drafts a request in
        proportion to the chance that drafting it pays, so a request with little or mixed
        evidence keeps being tried while one with a long record of failures rarely is."""
        pooled = self._pooled(slots)
        s, f = pooled[:, 0], pooled[:, 1]
        trials = s + f
        head_mean = pooled[:, 2] / trials.clamp(min=_EPS)
        alpha = s + self.head_weight * head_mean
        total = trials + self.head_weight
        mean = alpha / total
        std = (mean * (1 - mean) / (total + 1)).clamp(min=0).sqrt()
        z = torch.randn(mean.shape, generator=generator, device=generator.device).to(mean.device)
        return (mean + z * std).clamp(0.0, 1 - _EPS)

    def calibrate(self, slots: torch.Tensor, head_survival: torch.Tensor) -> torch.Tensor:
        """The head's survival for these slots, corrected by their history: [n]."""
        pooled = self._pooled(slots)
        trials = pooled[:, 0] + pooled[:, 1]
        h = head_survival.float()
        head_mean = torch.where(trials > 0, pooled[:, 2] / trials.clamp(min=_EPS), h)
        offset = _logit(self._rate(pooled, head_mean)) - _logit(head_mean)
        return torch.sigmoid(_logit(h) + offset)

    def observe(
        self,
        slots: torch.Tensor,
        head_survival: torch.Tensor,
        num_accepted: torch.Tensor,
        verify_lens: torch.Tensor,
    ) -> None:
        """Fold one verify step in. Rows that verified no proposal (L = 1) carry no evidence."""
        self.evidence += 1
        if self.host:
            self._observe_on_host(slots.numpy(), head_survival.numpy(), num_accepted.numpy(), verify_lens.numpy())
            return
        n = num_accepted.float()
        cand = (verify_lens.to(n.device) - 1).float()
        seen = cand > 0
        fail = (n < cand).float()
        trials = n + fail
        obs = torch.stack([n, fail, head_survival.float() * trials], dim=1) * seen[:, None]
        keep = torch.where(seen, self.decay, 1.0)[:, None]
        self.counts[slots] = self.counts[slots] * keep + obs
        self.domain_counts.mul_(self.domain_decay)
        self.domain_counts.index_add_(0, self.slot_domain[slots], obs)
        # the profile: proposal slot j was reached if j <= n, accepted if j < n (j < cand)
        j = torch.arange(self.slot_counts.shape[1], device=n.device)[None]
        reached = ((j <= n[:, None]) & (j < cand[:, None])).float()
        accepted = (j < n[:, None]).float() * reached
        self.slot_counts.mul_(self.profile_decay)
        self.slot_counts.index_add_(0, self.slot_domain[slots], torch.stack([accepted, reached], dim=2))

    def _observe_on_host(self, slots: np.ndarray, head: np.ndarray, n: np.ndarray, lens: np.ndarray) -> None:
        """:meth:`observe` in numpy on views of the state (a CPU: the engine calls it every step,
        and torch's per-call overhead was most of its 0.25 ms at c=1)."""
        n = n.astype(np.float32)
        cand = (lens - 1).astype(np.float32)
        seen = cand > 0
        fail = (n < cand).astype(np.float32)
        trials = n + fail
        obs = np.stack([n, fail, head.astype(np.float32) * trials], axis=1) * seen[:, None]
        keep = np.where(seen, np.float32(self.decay), np.float32(1.0))[:, None]
        counts, domains = self.counts.numpy(), self.domain_counts.numpy()
        counts[slots] = counts[slots] * keep + obs
        ids = self.slot_domain.numpy()[slots]
        domains *= np.float32(self.domain_decay)
        np.add.at(domains, ids, obs)
        j = np.arange(self.slot_counts.shape[1])[None]
        reached = (j <= n[:, None]) & (j < cand[:, None])
        profile = self.slot_counts.numpy()
        profile *= np.float32(self.profile_decay)
        np.add.at(profile, ids, np.stack([(j < n[:, None]) & reached, reached], axis=2).astype(np.float32))

    def idle(self, n: int, drafted: list[int]) -> None:
        """Cache slots 0..n-1 not in `drafted` advanced a token without drafting: their own
        evidence fades by idle_decay, so a request left undrafted drifts back to its domain's rate.

        A request's acceptance is only locally its own: on the embedded pair (in-domain, T=0, the
        drafter's fate at every position; benchmarks/adaptive/signals.py) the accepted count at a
        position correlates 0.53 with the next position's, 0.20 with the one four tokens on, 0.13
        at eight and 0.02 at 32, and which request it is explains 13% of its variance. Without the
        fade a request whose last few drafts failed kept that verdict for the rest of its output
        (nothing but a probe changes it while it drafts nothing), which is how one engine drafted
        3-44% of request-steps from run to run at in-domain c=8. idle_decay = 1 keeps the counts."""
        if self.idle_decay == 1.0 or n == 0:
            return
        if not drafted:
            # Most steps of a batch that drafts nobody: the fade is counted here and folded in
            # when the counts are next read (the counts property), so a run of plain steps pays
            # one multiply, not one a step (53 us a step at math c=1, timed in place between the
            # target's forwards, where even a small numpy call meets cold caches:
            # benchmarks/adaptive/host_parts/).
            if self._idle_steps and n != self._idle_rows:
                self._fold_idle()
            self._idle_steps, self._idle_rows = self._idle_steps + 1, n
            return
        keep = np.full((n, 1), self.idle_decay, dtype=np.float32)
        keep[drafted] = 1.0
        counts = self.counts
        if self.host:
            counts.numpy()[:n] *= keep
        else:
            counts[:n] *= torch.as_tensor(keep, device=counts.device)

    def per_slot(self, slots: torch.Tensor, rate: torch.Tensor, width: int) -> torch.Tensor:
        """[n, width]: each slot's rate for these cache slots, rate [n] scaled by the domain's
        profile (slot j's acceptance once reached, over the domain's mean over reached slots)."""
        c = self.slot_counts[self.slot_domain[slots], :width]  # [n, width, 2]
        acc, reached = c[..., 0], c[..., 1]
        mean = acc.sum(1) / reached.sum(1).clamp(min=_EPS)  # [n]
        k = self.profile_weight
        prof = (acc + k * mean[:, None]) / (reached + k)
        shape = torch.where(reached.sum(1, keepdim=True) > 0.5, prof / mean.clamp(min=_EPS)[:, None],
                            torch.ones_like(prof))
        return (rate.float()[:, None] * shape).clamp(0.0, 1 - _EPS)
