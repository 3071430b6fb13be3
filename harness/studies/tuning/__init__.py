"""Optuna tuning under a fixed budget: `fedharness tune` (see docs/tuning.md).

space.py (parameters bound to config keys), budget.py (rounds a config can afford),
objective.py (what a trial scores), study.py (spec, storage, workers, trials),
export.py (trials/ Parquet, best overrides, plots), compare.py (--compare).
"""
