"""`adaflash distill`: one on-policy distillation round by hand.

It is the operator's job (`python -m training_job.distill`, docs/distillation.md) with the same
options, so a round tried on a workstation behaves as the Job will: it reads
`$ADAFLASH_HOME/traffic`, trains, evaluates, publishes the next version under
`$ADAFLASH_HOME/drafters` and prints the report.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    from training_job.distill import add_arguments

    p = sub.add_parser("distill", help="on-policy distillation rounds from served traffic",
                       description="Train the drafter on the traffic under $ADAFLASH_HOME/traffic "
                                   "(OPD or OSD), evaluate it against its parent and publish the "
                                   "next version; the job the operator runs. --follow keeps "
                                   "running rounds as traffic arrives.")
    return add_arguments(p)


def cmd_distill(args) -> int:
    from training_job.distill import run

    return run(args)
