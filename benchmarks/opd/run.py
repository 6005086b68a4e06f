"""On-policy distillation on the embedded pair under a shift scenario: mixed traffic gains math.

The shipped drafter was trained offline on code and prose; the deployment's live traffic mixes
math word problems in with code and prose. Prompts come from the workloads' train splits
(`python -m training_job.data build`, the same deterministic build the pair was trained from),
never from the shipped held-out prompts the figures are measured on. The embedded target
answers them greedily through the reference engine (`adaflash generate --traffic-dir`), round
by round; after each batch one distillation round runs (`python -m training_job.distill`, the
operator's job) and publishes the next version, which the next round starts from.

Measured after every round, on the shipped held-out prompts of every domain: tau (reference
engine, mode dflash, T=0, 64 new tokens), the coefficient of variation of tau across domains,
and the round's wall time (the job alone). After the last round, the length head on held-out
math: its predicted E[tau]/B at every drafted step against the step's actual tau/B (mode dflash
verifies the whole block, so the actual figure is not cut by the head's own choice). An
ablation trains the same parent on the same records with the same steps under each other
`--loss` (fkl, sft) for `--ablation-rounds` rounds.

    nice -n 5 python benchmarks/opd/run.py --out benchmarks/opd/results.json

Greedy decoding is lossless, so the traffic does not depend on the drafter that served it; each
round's traffic is generated once and shown to every arm. Intermediate files go to --work
(default .cache/opd-bench). The script and the jobs import the code next to it, so on a checkout
others are editing run it from an export of one commit (README.md shows how).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ASSETS = ROOT / "sglang_adaflash" / "assets"
TARGET = ASSETS / "models" / "target"
DRAFTER = ASSETS / "models" / "drafter"
WORKLOADS = ASSETS / "workloads"
DOMAINS = ("math", "code", "prose")


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET))


def prompt_ids(tok, text: str) -> list[int]:
    from sglang_adaflash.assets.chat_format import render_prompt

    return tok(render_prompt(text), add_special_tokens=False)["input_ids"]


def build_data(data: Path, log: Path) -> Path:
    if not (data / "manifest.json").exists():
        run([sys.executable, "-m", "training_job.data", "build", "--out", str(data)], log)
    return data


def live_prompts(data: Path, rounds: int, per_round: dict[str, int], max_prompt: int,
                 seed: int) -> tuple[list[list[dict]], dict]:
    """Each round's prompts: ``per_round[d]`` train-split prompts of domain d, none of them a
    shipped held-out prompt, none used twice, none longer than ``max_prompt`` tokens."""
    tok = tokenizer()
    held = {json.loads(line)["prompt"] for d in DOMAINS
            for line in open(WORKLOADS / f"{d}.heldout.jsonl")}
    rng = random.Random(seed)
    pools, stats = {}, {}
    for d in DOMAINS:
        recs = [json.loads(line) for line in open(data / f"{d}.train.jsonl")]
        overlap = sum(r["prompt"] in held for r in recs)
        rng.shuffle(recs)
        need = rounds * per_round[d]
        pool = []
        too_long = 0
        for r in recs:
            if len(pool) == need:
                break
            if r["prompt"] in held:
                continue
            if len(prompt_ids(tok, r["prompt"])) > max_prompt:
                too_long += 1
                continue
            pool.append({"id": f"{d}-{r['id']}", "domain": d, "prompt": r["prompt"]})
        if len(pool) < need:
            raise SystemExit(f"only {len(pool)} usable {d} train prompts, need {need}")
        pools[d] = pool
        stats[d] = {"train_split": len(recs), "in_heldout": overlap, "too_long_skipped": too_long}
    out = []
    for r in range(rounds):
        batch = [p for d in DOMAINS for p in pools[d][r * per_round[d]:(r + 1) * per_round[d]]]
        random.Random(seed + r).shuffle(batch)
        out.append(batch)
    return out, stats


def heldout(tok, domain: str, n: int):
    """The first `n` shipped held-out prompts of a domain, as evaluation samples."""
    from training_job.opd.traffic import Sample

    out = []
    for i, line in enumerate(open(WORKLOADS / f"{domain}.heldout.jsonl")):
        if i >= n:
            break
        rec = json.loads(line)
        out.append(Sample(key=rec["id"], source="heldout", writer="-", id=rec["id"],
                          domain=domain, prompt_ids=prompt_ids(tok, rec["prompt"]),
                          output_ids=[0] * 64))
    return out


def evaluate(version_dir: Path, samples, threads: int, new_tokens: int = 64) -> dict:
    """tau by domain (mode dflash, greedy) and the raw length head against the actual tau/B.

    The engine is asked for the head's E[tau]/B on every drafted step even in mode dflash (a
    subclass that reads the head and still verifies the whole block), so the actual accepted
    length is the drafter's, not cut short by a verify length the head chose.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_adaflash.bench.metrics import pearson, step_mae_floor
    from sglang_adaflash.core.sampling import SamplingParams
    from sglang_adaflash.drafter.checkpoint import load_drafter
    from sglang_adaflash.engine.engine import SpecEngine
    from sglang_adaflash.engine.request import Request
    from sglang_adaflash.target.hf_target import HFTarget
    from training_job.distill import stop_ids_and_pad

    class HeadReadingEngine(SpecEngine):
        def _verify_lengths(self, spec, hidden, cap):
            super()._verify_lengths(spec, hidden, cap)
            if self.drafter.length_head is not None and spec.head_ratio is None:
                spec.head_ratio = self.drafter.length_head(hidden)

    torch.set_num_threads(threads)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    stops, _ = stop_ids_and_pad(TARGET, target)
    drafter = load_drafter(version_dir, dtype=torch.float32).eval()
    reqs = [Request(prompt_ids=list(s.prompt_ids), request_id=s.key, domain=s.domain,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                            stop_token_ids=tuple(stops))) for s in samples]
    longest = max(len(r.prompt_ids) for r in reqs) + new_tokens + 1
    engine = HeadReadingEngine(HFTarget(target), drafter, mode="dflash",
                               max_batch_size=len(reqs), max_seq_len=longest)
    block = drafter.config.block_size
    t0 = time.time()
    tot: dict[str, list[int]] = {d: [0, 0] for d in DOMAINS}
    pairs: dict[str, list[tuple[float, float]]] = {d: [] for d in DOMAINS}
    per_request: dict[str, list[tuple[float, float]]] = {d: [] for d in DOMAINS}
    unpaired = {d: 0 for d in DOMAINS}
    with torch.no_grad():
        for out in engine.run(reqs):
            if not out.ok:
                raise SystemExit(f"evaluation request {out.request_id} failed: {out.error}")
            st = out.stats
            tot[out.domain][0] += st.committed_tokens
            tot[out.domain][1] += st.steps
            # head_ratios has an entry per drafted step: those that verified more than the
            # bonus token. Only steps that verified a whole block count (near the end of a
            # request the block is cut to what is left, which caps the actual tau).
            drafted = [i for i, n in enumerate(st.verify_lens) if n > 1]
            if len(drafted) == len(st.head_ratios):
                mine = [(p, st.accept_lens[i] / block) for p, i in zip(st.head_ratios, drafted)
                        if st.verify_lens[i] == block]
                pairs[out.domain] += mine
                if mine:  # the request's mean prediction against its mean outcome
                    per_request[out.domain].append((sum(p for p, _ in mine) / len(mine),
                                                    sum(a for _, a in mine) / len(mine)))
            else:
                unpaired[out.domain] += 1
    res = {"tau": {d: round(t / s, 3) for d, (t, s) in tot.items() if s},
           "steps": {d: s for d, (_, s) in tot.items()},
           "tokens": {d: t for d, (t, _) in tot.items()},
           "seconds": round(time.time() - t0, 1)}
    res["cv"] = round(cv(list(res["tau"].values())), 4)
    head = {}
    for d, ps in pairs.items():
        if ps:
            pred, act = [p for p, _ in ps], [a for _, a in ps]
            r = pearson(pred, act)
            head[d] = {"steps": len(ps), "pearson": None if r is None else round(r, 4),
                       "mae": round(sum(abs(p - a) for p, a in ps) / len(ps), 4),
                       # what a perfectly calibrated prediction would still miss per step
                       "mae_floor": round(sum(step_mae_floor(p, block, block) for p in pred)
                                          / len(ps), 4),
                       "mean_predicted": round(sum(pred) / len(ps), 4),
                       "mean_actual": round(sum(act) / len(ps), 4),
                       "requests_not_paired": unpaired[d]}
            rq = per_request[d]
            if len(rq) >= 2:
                rr = pearson([p for p, _ in rq], [a for _, a in rq])
                head[d]["per_request"] = {
                    "requests": len(rq), "pearson": None if rr is None else round(rr, 4),
                    "mae": round(sum(abs(p - a) for p, a in rq) / len(rq), 4)}
    res["length_head"] = head
    return res


