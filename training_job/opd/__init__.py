"""On-policy distillation (OPD) of the drafter from served traffic; `training_job.distill` runs it."""
