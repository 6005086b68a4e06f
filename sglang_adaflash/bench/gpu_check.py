"""The judgements of ``scripts/sglang_gpu_check.py``, as pure functions of what the servers
returned: token equality, a two-sample test of sampled tokens, counters read from Prometheus
text, and the pass/fail thresholds. The script does the serving; tests call these directly.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

#: Every pass/fail threshold of the GPU check, in one place (results.json repeats them).
THRESHOLDS: dict[str, float] = {
    # T>0: a speculative server's sampled tokens against plain decoding's, per position, by a
    # chi-square test of homogeneity: fail below this p-value ...
    "sampled_min_p": 1e-3,
    # ... and the control (plain decoding at another temperature) must be rejected below it,
    # or the test had no power and says nothing
    "sampled_control_max_p": 1e-3,
    # compact and cap modes: proposals verified (cap: acceptance capped at) / proposals drafted,
    # at concurrency 64 (< 1: the head's lengths were applied)
    "compact_max_verified_share": 0.98,
    # share of decode forward passes that replayed a CUDA graph
    "min_graph_replay_share": 0.5,
    # hot reload: accepted proposals per draft with the bad drafter / with the original ...
    "bad_drafter_max_acceptance_share": 0.5,
    # ... and with the good one published after it / with the original
    "good_drafter_min_acceptance_share": 0.8,
    # ADAFLASH throughput / DFLASH (and / DSPARK) at every concurrency; the embedded target is
    # tiny, so this bounds per-step overheads rather than demanding a saving
    "min_throughput_ratio": 0.85,
    # the whole check, from a clean start
    "max_seconds": 480.0,
}


def check(name: str, ok: bool, **detail: Any) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), **detail}


def equal_outputs(name: str, got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """Token-for-token equality, request by request."""
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return check(name, not bad and len(got) == len(want), requests=len(got),
                 mismatching_requests=bad[:10])  # fmt: skip


# -- Prometheus text --------------------------------------------------------------------------


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        if "=" in part:
            key, value = part.split("=", 1)
            out[key.strip()] = value.strip().strip('"')
    return out


def metric_sum(metrics: str, name: str, **labels: str) -> float:
    """Sum of a series over the samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name):]
        if rest[:1] == "{":
            label_text, _, value = rest[1:].partition("} ")
            if any(_labels(label_text).get(k) != v for k, v in labels.items()):
                continue
        elif rest[:1] == " " and not labels:
            value = rest
        else:
            continue
        total += float(value.split()[0])
    return total


ADAFLASH_COUNTERS = ("drafts", "draft_tokens", "verified_tokens", "accepted_tokens")


def adaflash_counts(metrics: str) -> dict[str, float]:
    return {k: metric_sum(metrics, f"adaflash_spec_{k}_total") for k in ADAFLASH_COUNTERS}


def graph_passes(metrics: str) -> dict[str, float]:
    """SGLang's decode forward passes with and without a CUDA-graph replay."""
    name = "sglang:cuda_graph_passes_total"
    return {mode: metric_sum(metrics, name, mode=mode)
            for mode in ("decode_cuda_graph", "decode_none")}  # fmt: skip


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def acceptance_per_draft(counts: dict[str, float]) -> float | None:
    return counts["accepted_tokens"] / counts["drafts"] if counts.get("drafts") else None


def compaction(name: str, counts: dict[str, float], mode: str | None) -> dict[str, Any]:
    """What the verify lengths did, from the plugin's counters (proposals verified, i.e. the
    candidate length - 1 of each draft, against proposals drafted). ``compact``: the target
    verified fewer than were drafted (a silent fallback to whole blocks verifies all of them);
    ``cap``: the target computes whole blocks, but acceptance is capped at the head's lengths,
    which the counters report, so they must fall short of whole blocks too; ``fixed`` (and
    DFLASH's own block): every proposal."""
    drafted, verified = counts["draft_tokens"], counts["verified_tokens"]
    share = verified / drafted if drafted else None
    if mode in ("compact", "cap"):
        ok = share is not None and share <= THRESHOLDS["compact_max_verified_share"]
    else:
        ok = share == 1.0
    return check(f"{name}_verified_vs_drafted", ok, drafted=drafted, verified=verified,
                 verified_share=share)  # fmt: skip