def cv(xs: list[float]) -> float:
    """Coefficient of variation (population standard deviation over the mean)."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) / m


def _child_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run ``cmd``; returns (wall seconds, CPU seconds it used). The CPU figure is the steadier
    one on a machine shared with other jobs: wall time includes the time others held the cores."""
    t0, c0 = time.time(), _child_cpu()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}; see {log}")
    return time.time() - t0, _child_cpu() - c0


def fresh_work(rel: str) -> tuple[Path, Path, float]:
    """(an emptied work directory under the checkout, its log file, the start time), with
    OpenMP's idle threads told not to spin on a shared machine."""
    work = ROOT / rel
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return work, work / "log.txt", time.time()


def distil_round(home: Path, report: Path, loss: str, min_records: int, threads: int,
                 job_args: list[str], log: Path) -> tuple[dict, tuple[float, float]]:
    # the target as a path relative to the checkout: the report records it as given
    secs = run([sys.executable, "-m", "training_job.distill", "--home", str(home), "--target",
                str(TARGET.relative_to(ROOT)), "--parent", "latest", "--min-records",
                str(min_records), "--report", str(report), "--threads", str(threads),
                "--quiet", "--loss", loss, *job_args], log)
    return json.loads(report.read_text()), secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/opd/results.json")
    ap.add_argument("--plot", default="benchmarks/opd/opd.png")
    ap.add_argument("--work", default=".cache/opd-bench")
    ap.add_argument("--data", default=None,
                    help="built workloads (python -m training_job.data build); default: built "
                         "into --work")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--math", type=int, default=800, help="math prompts per round")
    ap.add_argument("--code", type=int, default=240, help="code prompts per round")
    ap.add_argument("--prose", type=int, default=240, help="prose prompts per round")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="of the served responses")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per domain")
    ap.add_argument("--ablation", default="fkl,sft", help="the other losses, same data and steps")
    ap.add_argument("--ablation-rounds", type=int, default=1)
    ap.add_argument("--job-args", default="--eval-max-new-tokens 32 --head-steps 200",
                    help="extra flags of every distillation job (one string)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--traffic-from", default=None, metavar="WORK",
                    help="reuse the traffic of an earlier run's --work instead of generating it")
    ap.add_argument("--ablation-only", action="store_true",
                    help="run the ablation arms alone (no parent evaluation, no rkl rounds); "
                         "--merge joins the result to a main run's")
    ap.add_argument("--merge", nargs=2, default=None, metavar=("MAIN", "ABLATION"),
                    help="join two results files (main run, --ablation-only run) into --out, "
                         "with the goals and the plot, and exit")
    ap.add_argument("--commit", default=None,
                    help="the commit this code was exported from (when run outside a checkout)")
    args = ap.parse_args()
    if args.merge:
        return merge(args)

    from sglang_adaflash.drafter.manifest import target_fingerprint
    from sglang_adaflash.drafter.store import publish_checkpoint

    work, log, started = fresh_work(args.work)
    job_args = shlex.split(args.job_args)
    per_round = {"math": args.math, "code": args.code, "prose": args.prose}
    n_round = sum(per_round.values())

    # 1. Live prompts from the train splits, and the target's answers, round by round.
    data = build_data(Path(args.data) if args.data else work / "data", log)
    rounds, prompt_stats = live_prompts(data, args.rounds, per_round,
                                        512 - args.max_new_tokens - 8, args.seed)
    t0 = time.time()
    if args.traffic_from:
        shutil.copytree(Path(args.traffic_from) / "traffic", work / "traffic")
        rounds = []
    for r, batch in enumerate(rounds, 1):
        part = work / f"round{r}.jsonl"
        part.write_text("".join(json.dumps(p) + "\n" for p in batch))
        run([sys.executable, "-m", "sglang_adaflash.cli.main", "generate", "--target",
             str(TARGET), "--drafter", str(DRAFTER), "--mode", "dflash", "--dtype", "float32",
             "--prompts", str(part), "--max-new-tokens", str(args.max_new_tokens),
             "--max-batch-size", "96", "--json", "--quiet",
             "--traffic-dir", str(work / "traffic" / "traffic" / f"round{r}")], log)
    traffic_s = time.time() - t0
    print(f"traffic: {args.rounds} rounds of {n_round} in {traffic_s:.0f} s", flush=True)

    # 2. One volume per arm, each starting from the shipped drafter as v000001.
    arms = ["rkl"] + [a for a in args.ablation.split(",") if a]
    for arm in arms:
        publish_checkpoint(work / arm, DRAFTER, target=target_fingerprint(TARGET),
                           training={"algorithm": "dflash-offline (shipped)"})
    tok = tokenizer()
    samples = [s for d in DOMAINS for s in heldout(tok, d, args.eval_prompts)]
    results = {"rounds": [], "ablation": {}}
    if not args.ablation_only:
        results["parent"] = evaluate(work / "rkl" / "drafters" / "v000001", samples,
                                     args.threads)
        print(f"parent v000001: {results['parent']['tau']} cv {results['parent']['cv']} "
              f"({results['parent']['seconds']} s)", flush=True)

    # 3. Rounds of the main arm (rkl): reveal a batch, distil, evaluate.
    def one_round(arm: str, r: int) -> dict:
        shutil.copytree(work / "traffic" / "traffic" / f"round{r}",
                        work / arm / "traffic" / f"round{r}")
        rep, (secs, cpu) = distil_round(work / arm, work / f"report-{arm}-{r}.json", arm,
                                        n_round, args.threads, job_args, log)
        ev = evaluate(work / arm / "drafters" / rep["version"], samples, args.threads)
        print(f"round {r} {arm} {rep['version']}: tau {ev['tau']} cv {ev['cv']}, job "
              f"{secs:.0f} s ({cpu:.0f} s CPU), job eval {rep.get('eval')}", flush=True)
        return {"round": r, "version": rep["version"], "report": rep,
                "round_seconds": round(secs, 1), "round_cpu_seconds": round(cpu, 1),
                "heldout": ev}

    for r in range(1, 0 if args.ablation_only else args.rounds + 1):
        results["rounds"].append(one_round("rkl", r))
        # keep what is there so far: a run cut short still leaves its figures
        write_results(results, args, prompt_stats, traffic_s, started, job_args)
    results["ablation"]["rkl"] = results["rounds"][:args.ablation_rounds]

    # 4. The ablation: the other losses on the same first rounds (same data, same steps).
    for arm in arms[1:]:
        for r in range(1, args.ablation_rounds + 1):
            results["ablation"].setdefault(arm, []).append(one_round(arm, r))
            write_results(results, args, prompt_stats, traffic_s, started, job_args)

    if args.ablation_only:
        return 0
    results["goals"] = goals(results)
    write_results(results, args, prompt_stats, traffic_s, started, job_args)
    plot(results, ROOT / args.plot)
    print(json.dumps(results["goals"], indent=2))
    return 0


