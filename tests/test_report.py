"""`fedharness report`: from a results directory written by a sweep in a subprocess, the tables match a direct
computation from the Parquet rows (duckdb, not the report's code), censored replicas are counted and shown, and
the fit and its bootstrap interval behave on data whose answer is known."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from fedharness.errors import ConfigError
from fedharness.studies.reports.analysis import bootstrap_exponent, fit_power_law, median_censored, parse_target

SWEEP = """
name: rep
base:
  dataset: quadratic
  dataset.num_clients: 20
  dataset.noise: 2.0
  dataset.data_seed: 0
  algorithm.sampler: scheme_ii
  algorithm.local_steps: 5
  rounds: 30
  eval_every: 1
  replicas: 6
grid:
  algorithm: [fedavg, scaffold]
  algorithm.clients_per_round: [1, 4, 20]
  algorithm.client_lr: [0.05, 0.05, 50.0]   # n = 20 at a step far beyond 2/L: these runs diverge
zip: [[algorithm.clients_per_round, algorithm.client_lr]]
report:
  targets: ["subopt<=0.1"]
  bootstrap: 200
"""
TARGET = 0.1


def fedharness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedharness.cli", *args], capture_output=True, text=True, timeout=300)


def direct_time_to_target(results: Path) -> pd.DataFrame:
    """Per (algorithm, n): replicas, censored, and medians (censored = inf) straight from the Parquet files."""
    con = duckdb.connect()
    runs = con.sql(f"""
        SELECT run_id, status, n_replicas,
               json_extract_string(config_json, '$.algorithm.name') AS algorithm,
               CAST(json_extract(config_json, '$.algorithm.clients_per_round') AS DOUBLE) AS n
        FROM read_parquet('{results}/runs/*/*.parquet', hive_partitioning = true)""").df()
    rounds = con.sql(f"""
        SELECT run_id, replica, round, subopt, (bytes_up + bytes_down) / 1e6 AS mb, sim_s
        FROM read_parquet('{results}/rounds/*/*.parquet', hive_partitioning = true)
        WHERE series = 'iterate'""").df()
    first = con.sql(f"""
        SELECT run_id, replica, arg_min(round, round) AS t, arg_min(mb, round) AS mb, arg_min(sim_s, round) AS s
        FROM rounds WHERE subopt <= {TARGET} GROUP BY run_id, replica""").df()
    seen = rounds[["run_id", "replica"]].drop_duplicates()
    # A run with no rounds (it failed at once) still has its n_replicas replicas, all censored.
    empty = runs[~runs["run_id"].isin(seen["run_id"])]
    missing = pd.DataFrame([(r.run_id, k) for r in empty.itertuples() for k in range(r.n_replicas)],
                           columns=["run_id", "replica"])
    reps = pd.concat([seen, missing]).merge(first, how="left", on=["run_id", "replica"]).merge(runs, on="run_id")
    rows = []
    for (alg, n), g in reps.groupby(["algorithm", "n"]):
        med = {c: float(np.median(g[c].fillna(np.inf))) for c in ("t", "mb", "s")}
        rows.append({"algorithm": alg, "n": n, "replicas": len(g), "censored": int(g["t"].isna().sum()), **med})
    return pd.DataFrame(rows)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 18 s idle
def test_report_from_a_sweep_in_a_subprocess_matches_the_parquet_rows(tmp_path):
    (tmp_path / "rep.yaml").write_text(SWEEP)
    results = tmp_path / "res"
    sweep = fedharness("sweep", f"sweep={tmp_path / 'rep.yaml'}", f"results_dir={results}", "sweep.runner=local")
    assert sweep.returncode == 0, sweep.stderr  # a diverged run is a result, not a failure
    assert "2 diverged, 4 ok" in sweep.stdout, sweep.stdout
    rep = fedharness("report", str(results))  # targets and bootstrap come from the sweep's own settings
    assert rep.returncode == 0, rep.stderr

    direct = direct_time_to_target(results)
    table = pd.read_csv(results / "report" / "tables" / "to_target_subopt_le_0.1.csv")
    merged = table.merge(direct, on=["algorithm", "n"], validate="one_to_one")
    assert len(merged) == len(direct) == 6
    assert (merged["replicas_x"] == merged["replicas_y"]).all()
    assert (merged["censored_x"] == merged["censored_y"]).all()
    for mine, theirs in (("rounds", "t"), ("MB", "mb"), ("sim_s", "s")):
        np.testing.assert_allclose(merged[mine].astype(float), merged[theirs], rtol=1e-12)
    # The diverged runs (n = 20) count as censored, and the report says how many replicas were censored.
    assert (merged.loc[merged["n"] == 20, "censored_x"] == 6).all()
    censored = int(direct["censored"].sum())
    md = (results / "report" / "report.md").read_text()
    assert f"**Censored: {censored} of 36 replicas**" in md
    assert "diverged" in md
    assert f"{censored} of 36 replicas censored" in rep.stdout
    for png in (results / "report" / "figures").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert sorted(p.stem for p in (results / "report" / "figures").glob("*.png")) == [
        "collapse_subopt", "communication_subopt", "convergence_subopt", "cost_subopt_le_0.1",
        "speedup_sim_s_subopt_le_0.1", "speedup_subopt_le_0.1"]
    assert "![speedup_subopt_le_0.1](figures/speedup_subopt_le_0.1.png)" in md


def test_fit_recovers_a_known_exponent_and_its_interval_covers_it():
    rng = np.random.default_rng(1)
    n = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    samples = [np.round(400 * k ** -0.7 * rng.lognormal(0, 0.1, 64)) for k in n]
    a, b = fit_power_law(n, np.array([np.median(s) for s in samples]))
    lo, hi, used = bootstrap_exponent(samples, n, reps=400)
    assert used == 400 and lo < 0.7 < hi and hi - lo < 0.1
    assert b == pytest.approx(0.7, abs=0.03) and a == pytest.approx(400, rel=0.1)


def test_censored_median_is_finite_only_while_fewer_than_half_are_censored():
    assert median_censored(np.array([3.0, 5.0, np.nan])) == 5.0
    assert median_censored(np.array([3.0, np.nan, np.nan])) == np.inf
    assert median_censored(np.array([3.0, 4.0, np.nan, np.nan])) == np.inf


def test_targets_parse_with_their_direction():
    t = parse_target("test_acc>=0.8")
    assert (t.metric, t.op, t.value) == ("test_acc", ">=", 0.8)
    assert list(t.reached(pd.Series([0.7, 0.8, None, 0.9]))) == [False, True, False, True]
    assert parse_target(" subopt <= 1e-3 ").value == 1e-3
    for bad in ("train_loss<0.5", "accuracy>=0.9", "train_loss<=abc"):
        with pytest.raises(ConfigError, match="--target"):
            parse_target(bad)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_report_command_names_a_bad_directory(tmp_path):
    out = fedharness("report", str(tmp_path / "nothing"), "--target", "train_loss<=1")
    assert out.returncode == 2 and "RESULTS_DIR" in out.stderr
    assert textwrap.shorten(out.stderr, 300).count("Traceback") == 0


@pytest.fixture(scope="module")
def diverged_group(tmp_path_factory) -> Path:
    """fedavg at n = 1, 2, 4 (ok), and a fednova group at n = 2, 4 that diverges before its first evaluation
    after round 0 (eval_every=10, a client step size of 50)."""
    from fedharness.config.load import load_settings
    from fedharness.runs.execute import execute

    results = tmp_path_factory.mktemp("diverged") / "res"
    base = [f"results_dir={results}", "progress=false", "dataset=quadratic", "dataset.num_clients=10", "rounds=20",
            "replicas=2", "algorithm.sampler=scheme_ii"]
    for n in (1, 2, 4):
        assert execute(load_settings([*base, f"algorithm.clients_per_round={n}", "eval_every=1"])).status == "ok"
    for n in (2, 4):
        cfg = load_settings([*base, "algorithm=fednova", "algorithm.sampler=scheme_ii", f"algorithm.clients_per_round={n}",
                           "eval_every=10", "algorithm.client_lr=50"])
        assert execute(cfg).status == "diverged"
    return results


def _copy(results: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(results, tmp_path / "res"))


def _report(results: Path, *args: str) -> int:
    from fedharness.cli import main

    return main(["report", str(results), "--target", "subopt<=0.5", *args])


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 6 s idle
def test_report_counts_runs_that_diverged_before_their_first_evaluation_as_censored(diverged_group, tmp_path):
    results = _copy(diverged_group, tmp_path)
    assert _report(results) == 0
    cells = pd.read_csv(results / "report" / "tables" / "to_target_subopt_le_0.5.csv")
    fednova = cells[cells["algorithm"] == "fednova"]
    assert list(fednova["n"]) == [2.0, 4.0] and (fednova["censored"] == 2).all() and (fednova["reached"] == 0).all()
    for png in ("collapse_subopt", "convergence_subopt", "communication_subopt", "speedup_subopt_le_0.5"):
        assert (results / "report" / "figures" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_names_and_skips_a_truncated_part(diverged_group, tmp_path, capsys):
    results = _copy(diverged_group, tmp_path)
    part = sorted((results / "rounds").glob("run_id=*/part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    assert _report(results) == 0
    assert f"skipped an unreadable file, {part}: ArrowInvalid" in capsys.readouterr().err
    assert f"* `{part}: ArrowInvalid" in (results / "report" / "report.md").read_text()
    replicas = pd.read_csv(results / "report" / "tables" / "replicas_subopt_le_0.5.csv")
    lost = replicas[replicas["run_id"] == part.parent.name.split("=", 1)[1]]
    assert len(lost) == 2 and not lost["reached"].any()  # its replicas count as censored, not vanish


def test_report_bad_scale_key_lists_the_usable_ones_and_writes_nothing(diverged_group, tmp_path, capsys):
    results = _copy(diverged_group, tmp_path)
    assert _report(results, "--scale-key", "nosuch") == 2
    err = capsys.readouterr().err
    assert "'--scale-key': 'nosuch'" in err and "algorithm.clients_per_round" in err
    assert _report(results, "--scale-key", "algorithm.name") == 2  # a key, but not a number
    assert sorted(p.name for p in results.iterdir()) == ["rounds", "runs"]


def test_report_that_fails_midway_leaves_no_half_written_folder(diverged_group, tmp_path, monkeypatch):
    from fedharness.studies.reports import plots

    results = _copy(diverged_group, tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(plots, "speedup", broken)
    with pytest.raises(RuntimeError, match="plot failed"):
        _report(results)
    assert sorted(p.name for p in results.iterdir()) == ["rounds", "runs"]  # no report/, no staging folder


def test_report_draws_the_accuracy_over_clients(run_config, tmp_path):
    from fedharness.runs.execute import execute
    from fedharness.studies.reports.data import load_results
    from fedharness.studies.reports.report import build_report

    for k in (2, 4):
        execute(run_config("dataset=synthetic", "dataset.num_clients=8", "rounds=4", "eval_every=2", "replicas=2",
                           f"algorithm.clients_per_round={k}", "eval.per_client=true"))
    report = build_report(load_results(tmp_path / "results"), targets=[], scale_key="algorithm.clients_per_round",
                          out_dir=tmp_path / "report", bootstrap=10)
    table = report.tables["client_acc"]
    rounds = pd.read_parquet(tmp_path / "results" / "rounds")
    runs = pd.read_parquet(tmp_path / "results" / "runs")
    n_of = {r.run_id: float(json.loads(r.config_json)["algorithm"]["clients_per_round"]) for r in runs.itertuples()}
    rounds["n"] = rounds["run_id"].astype(str).map(n_of)
    want = rounds.groupby(["n", "round"])[["client_acc_p10", "client_acc_p90"]].mean().reset_index()
    got = table.merge(want, on=["n", "round"], suffixes=("", "_want"))
    assert len(got) == len(table) == 2 * 3  # n = 2, 4; rounds 0, 2, 4
    assert np.allclose(got.client_acc_p10, got.client_acc_p10_want, rtol=1e-12)
    assert np.allclose(got.client_acc_p90, got.client_acc_p90_want, rtol=1e-12)
    assert (tmp_path / "report" / "figures" / "client_acc.png").stat().st_size > 1000
    assert "## Accuracy over clients" in (tmp_path / "report" / "report.md").read_text()


def test_speedup_figure_draws_censored_cells_at_the_top_edge_not_at_a_made_up_height(tmp_path, monkeypatch):
    from fedharness.studies.reports import plots
    from fedharness.studies.reports.analysis import parse_target

    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault("fig", fig) and path)
    cells = pd.DataFrame({"group": ["fedavg"] * 4, "n": [1, 2, 4, 8], "rounds": [40.0, 20.0, np.inf, np.inf]})
    fits = pd.DataFrame({"group": ["fedavg"], "a": [40.0], "b": [1.0], "b_lo": [0.9], "b_hi": [1.1]})
    plots.speedup(cells, fits, parse_target("subopt<=1e-3"), "algorithm.clients_per_round", tmp_path / "s.png")
    ax = drawn["fig"].axes[0]
    (marks,) = [line for line in ax.get_lines() if "censored" in line.get_label()]
    assert list(marks.get_xdata()) == [4, 8]
    # y = 1 in the axis' own coordinates: the top edge, whatever the rounds' scale; the axis range is the reached
    # cells' alone (40 and 20 rounds), not stretched to hold a fictitious number of rounds
    assert list(marks.get_ydata()) == [1.0, 1.0]
    assert marks.get_transform() == ax.get_xaxis_transform()
    assert ax.get_ylim()[1] < 60
    assert "subopt<=0.001" in marks.get_label() or "subopt<=1e-3" in marks.get_label()


def test_report_puts_the_mb_sent_on_the_x_axis_of_a_communication_plot(run_config, tmp_path):
    """Compressed and dense runs: each curve's x is the mean over replicas of (bytes_up + bytes_down) / 1e6 by that
    round, as the rows recorded it (top-k sends a fraction of the dense bytes up)."""
    from fedharness.runs.execute import execute
    from fedharness.studies.reports import analysis
    from fedharness.studies.reports.data import load_results
    from fedharness.studies.reports.report import build_report

    for option in ("compress=none", "compress=topk"):
        execute(run_config("dataset=synthetic", "dataset.num_clients=8", "rounds=4", "eval_every=2", "replicas=2",
                           "algorithm.clients_per_round=4", option))
    results = load_results(tmp_path / "results")
    report = build_report(results, targets=[], scale_key="algorithm.clients_per_round", out_dir=tmp_path / "report",
                          bootstrap=10)
    labels, _ = analysis.run_labels(results, "algorithm.clients_per_round")
    curves = analysis.curves(results, labels, "train_loss")
    rounds = pd.read_parquet(tmp_path / "results" / "rounds")
    rounds["mb"] = (rounds["bytes_up"] + rounds["bytes_down"]) / 1e6
    names = {r.run_id: (json.loads(r.config_json).get("compress") or {}).get("name", "none")
             for r in pd.read_parquet(tmp_path / "results" / "runs").itertuples()}
    rounds["compress"] = rounds["run_id"].astype(str).map(names)
    want = rounds.groupby(["compress", "round"])["mb"].mean()
    assert sorted(curves["group"].unique()) == ["compress.name=none", "compress.name=topk"]
    for row in curves.itertuples():
        assert row.mb == pytest.approx(want[(row.group.split("=")[1], row.round)], rel=1e-12)
    final = curves[curves["round"] == 4].set_index("group")["mb"]
    assert final["compress.name=topk"] < 0.6 * final["compress.name=none"]  # down stays dense: up shrinks 50x
    assert report.figures["communication_train_loss"].stat().st_size > 1000
    assert "![communication_train_loss]" in (tmp_path / "report" / "report.md").read_text()


def test_report_fits_the_speedup_in_simulated_seconds_from_each_replicas_clock(run_config, tmp_path):
    """With slow clients, T in seconds is each replica's sim_s when it first met the target; the speedup table and
    the fit on sim_s follow from the Parquet rows, computed here independently."""
    from fedharness.runs.execute import execute
    from fedharness.studies.reports.analysis import fit_power_law, parse_target
    from fedharness.studies.reports.data import load_results
    from fedharness.studies.reports.report import build_report

    for K in (2, 4, 8):
        execute(run_config("dataset=synthetic", "dataset.num_clients=16", "dataset.samples_per_client=50",
                           "eval_every=2", "rounds=30", "replicas=3", "reference=off", "heterogeneity=false",
                           "algorithm.sampler=yang_s2", f"algorithm.clients_per_round={K}",
                           "network.compute_s_per_step=0.1", "speed=slow_tail", "speed.fraction=0.3"))
    target = parse_target("train_loss<=1.0")
    report = build_report(load_results(tmp_path / "results"), targets=[target],
                          scale_key="algorithm.clients_per_round", out_dir=tmp_path / "report", bootstrap=20)
    rounds = pd.read_parquet(tmp_path / "results" / "rounds").sort_values("round")
    runs = pd.read_parquet(tmp_path / "results" / "runs")
    K_of = {r.run_id: json.loads(r.config_json)["algorithm"]["clients_per_round"] for r in runs.itertuples()}
    first = rounds[rounds["train_loss"] <= 1.0].groupby(["run_id", "replica"]).head(1)
    seconds = first.assign(n=first["run_id"].astype(str).map(K_of)).groupby("n")["sim_s"].median()
    assert len(seconds) == 3 and (first.groupby("run_id").size() == 3).all()  # every replica met it
    table = report.tables[f"speedup_sim_s_{target.slug}"].set_index("n")
    np.testing.assert_allclose(table["sim_s"], seconds.loc[table.index], rtol=1e-12)
    np.testing.assert_allclose(table["speedup"], seconds.iloc[0] / seconds.loc[table.index], rtol=1e-12)
    a, b = fit_power_law(seconds.index.to_numpy(float), seconds.to_numpy())
    fit = report.tables[f"fit_sim_s_{target.slug}"].iloc[0]
    assert fit["b"] == pytest.approx(b, rel=1e-12) and fit["a"] == pytest.approx(a, rel=1e-12)
    assert report.tables[f"fit_{target.slug}"].iloc[0]["b"] != pytest.approx(b, rel=1e-3)  # not the rounds' fit
    assert "### In simulated seconds" in (tmp_path / "report" / "report.md").read_text()
    assert report.figures[f"speedup_sim_s_{target.slug}"].stat().st_size > 5000
