"""`adaflash demo`: the closed learning loop on one machine.

Two processes meet on a temporary volume (``ADAFLASH_HOME``), seeded with the shipped drafter as
``v000001``: ``adaflash serve`` answers, writes a traffic record per answer and hot-reloads each
new ``drafters/latest``; ``python -m training_job.distill --follow`` trains a round whenever
enough new records arrived and publishes the next version. This process is only their client:
through the `openai` client it replays code and prose, then shifts to math, and watches live tau
(per domain, per drafter version), throughput and the versions loaded. A third child, ``adaflash
serve --mode ar`` (plain decoding, no traffic), answers every other prompt again right after the
speculative server did, so each version's speed is a ratio to plain decoding on the same prompts
in the same minute (client.py, report.py). After the last round it replays some of the first
phase's code and prose prompts, to show whether the drafter forgot them. It ends by comparing the
final version's T=0 answers with plain decoding's, token for token.

Exit status: 0 when every request was answered, both children behaved and the T=0 answers are
plain decoding's; 1 otherwise (results.json says which); 2 bad arguments; 130 interrupted. The
children are stopped on every path (see ``procs``).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from ..errors import CLIError
from . import check as eqcheck
from .client import Poller, Replayer
from .plan import Plan, plan_for
from .procs import ChildError, Children, restore_sigterm, terminate_as_interrupt
from .report import cells, plot, stalls, table
from .workload import FIRST_PHASE, REPLAY_PHASE, SHIFT_PHASE, first_phase, math_stream, shipped

MODEL_NAME = "demo"
#: The loop's goal: by the last version, math at least this many times plain decoding's speed.
MATH_SPEED_GOAL = 1.3


def _child_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["ADAFLASH_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on 2 cores
    root = str(Path(__file__).resolve().parents[2])  # sglang_adaflash/ and training_job/ live here
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def serve_argv(args, home: Path, concurrency: int, mode: str | None = None) -> list[str]:
    """The speculative server (mode None: --mode's), or with mode "ar" plain decoding: the same
    server with no drafter, writing no traffic, on its own volume."""
    argv = [sys.executable, "-m", "sglang_adaflash.cli.main", "serve", "--target", args.target,
            "--home", str(home), "--mode", mode or args.mode, "--port", "0", "--model-name", MODEL_NAME,
            "--reload-poll-s", "0.5", "--threads", str(args.threads),
            "--max-batch-size", str(max(8, concurrency)), "--log-level", "warning"]
    argv += ["--no-traffic"] if mode == "ar" else ["--traffic-writer", "demo"]
    return argv + (["--dtype", args.dtype] if args.dtype else [])


def distill_argv(args, home: Path, plan: Plan, report: Path) -> list[str]:
    return [sys.executable, "-m", "training_job.distill", "--home", str(home), "--target", args.target,
            "--parent", "latest", "--min-records", str(plan.min_records), "--report", str(report),
            "--follow", "--poll-interval", "1", "--max-rounds", str(plan.rounds),
            "--epochs", str(plan.epochs), "--lr", repr(plan.lr), "--max-records", str(plan.max_records),
            "--head-steps", str(plan.head_steps), "--min-eval-records", "2",
            "--max-eval-records", str(plan.eval_records), "--eval-max-new-tokens", str(plan.eval_tokens),
            "--standing-eval-records", str(plan.standing_eval),
            "--threads", str(args.threads), "--quiet"]


def wait_ready(url: str, timeout_s: float, serve) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not serve.running:
            raise ChildError(f"adaflash serve exited with status {serve.proc.returncode}:\n{serve.tail()}")
        time.sleep(0.2)
    raise ChildError(f"adaflash serve did not answer /ready within {timeout_s:.0f} s:\n{serve.tail()}")


def published(home: Path) -> list[dict]:
    """Every version on the volume with the summary its manifest carries."""
    out = []
    for d in sorted((home / "drafters").glob("v*")):
        try:
            m = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        out.append({"version": m.get("version", d.name), "parent": m.get("parent"),
                    "created": m.get("created"), "training": m.get("training"), "eval": m.get("eval")})
    return out


def check_installed() -> None:
    import importlib.util

    missing = [m for m in ("openai", "fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise CLIError(f"the closed loop needs {', '.join(missing)}: pip install "
                       "'sglang-adaflash[serve,bench]' openai (or `make demo`, which installs everything)")


def run_loop(args) -> int:
    check_installed()
    plan = plan_for(args)
    concurrency = args.concurrency[0] if isinstance(args.concurrency, list) else args.concurrency
    if isinstance(args.concurrency, list) and len(args.concurrency) > 1:
        raise CLIError("the closed loop takes one --concurrency (clients in flight), such as 8; "
                       "several levels are for --static")
    if args.mode == "ar":
        raise CLIError("--mode ar serves no drafter, so the loop has nothing to learn or reload; "
                       "use --mode dflash (the default) or adaflash")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="adaflash-demo-"))
    t0 = time.time()

    def clock() -> float:
        return time.time() - t0

    from ..drafter.manifest import target_fingerprint
    from ..drafter.store import latest_version as read_latest
    from ..drafter.store import publish_checkpoint

    try:
        v1 = publish_checkpoint(home, args.drafter, target=target_fingerprint(args.target))
    except Exception as e:
        raise CLIError(f"cannot publish the drafter {args.drafter} into {home}: {e}") from None
    say = (lambda *a: None) if args.quiet else (lambda msg: print(f"demo [{clock():6.1f}s] {msg}", flush=True))
    say(f"volume {home}: {v1} = {args.drafter}")
    previous_sigterm = terminate_as_interrupt()
    state: dict = {"failed_children": {}, "phases": [], "answers": []}
    poller = None
    try:
        with Children() as kids:
            serve = kids.start("serve", serve_argv(args, home, concurrency), out / "logs" / "serve.log",
                               _child_env(home))
            url = serve.wait_for_line(r"listening on (http://\S+)", args.start_timeout).group(1)
            wait_ready(url, args.start_timeout, serve)
            say(f"adaflash serve (pid {serve.pid}) ready at {url}, mode {args.mode}")
            plain_home = home / "plain"
            plain_home.mkdir(exist_ok=True)
            plain = kids.start("plain", serve_argv(args, plain_home, concurrency, mode="ar"),
                               out / "logs" / "plain.log", _child_env(plain_home))
            plain_url = plain.wait_for_line(r"listening on (http://\S+)", args.start_timeout).group(1)
            wait_ready(plain_url, args.start_timeout, plain)
            say(f"plain decoding (adaflash serve --mode ar, pid {plain.pid}) ready at {plain_url}: "
                f"every {plan.baseline_every}. prompt of each domain is answered there too")
            distill = kids.start("distill", distill_argv(args, home, plan, out / "logs" / "distill-report.json"),
                                 out / "logs" / "distill.log", _child_env(home))
            say(f"distillation follower (pid {distill.pid}): a round per {plan.min_records} new records, "
                f"{plan.rounds} round(s)")
            (out / "logs" / "processes.json").write_text(json.dumps({"serve": serve.pid, "distill": distill.pid,
                                                                     "plain": plain.pid}))
            poller = Poller(url, clock).start()
            baseline = Replayer(plain_url, MODEL_NAME, concurrency=1, max_tokens=plan.max_tokens,
                                clock=clock, server="plain")
            replayer = Replayer(url, MODEL_NAME, concurrency=concurrency, max_tokens=plan.max_tokens,
                                clock=clock, baseline=baseline, baseline_every=plan.baseline_every)
            answers = state["answers"]

            live: list = []  # this phase's answers as they arrive (the run returns them at its end)

            def on_answer(a) -> None:
                live.append(a)
                if not a.ok:
                    say(f"request {a.id} FAILED: {a.error}")

            start = traffic_start = clock()
            answers += replayer.run(iter(first_phase(plan.first_requests)), FIRST_PHASE, on_answer=on_answer)
            state["phases"].append({"name": FIRST_PHASE, "start": start, "end": clock()})
            say(f"phase {FIRST_PHASE}: {len(answers)} answers; now the traffic shifts to math")

            shown = {v1}
            rounds = {"done_at": None}

            def enough() -> bool:
                version = poller.version()
                if version not in shown:
                    shown.add(version)
                    say(f"the server swapped in {version} between two steps")
                if clock() - traffic_start > plan.budget_s:
                    say(f"the traffic budget ({plan.budget_s:.0f} s) is spent")
                    return True
                if rounds["done_at"] is None:
                    if distill.running and len(published(home)) - 1 < plan.rounds:
                        return False
                    rounds["done_at"] = clock()
                if distill.running and clock() - rounds["done_at"] > 20:
                    # --max-rounds ends the follower after its last round; should it still be
                    # running, no round past the plan's may start: stop() below waits for it
                    distill.terminate()
                latest = read_latest(home)
                if version != latest:
                    return False
                served = sum(1 for a in list(live) if a.ok and a.phase == SHIFT_PHASE and a.server == "spec"
                             and [p["version"] for p in a.by_version] == [latest])
                return served >= plan.per_version

            start = clock()
            answers += replayer.run(math_stream(), SHIFT_PHASE, until=enough, on_answer=on_answer)
            state["phases"].append({"name": SHIFT_PHASE, "start": start, "end": clock()})
            exited_alone = not distill.running and not distill.terminated
            code = distill.stop(timeout_s=60)
            state["distill_exit"] = {"status": code, "stopped_by_demo": not exited_alone}
            if exited_alone and code != 0:
                state["failed_children"]["distill"] = code
                say(f"the distillation follower failed (status {code}); see {distill.log_path}")
            say(f"phase {SHIFT_PHASE}: {sum(a.phase == SHIFT_PHASE for a in answers)} answers")

            settle(url, home, read_latest)
            if plan.replay:  # did the math rounds make the drafter forget code and prose?
                start = clock()
                answers += replayer.run(iter(first_phase(plan.replay)), REPLAY_PHASE, on_answer=on_answer)
                state["phases"].append({"name": REPLAY_PHASE, "start": start, "end": clock()})
                say(f"phase {REPLAY_PHASE}: the first phase's first {plan.replay} prompts again, on the final version")
            served_ids, check_prompts = served_check(replayer, plan)
            state["check_versions"] = sorted({v for v, _ in served_ids.values()}, key=str)
            ready = httpx.get(url + "/ready", timeout=10).json()
            state["swaps"] = ready.get("swaps") or []
            state["steps"] = ready.get("steps")
            poller.stop()
            for name, child in (("serve", serve), ("plain", plain)):
                if not child.running:
                    state["failed_children"][name] = child.proc.returncode
    except KeyboardInterrupt:
        print("demo: interrupted; both processes were stopped", file=sys.stderr)
        return 130
    except ChildError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 1
    finally:
        restore_sigterm(previous_sigterm)
        if poller is not None:
            poller.stop()
        volume = published(home)
        if not args.home and not args.keep_home:
            shutil.rmtree(home, ignore_errors=True)

    say(f"T=0 check: {len(check_prompts)} prompts through the final version, against plain decoding")
    reference = eqcheck.ar_outputs(args.target, args.dtype, {p.id: p.text for p in check_prompts},
                                   plan.max_tokens, threads=args.threads)
    equality = eqcheck.compare({k: ids for k, (_, ids) in served_ids.items()}, reference)
    return finish(args, plan, out, state, poller, volume, equality, clock(), concurrency, say)


def settle(url: str, home: Path, latest, timeout_s: float = 30.0) -> None:
    """Wait until the server has loaded the newest published version (the follower is stopped
    now, so nothing moves it again), so the T=0 check runs on the final version alone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(url + "/ready", timeout=10).json().get("drafter_version") == latest(home):
            return
        time.sleep(0.2)


def served_check(replayer: Replayer, plan: Plan):
    """The check prompts at T=0 through the server: {id: (version, token ids)}."""
    per = max(1, plan.check_prompts // 3)
    prompts = shipped("math")[:plan.check_prompts - 2 * per] + shipped("code")[:per] + shipped("prose")[:per]
    served = {}
    with ThreadPoolExecutor(replayer.concurrency) as pool:
        for p, (a, ids) in zip(prompts, pool.map(lambda p: replayer.ask(p, "check", token_ids=True), prompts)):
            if not a.ok:
                raise ChildError(f"the T=0 check request {p.id} failed: {a.error}")
            served[p.id] = (a.fingerprint, list(ids or []))
    return served, prompts


def finish(args, plan, out: Path, state, poller, volume, equality, end: float, concurrency: int, say) -> int:
    answers, phases, swaps = state["answers"], state["phases"], state.get("swaps", [])
    t0 = time.time() - end
    for s in swaps:
        s["t"] = round(s.pop("at", t0) - t0, 2)
    rows = cells(answers, phases, poller.samples, end)
    failed = [a.to_dict() for a in answers if not a.ok]
    domains = [d for d in ("code", "prose", "math") if any(d in r["tau"] for r in rows)]
    math = [(r["version"], r["tau"]["math"]) for r in rows if r["phase"] == SHIFT_PHASE and "math" in r["tau"]]
    pauses = [s["pause_steps"] for s in swaps if s.get("pause_steps") is not None]
    math_speed = [(r["version"], r["vs_plain"]["math"]) for r in rows
                  if r["phase"] == SHIFT_PHASE and (r.get("vs_plain") or {}).get("math")]
    first = next((r for r in rows if r["phase"] == FIRST_PHASE), None)
    again = next((r for r in rows if r["phase"] == REPLAY_PHASE), None)
    summary = {
        "failed_requests": len(failed),
        "answered_requests": sum(a.ok for a in answers),
        "plain_answers": sum(a.ok and a.server == "plain" for a in answers),
        "math_tau_first_to_last": [math[0], math[-1]] if math else None,
        "math_tau_rose": bool(math) and len(math) > 1 and math[-1][1] > math[0][1],
        # speed against plain decoding on the same prompts, measured in this run (report.py)
        "math_vs_plain_first_to_last": [math_speed[0], math_speed[-1]] if math_speed else None,
        "math_vs_plain_goal": {"goal": MATH_SPEED_GOAL, "last": math_speed[-1][1] if math_speed else None,
                               "met": bool(math_speed) and math_speed[-1][1] >= MATH_SPEED_GOAL},
        "first_domains_before_after": None if first is None or again is None else {
            d: {"tau": [first["tau"].get(d), again["tau"].get(d)],
                "vs_plain": [(first.get("vs_plain") or {}).get(d), (again.get("vs_plain") or {}).get(d)],
                "versions": [first["version"], again["version"]]}
            for d in ("code", "prose")},
        "versions_loaded": [s["version"] for s in swaps],
        "reload_pause_max_s": max((s["pause_s"] for s in swaps), default=None),
        "reload_pause_max_steps": max(pauses, default=None),
        "reload_pause_at_most_one_step": all(p <= 1 for p in pauses) if pauses else None,
        "longest_stall_s": stalls(poller.samples),
        "poll_failures": poller.failures,
        "t0_equal_to_ar": equality.ok,
        "check_versions": state.get("check_versions"),
        "children_failed": state["failed_children"],
        "distill_exit": state.get("distill_exit"),
        "seconds": round(end, 1),
    }
    doc = {
        "command": "adaflash demo " + " ".join(args.argv_shown),
        "settings": {"mode": args.mode, "concurrency": concurrency, "dtype": args.dtype, "threads": args.threads,
                     "temperature": 0.0, **vars(plan)},
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count()},
        "summary": summary, "cells": rows, "phases": phases, "swaps": swaps, "versions": volume,
        "equality": equality.to_dict(), "failed": failed,
        "timeline": poller.samples, "answers": [a.to_dict() for a in answers],
    }
    from ..fsio import write_text_atomic

    write_text_atomic(out / "results.json", json.dumps(doc, indent=1, default=str) + "\n")
    text = table(rows, domains)
    (out / "table.txt").write_text(text + "\n")
    plotted = plot(out / "closed_loop.png", answers, phases, rows, swaps,
                   f"adaflash demo: mode {args.mode}, {concurrency} clients, T=0; live tau by domain and drafter version")
    print(text)
    print(f"\nanswered {summary['answered_requests']}, failed {summary['failed_requests']}; "
          f"versions loaded while serving: {', '.join(summary['versions_loaded']) or 'none'}")
    if math:
        print(f"math live tau: {math[0][0]} {math[0][1]:.2f} -> {math[-1][0]} {math[-1][1]:.2f}")
    if math_speed:
        goal = "met" if summary["math_vs_plain_goal"]["met"] else "missed"
        print(f"math speed against plain decoding (same prompts, this run): {math_speed[0][0]} "
              f"{math_speed[0][1]:.2f}x -> {math_speed[-1][0]} {math_speed[-1][1]:.2f}x "
              f"(goal {MATH_SPEED_GOAL}x by the last version: {goal})")
    for d, v in (summary["first_domains_before_after"] or {}).items():
        if v["tau"][0] is not None and v["tau"][1] is not None:
            print(f"{d} after the math rounds: tau {v['tau'][0]:.2f} ({v['versions'][0]}) -> "
                  f"{v['tau'][1]:.2f} ({v['versions'][1]})")
    if swaps:
        print("reload pause: " + ", ".join(
            f"{s['version']} {s['pause_s'] * 1e3:.1f} ms"
            + (f" ({s['pause_steps']:.2f} of a step)" if s.get("pause_steps") is not None else "")
            for s in swaps))
    verdict = "EQUAL" if equality.ok else "DIFFERENT"
    print(f"T=0 answers of the final version against plain decoding (ar): {verdict} "
          f"({equality.equal}/{equality.compared})")
    say(f"wrote {out / 'results.json'}" + (f", {out / 'closed_loop.png'}" if plotted else ""))
    ok = equality.ok and not failed and not state["failed_children"]
    return 0 if ok else 1
