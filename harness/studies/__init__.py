"""Studies built from many runs: Optuna tuning, sweeps, reports (speedup fits, plots), paper reproductions."""
