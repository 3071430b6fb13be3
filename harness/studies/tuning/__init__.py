"""Optuna tuning under a fixed budget: `fedharness tune` (see docs/tuning.md).

space.py (parameters bound to config keys), budget.py (rounds a config can afford),
objective.py (what a trial scores), spec.py (the validated TuneSpec), storage.py (where the study
lives), optuna_parts.py (sampler, pruner, the Optuna study), lease.py (heartbeats, lost trials), workers.py
(claim and run trials, here or as Ray tasks), study.py (one study, start to export), export.py (trials/
Parquet, best overrides, plots), compare.py (--compare), command.py (`fedharness tune`).
"""