def graph_replay(name: str, passes: dict[str, float]) -> dict[str, Any]:
    replayed, eager = passes["decode_cuda_graph"], passes["decode_none"]
    share = replayed / (replayed + eager) if replayed + eager else None
    ok = share is not None and share >= THRESHOLDS["min_graph_replay_share"]
    return check(f"{name}_cuda_graphs_replayed", ok, replayed=replayed, eager=eager, share=share)


# -- sampled tokens ---------------------------------------------------------------------------


def homogeneity_p(a: list[int], b: list[int], min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that two samples of tokens come from one distribution.
    Tokens whose expected count falls below ``min_expected`` in either sample are pooled."""
    from scipy.stats import chi2

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if not na or not nb:
        return float("nan")
    cells, rest = [], [0, 0]
    for tok in sorted(set(ca) | set(cb)):
        n = ca[tok] + cb[tok]
        if min(n * na, n * nb) / (na + nb) < min_expected:
            rest[0] += ca[tok]
            rest[1] += cb[tok]
        else:
            cells.append((ca[tok], cb[tok]))
    if sum(rest):
        cells.append(tuple(rest))
    if len(cells) < 2:
        return 1.0
    stat = 0.0
    for x, y in cells:
        n = x + y
        for observed, total in ((x, na), (y, nb)):
            expected = n * total / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return float(chi2.sf(stat, len(cells) - 1))


def sampled_positions(outputs: list[list[int]], positions: range) -> dict[int, list[int]]:
    return {k: [o[k] for o in outputs if len(o) > k] for k in positions}


def same_distribution(name: str, got: list[list[int]], plain: list[list[int]],
                      control: list[list[int]], positions: range) -> dict[str, Any]:
    """Per position (the speculative ones: the first token comes from prefill), the server's
    sampled tokens against plain decoding's; the control sample (plain decoding at another
    temperature) must be told apart from plain decoding, or the test is not trusted."""
    g, p, c = (sampled_positions(x, positions) for x in (got, plain, control))
    p_server = {k: homogeneity_p(g[k], p[k]) for k in positions}
    p_control = {k: homogeneity_p(c[k], p[k]) for k in positions}
    powered = min(p_control.values()) <= THRESHOLDS["sampled_control_max_p"]
    same = all(not math.isnan(v) and v >= THRESHOLDS["sampled_min_p"] for v in p_server.values())
    return check(f"t_gt_0_distribution_{name}", powered and same, p_values=p_server,
                 control_p_values=p_control, control_rejected=powered,
                 samples=len(got))  # fmt: skip


# -- throughput -------------------------------------------------------------------------------


def ratio_rows(throughput: dict[str, list[dict]], min_ratio: float | None = None) -> list[dict]:
    """ADAFLASH (each server) over DFLASH, and over DSPARK when it ran, per concurrency; ``ok``
    when at least ``min_ratio`` (default: the threshold)."""
    if min_ratio is None:
        min_ratio = THRESHOLDS["min_throughput_ratio"]
    by = {name: {r["concurrency"]: r["tokens_per_s"] for r in runs}
          for name, runs in throughput.items()}  # fmt: skip
    rows = []
    for name in sorted(n for n in by if n.startswith("adaflash")):
        for base in ("dflash", "dspark"):
            for c in sorted(by[name]):
                if base in by and by[base].get(c):
                    ratio = by[name][c] / by[base][c]
                    rows.append({"adaflash": name, "vs": base, "concurrency": c,
                                 "ratio": round(ratio, 3),
                                 "ok": ratio >= min_ratio})  # fmt: skip
    return rows
