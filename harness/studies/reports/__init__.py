"""Scaling reports: rounds to target, speedup S(n) and the fit T = a n^-b with a bootstrap interval, plots, Markdown.

    from fedharness.studies.reports import build_report, load_results, parse_target
    report = build_report(load_results("results/sweeps/speedup"), [parse_target("subopt<=0.1")])
    report.markdown                          # <results_dir>/report/report.md
    report.tables["fit_subopt_le_0.1"]       # per group: a, b and b's bootstrap interval over seeds

Modules: data (read Parquet, find what varies), analysis (targets, censoring, fits), plots, markdown, report,
command (`fedharness report`). Imported lazily: the command line builds its parser without pandas or matplotlib.
"""

from __future__ import annotations

_EXPORTS = {"Report": "report", "build_report": "report", "Target": "analysis", "parse_target": "analysis",
            "load_results": "data"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    from importlib import import_module

    return getattr(import_module(f"fedharness.studies.reports.{_EXPORTS[name]}"), name)