def merge(args) -> int:
    """The main run's results with the ablation arms of an --ablation-only run (same traffic,
    same job settings) added, then the goals and the plot."""
    main_res = json.loads(Path(args.merge[0]).read_text())
    abl = json.loads(Path(args.merge[1]).read_text())
    for arm, rows in abl["ablation"].items():
        if arm != "rkl" and rows:
            main_res["ablation"][arm] = rows
    n = max(len(rows) for rows in main_res["ablation"].values())
    main_res["ablation"]["rkl"] = main_res["rounds"][:n]
    main_res["settings"]["ablation_run"] = abl["settings"]
    main_res["goals"] = goals(main_res)
    out = ROOT / args.out
    out.write_text(json.dumps(main_res, indent=2, sort_keys=True) + "\n")
    plot(main_res, ROOT / args.plot)
    print(json.dumps(main_res["goals"], indent=2))
    return 0


def goals(res: dict) -> dict:
    p, last = res["parent"], res["rounds"][-1]["heldout"]
    head = last["length_head"].get("math", {})
    out = {
        "math_tau_final": last["tau"]["math"], "math_tau_ge_4": last["tau"]["math"] >= 4.0,
        "code_ratio": round(last["tau"]["code"] / p["tau"]["code"], 4),
        "prose_ratio": round(last["tau"]["prose"] / p["tau"]["prose"], 4),
        "cv_start": p["cv"], "cv_final": last["cv"],
        "cv_at_most_half": last["cv"] <= p["cv"] / 2,
        "max_round_seconds": max(r["round_seconds"] for r in res["rounds"]),
        "max_round_cpu_seconds": max(r["round_cpu_seconds"] for r in res["rounds"]),
        "head_math_pearson": head.get("pearson"), "head_math_mae": head.get("mae"),
        "head_math_mae_floor": head.get("mae_floor"),
        # the same figures over requests (a request's mean prediction against its mean outcome)
        "head_math_per_request": head.get("per_request"),
    }
    # "within 5% of the start" read as: no more than 5% below it (a gain is not forgetting)
    out["code_within_5pct"] = out["code_ratio"] >= 0.95
    out["prose_within_5pct"] = out["prose_ratio"] >= 0.95
    out["rounds_within_10_min"] = out["max_round_seconds"] <= 600
    # issue 41's reading of the spread: no higher after the last round than before the shift
    out["cv_not_above_start"] = last["cv"] <= p["cv"]
    out["head_pearson_ge_0_7"] = (head.get("pearson") or 0) >= 0.7
    out["head_mae_le_0_05"] = head.get("mae") is not None and head["mae"] <= 0.05
    abl = {arm: rows[-1]["heldout"]["tau"]["math"] for arm, rows in res["ablation"].items()
           if rows}
    out["ablation_math_tau"] = abl
    if "rkl" in abl and len(abl) > 1:
        out["rkl_matches_or_beats_on_math"] = all(abl["rkl"] >= v for v in abl.values())
    return out


