"""The names of everything fedharness keeps under a `results_dir`: the one place that spells them.

Other tools read these files (docs/results.md), so the names are a contract:

    runs/run_id=<id>/run.parquet                       one row per run
    rounds/run_id=<id>/part-<first>-<last>.parquet     the run's evaluated rounds, one part per flush
    clients/run_id=<id>/part-<first>-<last>.parquet    per-client scores (eval.clients_table), likewise
    checkpoints/run_id=<id>/meta.json, state.pt        a resumable run's config and state
    sweeps/<name>-<time>.json                          a sweep's manifest: the grid point of each run
    trials/study=<study>/trials.parquet                a tuning study's trials
    tune/<study>/best.overrides, <plot>.png, compare.md   a study's own files
    compare/study=<study>/compare.parquet              `fedharness tune --compare`'s table
    optuna.db                                          the default Optuna storage (a folder results_dir only)
    report/                                            `fedharness report`'s output (a folder results_dir only)

Keys are POSIX paths relative to the results directory (harness/results/store.py); `runs/` and `rounds/` are
hive-partitioned by run_id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedharness.results.store import ResultsStore

RUNS, ROUNDS, SWEEPS = "runs", "rounds", "sweeps"  # the folders of the tables and of the sweep manifests
CLIENTS = "clients"  # per-client scores (eval.clients_table), parted like rounds/
RUN_FILE = "run.parquet"
PART_PATTERN = "part-*.parquet"  # a rounds/ part, as an fnmatch pattern
OPTUNA_DB = "optuna.db"
REPORT = "report"


def run_folder(table: str, run_id: str) -> str:
    """`<table>/run_id=<id>`: the run's hive partition of runs/ or rounds/."""
    return f"{table}/run_id={run_id}"


def run_key(run_id: str) -> str:
    return f"{run_folder(RUNS, run_id)}/{RUN_FILE}"


def run_of(key: str) -> str | None:
    """The run of a key `<table>/run_id=<id>/<file>`; None for a key of another shape."""
    parts = key.split("/")
    if len(parts) != 3 or not parts[1].startswith("run_id="):
        return None
    return parts[1].removeprefix("run_id=")


def part_name(first: int, last: int) -> str:
    """A rounds/ part's file name, by the range of rounds it holds."""
    return f"part-{first:09d}-{last:09d}.parquet"


def part_rounds(name: str) -> tuple[int, int]:
    """The first and last round a rounds/ part holds, from its name `part-<first>-<last>.parquet`."""
    _, first, last = name.removesuffix(".parquet").split("-")
    return int(first), int(last)


def part_key(run_id: str, name: str, table: str = ROUNDS) -> str:
    """A part of the run's rounds/ (or clients/) table."""
    return f"{run_folder(table, run_id)}/{name}"


def round_parts(store: ResultsStore, run_id: str, table: str = ROUNDS) -> list[str]:
    """The names of the run's rounds/ (or clients/) parts, sorted."""
    names = (key.rpartition("/")[2] for key in store.list(run_folder(table, run_id)))
    return [name for name in names if name.startswith("part-") and name.endswith(".parquet")]


def checkpoint_folder(run_id: str) -> str:
    return f"checkpoints/run_id={run_id}"


def checkpoint_meta_key(run_id: str) -> str:
    return f"{checkpoint_folder(run_id)}/meta.json"


def checkpoint_clients_folder(run_id: str) -> str:
    """Where the shards write their clients' slots (core/client_store.py), one file per shard and checkpoint."""
    return f"{checkpoint_folder(run_id)}/clients"


def checkpoint_state_key(run_id: str) -> str:
    return f"{checkpoint_folder(run_id)}/state.pt"


def manifest_key(sweep: str, stamp: str) -> str:
    """A sweep's manifest, `stamp` its start time (one manifest per time the sweep ran)."""
    return f"{SWEEPS}/{sweep}-{stamp}.json"


def is_manifest(key: str) -> bool:
    return key.startswith(f"{SWEEPS}/") and key.count("/") == 1 and key.endswith(".json")


def trials_key(study: str) -> str:
    return f"trials/study={study}/trials.parquet"


def study_key(study: str, name: str) -> str:
    """A study's own file (best.overrides, history.png, importance.png, compare.md) under tune/<study>/."""
    return f"tune/{study}/{name}"


def compare_key(study: str) -> str:
    return f"compare/study={study}/compare.parquet"


def probe_key(token: str) -> str:
    """The small object written and deleted to check that an object store takes writes (hidden: no listing shows
    it)."""
    return f".fedharness-probe-{token}"
