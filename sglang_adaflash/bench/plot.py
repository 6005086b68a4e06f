"""The benchmark figure: throughput vs concurrency, and acceptance by draft position, per mode."""

from __future__ import annotations

import io
from pathlib import Path

from ..fsio import atomic_path

COLORS = {"hf": "tab:gray", "ar": "tab:blue", "dflash": "tab:orange", "adaflash": "tab:green"}


def plot_results(results: dict, path: str | Path) -> Path:
    """Write a PNG atomically (temp file in the same directory, then rename).

    The figure is rendered into memory first, so the temp file exists only while its bytes are
    written: rendering takes seconds, and a run killed in that window would leave it behind.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    modes = [m for m in results["config"]["modes"] if any(r["mode"] == m for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        pts = sorted((r["concurrency"], r["throughput_tok_s"]) for r in rows if r["mode"] == mode)
        ax1.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=mode, color=COLORS.get(mode))
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrency (max batch size)")
    ax1.set_ylabel("generated tokens / s")
    title = "throughput" + (" (mixed output lengths)" if results["config"].get("mixed_lengths") else "")
    ax1.set_title(title)
    ax1.grid(True, alpha=0.3)
    ax1.legend()

    spec_modes = [m for m in modes if m in ("dflash", "adaflash")]
    width = 0.8 / max(len(spec_modes), 1)
    top = 0.0
    for j, mode in enumerate(spec_modes):
        mine = [r for r in rows if r["mode"] == mode]
        steps = sum(r["steps"] for r in mine)
        counts = [sum(col) for col in zip(*(r["accepted_by_position"] for r in mine))]
        rate = [c / steps if steps else 0.0 for c in counts]
        xs = [k + 1 + (j - (len(spec_modes) - 1) / 2) * width for k in range(len(rate))]
        ax2.bar(xs, rate, width=width, label=mode, color=COLORS.get(mode))
        top = max([top, *rate])
    ax2.set_xlabel("draft position k")
    ax2.set_ylabel("accepted per step (all concurrencies)")
    ax2.set_title("accepted tokens by position")
    ax2.set_ylim(0, min(1.0, max(0.02, top * 1.25)))  # zoom in when little is accepted
    ax2.grid(True, axis="y", alpha=0.3)
    if spec_modes:
        ax2.legend()
    else:
        ax2.text(0.5, 0.5, "no speculative mode run", ha="center", va="center", transform=ax2.transAxes)
    fig.suptitle(results["config"].get("label") or "adaflash bench")
    fig.tight_layout()

    path = Path(path)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    with atomic_path(path, suffix=".tmp.png") as tmp:
        tmp.write_bytes(buf.getvalue())
    return path
