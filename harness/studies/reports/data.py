"""Read a results directory (runs/, rounds/, sweeps/; a folder or an object store) into pandas, and find what
varies between runs. The tables are read by harness/results/tables.py, as the Python API reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from fedharness.base.mappings import flatten
from fedharness.errors import ConfigError, require
from fedharness.results import layout
from fedharness.results.store import FileStore, ResultsStore, open_store
from fedharness.results.tables import read_run_table, run_table_keys
from fedharness.runs.lifecycle import mark_lost_runs

# Keys that do not change a trajectory, or that identify a run rather than a design point.
IGNORED = ("seed", "results_dir", "study", "experiment", "progress", "executor", "num_shards", "threads", "device",
           "trial", "eval_every", "heterogeneity", "checkpoint_every", "resume")
IGNORED_PREFIXES = ("wandb.", "ray.")
# When a key is fixed by the others (theory step sizes follow K and n; a horizon zipped with n), these go first.
DERIVED_FIRST = ("algorithm.client_lr", "algorithm.server_lr", "rounds")


@dataclass
class Results:
    store: ResultsStore  # the results directory, opened once for the whole report
    runs: pd.DataFrame  # one row per run; `cfg` holds the flattened config dict
    rounds: pd.DataFrame  # one row per (run, replica, series, evaluated round)
    manifests: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unreadable Parquet files, with why

    @property
    def root(self) -> str:
        """The results directory: an absolute path or an object-store URL."""
        return self.store.url


def report_dir(store: ResultsStore) -> Path:
    """Where `fedharness report` writes without --out: RESULTS_DIR/report for a folder; for an object store,
    `report` in the working directory (the figures and Markdown are read here)."""
    return store.root / layout.REPORT if isinstance(store, FileStore) else Path(layout.REPORT)


def _open(results_dir: str | Path) -> ResultsStore:
    """The store, with the runs a killed process left `running` marked lost, so the report counts them as lost;
    an object store that cannot be reached or refuses the credentials is one line naming RESULTS_DIR."""
    store = open_store(results_dir)
    try:
        mark_lost_runs(store)
    except OSError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError("RESULTS_DIR", str(results_dir), f"a results directory fedharness can read; {first}") \
            from None
    return store


def load_results(results_dir: str | Path, study: str | None = None) -> Results:
    """All runs (any status) and their evaluated rounds; `study` keeps one study's runs. The results directory's
    store is opened here, once for the whole report, and kept in the Results."""
    store = _open(results_dir)
    run_keys = run_table_keys(store, layout.RUNS)
    require(len(run_keys) > 0, "RESULTS_DIR", str(results_dir),
            "a results directory with runs/ (and rounds/) written by fedharness run/sweep")
    skipped: list[str] = []
    runs = read_run_table(store, run_keys, skipped)
    require(len(runs) > 0, "RESULTS_DIR", str(results_dir), "holds no runs")
    if study is not None:
        studies = sorted(runs["study"].dropna().unique())
        require(study in studies, "--study", study, studies)
        runs = runs[runs["study"] == study]
    runs = runs.reset_index(drop=True)
    runs["cfg"] = [flatten(json.loads(c)) if isinstance(c, str) else {} for c in runs["config_json"]]
    keep = set(runs["run_id"])
    round_keys = [k for k in run_table_keys(store, layout.ROUNDS) if layout.run_of(k) in keep]
    rounds = read_run_table(store, round_keys, skipped)
    if len(rounds):
        rounds = rounds.sort_values(["run_id", "series", "replica", "round"], kind="stable").reset_index(drop=True)
    manifests = []
    for key in filter(layout.is_manifest, store.list(layout.SWEEPS)):
        data = json.loads(store.read(key) or b"{}")
        if study is None or data.get("name") == study:
            manifests.append(data)
    return Results(store, runs, rounds, manifests, skipped)


def _hashable(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def _ignored(key: str) -> bool:
    return key in IGNORED or key.startswith(IGNORED_PREFIXES)


def varying_keys(runs: pd.DataFrame) -> list[str]:
    """Config keys whose value differs between runs (in first-seen order), leaving out run-identity keys."""
    keys: dict[str, set] = {}
    for cfg in runs["cfg"]:
        for k in cfg:
            keys.setdefault(k, set())
    for cfg in runs["cfg"]:
        for k in keys:
            keys[k].add(_hashable(cfg.get(k)))
    return [k for k, vals in keys.items() if len(vals) > 1 and not _ignored(k)]


def _determined(runs: pd.DataFrame, key: str, by: list[str]) -> bool:
    """True when `key` takes one value within every cell of `by` (so it adds no grouping)."""
    seen: dict[tuple, Any] = {}
    for cfg in runs["cfg"]:
        cell = tuple(_hashable(cfg.get(k)) for k in by)
        v = _hashable(cfg.get(key))
        if seen.setdefault(cell, v) != v:
            return False
    return True


def design(runs: pd.DataFrame, scale_key: str, manifests: list[dict]) -> tuple[list[str], list[str]]:
    """(group keys, keys tied to the others). Groups are curves T(n); a key tied to n and the group keys
    (a horizon zipped with n, step sizes the protocol derived from K and n) does not split them."""
    varying = [k for k in varying_keys(runs) if k != scale_key]
    grid_keys = {k for m in manifests for k in m.get("grid_keys", [])}
    grid_keys |= {f"{k}.name" for k in grid_keys}  # `partition=iid` in a grid is the key partition.name

    def rank(k: str) -> tuple:  # removal order: derived keys, then keys no sweep listed, then grid keys
        return (0 if k in DERIVED_FIRST else 1 if k not in grid_keys else 2, 1 if k.endswith(".name") else 0)

    group = list(varying)
    tied = []
    for key in sorted(varying, key=rank):
        others = [k for k in group if k != key]
        if _determined(runs, key, [scale_key, *others]):
            group.remove(key)
            tied.append(key)
    return group, tied


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_scale_key(runs: pd.DataFrame, scale_key: str) -> None:
    """n must be a number in every run's config; otherwise name the numeric keys that vary between runs."""
    if all(_number(scale_value_raw(cfg, scale_key)) for cfg in runs["cfg"]):
        return
    usable = [k for k in varying_keys(runs) if all(_number(cfg.get(k)) for cfg in runs["cfg"])]
    raise ConfigError("--scale-key", scale_key, "a config key that is a number in every run; numeric keys that "
                      f"vary between these runs: {', '.join(usable) or 'none (every run has the same n)'}")


def scale_value_raw(cfg: dict[str, Any], scale_key: str) -> Any:
    v = cfg.get(scale_key)
    if scale_key == "algorithm.clients_per_round" and cfg.get("algorithm.sampler") == "full":
        v = cfg.get("dataset.num_clients")  # full participation: n is every client (Yang et al.'s m)
    return v


def scale_value(cfg: dict[str, Any], scale_key: str) -> float | None:
    v = scale_value_raw(cfg, scale_key)
    return None if v is None else float(v)
