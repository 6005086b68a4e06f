"""The distillation job's command line (shared by `python -m training_job.distill` and
`adaflash distill`), in its own module so the job's module is about the round alone."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from training_job.opd.workdir import JobError

DEFAULT_HOME = "/var/lib/adaflash"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The job's options (shared by `python -m training_job.distill` and `adaflash distill`)."""
    g = p.add_argument_group("the operator's contract")
    g.add_argument("--home", default=os.environ.get("ADAFLASH_HOME", DEFAULT_HOME),
                   help="shared volume (default $ADAFLASH_HOME, else /var/lib/adaflash)")
    g.add_argument("--target", required=True,
                   help="target model: a local directory or a Hugging Face id")
    g.add_argument("--parent", default="",
                   help="version to distil from, or 'latest' (the default: the one "
                        "drafters/latest names)")
    g.add_argument("--min-records", type=int, default=128,
                   help="fail unless at least this many new usable records exist (default 128)")
    g.add_argument("--report", default=None, metavar="PATH",
                   help="write the JSON report (or, on failure, the reason) here")
    g.add_argument("--idle-exit-code", type=int, default=3, metavar="N",
                   help="exit code when there are too few new records for a round (default 3; "
                        "the report then says \"outcome\": \"NotEnoughRecords\"). The operator "
                        "passes 0, so the Job completes instead of failing")
    t = p.add_argument_group("training")
    t.add_argument("--loss", choices=("rkl", "fkl", "sft"), default=None,
                   help="rkl: CE on the target argmax + clipped reverse KL (OPD, the default); "
                        "fkl: the same with forward KL; sft: plain CE on the response (OSD)")
    t.add_argument("--algorithm", choices=("opd", "osd"), default=None,
                   help="deprecated alias: opd = --loss rkl, osd = --loss sft")
    t.add_argument("--alpha", type=float, default=0.8, help="weight of the CE term (default 0.8)")
    t.add_argument("--tau", type=float, default=0.01,
                   help="entry-wise clip of the normalised KL (default 0.01)")
    t.add_argument("--temperature", type=float, default=1.0, help="of the KL term (default 1)")
    t.add_argument("--gamma", type=float, default=7.0, help="position decay (default 7)")
    t.add_argument("--norm", choices=("weights", "count"), default="weights",
                   help="denominator of the KL term: the decayed-weight sum (the reference, "
                        "default) or the count of valid slots (our earlier choice)")
    t.add_argument("--scope", choices=("sequence", "batch"), default="sequence",
                   help="normalisation group: each sequence (the reference's micro-batches, "
                        "default) or the whole batch")
    t.add_argument("--t-squared", action=argparse.BooleanOptionalAction, default=True,
                   help="multiply the KL by T^2 (the reference; default on)")
    t.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    t.add_argument("--adam-beta2", type=float, default=0.999,
                   help="AdamW beta2 (default 0.999; beta1 is 0.9)")
    t.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay (default 0.01)")
    t.add_argument("--epochs", type=int, default=2, help="passes over the round (default 2)")
    t.add_argument("--batch-size", type=int, default=8,
                   help="sequences per step over all ranks (default 8)")
    t.add_argument("--anchors-per-seq", type=int, default=24, help="blocks per sequence (default 24)")
    t.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip (default 1)")
    t.add_argument("--max-seq-len", type=int, default=1024,
                   help="prompt + response tokens kept per record (default 1024)")
    t.add_argument("--head", choices=("joint", "refit"), default="joint",
                   help="length head: trained in the drafter's steps on its detached states "
                        "(the reference, default) or refit after them")
    t.add_argument("--head-steps", type=int, default=50,
                   help="with --head refit: steps after the drafter (default 50; 0 = keep it)")
    t.add_argument("--head-lr", type=float, default=2e-4, help="length-head learning rate")
    t.add_argument("--head-calibration", action=argparse.BooleanOptionalAction, default=True,
                   help="after training, rescale the head's score on the round's held-out "
                        "records, which the drafter did not train on (default on)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every N steps (default 20)")
    d = p.add_argument_group("data and evaluation")
    d.add_argument("--max-records", type=int, default=4096,
                   help="newest new records used; older new ones are consumed unused (default 4096)")
    d.add_argument("--eval-fraction", type=float, default=0.1,
                   help="share of the round held out for the evaluation (default 0.1)")
    d.add_argument("--min-eval-records", type=int, default=8)
    d.add_argument("--max-eval-records", type=int, default=64)
    d.add_argument("--eval-max-new-tokens", type=int, default=64)
    d.add_argument("--eval-batch-size", type=int, default=16)
    d.add_argument("--replay-share", type=float, default=0.25, metavar="F",
                   help="records of earlier rounds trained on again, as a share of the round's "
                        "new training records, spread over their domains, so a round of one "
                        "domain does not train the others away (default 0.25; 0: none)")
    d.add_argument("--standing-eval-records", type=int, default=8, metavar="N",
                   help="earlier rounds' held-out records of each domain evaluated beside the "
                        "round's own, so the gate sees domains this round's traffic lacks "
                        "(default 8; 0: none)")
    g = p.add_argument_group("the gate (candidate against parent on the held-out prompts)")
    g.add_argument("--gate-min-gain", type=float, default=0.0, metavar="G",
                   help="pass only if the mean held-out tau beats the parent's by G beyond the "
                        "noise: its lower confidence bound >= parent * (1 + G) (default 0)")
    g.add_argument("--gate-confidence", type=float, default=0.95, metavar="C",
                   help="one-sided confidence of the paired bootstrap bounds (default 0.95)")
    g.add_argument("--gate-resamples", type=int, default=1000, metavar="N",
                   help="bootstrap resamples of the held-out prompts (default 1000)")
    g.add_argument("--gate-min-domain-prompts", type=int, default=4, metavar="N",
                   help="domains with fewer held-out prompts are reported, not floored "
                        "(default 4)")
    g.add_argument("--require-gain", type=float, default=None, metavar="G",
                   help="refuse to publish a candidate the gate fails, with --gate-min-gain G "
                        "(default: always publish; the report and the operator carry the "
                        "decision)")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default=None, help="default: cuda:<LOCAL_RANK> if available, else cpu")
    r.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the target's dtype (default float32 on CPU, bfloat16 on GPU); "
                        "the drafter always trains in float32")
    r.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    f = p.add_argument_group("follow mode")
    f.add_argument("--follow", action="store_true",
                   help="keep running rounds as traffic arrives, each from the version the "
                        "previous one published, until SIGTERM/SIGINT or --max-rounds")
    f.add_argument("--poll-interval", type=float, default=5.0, metavar="SECONDS",
                   help="with --follow: wait this long between looks at the traffic (default 5)")
    f.add_argument("--max-rounds", type=int, default=None, metavar="R",
                   help="with --follow: stop after R rounds that trained (default: no limit)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training_job.distill",
                                description="One on-policy distillation round of the drafter.")
    return add_arguments(p)