def write_results(results, args, prompt_stats, traffic_s, started, job_args) -> None:
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results["settings"] = {
        "command": "nice -n 5 python benchmarks/opd/run.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "per_round": {"math": args.math, "code": args.code, "prose": args.prose},
        "prompts": prompt_stats, "eval_prompts": args.eval_prompts,
        "eval": "reference engine, mode dflash, greedy, 64 new tokens, float32, one batch",
        "job": "python -m training_job.distill --parent latest --loss <arm> "
               + " ".join(job_args) + " (every other option at its default)",
        "traffic": f"train-split prompts (seed {args.seed}), greedy, {args.max_new_tokens} new "
                   + ("tokens, copied from an earlier run's --work (--traffic-from)" if args.traffic_from
                      else f"tokens, generated in {traffic_s:.0f} s"),
        "ablation": {"losses": args.ablation, "rounds": args.ablation_rounds},
        "git": args.commit or git.stdout.strip(), "python": platform.python_version(),
        "machine": platform.machine(), "threads": args.threads,
        "seconds": round(time.time() - started),
    }
    out = ROOT / args.out
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [0] + [r["round"] for r in res["rounds"]]
    for d in DOMAINS:
        a.plot(xs, [res["parent"]["tau"][d]] + [r["heldout"]["tau"][d] for r in res["rounds"]],
               marker="o", label=d)
    a.axhline(4.0, color="grey", ls=":", lw=1)
    a.set_xlabel("round (0 = shipped drafter)")
    a.set_ylabel("held-out tau (dflash, T=0)")
    a.set_title("OPD (rkl) on mixed traffic")
    a.legend()
    arms = [k for k, v in res["ablation"].items() if v]
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        last = res["ablation"][arm][-1]["heldout"]["tau"]
        b.bar([j + i * width for j in range(len(DOMAINS))], [last[d] for d in DOMAINS],
              width, label=arm)
    b.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(DOMAINS))], DOMAINS)
    n = len(next(iter(res["ablation"].values()), []))
    b.set_title(f"loss ablation after {n} round(s), same data and steps")
    b.set_ylabel("held-out tau")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
