"""Rounds to a target per run and replica, speedup and efficiency in n, and the log-log fit T = a n^-b.

Censoring: a replica that never reaches the target (the run ended, diverged or failed first) has an infinite
time to target. It is counted and shown, never dropped. The time to target of a cell (one design point, all its
seeds and replicas) is the median over replicas with censored ones at +infinity: this is the Kaplan-Meier
median when, as here, censoring happens at the end of a run, and it stays defined while fewer than half are
censored. A cell whose median is censored is left out of the fit, and the report says so.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from fedharness.errors import ConfigError
from fedharness.studies.reports.data import Results, design, scale_value

OPS = {"<=": operator.le, ">=": operator.ge}
_TARGET = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")
METRICS = ("train_loss", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss", "test_acc")


@dataclass(frozen=True)
class Target:
    metric: str
    op: str  # "<=" for a loss, ">=" for an accuracy
    value: float

    @property
    def label(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.metric}_{'le' if self.op == '<=' else 'ge'}_{self.value:g}")

    def reached(self, values: pd.Series) -> pd.Series:
        return OPS[self.op](values, self.value) & values.notna()


def parse_target(text: str) -> Target:
    """`train_loss<=0.5`, `test_acc>=0.8`, `subopt<=1e-3`."""
    m = _TARGET.match(text)
    if m is None or m.group(1) not in METRICS:
        raise ConfigError("--target", text, f"METRIC<=VALUE (a loss) or METRIC>=VALUE (an accuracy); "
                          f"metrics: {', '.join(METRICS)}")
    try:
        value = float(m.group(3))
    except ValueError:
        raise ConfigError("--target", text, "the threshold must be a number") from None
    return Target(m.group(1), m.group(2), value)


# ---------------------------------------------------------------- per run and replica

def replica_table(results: Results, series: str = "iterate") -> pd.DataFrame:
    """Every (run, replica) the results should hold, with its run's status and grid labels.

    Replicas come from the rounds a run wrote; a run that wrote none (failed at once) still counts
    its `n_replicas`, so that failures show up as censored rather than vanish.
    """
    rows = []
    seen = set()
    if len(results.rounds):
        r = results.rounds[results.rounds["series"] == series]
        seen = set(zip(r["run_id"], r["replica"]))
    have_rounds = {run for run, _ in seen}
    for run in results.runs.itertuples():
        if run.run_id in have_rounds:
            reps = sorted(rep for rid, rep in seen if rid == run.run_id)
        else:
            reps = list(range(int(run.n_replicas or 1)))
        for rep in reps:
            rows.append({"run_id": run.run_id, "replica": int(rep), "status": run.status})
    return pd.DataFrame(rows, columns=["run_id", "replica", "status"])


def time_to_target(results: Results, target: Target, series: str = "iterate") -> pd.DataFrame:
    """First evaluated round meeting the target, per (run, replica), with the local steps, MB and simulated
    seconds spent by then (from the run's own counters); censored replicas have reached=False and NaNs."""
    base = replica_table(results, series)
    cols = ["round", "local_steps", "grad_evals", "mb", "sim_s", "wall_s"]
    if not len(results.rounds):
        for c in cols:
            base[c] = np.nan
        base["reached"], base["last_round"] = False, np.nan
        return base
    r = results.rounds[results.rounds["series"] == series]
    if target.metric not in r.columns:
        raise ConfigError("--target", target.label, f"the results have no column {target.metric!r}")
    last = r.groupby(["run_id", "replica"])["round"].max().rename("last_round")
    hit = r[target.reached(r[target.metric].astype(float))]
    first = hit.groupby(["run_id", "replica"], sort=False).head(1).copy()  # rows are sorted by round
    first["mb"] = (first["bytes_up"].astype(float) + first["bytes_down"].astype(float)) / 1e6
    first = first.set_index(["run_id", "replica"])[["round", "local_steps", "grad_evals", "mb", "sim_s", "wall_s"]]
    out = base.join(first, on=["run_id", "replica"]).join(last, on=["run_id", "replica"])
    out["reached"] = out["round"].notna()
    for c in cols:
        out[c] = out[c].astype(float)
    return out


# ---------------------------------------------------------------- cells and groups

@dataclass
class Design:
    scale_key: str
    group_keys: list[str]
    tied_keys: list[str]

    def group_label(self, cfg: dict) -> str:
        return ", ".join(f"{k}={_short(cfg.get(k))}" for k in self.group_keys) or "all runs"


def _short(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def run_labels(results: Results, scale_key: str) -> tuple[pd.DataFrame, Design]:
    """Per run: its group label and its n."""
    group_keys, tied = design(results.runs, scale_key, results.manifests)
    d = Design(scale_key, group_keys, tied)
    labels = pd.DataFrame({
        "run_id": results.runs["run_id"],
        "group": [d.group_label(c) for c in results.runs["cfg"]],
        "n": [scale_value(c, scale_key) for c in results.runs["cfg"]],
        "algorithm": results.runs["algorithm"],
    })
    # Groups in the natural order of their keys' values (K = 1, 5, 20, not "1", "20", "5").
    values = {label: tuple(_sort_key(c.get(k)) for k in group_keys)
              for label, c in zip(labels["group"], results.runs["cfg"])}
    order = {label: i for i, label in enumerate(sorted(values, key=values.get))}
    labels["group_order"] = labels["group"].map(order)
    return labels, d


def _sort_key(v) -> tuple:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, str(v))


def median_censored(values: np.ndarray) -> float:
    """Median with censored values at +inf: finite while fewer than half are censored."""
    if len(values) == 0:
        return float("inf")
    return float(np.median(np.where(np.isnan(values), np.inf, values)))


def cell_table(ttt: pd.DataFrame, labels: pd.DataFrame) -> pd.DataFrame:
    """Per (group, n): replicas, reached, censored, and the median rounds / local steps / MB / seconds to target."""
    df = ttt.merge(labels, on="run_id")
    rows = []
    for (group, n), cell in df.groupby(["group", "n"], sort=True, dropna=False):
        reached = cell["reached"].to_numpy()
        row = {"group": group, "n": n, "runs": cell["run_id"].nunique(), "replicas": len(cell),
               "reached": int(reached.sum()), "censored": int((~reached).sum())}
        for col, name in (("round", "rounds"), ("local_steps", "local_steps"), ("mb", "MB"), ("sim_s", "sim_s")):
            row[name] = median_censored(cell[col].to_numpy(dtype=float))
        obs = cell.loc[reached, "round"].to_numpy(dtype=float)
        row["rounds_mean"] = float(obs.mean()) if len(obs) else np.nan
        row["rounds_std"] = float(obs.std(ddof=1)) if len(obs) > 1 else np.nan
        row["algorithm"] = ",".join(sorted(cell["algorithm"].dropna().unique()))
        rows.append(row)
    order = labels.drop_duplicates("group").set_index("group")["group_order"]
    out = pd.DataFrame(rows)
    if len(out):
        out = out.sort_values(["group", "n"], key=lambda col: col.map(order) if col.name == "group" else col,
                              kind="stable").reset_index(drop=True)
    return out


# What a time to target T can be measured in: the cells' column (cell_table) and the replicas' (time_to_target).
TIMES = {"rounds": "round", "sim_s": "sim_s"}


def speedup_table(cells: pd.DataFrame, time: str = "rounds") -> pd.DataFrame:
    """S(n) = T(n0) / T(n) and efficiency S(n) n0 / n, n0 the smallest n of the group with a finite T; T in
    rounds or in simulated seconds (`time`: a key of TIMES)."""
    out = []
    for group, g in cells.groupby("group", sort=False):
        g = g.sort_values("n")
        finite = g[fittable(g[time])]
        if len(finite):
            n0, t0 = float(finite["n"].iloc[0]), float(finite[time].iloc[0])
        for row in g.itertuples():
            t = getattr(row, time)
            ok = len(finite) and np.isfinite(t) and t > 0
            s = t0 / t if ok else np.nan
            out.append({"group": group, "n": row.n, time: t, "speedup": s,
                        "efficiency": s * n0 / row.n if ok else np.nan, "censored": row.censored,
                        "replicas": row.replicas})
    return pd.DataFrame(out)


def fittable(rounds: pd.Series) -> pd.Series:
    """Cells a log-log fit can use: a finite median, and not met already at round 0 (a target that loose says
    nothing about speed)."""
    return np.isfinite(rounds) & (rounds > 0)


def _left_out(g: pd.DataFrame, time: str = "rounds") -> str:
    why = [f"{n:g} ({'censored' if not np.isfinite(t) else 'met at round 0'})"
           for n, t in zip(g["n"], g[time]) if not (np.isfinite(t) and t > 0)]
    return ", ".join(why)


def fit_power_law(n: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """Least squares on log T = log a - b log n: returns (a, b)."""
    slope, intercept = np.polyfit(np.log(n), np.log(t), 1)
    return float(np.exp(intercept)), float(-slope)


def bootstrap_exponent(samples: list[np.ndarray], n: np.ndarray, reps: int = 1000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float, int]:
    """Percentile interval for b, resampling the replicas (seeds) of every cell with replacement.

    A resample whose median becomes censored (or 0) in some cell gives no b; the count of usable resamples is
    returned.
    """
    rng = np.random.default_rng(seed)
    bs = []
    logn = np.log(n)
    for _ in range(reps):
        meds = np.array([np.median(s[rng.integers(0, len(s), len(s))]) for s in samples])
        if np.all(np.isfinite(meds) & (meds > 0)):
            bs.append(-np.polyfit(logn, np.log(meds), 1)[0])
    if not bs:
        return float("nan"), float("nan"), 0
    lo, hi = np.percentile(bs, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(lo), float(hi), len(bs)


def fit_table(ttt: pd.DataFrame, labels: pd.DataFrame, cells: pd.DataFrame, reps: int = 1000,
              level: float = 0.95, time: str = "rounds") -> pd.DataFrame:
    """Per group: T = a n^-b over the cells with a finite median, b's bootstrap interval over seeds; T in rounds
    or in simulated seconds (`time`: a key of TIMES)."""
    df = ttt.merge(labels, on="run_id")
    out = []
    for group, g in cells.groupby("group", sort=False):
        use = g[fittable(g[time])].sort_values("n")
        row = {"group": group, "points": len(use), "left_out": _left_out(g, time)}
        if len(use) >= 2:
            n = use["n"].to_numpy(dtype=float)
            a, b = fit_power_law(n, use[time].to_numpy(dtype=float))
            samples = []
            for nv in n:
                vals = df[(df["group"] == group) & (df["n"] == nv)][TIMES[time]].to_numpy(dtype=float)
                samples.append(np.where(np.isnan(vals), np.inf, vals))
            lo, hi, used = bootstrap_exponent(samples, n, reps, level)
            row.update(a=a, b=b, b_lo=lo, b_hi=hi, level=level, bootstrap=used, bootstrap_asked=reps)
        else:
            row.update(a=np.nan, b=np.nan, b_lo=np.nan, b_hi=np.nan, level=level, bootstrap=0, bootstrap_asked=reps)
        out.append(row)
    return pd.DataFrame(out)


def curves(results: Results, labels: pd.DataFrame, metric: str, series: str = "iterate") -> pd.DataFrame:
    """Mean and standard deviation over replicas (all seeds of a cell) per (group, n, round), with the mean local
    steps and MB communicated (up + down, all clients) by then."""
    if not len(results.rounds) or metric not in results.rounds.columns:
        return pd.DataFrame(columns=["group", "n", "round", "mean", "std", "count", "local_steps", "mb"])
    r = results.rounds[results.rounds["series"] == series].merge(labels, on="run_id")
    r = r[r[metric].notna()]
    r = r.assign(mb=(r["bytes_up"].astype(float) + r["bytes_down"].astype(float)) / 1e6)
    agg = r.groupby(["group", "n", "round"]).agg(mean=(metric, "mean"), std=(metric, "std"),
                                                 count=(metric, "size"), local_steps=("local_steps", "mean"),
                                                 mb=("mb", "mean"))
    return agg.reset_index()


CLIENT_SPREAD = ("client_acc_p10", "client_acc_p50", "client_acc_p90", "client_acc_mean")  # eval.per_client's


def client_spread(results: Results, labels: pd.DataFrame, series: str = "iterate") -> pd.DataFrame:
    """Per (group, n, round): the per-client accuracy's percentiles and mean (eval.per_client), each averaged over
    the replicas that have it; empty when no run evaluated per client."""
    cols = ["group", "n", "round", *CLIENT_SPREAD]
    r = results.rounds
    if not len(r) or CLIENT_SPREAD[0] not in r.columns or r[CLIENT_SPREAD[0]].isna().all():
        return pd.DataFrame(columns=cols)
    r = r[(r["series"] == series) & r[CLIENT_SPREAD[0]].notna()].merge(labels, on="run_id")
    return r.groupby(["group", "n", "round"])[list(CLIENT_SPREAD)].mean().reset_index()[cols]
