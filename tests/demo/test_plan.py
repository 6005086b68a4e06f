"""The demo's sizes: one table (``demo/plan.py``) that the loop runs and ``--help`` prints."""

from __future__ import annotations

from dataclasses import fields

import pytest

from sglang_adaflash.cli.main import build_parser
from sglang_adaflash.demo.plan import DEFAULT, QUICK, Plan, plan_for
from sglang_adaflash.errors import CLIError

# Plan fields whose flag is spelt otherwise, or that have no flag (set by the loop's own code).
FLAG = {"max_tokens": "--max-new-tokens"}
NO_FLAG = {"eval_records", "eval_tokens", "standing_eval"}


def demo_args(*argv: str):
    return build_parser().parse_args(["demo", *argv])


def demo_actions() -> dict:
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    return {opt: a for a in demo._actions for opt in a.option_strings}


def test_no_flag_gives_the_default_plan_and_quick_gives_quick():
    args = demo_args()
    args.max_tokens = args.max_new_tokens  # what cli.main._demo does before the loop reads it
    assert plan_for(args) == DEFAULT
    quick = demo_args("--quick")
    quick.max_tokens = quick.max_new_tokens
    assert plan_for(quick) == QUICK


def test_a_flag_overrides_its_size_alone():
    args = demo_args("--rounds", "7", "--epochs", "3")
    args.max_tokens = None
    plan = plan_for(args)
    assert (plan.rounds, plan.epochs) == (7, 3)
    assert plan.min_records == DEFAULT.min_records and plan.max_records == DEFAULT.max_records


@pytest.mark.parametrize(("name", "value", "ok"), [("head_steps", 0, True), ("replay", 0, True),
                                                  ("check_prompts", 0, False), ("budget_s", 0.0, False)])
def test_only_head_steps_and_replay_may_be_zero(name, value, ok):
    args = demo_args()
    args.max_tokens = None
    setattr(args, name, value)
    if ok:
        assert getattr(plan_for(args), name) == value
    else:
        with pytest.raises(CLIError, match=f"--{name.replace('_', '-')} must be >= 1"):
            plan_for(args)


def shown(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def test_the_help_prints_the_sizes_the_loop_runs():
    actions = demo_actions()
    for f in fields(Plan):
        if f.name in NO_FLAG:
            continue
        help_text = actions[FLAG.get(f.name, "--" + f.name.replace("_", "-"))].help
        d, q = (getattr(p, f.name) for p in (DEFAULT, QUICK))
        assert f"default {shown(d)}" in help_text, (f.name, help_text)
        if d != q:
            assert f"--quick {shown(q)}" in help_text, (f.name, help_text)


@pytest.mark.parametrize("lr", ["0", "-1e-3", "nan", "inf"])
def test_a_learning_rate_must_be_a_positive_number(lr):
    args = demo_args(f"--lr={lr}")
    args.max_tokens = None
    with pytest.raises(CLIError, match="--lr must be a positive number"):
        plan_for(args)


def test_the_follower_is_started_with_the_plans_training_sizes(tmp_path):
    """The argv the loop gives `training_job.distill --follow`, read back by the job's own parser."""
    from sglang_adaflash.demo.loop import distill_argv
    from training_job.opd.options import build_parser as job_parser

    args = demo_args("--lr", "1e-3", "--epochs", "3")
    args.max_tokens = None
    args.target, args.threads = "embedded-target-dir", 1
    plan = plan_for(args)
    argv = distill_argv(args, tmp_path, plan, tmp_path / "report.json")
    job = job_parser().parse_args(argv[argv.index("training_job.distill") + 1:])
    assert (job.lr, job.epochs, job.max_rounds) == (1e-3, 3, DEFAULT.rounds)
    assert (job.min_records, job.max_records, job.head_steps) == (
        DEFAULT.min_records, DEFAULT.max_records, DEFAULT.head_steps)
    assert job.standing_eval_records == DEFAULT.standing_eval  # the job's default is 8
    assert job.follow and job.home == str(tmp_path)
