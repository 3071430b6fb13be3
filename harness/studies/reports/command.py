"""`fedharness report RESULTS_DIR [--target METRIC<=V ...]`: argument parsing stays free of heavy imports."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results_dir", help="a results directory (runs/, rounds/, sweeps/) from fedharness run or sweep: "
                   "a folder or an object-store URL (s3://bucket/prefix)")
    p.add_argument("--target", action="append", default=None, metavar="METRIC<=V",
                   help="a target, repeatable: train_loss<=0.5, subopt<=1e-3, test_acc>=0.8 (default: the sweep's "
                        "report.targets)")
    p.add_argument("--scale-key", default=None, help="the config key that is n (default: the sweep's "
                   "report.scale_key, else algorithm.clients_per_round; sampler=full counts every client)")
    p.add_argument("--study", default=None, help="only this study's runs")
    p.add_argument("--out", default=None, help="output folder (default RESULTS_DIR/report; for an object store, "
                   "./report)")
    p.add_argument("--bootstrap", type=int, default=None, help="bootstrap resamples for b's interval (default 1000)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the interval (default 0.95)")
    p.add_argument("--series", default="iterate", help="which recorded iterate (default iterate)")
    p.add_argument("--wandb", action="store_true", help="also log the figures and tables to Weights & Biases "
                   "(settings from the run config's wandb block; offline without an API key)")
    p.add_argument("--wandb-project", "--project", dest="wandb_project", default=None,
                   help="W&B project of the logged report and of the W&B Report")
    p.add_argument("--wandb-entity", "--entity", dest="wandb_entity", default=None, help="W&B entity (user or team)")
    p.add_argument("--wandb-group", default=None)
    p.add_argument("--wandb-mode", default=None, choices=("auto", "online", "offline"))
    p.add_argument("--wandb-report", action="store_true", help="also build a W&B Report of the study (panels, "
                   "tables, links to its W&B runs): written to OUT/wandb_report.json, published when online")
    p.add_argument("--publish", action="store_true", help="publish OUT/wandb_report.json, written earlier by "
                   "--wandb-report, to W&B (nothing is recomputed)")


def print_summary(report) -> None:
    """Per target: the censored replicas and each group's fit; then where the report is."""
    for t in report.targets:
        fits = report.tables[f"fit_{t.slug}"]
        cells = report.tables[f"to_target_{t.slug}"]
        print(f"{t.label}: {int(cells['censored'].sum())} of {int(cells['replicas'].sum())} replicas censored")
        for row in fits.itertuples():
            b = "no fit (fewer than 2 uncensored n)" if row.points < 2 else \
                f"b = {row.b:.3f}  [{row.b_lo:.3f}, {row.b_hi:.3f}] ({row.level:.0%}, {row.bootstrap} resamples)"
            print(f"  {row.group}: {b}")
    print(f"report: {report.markdown} ({len(report.figures)} figures, tables in {report.out_dir / 'tables'})")


def main(args: argparse.Namespace) -> int:
    if args.publish:
        from fedharness.studies.reports.wandb_report import publish_file

        return publish_file(args)
    from fedharness.studies.reports.analysis import parse_target
    from fedharness.studies.reports.data import load_results
    from fedharness.studies.reports.report import build_report

    targets = None if args.target is None else [parse_target(t) for t in args.target]
    results = load_results(args.results_dir, args.study)  # the one opening of the results store
    if args.wandb_report:  # refused before any work when no run of the study was logged to W&B
        from fedharness.studies.reports.wandb_report import logged_runs

        logged_runs(results)
    report = build_report(results, targets, args.scale_key, args.out, args.bootstrap, args.level, args.series)
    print_summary(report)
    if args.wandb:
        from fedharness.config.load import load_settings
        from fedharness.sinks.wandb_sink import log_report
        from fedharness.config.overrides import dict_overrides

        given = {f"wandb.{key}": getattr(args, f"wandb_{key}") for key in ("project", "entity", "group", "mode")}
        log_report(report, load_settings(dict_overrides({k: v for k, v in given.items() if v is not None})).wandb)
    if args.wandb_report:
        from fedharness.studies.reports.wandb_report import write

        write(report, results, args)
    return 0
