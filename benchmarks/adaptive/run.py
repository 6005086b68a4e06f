"""Adaptive verification on the embedded pair: ar, dflash, adaflash and the oracle side by side.

Workloads (held-out prompts): in-domain (code + prose), math only (the drafter never saw math),
and all three mixed in thirds. For every workload and concurrency c it serves max(2c, prompts)
requests (prompts cycled, freed slots refilled) in each mode, repeats interleaved, and records
throughput, tau, verify lengths, how often adaflash drafted, the calibration error of its
predictions, and token-for-token equality with `ar` (T=0) of every run. Mode `oracle` is
oracle.py's engine that knows every draft's fate (a_min 1; `oracle_a2`: a_min 2): the ceiling of
any verify-length rule, run in the same cells and interleaved with the others. Modes
`adaflash-history` and `adaflash-head` pin where adaflash's lengths come from (the engine's
`lengths_from`); plain `adaflash` is the engine's default.

    .venv/bin/python benchmarks/adaptive/run.py --out benchmarks/adaptive/results.json

Each timed run starts with a cold calibration state (no domain history), so every figure includes
the steps spent learning; the online cost model is kept across runs of one engine, as a server
keeps it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

# this checkout's package, not whichever one the interpreter has installed (an export of another
# commit, run with the main checkout's venv, once measured the main checkout's engine)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sglang_adaflash.assets import MODELS_DIR, WORKLOADS_DIR  # noqa: E402
from sglang_adaflash.bench.machine import cpu_description
from sglang_adaflash.bench.metrics import step_mae_floor
from sglang_adaflash.bench.runner import recorded_path
from sglang_adaflash.core.sampling import SamplingParams
from sglang_adaflash.engine.engine import EngineStats
from sglang_adaflash.engine.request import Request
from sglang_adaflash.fsio import write_text_atomic
from sglang_adaflash.launch.engine_factory import make_engine
from sglang_adaflash.launch.loading import load_pair
from sglang_adaflash.launch.prompts import read_prompts, resolve_prompt_ids

MODES = ("ar", "dflash", "adaflash", "oracle")
WARM_STEPS = 32  # calibration is judged after a request's first 32 steps


def workloads(per_domain: int) -> dict[str, list]:
    code = read_prompts(WORKLOADS_DIR / "code.heldout.jsonl")[:per_domain]
    prose = read_prompts(WORKLOADS_DIR / "prose.heldout.jsonl")[:per_domain]
    math = read_prompts(WORKLOADS_DIR / "math.heldout.jsonl")[: 2 * per_domain]
    mixed = [p for trio in zip(code, prose, math[:per_domain]) for p in trio]
    in_domain = [p for pair in zip(code, prose) for p in pair]
    return {"in_domain": in_domain, "math": math, "mixed": mixed}


def one_cell(workload: str, concurrency: int, threads: int = 1):
    """(pair, prompts, n, max_seq) for one cell at this file's defaults (16 prompts a domain, 64
    new tokens): what the single-cell scripts beside it (cost_trace.py, phase_times.py,
    profile_diff.py) build."""
    torch.set_num_threads(threads)
    pair = load_pair(MODELS_DIR / "target", str(MODELS_DIR / "drafter"), dtype="float32")
    prompts = [(resolve_prompt_ids(s, pair.tokenizer), s.domain) for s in workloads(16)[workload]]
    n = max(2 * concurrency, len(prompts))
    return pair, prompts, n, max(len(p) for p, _ in prompts) + 64


def cell_engine(pair, mode: str, concurrency: int, prompts, n: int, max_seq: int):
    """One mode's engine for a one_cell cell, as this file's timed runs meet it: after the
    two-request warm-up (allocator, adaflash's cost profile) and with a cold calibration state
    (no evidence beyond the drafter's own eval, which fresh() keeps: planner.prior)."""
    eng = make_engine(pair, mode, concurrency, max_seq, 0, num_requests=n)
    eng.run(cell_requests(prompts, n, 64, tuple(pair.stop_token_ids))[:2])
    if eng.posterior is not None:
        eng.posterior = eng.posterior.fresh()
    return eng


def cell_requests(prompts, n: int, max_new_tokens: int, stop) -> list[Request]:
    """A cell's n requests: the (prompt ids, domain) pairs cycled in order, ids r0..r{n-1}."""
    return [Request(list(prompts[i % len(prompts)][0]),
                    SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop),
                    f"r{i}", prompts[i % len(prompts)][1]) for i in range(n)]


def _load_oracle():
    import importlib.util

    spec = importlib.util.spec_from_file_location("adaptive_oracle", Path(__file__).resolve().with_name("oracle.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_engine(pair, mode: str, c: int, max_seq: int, n: int, requests, block: int):
    """The engine of one mode in one cell. An oracle's table of accepted proposals comes from
    ar's outputs of the cell's requests (at T=0 every mode commits them)."""
    if mode.startswith("oracle"):
        oracle = _load_oracle()
        a_min = int(mode[len("oracle_a"):]) if mode.startswith("oracle_a") else 1
        ar = make_engine(pair, "ar", c, max_seq, 0, num_requests=n)
        reference = {o.request_id: o.output_ids for o in ar.run(requests())}
        tables: dict[tuple, list[int]] = {}
        accepted = {}
        for r in requests():
            key = tuple(r.prompt_ids)
            if key not in tables:
                tables[key] = oracle.foresee(pair, r.prompt_ids, reference[r.request_id], block_size=block)
            accepted[r.request_id] = tables[key]
        return oracle.OracleEngine(pair.target, pair.drafter, max_batch_size=min(c, n), max_seq_len=max_seq,
                                   seed=0, accepted=accepted, a_min=a_min)
    if mode.startswith("adaflash-"):
        return make_engine(pair, "adaflash", c, max_seq, 0, num_requests=n, lengths_from=mode[len("adaflash-"):])
    return make_engine(pair, mode, c, max_seq, 0, num_requests=n)


def calibration(outs, block: int) -> dict:
    """|predicted - actual tau/B| after each request's first WARM_STEPS steps: per step (all, and
    drafted steps only, with the floor a calibrated prediction would show on those), and per
    request (its mean prediction against its mean outcome, averaged over requests)."""
    all_err, drafted_err, floor, pred, act, per_request = [], [], [], [], [], []
    for o in outs:
        s = o.stats
        mine_p, mine_a = [], []
        for k, (p, a, d, v) in enumerate(zip(s.predicted_ratios, s.accept_lens, s.drafted, s.verify_lens)):
            if k < WARM_STEPS:
                continue
            e = abs(p - a / block)
            all_err.append(e)
            pred.append(p)
            act.append(a / block)
            mine_p.append(p)
            mine_a.append(a / block)
            if d:
                drafted_err.append(e)
                floor.append(step_mae_floor(p, v, block))
        if mine_p:
            per_request.append(abs(sum(mine_p) - sum(mine_a)) / len(mine_p))

    def mean(x):
        return sum(x) / len(x) if x else None

    return {
        "steps": len(all_err),
        "mae": mean(all_err),
        "drafted_steps": len(drafted_err),
        "mae_drafted": mean(drafted_err),
        "mae_drafted_floor": mean(floor),
        "requests": len(per_request),
        "request_mae": mean(per_request),
        "bias": abs(mean(pred) - mean(act)) if pred else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--workloads", default="in_domain,math,mixed")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--per-domain", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="torch device (cuda for benchmarks/gpu/)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--warm-up", choices=("short", "full"), default="short",
                    help="untimed run per engine: 2 requests (short), or the whole workload (full: on a "
                         "GPU, where each batch shape's first pass is slow)")
    ap.add_argument("--drafter", default=None,
                    help="drafter directory (default: the shipped one); e.g. a candidate of "
                         "benchmarks/drafter_recipe/ before it is shipped")
    ap.add_argument("--extra-pairs", type=int, default=4,
                    help="after the repeats, this many more ar/adaflash runs back to back (order "
                         "alternating): the paired ratio is the median of adaflash/ar over these "
                         "pairs, which a machine whose speed drifts between runs moves least")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    conc = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    pair = load_pair(MODELS_DIR / "target", args.drafter or MODELS_DIR / "drafter", dtype=args.dtype,
                     device=args.device)
    block = pair.drafter.config.block_size
    stop = tuple(pair.stop_token_ids)
    rows, equality_ok = [], True
    loads = workloads(args.per_domain)
    for wname in args.workloads.split(","):
        specs = loads[wname]
        prompts = [(resolve_prompt_ids(s, pair.tokenizer), s.domain) for s in specs]
        max_seq = max(len(p) for p, _ in prompts) + args.max_new_tokens
        for c in conc:
            n = max(args.waves * c, len(prompts))

            def requests(prompts=prompts, n=n):
                return cell_requests(prompts, n, args.max_new_tokens, stop)

            engines = {m: build_engine(pair, m, c, max_seq, n, requests, block) for m in modes}
            shares: dict[int, list[float]] = {}  # per engine, each timed run's drafted share (timed)

            def timed(e, requests=requests, shares=shares):
                """One run: (wall tok/s, CPU tok/s, output ids, outputs)."""
                e.stats = EngineStats()
                if e.posterior is not None:  # cold calibration: no history carried over (the
                    # drafter's manifest eval stays, as in a server just started: planner.prior)
                    e.posterior = e.posterior.fresh()
                t0, c0 = time.perf_counter(), time.process_time()
                outs = e.run(requests())
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                ids = [o.output_ids for o in outs]
                done = sum(len(x) for x in ids)
                if e.posterior is not None:  # every timed run's drafted share of request-steps
                    steps = sum(o.stats.steps for o in outs)
                    shares.setdefault(id(e), []).append(sum(sum(o.stats.drafted) for o in outs) / max(steps, 1))
                return done / wall, done / cpu, ids, outs

            for e in engines.values():  # untimed warm-up: allocator, adaflash's cost profile
                e.run(requests() if args.warm_up == "full" else requests()[: min(2, n)])
            tput = {m: [] for m in modes}
            cput = {m: [] for m in modes}
            first = {}
            for rep in range(args.repeats):
                order = modes[rep % len(modes):] + modes[: rep % len(modes)]
                for m in order:
                    wall_tput, cpu_tput, ids, outs = timed(engines[m])
                    tput[m].append(wall_tput)
                    cput[m].append(cpu_tput)
                    if m == "ar":
                        first.setdefault("ar", ids)
                    elif "ar" in first and ids != first["ar"]:
                        equality_ok = False
                        print(f"T=0 MISMATCH: {wname} c={c} {m} repeat {rep}", file=sys.stderr)
                    if rep == 0:
                        steps = sum(o.stats.steps for o in outs)
                        verified = sum(o.stats.verified_tokens for o in outs)
                        drafted = sum(sum(o.stats.drafted) for o in outs)
                        adaptive = m.startswith("adaflash") or m.startswith("oracle")
                        first[m + "_stats"] = {
                            "tau": sum(o.stats.committed_tokens for o in outs) / steps,
                            "mean_verify_len": verified / steps,
                            "drafted_share": drafted / steps if adaptive else (1.0 if m == "dflash" else 0.0),
                            "calibration": calibration(outs, block) if m.startswith("adaflash") else None,
                        }
            adaptives = [m for m in modes if m.startswith("adaflash")]
            pairs: dict[str, list[float]] = {m: [] for m in adaptives}  # adaptive/ar of runs back to back
            if "ar" in modes:
                for m_ada in adaptives:
                    for k in range(args.extra_pairs):
                        got = {}
                        for m in (("ar", m_ada) if k % 2 == 0 else (m_ada, "ar")):
                            got[m] = timed(engines[m])
                            tput[m].append(got[m][0])
                            cput[m].append(got[m][1])
                            if got[m][2] != first.get("ar", got[m][2]):
                                equality_ok = False
                                print(f"T=0 MISMATCH: {wname} c={c} {m} extra pair {k}", file=sys.stderr)
                        pairs[m_ada].append(got[m_ada][1] / got["ar"][1])
            med = {m: statistics.median(tput[m]) for m in modes}
            cmed = {m: statistics.median(cput[m]) for m in modes}
            best = max(med.get("ar", 0.0), med.get("dflash", 0.0))
            cbest = max(cmed.get("ar", 0.0), cmed.get("dflash", 0.0))
            oracles = [m for m in modes if m.startswith("oracle")]
            ceiling = max([cmed.get("ar", 0.0)] + [cmed[m] for m in oracles]) if oracles else None
            for m in modes:
                row = {"workload": wname, "concurrency": c, "mode": m, "requests": n,
                       "throughput_tok_s": med[m], "samples": tput[m],
                       "cpu_throughput_tok_s": cmed[m], "cpu_samples": cput[m], **first[m + "_stats"]}
                if "ar" in modes and m != "ar":
                    row["cpu_vs_ar"] = cmed[m] / cmed["ar"]
                if shares.get(id(engines[m])):
                    # the stats above are the first repeat's; a run that drafts little moves a cell
                    row["drafted_shares"] = [round(x, 4) for x in shares[id(engines[m])]]
                if m.startswith("adaflash") and best:
                    row["vs_best_fixed"] = med[m] / best
                    row["cpu_vs_best_fixed"] = cmed[m] / cbest
                    if ceiling:
                        row["cpu_vs_ceiling"] = cmed[m] / ceiling
                    if pairs.get(m):  # max(ar, dflash) is ar wherever dflash is slower
                        row["paired_vs_ar"] = statistics.median(pairs[m])
                        row["paired_samples"] = pairs[m]
                        if "dflash" in modes and cmed["dflash"] > cmed["ar"]:  # dflash is the best fixed mode
                            row["paired_vs_best_fixed"] = statistics.median(pairs[m]) * cmed["ar"] / cmed["dflash"]
                        else:
                            row["paired_vs_best_fixed"] = statistics.median(pairs[m])
                if m.startswith("oracle") and ceiling:
                    row["ceiling_vs_ar"] = ceiling / cmed["ar"] if "ar" in modes else None
                rows.append(row)
            line = "  ".join(f"{m} {med[m]:7.1f}/{cmed[m]:7.1f}" for m in modes)
            for m_ada in adaptives:
                if pairs.get(m_ada):
                    line += f"  paired {m_ada}/ar {statistics.median(pairs[m_ada]):.3f}"
            extra = ""
            for m_ada in adaptives:
                if not best:
                    continue
                cal = first[m_ada + "_stats"]["calibration"]
                extra += (f"  {m_ada}/max wall {med[m_ada] / best:.3f} cpu {cmed[m_ada] / cbest:.3f}"
                          f"  drafted {first[m_ada + '_stats']['drafted_share']:.2f}"
                          f" (runs {min(shares[id(engines[m_ada])]):.2f}-{max(shares[id(engines[m_ada])]):.2f})"
                          f"  mae {cal['mae'] if cal['mae'] is None else round(cal['mae'], 4)}")
            if ceiling and "ar" in modes:
                extra += f"  ceiling/ar {ceiling / cmed['ar']:.3f}"
            print(f"{wname:9s} c={c:3d}  {line}{extra}", flush=True)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--out" in given:  # as bench records it: no machine's absolute path
        given[given.index("--out") + 1] = recorded_path(args.out)
    doc = {
        "command": "benchmarks/adaptive/run.py " + " ".join(given),
        "config": {**vars(args), "out": recorded_path(args.out)},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": args.threads, "machine": platform.machine(), "cpu": cpu_description(),
                        "cuda": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None},
        "equality_ok": equality_ok,
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(doc, indent=1) + "\n")
    print("T=0 equality with ar in every run:", "OK" if equality_ok else "FAILED")
    return 0 if equality_ok else 1


if __name__ == "__main__":
    sys.exit(main())
