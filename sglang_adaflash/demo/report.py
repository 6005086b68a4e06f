"""From what the demo saw to its table, its plot and results.json.

Live tau of a (phase, version, domain) cell = tokens committed / decode steps, summed over the
steps that version served for requests of that domain in that phase (each answer says which
version served which of its steps). Throughput of a (phase, version) cell = completion tokens of
the answers that finished while that version was loaded in that phase, over that window's
length; the windows come from the ``/ready`` poller's timeline.

Speed against plain decoding of a (phase, version, domain) cell: over the prompts that were
answered by both servers (the speculative one mostly by that version, then the plain one right
after it), (sum of tokens / sum of seconds) of the speculative answers over the same of the plain
answers. Both servers answered the same prompts one at a time on the same machine in the same
minute, so the ratio is side by side, not against a figure from another run.
"""

from __future__ import annotations

from collections import defaultdict

from .client import Answer


def version_windows(samples: list[dict], end: float) -> list[tuple[str | None, float, float]]:
    """[(version, from, to)]: when each version was loaded, from the poller's samples."""
    out: list[list] = []
    for s in samples:
        if out and out[-1][0] == s["version"]:
            continue
        if out:
            out[-1][2] = s["t"]
        out.append([s["version"], s["t"], end])
    return [tuple(w) for w in out]


def paired_speed(answers: list[Answer]) -> dict[tuple, dict]:
    """(phase, version, domain) -> speculative and plain tokens/s over the prompts both answered,
    and their ratio (see the module docstring)."""
    plain = {(a.phase, a.id): a for a in answers if a.ok and a.server == "plain"}
    agg: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0, 0])
    for a in answers:
        b = plain.get((a.phase, a.id))
        if not a.ok or a.server != "spec" or b is None or a.seconds <= 0 or b.seconds <= 0:
            continue
        x = agg[(a.phase, a.version, a.domain)]
        x[0] += a.completion_tokens
        x[1] += a.seconds
        x[2] += b.completion_tokens
        x[3] += b.seconds
        x[4] += 1
    out = {}
    for key, (st, ss, pt, ps, n) in agg.items():
        spec, ref = st / ss, pt / ps
        out[key] = {"pairs": n, "tokens_per_s": round(spec, 2), "plain_tokens_per_s": round(ref, 2),
                    "vs_plain": round(spec / ref, 3) if ref > 0 else None}
    return out


def cells(answers: list[Answer], phases: list[dict], samples: list[dict], end: float) -> list[dict]:
    """One row per (phase, version): tau by domain, speed against plain decoding by domain,
    requests, throughput, window. Plain decoding's own answers count only in the speed ratio."""
    speed = paired_speed(answers)
    answers = [a for a in answers if a.server == "spec"]
    steps: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])  # steps, tokens, requests
    for a in answers:
        if not a.ok:
            continue
        for part in a.by_version:
            agg = steps[(a.phase, part["version"], a.domain)]
            agg[0] += part["decode_steps"]
            agg[1] += part["committed_tokens"]
            agg[2] += 1
    windows = version_windows(samples, end)
    rows = []
    for ph in phases:
        for version, t0, t1 in windows:
            lo, hi = max(t0, ph["start"]), min(t1, ph["end"])
            if hi <= lo:
                continue
            done = [a for a in answers if a.ok and a.phase == ph["name"] and lo <= a.end < hi]
            tokens = sum(a.completion_tokens for a in done)
            tau = {d: round(v[1] / v[0], 3) for (p, ver, d), v in sorted(steps.items())
                   if p == ph["name"] and ver == version and v[0]}
            reqs = {d: v[2] for (p, ver, d), v in sorted(steps.items()) if p == ph["name"] and ver == version}
            vs = {d: v for (p, ver, d), v in sorted(speed.items()) if p == ph["name"] and ver == version}
            if not tau and not done:
                continue
            rows.append({"phase": ph["name"], "version": version, "from_s": round(lo, 2),
                         "to_s": round(hi, 2), "tau": tau, "requests": reqs,
                         "vs_plain": {d: v["vs_plain"] for d, v in vs.items()}, "speed": vs,
                         "finished": len(done), "completion_tokens": tokens,
                         "tokens_per_s": round(tokens / (hi - lo), 2)})
    return rows


