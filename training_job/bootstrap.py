"""The operator's bootstrap Job: put the first drafter on an empty volume, once.

    python -m training_job.bootstrap --home /var/lib/adaflash --target <target> \\
        --version v000001 --report /dev/termination-log \\
        (--import DIR | --train [--prompts FILE]) [-- extra arguments]

- the version is there already (verified, and for this target): nothing to do, ``Present``;
- ``--import DIR``: ``adaflash drafters import`` of the published DFlash checkpoint ``DIR``
  (a neutral length head that the first distillation round trains), ``Imported``;
- ``--train``: the offline recipe (``python -m training_job.dflash_offline``) on the target's
  answers to ``--prompts`` (or to the prompts of the volume's traffic), ``Trained``; under
  torchrun every rank trains.

The arguments after ``--`` go to the import or the recipe. The report, one JSON object
(``{"outcome": ..., "version": ..., "message": ...}``), goes to ``--report`` (the termination
message the operator reads) and stdout. A rerun after a crash is safe: an import or a recipe
that had published finds its version ``Present``; the recipe resumes its work directory.

Exit codes: 0 the version is there (whichever outcome), 1 failed (the reason in the report
file), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

#: What an import or the recipe publishes on an empty volume.
FIRST_VERSION = "v000001"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training_job.bootstrap",
                                description="Put the first drafter version on the volume.")
    p.add_argument("--home", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--version", default="v000001", help="the version the serving pods wait for")
    p.add_argument("--report", default=None)
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--import", dest="import_dir", metavar="DIR",
                     help="a published DFlash checkpoint to import")
    how.add_argument("--train", action="store_true", help="train one with the offline recipe")
    p.add_argument("--prompts", default=None, help="with --train: prompts file (default: the "
                                                   "volume's traffic)")
    return p


def present(home: str, version: str, target_dir: Path) -> bool:
    """Whether ``version`` is published under ``home`` for this target (raises when it is there
    but broken or another target's: a bootstrap must not paper over that)."""
    from sglang_adaflash.drafter.checkpoint import CheckpointError
    from sglang_adaflash.drafter.manifest import ManifestError, check_target
    from sglang_adaflash.drafter.store import list_versions, verify_version

    if version not in list_versions(home):
        return False
    try:
        check_target(verify_version(home, version), target_dir)
    except (CheckpointError, ManifestError) as e:
        raise RuntimeError(f"{version} is on the volume but unusable: {e}") from None
    return True


def run(args, extra: list[str]) -> tuple[int, dict | str]:
    from sglang_adaflash.drafter.store import list_versions
    from training_job.opd.round import resolve_target

    target_dir = resolve_target(args.target)
    if present(args.home, args.version, target_dir):
        return 0, {"outcome": "Present", "version": args.version,
                   "message": f"{args.version} is on the volume already"}
    existing = list_versions(args.home)
    if existing:
        return 1, (f"bootstrap: {Path(args.home) / 'drafters'} holds {', '.join(existing)} but "
                   f"not {args.version}, the version the pods wait for; set "
                   "spec.drafter.initialVersion to one of them, or empty the volume's drafters")
    if args.version != FIRST_VERSION:
        # Checked before any work: the import and the recipe publish a volume's first version.
        return 1, (f"bootstrap: an empty volume's first version is {FIRST_VERSION}, and the "
                   f"pods wait for {args.version}; set spec.drafter.initialVersion to "
                   f"{FIRST_VERSION} (its default)")
    if args.import_dir:
        from sglang_adaflash.cli.drafters import add_parser, cmd_import

        p = argparse.ArgumentParser(prog="adaflash")
        add_parser(p.add_subparsers(dest="command"))
        ia = p.parse_args(["drafters", "import", args.import_dir, "--target", str(target_dir),
                           "--target-name", args.target, "--home", args.home, *extra])
        with contextlib.redirect_stdout(sys.stderr):
            cmd_import(ia)
        outcome = "Imported"
    else:
        from training_job.recipe import main as recipe

        src = ["--prompts", args.prompts] if args.prompts else ["--traffic", args.home]
        code = recipe(["--target", args.target, "--home", args.home, *src, "--quiet",
                       *extra])
        if code != 0:
            return code, "bootstrap: the offline recipe failed (its reason is above)"
        if int(os.environ.get("RANK", "0")) != 0:
            return 0, {}
        outcome = "Trained"
    got = list_versions(args.home)
    if got != [args.version]:
        return 1, f"bootstrap: expected {args.version} on the volume, found {got}"
    return 0, {"outcome": outcome, "version": args.version,
               "message": f"{outcome.lower()} {args.version} for {args.target}"}


def main(argv: list[str] | None = None) -> int:
    from training_job.opd.report import write_report

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = build_parser().parse_args(argv[:cut]), argv[cut + 1:]
    try:
        code, result = run(args, extra)
    except SystemExit as e:  # the import's or the recipe's argument errors
        code, result = 2, f"bootstrap: bad extra arguments {extra} ({e})"
    except Exception as e:  # noqa: BLE001 - whatever it is, the operator must read why
        code, result = 1, f"bootstrap: {type(e).__name__}: {' '.join(str(e).split())}"
    if int(os.environ.get("RANK", "0")) == 0:
        data = (json.dumps(result, sort_keys=True) if isinstance(result, dict)
                else result).encode()[:4000]
        if args.report:
            with contextlib.suppress(OSError):
                write_report(args.report, data)
        print(data.decode(), file=sys.stdout if code == 0 else sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