def opd_config(args) -> Any:
    from training_job.opd.train import ALGORITHM_ALIASES, OPDConfig

    loss = args.loss
    if args.algorithm is not None:
        alias = ALGORITHM_ALIASES[args.algorithm]
        if loss is not None and loss != alias:
            raise JobError(f"--algorithm {args.algorithm} (deprecated) means --loss {alias}, "
                           f"which contradicts --loss {loss}; pass --loss alone")
        loss = alias
    try:
        return OPDConfig(loss=loss or "rkl", alpha=args.alpha, tau=args.tau,
                         temperature=args.temperature, gamma=args.gamma, norm=args.norm,
                         scope=args.scope, t_squared=args.t_squared, lr=args.lr,
                         adam_beta2=args.adam_beta2, weight_decay=args.weight_decay,
                         epochs=args.epochs, batch_size=args.batch_size,
                         anchors_per_seq=args.anchors_per_seq, grad_clip=args.grad_clip,
                         max_seq_len=args.max_seq_len, seed=args.seed,
                         ckpt_every=max(1, args.ckpt_every), head=args.head,
                         head_steps=args.head_steps, head_lr=args.head_lr)
    except ValueError as e:
        raise JobError(str(e)) from None


def gate_config(args) -> Any:
    from training_job.opd.gate import GateConfig

    gain = args.require_gain if args.require_gain is not None else args.gate_min_gain
    return GateConfig(min_gain=gain, confidence=args.gate_confidence,
                      resamples=args.gate_resamples,
                      min_domain_prompts=args.gate_min_domain_prompts, seed=args.seed,
                      refuse=args.require_gain is not None)


def _bad(value, ok) -> bool:
    return not (isinstance(value, (int, float)) and math.isfinite(value) and ok(value))


def check_arguments(args) -> list[str]:
    """Every problem with the option values, found before the job touches the volume (so a
    typo such as ``--lr nan`` costs no selection, no model load and no retry)."""
    problems: list[str] = []
    try:
        opd_config(args)
        gate_config(args)
    except (JobError, ValueError) as e:
        problems.append(str(e))
    for name, ok, what in (
        ("min_records", lambda v: v >= 1, ">= 1"), ("max_records", lambda v: v >= 1, ">= 1"),
        ("eval_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
        ("min_eval_records", lambda v: v >= 1, ">= 1"),
        ("max_eval_records", lambda v: v >= 1, ">= 1"),
        ("eval_max_new_tokens", lambda v: v >= 1, ">= 1"),
        ("eval_batch_size", lambda v: v >= 1, ">= 1"),
        ("replay_share", lambda v: 0 <= v <= 4, "in [0, 4]"),
        ("standing_eval_records", lambda v: v >= 0, ">= 0"),
        ("poll_interval", lambda v: v >= 0, ">= 0"),
    ):
        if _bad(getattr(args, name), ok):
            problems.append(f"--{name.replace('_', '-')} must be {what}, got "
                            f"{getattr(args, name)}")
    if args.max_rounds is not None and args.max_rounds < 1:
        problems.append(f"--max-rounds must be >= 1, got {args.max_rounds}")
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads must be >= 1, got {args.threads}")
    return problems