def stalls(samples: list[dict]) -> float:
    """Longest time (s) the step counter stood still while requests were outstanding (seen so
    at both ends: an interval in which the server may have gone idle does not count)."""
    def busy(s: dict) -> bool:
        return (s.get("running") or 0) + (s.get("waiting") or 0) > 0

    longest, since = 0.0, None
    for prev, cur in zip(samples, samples[1:]):
        if busy(prev) and busy(cur) and cur["steps"] == prev["steps"]:
            since = prev["t"] if since is None else since
            longest = max(longest, cur["t"] - since)
        else:
            since = None
    return round(longest, 2)


def table(rows: list[dict], domains: list[str]) -> str:
    """One line per (phase, version): live tau per domain, then speed against plain decoding
    per domain ("1.31x": 1.31 times plain decoding's tokens/s on the same prompts)."""
    head = ["phase", "version", *[f"tau {d}" for d in domains], *[f"vs ar {d}" for d in domains],
            "requests", "tok/s", "window s"]
    lines = [head]
    for r in rows:
        vs = r.get("vs_plain") or {}
        lines.append([r["phase"], str(r["version"]),
                      *[f"{r['tau'][d]:.2f}" if d in r["tau"] else "-" for d in domains],
                      *[f"{vs[d]:.2f}x" if vs.get(d) else "-" for d in domains],
                      str(r["finished"]), f"{r['tokens_per_s']:.1f}",
                      f"{r['from_s']:.0f}-{r['to_s']:.0f}"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def plot(path, answers: list[Answer], phases: list[dict], rows: list[dict], swaps: list[dict],
         title: str) -> bool:
    """Live tau per request and per (version, domain), and throughput, against time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {"code": "tab:blue", "prose": "tab:green", "math": "tab:red"}
    plain = [a for a in answers if a.ok and a.server == "plain" and a.seconds > 0]
    answers = [a for a in answers if a.server == "spec"]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[2, 1])
    for ph in phases[:1]:
        for a_ in (ax, bx):
            a_.axvspan(ph["start"], ph["end"], color="0.92", zorder=0)
    for d, c in colors.items():
        pts = [(a.end, sum(p["committed_tokens"] for p in a.by_version) /
                max(1, sum(p["decode_steps"] for p in a.by_version)))
               for a in answers if a.ok and a.domain == d and a.by_version]
        if pts:
            ax.scatter(*zip(*pts), s=6, color=c, alpha=0.35, label=f"{d} (one request)")
    for r in rows:
        for d, tau in r["tau"].items():
            ax.hlines(tau, r["from_s"], r["to_s"], color=colors.get(d, "k"), lw=2.5)
            if d == "math":
                ax.annotate(f"{r['version']}\n{tau:.2f}", ((r["from_s"] + r["to_s"]) / 2, tau),
                            ha="center", va="bottom", fontsize=7)
    # per-request decode speed of both servers (one request at a time: the server's throughput)
    for d, c in colors.items():
        pts = [(a.end, a.completion_tokens / a.seconds) for a in answers
               if a.ok and a.domain == d and a.seconds > 0]
        if pts:
            bx.scatter(*zip(*pts), s=5, color=c, alpha=0.35)
    if plain:
        bx.scatter([a.end for a in plain], [a.completion_tokens / a.seconds for a in plain], s=8,
                   marker="x", color="k", alpha=0.5, label="plain decoding (ar), same prompts")
    for r in rows:
        for d, sp in (r.get("speed") or {}).items():
            bx.hlines(sp["plain_tokens_per_s"], r["from_s"], r["to_s"], color="k", lw=1.5, ls=":")
            bx.hlines(sp["tokens_per_s"], r["from_s"], r["to_s"], color=colors.get(d, "k"), lw=2.5)
            if sp.get("vs_plain"):
                bx.annotate(f"{sp['vs_plain']:.2f}x", ((r["from_s"] + r["to_s"]) / 2, sp["tokens_per_s"]),
                            ha="center", va="bottom", fontsize=7, color=colors.get(d, "k"))
    if plain:
        bx.legend(loc="upper left", fontsize=7)
    for s in swaps:
        for a_ in (ax, bx):
            a_.axvline(s["t"], color="0.4", ls="--", lw=0.8)
        ax.text(s["t"], ax.get_ylim()[1] if ax.has_data() else 1, f" {s['version']}", fontsize=7,
                va="top", rotation=90)
    ax.set_ylabel("live tau (tokens per decode step)")
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=7)
    bx.set_ylabel("tokens/s per request")
    bx.set_xlabel("seconds (grey: first phase, code+prose; dashed: hot reloads; dotted black: plain decoding)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
