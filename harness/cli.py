"""The `fedharness` command: run, list, tune, sweep, report."""

from __future__ import annotations

import argparse
import sys

from harness.errors import ConfigError


class ProgressBar:
    """A tqdm bar over rounds, opened at the first evaluation so errors print before any bar."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __call__(self, rnd: int, rows: list[dict]) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=self.total, desc="rounds", unit="rnd", disable=not self.enabled, file=sys.stderr)
        losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]
        self.bar.n = rnd
        self.bar.set_postfix(train_loss=f"{sum(losses) / max(len(losses), 1):.4g}")
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_run(overrides: list[str]) -> int:
    """One run. SIGINT/SIGTERM end it with one line on stderr and exit status 130/143 (128 + the signal)."""
    from harness.config import load_config
    from harness.lifecycle import RunInterrupted, mark_lost_runs
    from harness.run import execute, summary_table

    cfg = load_config(overrides)
    mark_lost_runs(cfg["results_dir"])
    bar = ProgressBar(cfg["rounds"], bool(cfg["progress"]))
    try:
        result = execute(cfg, progress=bar)
    except RunInterrupted as err:
        bar.close()
        print(f"fedharness: {interrupted_line(err, overrides)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # before the run started: nothing was recorded
        bar.close()
        print("fedharness: interrupted before the run started; nothing recorded", file=sys.stderr)
        return 130
    finally:
        bar.close()
    print(summary_table(result.rows))
    print(f"run {result.run_id}: status={result.status}; results in {result.results_dir}/ "
          f"(runs/, rounds/ as Parquet)")
    return 0 if result.status == "ok" else 3


def interrupted_line(err, overrides: list[str]) -> str:
    """Where an interrupted run stood, and the command that continues it (resume needs a checkpoint)."""
    import shlex

    head = f"interrupted at round {err.rounds_done} ({err}); run {err.run_id}"
    if err.checkpoint_round is None:
        return f"{head} cannot be resumed: no checkpoint (set checkpoint_every=N to make runs resumable)"
    kept = [shlex.quote(o) for o in overrides if not o.startswith("resume=")]
    start = f"continues from round {err.checkpoint_round}, its last checkpoint" if err.checkpoint_round else \
        "starts again from round 0: no checkpoint was written yet"
    return f"{head}; resume with: fedharness run {' '.join([*kept, f'resume={err.run_id}'])} ({start})"


def cmd_list() -> int:
    from algorithms.registry import PARTS
    from harness.config import group_options
    from harness.problems import DATASETS, MODELS
    from partitions import PARTITIONERS

    sections = {
        "datasets": DATASETS, "partitions": ("auto", *PARTITIONERS), "models": MODELS,
        "algorithms": group_options("algorithm"), "experiments": group_options("experiment"),
    }
    sections.update({f"{kind}s" if not kind.endswith("s") else kind: tuple(reg) for kind, reg in PARTS.items()})
    for title, names in sections.items():
        print(f"{title + ':':<20}{', '.join(names)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedharness", description="Federated optimization benchmark harness.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment: fedharness run key=value ...")
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset=digits algorithm.client_lr=0.1")
    sub.add_parser("list", help="list registered datasets, partitions, models, algorithms and parts")
    tune = sub.add_parser("tune", help="tune with Optuna under a fixed budget: fedharness tune tune=NAME key=value ...")
    tune.add_argument("overrides", nargs="*", help="tune=NAME, tune.* keys (e.g. tune.n_trials=20) and run overrides")
    tune.add_argument("--compare", metavar="ALGS", default=None,
                      help="comma-separated algorithms, e.g. fedavg,fednova,scaffold: same trials and budget each, "
                           "best configs re-run with fresh seeds, mean/std table")
    sweep = sub.add_parser("sweep", help="run a study grid as Ray tasks: fedharness sweep sweep=NAME [k=v] [k=a,b]")
    sweep.add_argument("overrides", nargs="*", help="sweep=NAME (conf/sweep/NAME.yaml); sweep.KEY=V sets the sweep "
                       "(e.g. sweep.runner=local, sweep.resources.num_cpus=2); k=v fixes a run key; k=a,b adds a "
                       "grid dimension")
    sweep.add_argument("--dry-run", action="store_true", help="list the runs and their overrides; start nothing")
    from harness.reports.command import add_arguments as add_report_arguments

    add_report_arguments(sub.add_parser("report", help="rounds to target, speedup and its fit with a bootstrap "
                                        "interval, plots and a Markdown report of a results directory"))
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args.overrides)
        if args.command == "tune":
            from harness.tuning.study import main as cmd_tune

            return cmd_tune(args.overrides, args.compare)
        if args.command == "sweep":
            from harness.sweep import main as cmd_sweep

            return cmd_sweep(args.overrides, args.dry_run)
        if args.command == "report":
            from harness.reports.command import main as cmd_report

            return cmd_report(args)
        return cmd_list()
    except ConfigError as err:
        print(f"fedharness: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
