"""`fedharness report RESULTS_DIR [--target METRIC<=V ...]`: argument parsing stays free of heavy imports."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results_dir", help="a results directory (runs/, rounds/, sweeps/) from fedharness run or sweep")
    p.add_argument("--target", action="append", default=None, metavar="METRIC<=V",
                   help="a target, repeatable: train_loss<=0.5, subopt<=1e-3, test_acc>=0.8 (default: the sweep's "
                        "report.targets)")
    p.add_argument("--scale-key", default=None, help="the config key that is n (default: the sweep's "
                   "report.scale_key, else algorithm.clients_per_round; sampler=full counts every client)")
    p.add_argument("--study", default=None, help="only this study's runs")
    p.add_argument("--out", default=None, help="output folder (default RESULTS_DIR/report)")
    p.add_argument("--bootstrap", type=int, default=None, help="bootstrap resamples for b's interval (default 1000)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the interval (default 0.95)")
    p.add_argument("--series", default="iterate", help="which recorded iterate (default iterate)")
    p.add_argument("--wandb", action="store_true", help="also log the figures and tables to Weights & Biases "
                   "(settings from the run config's wandb block; offline without an API key)")
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--wandb-entity", default=None)
    p.add_argument("--wandb-group", default=None)
    p.add_argument("--wandb-mode", default=None, choices=("auto", "online", "offline"))


def main(args: argparse.Namespace) -> int:
    from harness.lifecycle import mark_lost_runs
    from harness.reports.analysis import parse_target
    from harness.reports.report import build_report

    targets = None if args.target is None else [parse_target(t) for t in args.target]
    mark_lost_runs(args.results_dir)  # so the report counts a killed run as lost, not running
    report = build_report(args.results_dir, targets, args.scale_key, args.out, args.study, args.bootstrap,
                          args.level, args.series)
    for t in report.targets:
        fits = report.tables[f"fit_{t.slug}"]
        cells = report.tables[f"to_target_{t.slug}"]
        print(f"{t.label}: {int(cells['censored'].sum())} of {int(cells['replicas'].sum())} replicas censored")
        for row in fits.itertuples():
            b = "no fit (fewer than 2 uncensored n)" if row.points < 2 else \
                f"b = {row.b:.3f}  [{row.b_lo:.3f}, {row.b_hi:.3f}] ({row.level:.0%}, {row.bootstrap} resamples)"
            print(f"  {row.group}: {b}")
    print(f"report: {report.markdown} ({len(report.figures)} figures, tables in {report.out_dir / 'tables'})")
    if args.wandb:
        from harness.config import load_config
        from harness.wandb_sink import log_report

        wcfg = load_config([])["wandb"]
        for key in ("project", "entity", "group", "mode"):
            value = getattr(args, f"wandb_{key}")
            if value is not None:
                wcfg[key] = value
        log_report(report, wcfg)
    return 0
