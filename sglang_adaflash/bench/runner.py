"""`adaflash bench` and `adaflash demo`: throughput and speculation statistics per mode.

For every concurrency c the benchmark serves n = max(waves * c, num_prompts) requests (prompts
cycled) with max_batch_size = c, in every mode:

    hf        Hugging Face generate(), greedy, static batches of c left-padded requests
    ar        the reference engine, plain decoding (verify length 1), continuous batching
    dflash    the engine verifying the drafter's whole block
    adaflash  the engine with the length head and the load-aware verify-length rule

Throughput = generated tokens / wall seconds of the whole run (prefill included). Runs are
interleaved (each repeat visits every mode, in a rotated order) so slow drifts of a shared
machine hit all modes alike; the median over repeats is reported. At T=0 every speculative
mode must reproduce ar's tokens exactly: the benchmark checks it and reports any mismatch.

results.json is meant to be committed and compared across machines, so it holds no absolute path
of the machine that wrote it (see `recorded_path`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.sampling import SamplingParams
from ..d2sd.cli import options_from_args
from ..engine.engine import EngineStats
from ..engine.request import Request
from ..fsio import write_json_atomic
from ..launch.engine_factory import check_seed, make_engine, quiet_transformers
from ..launch.loading import LoadedPair, load_pair
from ..launch.prompts import CLIError, PromptSpec, read_prompts, resolve_prompt_ids
from .hf_baseline import run_hf
from .machine import cpu_description
from .metrics import aggregate, first_difference
from .plot import plot_results

RESULTS_NAME = "results.json"
PLOT_NAME = "bench.png"
ENGINE_MODES = ("ar", "dflash", "adaflash", "d2sd")
SPEC_MODES = ("dflash", "adaflash", "d2sd")


@dataclass
class BenchConfig:
    target: str
    drafter: str | None
    prompts: list[str]
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    modes: list[str] = field(default_factory=lambda: ["hf", "ar", "dflash", "adaflash"])
    max_new_tokens: int = 64
    mixed_lengths: bool = False
    num_prompts: int | None = None
    repeats: int = 1
    waves: int = 1
    seed: int = 0
    dtype: str | None = None
    device: str = "cpu"
    ignore_eos: bool = False
    use_chat_template: bool = True
    label: str | None = None
    threads: int | None = None
    temperature: float = 0.0  # 0 = greedy; above it every mode samples (hf included)
    top_p: float = 1.0
    d2sd: dict | None = None  # mode d2sd: D2SDOptions as a dict (recovery drafter, tree_k, ...)
    warm_up: str = "short"  # "full": one untimed pass of the whole workload per (mode, concurrency)


@dataclass
class Workload:
    prompts: list[list[int]]  # tokenized, usable prompts
    domains: list[str | None]
    lengths: list[int]  # max_new_tokens of request i (cycled with the prompts)
    skipped: list[str]  # errors of unusable prompt lines

    def requests(self, n: int, stop_ids: tuple[int, ...], temperature: float = 0.0,
                 top_p: float = 1.0) -> list[Request]:
        out = []
        for i in range(n):
            j = i % len(self.prompts)
            sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=self.lengths[i],
                                stop_token_ids=stop_ids)
            out.append(Request(list(self.prompts[j]), sp, request_id=f"b{i}", domain=self.domains[j]))
        return out


def build_workload(specs: list[PromptSpec], pair: LoadedPair, cfg: BenchConfig, max_requests: int) -> Workload:
    """Tokenize the usable prompts (the others are listed in .skipped) and fix every request's length."""
    prompts, domains, skipped = [], [], []
    vocab = pair.target.vocab_size
    for spec in specs:
        try:
            ids = resolve_prompt_ids(spec, pair.tokenizer, cfg.use_chat_template)
        except ValueError as e:
            skipped.append(str(e))
            continue
        if not ids or not all(0 <= t < vocab for t in ids):
            skipped.append(f"{spec.where or spec.id}: prompt is empty or holds ids outside the vocabulary [0, {vocab})")
            continue
        limit = getattr(pair.target.config, "max_position_embeddings", None)
        if limit and len(ids) + cfg.max_new_tokens > limit:
            skipped.append(
                f"{spec.where or spec.id}: prompt of {len(ids)} tokens plus {cfg.max_new_tokens} new tokens "
                f"exceeds the target's {limit} positions"
            )
            continue
        prompts.append(ids)
        domains.append(spec.domain)
    if not prompts:
        raise CLIError("no usable prompt in the prompt file(s): " + (skipped[0] if skipped else "all lines were empty"))
    if cfg.num_prompts is not None:
        idx = [i % len(prompts) for i in range(cfg.num_prompts)]
        prompts, domains = [prompts[i] for i in idx], [domains[i] for i in idx]
    max_requests = max(max_requests, len(prompts))
    if cfg.mixed_lengths:
        rng = random.Random(cfg.seed)
        lo = max(1, cfg.max_new_tokens // 8)
        lengths = [rng.randint(lo, cfg.max_new_tokens) for _ in range(max_requests)]
    else:
        lengths = [cfg.max_new_tokens] * max_requests
    return Workload(prompts, domains, lengths, skipped)


def _environment(device: str) -> dict:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_description(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "cuda": torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None,
    }


def _num_params(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def _models(pair: LoadedPair, cfg: BenchConfig) -> dict:
    t = pair.target
    out = {
        "target": {
            "path": recorded_path(cfg.target),
            "layers": t.num_layers,
            "hidden_size": t.hidden_size,
            "vocab_size": t.vocab_size,
            "dtype": str(t.dtype).removeprefix("torch."),
            "params": _num_params(t.model),
        }
    }
    if pair.drafter is not None:
        d = pair.drafter.config
        out["drafter"] = {
            "path": recorded_path(cfg.drafter),
            "layers": d.num_hidden_layers,
            "block_size": d.block_size,
            "target_layer_ids": list(d.target_layer_ids),
            "length_head": pair.drafter.length_head is not None,
            "params": _num_params(pair.drafter),
        }
    return out


def _warm_up(engine, workload: Workload, stop_ids, n: int, cfg: BenchConfig) -> None:
    """An untimed run, so lazy work (allocator growth, adaflash's cost profile) is not timed.

    short: two requests of four tokens, enough on a CPU. full: the timed runs' own requests. On
    a GPU the first pass over each batch shape is slow (candidates: the caching allocator's first
    mallocs, the BLAS libraries' per-shape setup): on the first H200 run, with the short warm-up,
    the first repeat ran at 0.08-0.63x the second in 16 of 20 cells (benchmarks/gpu/README.md).
    """
    if cfg.warm_up == "full":
        reqs = workload.requests(n, stop_ids, cfg.temperature, cfg.top_p)
    else:
        reqs = workload.requests(min(2, engine.max_batch_size), stop_ids)
        for r in reqs:
            r.sampling = SamplingParams(max_new_tokens=min(4, r.sampling.max_new_tokens), stop_token_ids=stop_ids)
    for r in reqs:
        r.request_id = "warm-" + r.request_id
    engine.run(reqs)
    engine.stats = EngineStats()


def run_bench(cfg: BenchConfig, pair: LoadedPair, specs: list[PromptSpec], *, progress: bool = True, log=print) -> dict:
    """Run every (mode, concurrency) and return the results document (not yet written)."""
    from tqdm import tqdm

    if any(m != "hf" for m in cfg.modes) and "ar" not in cfg.modes:
        log("note: mode 'ar' is not in --modes, so the T=0 equality check has no reference")
    if any(m in SPEC_MODES for m in cfg.modes) and pair.drafter is None:
        raise CLIError("modes dflash, adaflash and d2sd need --drafter DIR")
    if "adaflash" in cfg.modes and pair.drafter.length_head is None:
        raise CLIError("mode adaflash needs a drafter with a length head (dflash_config.use_thresh_head_two_model); drop it from --modes")
    workload = build_workload(specs, pair, cfg, cfg.waves * max(cfg.concurrency))
    for msg in workload.skipped:
        log(f"warning: skipped prompt: {msg}")
    counts = {c: max(cfg.waves * c, len(workload.prompts)) for c in cfg.concurrency}
    stop_ids = () if cfg.ignore_eos else pair.stop_token_ids
    block = pair.drafter.config.block_size if pair.drafter is not None else 1
    max_seq = max(len(p) for p in workload.prompts) + cfg.max_new_tokens
    total = sum(counts[c] * len(cfg.modes) * cfg.repeats for c in cfg.concurrency)
    bar = tqdm(total=total, desc="bench", unit="req", disable=not progress, file=sys.stderr)

    runs, results, mismatches, hf_agreement = [], [], [], {}
    for c in cfg.concurrency:
        n = counts[c]
        engines = {m: make_engine(pair, m, c, max_seq, cfg.seed, num_requests=n, batch_flag="--concurrency")
                   for m in cfg.modes if m != "hf"}
        for m, e in engines.items():
            bar.set_postfix_str(f"c={c} warm-up {m}")
            _warm_up(e, workload, stop_ids, n, cfg)

        def hf_run(reqs, progress=None, c=c):
            return run_hf(pair.target.model, [r.prompt_ids for r in reqs], [r.sampling.max_new_tokens for r in reqs],
                          c, pair.pad_token_id, stop_ids, progress=progress, temperature=cfg.temperature, top_p=cfg.top_p)

        if "hf" in cfg.modes:
            if cfg.warm_up == "full":
                hf_run(workload.requests(n, stop_ids, cfg.temperature, cfg.top_p))
            else:
                run_hf(pair.target.model, workload.prompts[:1], [2], 1, pair.pad_token_id, stop_ids)
        first: dict[str, list[list[int]]] = {}
        stats: dict[str, dict] = {}
        samples: dict[str, list[float]] = {m: [] for m in cfg.modes}
        walls: dict[str, list[float]] = {m: [] for m in cfg.modes}
        cpus: dict[str, list[float]] = {m: [] for m in cfg.modes}
        hf_decoded = None
        for rep in range(cfg.repeats):
            order = cfg.modes[rep % len(cfg.modes):] + cfg.modes[: rep % len(cfg.modes)]
            for mode in order:
                bar.set_postfix_str(f"c={c} {mode} #{rep + 1}")
                reqs = workload.requests(n, stop_ids, cfg.temperature, cfg.top_p)
                cpu0 = time.process_time()
                if mode == "hf":
                    hf = hf_run(reqs, progress=bar)
                    wall, outs_ids, hf_decoded = hf.wall_s, hf.outputs, hf.decoded_tokens
                    agg = None
                else:
                    engine = engines[mode]
                    engine.stats = EngineStats()
                    if hasattr(engine, "tree_stats"):
                        engine.tree_stats = dict.fromkeys(engine.tree_stats, 0)
                    t0 = time.perf_counter()
                    outs = engine.run(reqs, progress=bar)
                    wall = time.perf_counter() - t0
                    failed = [o for o in outs if not o.ok]
                    if failed:
                        raise CLIError(f"{len(failed)} benchmark request(s) failed in mode {mode}, e.g. {failed[0].error}")
                    outs_ids = [o.output_ids for o in outs]
                    agg = aggregate(outs, block)
                    agg["mean_batch_size"] = statistics.fmean(engine.stats.batch_sizes) if engine.stats.batch_sizes else 0.0
                    agg["draft_s"] = engine.stats.draft_seconds
                    agg["verify_s"] = engine.stats.verify_seconds
                    agg["prefill_s"] = engine.stats.prefill_seconds
                    if hasattr(engine, "tree_stats"):  # d2sd: branches drafted, verified and won
                        agg["tree"] = dict(engine.tree_stats)
                cpu = time.process_time() - cpu0
                tokens = sum(len(o) for o in outs_ids)
                runs.append({"mode": mode, "concurrency": c, "repeat": rep, "requests": n, "generated_tokens": tokens,
                             "wall_s": wall, "cpu_s": cpu, "throughput_tok_s": tokens / wall,
                             "tokens_per_cpu_s": tokens / cpu if cpu > 0 else None})
                samples[mode].append(tokens / wall)
                walls[mode].append(wall)
                cpus[mode].append(cpu)
                if rep == 0:
                    first[mode] = outs_ids
                    stats[mode] = agg or {"requests": n, "generated_tokens": tokens}
        for mode in cfg.modes:
            row = {"mode": mode, "concurrency": c, "max_batch_size": c, **stats[mode]}
            row["throughput_tok_s"] = statistics.median(samples[mode])
            row["throughput_samples"] = samples[mode]
            row["wall_s"] = statistics.median(walls[mode])
            # CPU seconds of this process: on a shared machine, less disturbed by other jobs than
            # wall time (with --threads 1 it equals wall time on an idle machine)
            row["cpu_s"] = statistics.median(cpus[mode])
            row["tokens_per_cpu_s"] = row["generated_tokens"] / row["cpu_s"] if row["cpu_s"] > 0 else None
            if mode == "hf":
                row.update(steps=0, accepted_by_position=[0] * max(block - 1, 0), decoded_tokens_incl_padding=hf_decoded,
                           padding_waste=1 - stats[mode]["generated_tokens"] / hf_decoded if hf_decoded else None)
            results.append(row)
        if "ar" in first and cfg.temperature == 0:
            for mode in SPEC_MODES:
                if mode not in first:
                    continue
                for i, (a, b) in enumerate(zip(first["ar"], first[mode])):
                    pos = first_difference(a, b)
                    if pos is not None:
                        mismatches.append({"mode": mode, "concurrency": c, "request": i, "first_diff": pos,
                                           "ar_len": len(a), "mode_len": len(b)})
            if "hf" in first:
                same = sum(a == b for a, b in zip(first["ar"], first["hf"]))
                hf_agreement[str(c)] = same / len(first["ar"])
        del engines
    bar.close()
    add_speedups(results, runs)
    equality = {
        # token-for-token equality holds at T=0 only; sampled runs are lossless in distribution
        # (tests/engine's statistical tests), which one benchmark run cannot show
        "reference": "ar" if "ar" in cfg.modes and cfg.temperature == 0 else None,
        "checked_modes": ([m for m in SPEC_MODES if m in cfg.modes]
                          if "ar" in cfg.modes and cfg.temperature == 0 else []),
        "ok": not mismatches,
        "mismatches": mismatches,
        # HF's batched kernels round differently from the engine's ragged ones, so near-tied argmaxes
        # may flip: informational, not part of the check.
        "hf_exact_agreement": hf_agreement,
    }
    return {
        "format": "adaflash.bench/v1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": recorded_command(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("adaflash") else None,
        "config": {**asdict(cfg), "target": recorded_path(cfg.target), "drafter": recorded_path(cfg.drafter),
                   "d2sd": None if cfg.d2sd is None else {**cfg.d2sd, "recovery_drafter": recorded_path(cfg.d2sd.get("recovery_drafter"))},
                   "prompts": [recorded_path(p) for p in cfg.prompts],
                   "requests_per_concurrency": {str(c): counts[c] for c in cfg.concurrency},
                   "stop_token_ids": list(stop_ids)},
        "environment": _environment(cfg.device),
        "models": _models(pair, cfg),
        "workload": {"prompts": len(workload.prompts), "skipped": workload.skipped,
                     "prompt_tokens_mean": statistics.fmean(len(p) for p in workload.prompts),
                     "max_new_tokens_mean": statistics.fmean(workload.lengths)},
        "results": results,
        "runs": runs,
        "equality": equality,
    }


def recorded_path(path: str | os.PathLike | None) -> str | None:
    """A path as results.json records it: as given when relative; `<embedded>/...` inside the
    package's bundled assets; relative to the current directory when under it; else
    `<outside>/NAME`. Results are shared between machines, and one machine's absolute paths
    mean nothing on another (and say more about it than they should)."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    from ..assets import ASSETS_DIR

    seen = [Path(os.path.normpath(p)), p.resolve()]  # as written, and through symlinks
    for q in seen:
        if q.is_relative_to(ASSETS_DIR):
            return "/".join(["<embedded>", *q.relative_to(ASSETS_DIR).parts])
    for cwd in (Path.cwd(), Path.cwd().resolve()):
        for q in seen:
            if q.is_relative_to(cwd):
                return q.relative_to(cwd).as_posix()
    return f"<outside>/{p.name}"


def recorded_command(argv: list[str]) -> str:
    """The command line with its absolute paths recorded as `recorded_path` does."""
    def one(arg: str) -> str:
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("--") and os.path.isabs(value):
            return f"{flag}={recorded_path(value)}"
        return recorded_path(arg) if os.path.isabs(arg) else arg

    return " ".join(["adaflash"] + [one(a) for a in argv])


def add_speedups(results: list[dict], runs: list[dict]) -> None:
    """speedup_vs_{hf,ar} (medians), cpu_speedup_vs_* and paired_* (median of per-repeat ratios)."""
    def ratio(a, b):
        return a / b if a and b else None

    for row in results:
        c = row["concurrency"]
        for ref in ("hf", "ar"):
            ref_row = next((r for r in results if r["concurrency"] == c and r["mode"] == ref), None)
            if ref_row is None:
                for key in ("speedup", "cpu_speedup", "paired_speedup", "paired_cpu_speedup"):
                    row[f"{key}_vs_{ref}"] = None
                continue
            row[f"speedup_vs_{ref}"] = ratio(row["throughput_tok_s"], ref_row["throughput_tok_s"])
            row[f"cpu_speedup_vs_{ref}"] = ratio(row.get("tokens_per_cpu_s"), ref_row.get("tokens_per_cpu_s"))
            # within each repeat the two runs are close in time; the median of those ratios
            # resists the load swings of a shared machine better than a ratio of medians
            mine = [r for r in runs if r["concurrency"] == c and r["mode"] == row["mode"]]
            theirs = [r for r in runs if r["concurrency"] == c and r["mode"] == ref]
            wall = [ratio(x["throughput_tok_s"], y["throughput_tok_s"]) for x, y in zip(mine, theirs)]
            cpu = [ratio(x.get("tokens_per_cpu_s"), y.get("tokens_per_cpu_s")) for x, y in zip(mine, theirs)]
            row[f"paired_speedup_vs_{ref}"] = statistics.median(wall) if wall and None not in wall else None
            row[f"paired_cpu_speedup_vs_{ref}"] = statistics.median(cpu) if cpu and None not in cpu else None


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(doc: dict) -> str:
    head = f"{'conc':>5} {'mode':>9} {'reqs':>5} {'tokens':>7} {'wall s':>8} {'tok/s':>9} {'vs hf':>6} {'vs ar':>6} {'tok/cpu-s':>9} {'vs hf':>6} {'tau':>5} {'verify eff':>10} {'mean L':>6} {'batch':>6}"
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        lines.append(
            f"{r['concurrency']:>5} {r['mode']:>9} {r['requests']:>5} {r['generated_tokens']:>7} {r['wall_s']:>8.2f} "
            f"{r['throughput_tok_s']:>9.1f} {_fmt(r.get('speedup_vs_hf'), '.2f'):>6} {_fmt(r.get('speedup_vs_ar'), '.2f'):>6} "
            f"{_fmt(r.get('tokens_per_cpu_s'), '.1f'):>9} {_fmt(r.get('cpu_speedup_vs_hf'), '.2f'):>6} {_fmt(r.get('tau'), '.2f'):>5} {_fmt(r.get('verify_efficiency'), '.3f'):>10} {_fmt(r.get('mean_verify_len'), '.2f'):>6} "
            f"{_fmt(r.get('mean_batch_size'), '.1f'):>6}"
        )
    for r in doc["results"]:
        if r["mode"] != "hf" and r.get("paired_speedup_vs_hf") is not None and len(r.get("throughput_samples", [])) > 1:
            lines.append(f"{r['mode']} vs hf @c={r['concurrency']}, per-repeat ratios (median): wall "
                         f"{r['paired_speedup_vs_hf']:.2f}x, cpu {_fmt(r.get('paired_cpu_speedup_vs_hf'), '.2f')}x")
    for r in doc["results"]:
        lh = r.get("length_head")
        if lh:
            lines.append(f"length head @c={r['concurrency']}: predicted ratio {lh['mean_predicted_ratio']:.3f} vs actual tau/B "
                         f"{lh['mean_actual_ratio']:.3f}, pearson {_fmt(lh['pearson'], '.3f')} over {lh['steps']} steps")
        if r.get("per_domain") and r["mode"] != "ar":
            taus = ", ".join(f"{k} {_fmt(v['tau'], '.2f')}" for k, v in r["per_domain"].items())
            lines.append(f"tau by domain @c={r['concurrency']} {r['mode']}: {taus}")
    eq = doc["equality"]
    temperature = doc["config"].get("temperature", 0.0)
    if temperature:
        lines.append(f"T=0 equality: not applicable (sampled at T={temperature:g}; the speculative modes are "
                     "lossless in distribution there, see tests/engine)")
    elif eq["reference"] is None:
        lines.append("T=0 equality: not checked (ar not run)")
    elif not eq["checked_modes"]:
        lines.append("T=0 equality: nothing to check (no speculative mode run)")
    elif eq["ok"]:
        lines.append(f"T=0 equality: OK ({', '.join(eq['checked_modes'])} == ar, token for token)")
    else:
        lines.append(f"T=0 equality: FAILED, {len(eq['mismatches'])} request(s) differ from ar")
    return "\n".join(lines)


def bench_and_write(cfg: BenchConfig, out_dir: str | Path, *, progress: bool = True, strict: bool = False) -> int:
    quiet_transformers()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"cannot create output directory {out}: {e}") from None
    stale = remove_stale_temps(out)
    if stale:
        print(f"removed {len(stale)} temporary file(s) an interrupted run left in {out}", file=sys.stderr)
    specs = read_prompts(cfg.prompts)
    need_drafter = any(m in SPEC_MODES for m in cfg.modes)
    pair = load_pair(cfg.target, cfg.drafter, dtype=cfg.dtype, device=cfg.device, need_drafter=need_drafter)
    if "d2sd" in cfg.modes:
        from ..d2sd.cli import D2SDOptions, attach_recovery

        attach_recovery(pair, D2SDOptions(**(cfg.d2sd or {})))
    torch.manual_seed(cfg.seed)
    doc = run_bench(cfg, pair, specs, progress=progress, log=lambda m: print(m, file=sys.stderr))
    print(format_table(doc))
    try:
        write_json_atomic(out / RESULTS_NAME, doc)
    except OSError as e:
        # the measurements took long to make: hand them over rather than lose them
        print(json.dumps(doc, indent=2))
        raise CLIError(f"cannot write {out / RESULTS_NAME} ({e.strerror or e}); the results document is printed above") from None
    try:
        plot_results(doc, out / PLOT_NAME)
    except OSError as e:
        raise CLIError(f"wrote {out / RESULTS_NAME}, but cannot write {out / PLOT_NAME} ({e.strerror or e})") from None
    print(f"wrote {out / RESULTS_NAME} and {out / PLOT_NAME}")
    if not doc["equality"]["ok"]:
        print("!" * 72, file=sys.stderr)
        print("MISMATCH: speculative decoding changed the output at T=0 (it must be lossless):", file=sys.stderr)
        for m in doc["equality"]["mismatches"][:10]:
            print(f"  {m['mode']} c={m['concurrency']} request {m['request']}: first differs at token {m['first_diff']}", file=sys.stderr)
        print("!" * 72, file=sys.stderr)
        return 1 if strict else 0
    return 0


# the temp names fsio.atomic_path gives our outputs: "." + name + "." + 8 random chars + suffix
_TEMP_PATTERNS = [re.compile(rf"^\.{re.escape(name)}\.[a-z0-9_]{{8}}{re.escape(suffix)}$")
                  for name, suffix in ((RESULTS_NAME, ".tmp"), (PLOT_NAME, ".tmp.png"))]
STALE_TEMP_S = 60.0


def remove_stale_temps(out: Path, older_than_s: float = STALE_TEMP_S) -> list[Path]:
    """Delete the temp files of our outputs that a killed run (SIGKILL, power loss) left behind.

    Every temp lives only while its bytes are written and fsynced (the figure is rendered in
    memory first), so one older than a minute belongs to no live writer; younger ones may be a
    concurrent run's and are kept. Returns what was removed.
    """
    removed = []
    now = time.time()
    try:
        entries = list(out.iterdir())
    except OSError:
        return removed
    for p in entries:
        if not any(pat.match(p.name) for pat in _TEMP_PATTERNS):
            continue
        try:
            if not p.is_file() or p.is_symlink() or now - p.stat().st_mtime < older_than_s:
                continue
            p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed


def cmd_bench(args) -> int:
    check_seed(args.seed)
    if not (args.temperature >= 0 and args.temperature < float("inf")):
        raise CLIError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CLIError(f"--top-p must lie in (0, 1], got {args.top_p}")
    cfg = BenchConfig(
        target=args.target, drafter=args.drafter, prompts=list(args.prompts), concurrency=args.concurrency,
        modes=args.modes, max_new_tokens=args.max_new_tokens, mixed_lengths=args.mixed_lengths,
        num_prompts=args.num_prompts, repeats=args.repeats, waves=args.waves, seed=args.seed, dtype=args.dtype,
        device=args.device, ignore_eos=args.ignore_eos, use_chat_template=not args.no_chat_template,
        threads=args.threads, temperature=args.temperature, top_p=args.top_p, warm_up=args.warm_up,
    )
    opts = options_from_args(args, args.modes)
    if opts is not None:
        cfg.d2sd = opts.to_dict()
    return bench_and_write(cfg, args.out, progress=not args.quiet, strict=args.strict)


def _sample_workloads(files: list[Path], total: int, out: Path) -> Path:
    """The first lines of every workload file, about total/len(files) each, into one JSONL file."""
    per_file = max(1, -(-total // len(files)))
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for f in files:
        taken = [line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()][:per_file]
        lines.extend(taken)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def cmd_demo(args) -> int:
    from ..assets import MODELS_DIR, WORKLOADS_DIR

    target, drafter = MODELS_DIR / "target", MODELS_DIR / "drafter"
    workloads = sorted(WORKLOADS_DIR.glob("*.heldout.jsonl")) if WORKLOADS_DIR.is_dir() else []
    if (target / "config.json").is_file() and (drafter / "config.json").is_file() and workloads:
        print(f"demo: the embedded pair {MODELS_DIR} on {len(workloads)} held-out workload(s)", file=sys.stderr)
        prompts = _sample_workloads(workloads, args.num_prompts or 24, Path(args.out) / "demo-prompts.jsonl")
        dtype = args.dtype or ("float32" if args.device == "cpu" else None)
        cfg = BenchConfig(target=str(target), drafter=str(drafter), prompts=[str(prompts)],
                          concurrency=args.concurrency, modes=args.modes, max_new_tokens=args.max_new_tokens,
                          device=args.device, dtype=dtype, waves=args.waves, repeats=args.repeats,
                          threads=args.threads, label="embedded pair, held-out workloads")
    else:
        from ..testing import PRESETS, build_tiny_pair, write_tiny_workload

        root = Path(args.cache_dir) / "tiny-pair"
        print(f"demo: the embedded model pair is not there yet ({MODELS_DIR}); building a tiny RANDOM pair in {root} "
              "instead. Its drafter accepts almost nothing: expect no speculative speedup.", file=sys.stderr)
        pair = build_tiny_pair(root, seed=0, **PRESETS["engine-tiny"])
        prompts = write_tiny_workload(root / "workload.jsonl", num_prompts=args.num_prompts or 16, seed=0)
        cfg = BenchConfig(target=str(pair.target_dir), drafter=str(pair.drafter_dir), prompts=[str(prompts)],
                          concurrency=args.concurrency, modes=args.modes, max_new_tokens=args.max_new_tokens,
                          num_prompts=args.num_prompts, device=args.device, ignore_eos=True, dtype=args.dtype,
                          waves=args.waves, repeats=args.repeats, threads=args.threads,
                          label="tiny random pair (no speculative speedup expected)")
    return bench_and_write(cfg, args.out, progress=not args.quiet)
