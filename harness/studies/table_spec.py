"""A study table's spec and data (studies/tables.py runs it): the spec read from conf/table/, a seed row per finished
(run, replica), a cell's statistics over its seeds, and the cells' order.

A seed row starts from what every table can read: the run's flattened config keys (`systems.speed`), its problem
(data set) and target, `status`, `replica`, `reached`, `round` and the spec's `costs` to the target
(time_to_target's columns at the first evaluated round meeting it; NaN when censored), `last_round`, `last_sim_s`,
`sim_s_per_round` (last_sim_s / last_round), `participants` (its mean over rounds 1..last), the final `test_acc` and
each rounds/ column the spec's `read` names at that last evaluated round (NaN where null or absent: a per-client
statistic the run did not compute); the spec's measures and fields add to it. A cell's statistics (seed_stats) are
the seeds, the seeds that reached the target, the last round, whether a seed diverged, mean and std (ddof 1) of the
final test accuracy (%) over every seed and of each `to_target` column over the seeds that reached the target only
(a censored seed has no value to average).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from fedharness.config.compose import CONF_DIR, group_options, user_config_dirs
from fedharness.errors import require
from fedharness.studies.reports.analysis import Target, parse_target, time_to_target
from fedharness.studies.reports.data import Results
from fedharness.studies.table_text import matches, text

SPEC_KEYS = {"description", "sweep", "out", "include", "status", "targets", "costs", "read", "fields", "measures",
             "cell", "carry", "to_target", "means", "stds", "baseline", "order", "tables", "columns", "pivot",
             "figure"}


# ---------------------------------------------------------------- the spec

def read_spec(name: str) -> dict[str, Any]:
    """conf/table/NAME.yaml (or one in a $FEDHARNESS_CONFIG_PATH folder's table/, or a path to a YAML file), over
    the files its `include` names (their fields first, their other keys as defaults)."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        found = [p for d in (CONF_DIR, *user_config_dirs()) if (p := Path(d) / "table" / f"{name}.yaml").is_file()]
        require(bool(found), "table", name, group_options("table") or "(no specs in conf/table)")
        path = found[0]
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    require(isinstance(spec, dict), "table", name, f"{path} must hold a mapping")
    unknown = sorted(set(spec) - SPEC_KEYS)
    require(not unknown, f"table {path.stem}", unknown, "keys: " + ", ".join(sorted(SPEC_KEYS)))
    for other in spec.pop("include", []):
        base = read_spec(other)
        spec = {**base, **spec, "fields": {**base.get("fields", {}), **spec.get("fields", {})}}
    return spec


# ---------------------------------------------------------------- seed rows

@dataclass(frozen=True)
class Replica:
    """One finished (run, replica): its problem and target, the run's runs/ row, its last evaluated iterate round
    and, where the problem has a target, its time_to_target row."""

    problem: str
    target: Target | None
    run: Any  # the runs/ row, a namedtuple of DataFrame.itertuples
    replica: int
    last: pd.Series
    hit: pd.Series | None
    store: Any = None  # the results directory (measures that read more than runs/ and rounds/)

    def cells(self, costs: list[str]) -> dict[str, Any]:
        """The columns every seed row has; censored or target-less: reached False and NaN round and costs."""
        hit = self.hit
        return {"problem": self.problem, "target": self.target.label if self.target else "",
                "run_id": self.run.run_id, "replica": self.replica, "status": self.run.status,
                "reached": bool(hit["reached"]) if hit is not None else False,
                **{c: float(hit[c]) if hit is not None else np.nan for c in ["round", *costs]},
                "last_round": int(self.last["round"]), "test_acc": float(self.last["test_acc"])}


def iterate_rounds(results: Results) -> pd.DataFrame:
    """The rounds/ rows of the iterate series: the model the tables and figures describe."""
    return results.rounds[results.rounds["series"] == "iterate"]


def replicas(results: Results, targets: dict[str, str], status: list[str]) -> Iterator[Replica]:
    """Each replica of each run of a `status` (ok, diverged: its seeds stop early), problem (data set) by problem
    in the order the runs first name them; time_to_target runs once per problem, as its target is per problem."""
    runs = results.runs[results.runs["status"].isin(status)]
    rounds = iterate_rounds(results)
    last = rounds[rounds["round"] == rounds.groupby(["run_id", "replica"])["round"].transform("max")]
    for problem, group in runs.groupby(runs["cfg"].map(lambda cfg: str(cfg.get("dataset.name"))), sort=False):
        target = parse_target(targets[problem]) if problem in targets else None
        sub = Results(results.store, group, rounds[rounds["run_id"].isin(group["run_id"])])
        ttt = time_to_target(sub, target) if target is not None else None
        for run in group.itertuples():
            fin = last[last["run_id"] == run.run_id].set_index("replica")
            hit = ttt[ttt["run_id"] == run.run_id].set_index("replica") if ttt is not None else None
            for rep, row in fin.iterrows():
                yield Replica(problem, target, run, int(rep), row, hit.loc[rep] if hit is not None else None,
                              results.store)


TYPES = {"float": lambda v: math.nan if v is None else float(v), "int": int, "str": str, "bool": bool}


def field_value(spec: Any, names: Mapping[str, Any]) -> Any:
    """A field of a seed row: its first alternative whose `when` holds. An alternative reads a config `key` (or a
    `value`, a template), falls back to `default` where that is null or empty, looks it up in `map` (`otherwise`
    where absent) and converts it to `type`."""
    for alt in spec if isinstance(spec, list) else [spec]:
        if not matches(names, alt.get("when", {})):
            continue
        value = names.get(alt["key"]) if "key" in alt else alt.get("value")
        value = text(value, names) if isinstance(value, str) and "key" not in alt else value
        if value in (None, "") and "default" in alt:
            value = text(alt["default"], names) if isinstance(alt["default"], str) else alt["default"]
        if "map" in alt:
            other = alt.get("otherwise")
            value = alt["map"].get(value, text(other, names) if isinstance(other, str) else other)
        return TYPES[alt["type"]](value) if "type" in alt else value
    return None


def fields(spec: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields of a run's `names` (its flattened config and seed row), each seeing those before it."""
    out: dict[str, Any] = {}
    for name, field in spec.get("fields", {}).items():
        out[name] = names[name] = field_value(field, names)
    return out


def _number(value: Any) -> float:
    return math.nan if value is None or pd.isna(value) else float(value)


def seed_rows(spec: dict[str, Any], results: Results, targets: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per finished (run, replica): the common columns (module doc), the spec's measures and fields."""
    rounds = iterate_rounds(results)
    trained = rounds[rounds["round"] >= 1]  # round 0 is the initial model's evaluation: no one took part
    participants = trained.groupby(["run_id", "replica"])["participants"].mean()
    cache: dict[str, Any] = {}
    rows = []
    for rep in replicas(results, {**spec.get("targets", {}), **(targets or {})},
                        spec.get("status", ["ok", "diverged"])):
        row = {**rep.cells(spec.get("costs", [])), "last_sim_s": float(rep.last["sim_s"]),
               "participants": float(participants.get((rep.run.run_id, rep.replica), math.nan))}
        row["sim_s_per_round"] = row["last_sim_s"] / row["last_round"] if row["last_round"] else math.nan
        row.update({c: _number(rep.last.get(c)) for c in spec.get("read", [])})
        for measure in spec.get("measures", []):
            row.update(MEASURES[measure].seed(rep, cache))
        rows.append({**row, **fields(spec, {**rep.run.cfg, **row})})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- statistics over seeds

def seed_stats(g: pd.DataFrame, **to_target: str) -> dict[str, Any]:
    """A cell's statistics over its seeds `g` (module doc); `to_target` maps a name to its seed column."""
    hit = g[g["reached"]]
    out: dict[str, Any] = {"seeds": len(g), "reached": len(hit), "last_round": int(g["last_round"].max()),
                           "diverged": bool((g["status"] == "diverged").any())}
    for name, column in to_target.items():
        out[f"{name}_mean"], out[f"{name}_std"] = hit[column].mean(), hit[column].std()
    return {**out, "acc_mean": 100 * g["test_acc"].mean(), "acc_std": 100 * g["test_acc"].std()}


def order(spec: dict[str, Any], df: pd.DataFrame) -> pd.DataFrame:
    """`df` sorted (stably) by the spec's `order`: a field by its value (NaN last, or first with `nan: first`),
    or by its place in `rank` (values not listed after those listed); `template` sorts by a text of the row."""
    keys = []
    for i, entry in enumerate(spec.get("order", [])):
        entry = {"field": entry} if isinstance(entry, str) else entry
        values = (df[entry["field"]] if "field" in entry else
                  pd.Series([text(entry["template"], r) for r in df.to_dict("records")], index=df.index))
        if "rank" in entry:
            values = values.map(lambda v, rank=entry["rank"]: rank.index(v) if v in rank else len(rank))
        elif entry.get("nan") == "first":
            values = values.fillna(-math.inf)
        df = df.assign(**{f"_o{i}": values})
        keys.append(f"_o{i}")
    return df.sort_values(keys, kind="stable").drop(columns=keys) if keys else df


def summary(spec: dict[str, Any], seeds: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (the spec's `cell` keys): the keys, the `carry` columns of its first seed, its statistics,
    the mean over seeds of each `means` column and the std (ddof 1) of each `stds` column (a mapping name: seed
    column, or a list of seed columns named as themselves), the measures' columns and the `baseline`, in
    `order`."""
    keys, rows = spec["cell"], []
    for key, g in seeds.groupby(keys, sort=False, dropna=False):
        first = g.iloc[0]
        row = {**dict(zip(keys, key)), **{c: first[c] for c in spec.get("carry", [])},
               **seed_stats(g, **spec.get("to_target", {})),
               **{name: g[column].mean() for name, column in _named(spec.get("means", {})).items()},
               **{name: g[column].std() for name, column in _named(spec.get("stds", {})).items()}}
        for measure in spec.get("measures", []):
            row.update(MEASURES[measure].cell(g))
        rows.append(row)
    table = order(spec, pd.DataFrame(rows)).reset_index(drop=True)
    if "baseline" in spec:  # the baseline row's `stat` (the one matching the row on `match`) over the row's `of`
        b = spec["baseline"]  # (default: stat), or with `op: difference` the row's `of` less the baseline's `stat`
        base = table[[matches(r, b["where"]) for r in table.to_dict("records")]].set_index(b["match"])[b["stat"]]
        base = base[~base.index.duplicated()]
        key = (lambda r: tuple(r[m] for m in b["match"])) if len(b["match"]) > 1 else (lambda r: r[b["match"][0]])
        rows = [(base.get(key(r), math.nan), r[b.get("of", b["stat"])])
                for r in table.to_dict("records")]
        table[b["name"]] = [own - of_base if b.get("op") == "difference" else of_base / own
                            for of_base, own in rows]
    return table


def _named(columns: dict[str, str] | list[str]) -> dict[str, str]:
    return columns if isinstance(columns, dict) else {c: c for c in columns}


# ---------------------------------------------------------------- measures a spec adds by name

VALUE_BYTES = {"float32": 4, "float64": 8}


def dense_bytes(config: dict) -> int:
    """The dense model's bytes (what each sampled client downloads): its dim times the dtype's bytes, from the
    run's own problem, built again."""
    from fedharness.config.load import recorded_settings
    from fedharness.problems import build_problem

    settings = recorded_settings(config)  # recorded by an earlier version, perhaps: keys added since take defaults
    problem = build_problem(settings, config["algorithm"]["batch_size"])
    return int(problem.dim) * VALUE_BYTES[config["dtype"]]


class Upload:
    """The bytes a client sends a round: bytes_up over the uploads, the uploads counted as bytes_down over the
    dense model's bytes (`up_per_client`, `dense_bytes` a seed; `up_bytes`, `up_share` of the dense, a cell)."""

    @staticmethod
    def seed(rep: Replica, cache: dict[str, Any]) -> dict[str, float]:
        cfg = rep.run.cfg  # the dense bytes by the keys that fix the model: building a problem is slow
        key = json.dumps([cfg.get(k) for k in sorted(cfg) if k.startswith(("dataset.", "model.", "partition."))]
                         + [cfg.get("algorithm.batch_size"), cfg.get("dtype")], default=str)
        if key not in cache:
            cache[key] = dense_bytes(json.loads(rep.run.config_json))
        up, down = int(rep.last["bytes_up"]), int(rep.last["bytes_down"])
        return {"up_per_client": up * cache[key] / down if down else math.nan, "dense_bytes": cache[key]}

    @staticmethod
    def cell(g: pd.DataFrame) -> dict[str, float]:
        up = g["up_per_client"].unique()
        return {"up_bytes": float(up[0]) if len(up) == 1 else math.nan,
                "up_share": float(up[0]) / g["dense_bytes"].iloc[0] if len(up) == 1 else math.nan}


class Benign:
    """An attack.fixed run's benign clients (eval.clients_table): each protocol's mean accuracy over the training
    clients never Byzantine (algorithms/byzantine.py fixed_byzantine, of the run's seed and the replica) that have
    held-out samples, at the last evaluated round (`benign_global`, `benign_finetune`, `benign_personal`, NaN where
    the run did not score the protocol or wrote no clients/; a cell: their means over seeds and `_std`s, ddof 1)."""

    PROTOCOLS = ("global", "finetune", "personal")

    @staticmethod
    def seed(rep: Replica, cache: dict[str, Any]) -> dict[str, float]:
        from fedharness.algorithms.byzantine import fixed_byzantine
        from fedharness.results import layout
        from fedharness.results.tables import read_run_table, run_table_keys

        cfg, run_id = rep.run.cfg, rep.run.run_id
        if ("clients", run_id) not in cache:
            cache["clients", run_id] = read_run_table(rep.store, run_table_keys(rep.store, layout.CLIENTS, [run_id]))
        rows = cache["clients", run_id]
        if not len(rows):  # a run without clients/ (eval.clients_table=false): no client's score to read
            return {f"benign_{p}": math.nan for p in Benign.PROTOCOLS}
        n = int(cfg["dataset.num_clients"])
        training = n - math.floor(float(cfg.get("dataset.unseen_clients") or 0) * n)
        bad = (fixed_byzantine(float(cfg["attack.fraction"]), int(cfg["seed"]), rep.replica, training)
               if cfg.get("attack.fixed") else np.array([], dtype=np.int64))
        rows = rows[(rows["replica"] == rep.replica) & (rows["round"] == int(rep.last["round"]))
                    & (rows["client"] < training) & ~rows["client"].isin(bad) & rows["acc"].notna()]
        return {f"benign_{p}": _number(rows.loc[rows["protocol"] == p, "acc"].mean()) for p in Benign.PROTOCOLS}

    @staticmethod
    def cell(g: pd.DataFrame) -> dict[str, float]:
        out = {}
        for p in Benign.PROTOCOLS:
            out[f"benign_{p}"], out[f"benign_{p}_std"] = g[f"benign_{p}"].mean(), g[f"benign_{p}"].std()
        return out


MEASURES = {"upload": Upload, "benign": Benign}
