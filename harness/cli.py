"""The `fedharness` command: run, list, tune, sweep, report."""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import sys
import threading
from typing import NoReturn

from fedharness.errors import ConfigError, ResultsWriteError
from fedharness.base.extras import require_extra


def cmd_run(overrides: list[str]) -> int:
    """One run. SIGINT/SIGTERM end it with one line on stderr and exit status 130/143 (128 + the signal)."""
    from fedharness.api import run
    from fedharness.runs.lifecycle import RunInterrupted
    from fedharness.runs.execute import summary_table
    from fedharness.studies.tuning.export import shown

    try:
        result = run(overrides)  # the Python API's code path
    except RunInterrupted as err:
        print(f"fedharness: {interrupted_line(err, overrides)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:  # before the run started: nothing was recorded
        print("fedharness: interrupted before the run started; nothing recorded", file=sys.stderr)
        return 130
    print(summary_table(result.rows))
    if (privacy := privacy_line(result)) is not None:
        print(privacy)
    print(f"run {result.run_id}: status={result.status}; results in {shown(result.results_dir)}/ "
          f"(runs/, rounds/ as Parquet)")
    if result.status == "diverged":
        print(f"fedharness: {diverged_line(result)}", file=sys.stderr)
    return 0 if result.status == "ok" else 3


def privacy_line(result) -> str | None:
    """A DP run's guarantee and the noise multiplier z it used (given, or calibrated to dp.target_epsilon), from
    its runs/ row; None without DP."""
    import json
    import math

    from fedharness.algorithms.privacy import CLIP_COUNTER

    if not any(CLIP_COUNTER in r for r in result.rows):  # a DP run's rows carry its clip norm
        return None
    row = result.runs.iloc[0]
    dp = json.loads(row.config_json)["dp"]  # z as the run used it: given, or calibrated before it started
    eps = row.epsilon if row.epsilon is not None and math.isfinite(row.epsilon) else math.inf  # null: no noise
    source = "dp.noise_multiplier" if dp["target_epsilon"] is None else \
        f"calibrated to dp.target_epsilon = {dp['target_epsilon']:g}"
    return (f"privacy: epsilon = {eps:.4g} at delta = {dp['delta']:g} after {row.rounds_done} rounds "
            f"({dp['accountant']}); noise multiplier z = {dp['noise_multiplier']:.4g} ({source})")


def diverged_line(result) -> str:
    """Where a diverged run stopped and what to try: its rounds/ end at the last finite round."""
    import json

    row = result.runs.iloc[0]
    lr = json.loads(row["config_json"])["algorithm"].get("client_lr")
    advice = f"a smaller algorithm.client_lr (now {lr:g}; e.g. {lr / 10:g})" if isinstance(lr, (int, float)) \
        else "a smaller algorithm.client_lr"
    return (f"run {result.run_id} diverged in round {int(row['rounds_done']) + 1} (the model or its loss was not "
            f"finite); try {advice}, or a model that fits the data (model=auto picks the data's own)")


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


def cmd_show_config(overrides: list[str]) -> int:
    """`fedharness run --cfg job ...`: the resolved, validated config as YAML; runs nothing."""
    from omegaconf import OmegaConf

    from fedharness.config.load import load_config

    print(OmegaConf.to_yaml(load_config(overrides)), end="")
    return 0


def cmd_config(group: str | None, option: str | None) -> int:
    from fedharness.config.help import describe_group, describe_run

    studies = {"tune": describe_tune, "sweep": describe_sweep}
    print(studies[group](option) if group in studies else describe_group(group, option) if group else describe_run())
    return 0


def describe_tune(option: str | None = None) -> str:
    from fedharness.studies.tuning.spec import describe_tune as describe

    return describe(option)


def describe_sweep(option: str | None = None) -> str:
    from fedharness.studies.sweep import describe_sweep as describe

    return describe(option)


def single_values(overrides: list[str]) -> None:
    """`run` takes one value per key: `k=a,b` is a grid, which is what `fedharness sweep` runs."""
    for ov in overrides:
        key, _, value = ov.partition("=")
        if "," in value and value.strip()[:1] not in ("[", "{", "'", '"'):
            raise ConfigError(key, value, f"one value per key; a grid of runs is: fedharness sweep {ov}")


class KeysHelp(argparse.Action):
    """`--help` of run, tune and sweep: the usage, then every key with its default and doc from the declarations
    (composed only when asked)."""

    def __init__(self, option_strings, dest, describe, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="show the keys with their defaults and docs")
        self.describe = describe

    def __call__(self, parser, namespace, values, option_string=None):
        print(parser.format_help() + "\n" + self.describe())
        parser.exit()


def describe_run() -> str:
    from fedharness.config.help import describe_run as describe

    return describe()


def cmd_list() -> int:
    from fedharness.config.compose import group_options
    from fedharness.algorithms.registry import PARTS
    from fedharness.problems import DATASETS, MODELS
    from fedharness.partitions import PARTITIONERS
    from fedharness.registry.groups import ATTACKS, AVAILABILITIES, CADENCES, COMPRESSORS, SPEEDS, STALENESS
    from fedharness.registry.plugins import load_entry_points

    load_entry_points()  # installed packages' parts are listed with the built-ins
    sections = {
        "datasets": DATASETS, "partitions": ("auto", *PARTITIONERS), "models": MODELS,
        "algorithms": group_options("algorithm"), "experiments": group_options("experiment"),
        "attacks": ("none", *ATTACKS), "compressors": ("none", *COMPRESSORS), "cadences": CADENCES,
        "speeds": SPEEDS, "availabilities": AVAILABILITIES, "staleness": STALENESS,
    }
    sections.update({f"{kind}s" if not kind.endswith("s") else kind: tuple(reg) for kind, reg in PARTS.items()})
    for title, names in sections.items():
        print(f"{title + ':':<20}{', '.join(names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedharness", description="Federated optimization benchmark harness.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment: fedharness run key=value ...", add_help=False)
    run.add_argument("-h", "--help", action=KeysHelp, describe=describe_run)
    run.add_argument("overrides", nargs="*", help="key=value, e.g. dataset=digits algorithm.client_lr=0.1")
    run.add_argument("--cfg", choices=["job"], help="print the resolved, validated config as YAML; run nothing")
    run.add_argument("-m", "--multirun", action="store_true", help="not here: grids of runs are `fedharness sweep`")
    config = sub.add_parser("config", help="a config group's options and keys with defaults and docs: "
                            "fedharness config [GROUP [OPTION]]")
    config.add_argument("group", nargs="?", help="dataset, partition, model, algorithm, attack, tune or sweep (none: "
                        "every top-level key of a run)")
    config.add_argument("option", nargs="?", help="an option of the group (default: the group's default)")
    sub.add_parser("list", help="list registered datasets, partitions, models, algorithms and parts")
    tune = sub.add_parser("tune", help="tune with Optuna under a fixed budget: fedharness tune tune=NAME key=value ...",
                          add_help=False)
    tune.add_argument("-h", "--help", action=KeysHelp, describe=describe_tune)
    tune.add_argument("overrides", nargs="*", help="tune=NAME, tune.* keys (e.g. tune.n_trials=20) and run overrides")
    tune.add_argument("--compare", metavar="ALGS", default=None,
                      help="comma-separated algorithms, e.g. fedavg,fednova,scaffold: same trials and budget each, "
                           "best configs re-run with fresh seeds, mean/std table")
    sweep = sub.add_parser("sweep", help="run a study grid as Ray tasks: fedharness sweep sweep=NAME [k=v] [k=a,b]",
                           add_help=False)
    sweep.add_argument("-h", "--help", action=KeysHelp, describe=describe_sweep)
    sweep.add_argument("overrides", nargs="*", help="sweep=NAME (conf/sweep/NAME.yaml); sweep.KEY=V sets the sweep "
                       "(e.g. sweep.runner=local, sweep.resources.num_cpus=2); k=v fixes a run key; k=a,b adds a "
                       "grid dimension")
    sweep.add_argument("--dry-run", action="store_true", help="list the runs and their overrides; start nothing")
    reproduce = sub.add_parser("reproduce", help="every paper claim at smoke scale over 5 data draws "
                               "(docs/reproductions.md; the same as make reproduce)")
    for flag, text in (("--only", "comma-separated claims (default: all)"), ("--out", "folder for the figures and "
                       "results.json (default: docs/reproductions)"), ("--draws", "data draws of each claim (5)"),
                       ("--jobs", "draws run at once, one process each (2)")):
        reproduce.add_argument(flag, default=None, help=text)
    from fedharness.studies.reports.command import add_arguments as add_report_arguments

    add_report_arguments(sub.add_parser("report", help="rounds to target, speedup and its fit with a bootstrap "
                                        "interval, plots and a Markdown report of a results directory"))
    return parser


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        if args.multirun:
            raise ConfigError("-m", "--multirun", "fedharness run makes one run; a grid of runs is: "
                              "fedharness sweep k=a,b ...")
        single_values(args.overrides)
        return cmd_show_config(args.overrides) if args.cfg else cmd_run(args.overrides)
    if args.command == "config":
        return cmd_config(args.group, args.option)
    if args.command == "tune":
        require_extra("optuna", "command", "tune")  # the `tune` extra
        from fedharness.studies.tuning.command import main as cmd_tune

        return cmd_tune(args.overrides, args.compare)
    if args.command == "sweep":
        from fedharness.studies.sweep import main as cmd_sweep

        return cmd_sweep(args.overrides, args.dry_run)
    if args.command == "reproduce":
        from fedharness.studies.reproduce import main as cmd_reproduce

        given = {flag: getattr(args, flag) for flag in ("only", "out", "draws", "jobs")}
        return cmd_reproduce([f"--{flag}={value}" for flag, value in given.items() if value is not None])
    if args.command == "report":
        from fedharness.studies.reports.command import main as cmd_report

        return cmd_report(args)
    return cmd_list()


def main(argv: list[str] | None = None) -> int:
    """Bad input and unwritable results: one line, exit 2. A closed pipe (`fedharness ... | head`): quiet.
    The library's log lines (INFO and up) show on stderr as `fedharness: <message>` while the command runs."""
    logger, handler = logging.getLogger("fedharness"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fedharness: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return dispatch(build_parser().parse_args(argv))
    except (ConfigError, ResultsWriteError) as err:
        print(f"fedharness: error: {err if isinstance(err, ConfigError) else err.strerror}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would fail too
        return 141
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


GC_THRESHOLDS = (7000, 10, 10)  # Python's are (700, 10, 10)


def entry() -> NoReturn:
    """The installed `fedharness` command: main, then the process ends without tearing the interpreter down.

    Python's own exit first joins the threads that are not daemons and runs the atexit handlers (Ray's shutdown,
    logging's flush, multiprocessing's), which is done here too, then frees every module's objects one by one
    (torch's among them): a quarter of a one-round run's CPU time (docs/performance.md, Start-up), and nothing of
    it reaches a file. So after the handlers and a flush of stdout and stderr the process ends with
    os._exit. An exception from main leaves through Python's usual exit (its traceback and status).

    The cyclic garbage collector runs a tenth as often (GC_THRESHOLDS): with torch, Optuna and SQLAlchemy loaded,
    each full collection walks some 280,000 objects, and a 64-trial study spent about 0.7 CPU s in the collector
    (0.25 s with these thresholds, never a full collection; docs/performance.md). A process-wide choice, so the
    command makes it, not the library."""
    gc.set_threshold(*GC_THRESHOLDS)
    code = main()
    threading._shutdown()  # the join of non-daemon threads Python's exit does before atexit (no public call)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stream: Python's own exit status for a failed flush
        code = code or 120
    os._exit(code)


if __name__ == "__main__":
    entry()
