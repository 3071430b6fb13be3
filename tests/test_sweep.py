"""`fedharness sweep`: grid expansion (zip, unions, command-line sweeps), step-size protocols, validation before
any file, and failures recorded as failed while the other runs go on."""

from __future__ import annotations

import json
import math

import pyarrow.dataset as ds
import pytest

from fedharness.config.load import load_config
from fedharness.errors import ConfigError
from fedharness.studies.sweep import apply_cli, expand, grid_points, run_sweep, spec_from_dict, split_args

BASE = {"dataset": "quadratic", "dataset.num_clients": 20, "rounds": 4, "eval_every": 2}


def spec(tmp_path, **kw):
    data = {"results_dir": str(tmp_path / "res"), "runner": "local", "base": dict(BASE), **kw}
    return spec_from_dict(data, "t")


def test_zip_keys_advance_together_and_grids_unite(tmp_path):
    s = spec(tmp_path, grid=[{"algorithm.clients_per_round": [1, 2, 4], "rounds": [40, 20, 10],
                              "algorithm.local_steps": [1, 5]},
                             {"algorithm": ["fednova"], "algorithm.local_steps": [2]}],
             zip=[["algorithm.clients_per_round", "rounds"]])
    points = grid_points(s)
    assert points[:6] == [{"algorithm.clients_per_round": n, "rounds": r, "algorithm.local_steps": k}
                          for n, r in (("1", "40"), ("2", "20"), ("4", "10")) for k in ("1", "5")]
    assert points[6:] == [{"algorithm": "fednova", "algorithm.local_steps": "2"}]


def test_command_line_sweeps_add_dimensions_and_fixed_values_remove_them(tmp_path):
    name, sweep_keys, plain, sweeps = split_args(
        ["sweep=x", "sweep.runner=local", "algorithm.local_steps=1,2", "seed=range(0,3)", "rounds=7",
         "algorithm.client_lr=0.1"])
    assert (name, sweep_keys) == ("x", ["runner=local"])
    assert sweeps == {"algorithm.local_steps": ["1", "2"], "seed": ["0", "1", "2"]}
    s = apply_cli(spec(tmp_path, grid={"algorithm.client_lr": [0.01, 0.1], "algorithm.local_steps": [5, 10]}),
                  plain, sweeps)
    points = grid_points(s)
    assert len(points) == 6 and all(set(p) == {"algorithm.local_steps", "seed"} for p in points)
    jobs = expand(s)
    cfg = load_config(jobs[0].overrides)
    assert cfg["algorithm"]["client_lr"] == 0.1 and cfg["rounds"] == 7  # fixed on the command line
    assert cfg["study"] == "t" and cfg["results_dir"] == str(tmp_path / "res") and cfg["progress"] is False
    with pytest.raises(ConfigError, match="sweep"):
        split_args(["rounds=3"])  # no sweep named


def test_theory_protocol_sets_yang_step_sizes(tmp_path):
    s = spec(tmp_path, grid={"algorithm.clients_per_round": [2, 8], "algorithm.local_steps": [5],
                             "rounds": [100], "algorithm.sampler": ["scheme_i", "full"]},
             protocol={"name": "theory", "c1": 0.5, "c2": 2.0})
    for job in expand(s):
        cfg = load_config(job.overrides)
        n = 20 if cfg["algorithm"]["sampler"] == "full" else cfg["algorithm"]["clients_per_round"]
        assert cfg["algorithm"]["client_lr"] == pytest.approx(0.5 / (5 * math.sqrt(100)), rel=1e-12)
        assert cfg["algorithm"]["server_lr"] == pytest.approx(2.0 * math.sqrt(5 * n), rel=1e-12)
    bad = spec(tmp_path, grid={"algorithm.local_work": ["epochs"]}, protocol={"name": "theory"})
    with pytest.raises(ConfigError, match="algorithm.local_work"):
        expand(bad)


def test_tuned_protocol_reads_the_tuners_override_file(tmp_path):
    (tmp_path / "best-fedavg.yaml").write_text("algorithm:\n  client_lr: 0.0123\n  server_lr: 1.5\n")
    (tmp_path / "best-fednova.txt").write_text("# best trial\nalgorithm.client_lr=0.0456\n")
    s = spec(tmp_path, grid={"algorithm": ["fedavg", "fednova"]},
             protocol={"name": "tuned", "file": str(tmp_path / "best-{algorithm}.yaml")})
    with pytest.raises(ConfigError, match="sweep.protocol.file"):
        expand(s)  # best-fednova.yaml does not exist
    (tmp_path / "best-fednova.yaml").write_text("- algorithm.client_lr=0.0456\n")
    lrs = {load_config(j.overrides)["algorithm"]["name"]: load_config(j.overrides)["algorithm"]["client_lr"]
           for j in expand(s)}
    assert lrs == {"fedavg": 0.0123, "fednova": 0.0456}
    # The tuner's best.overrides (one override per line), taking only the step sizes from it.
    (tmp_path / "best.overrides").write_text("dataset=quadratic\nrounds=999\nalgorithm.client_lr=0.0789\n")
    s = spec(tmp_path, protocol={"name": "tuned", "file": str(tmp_path / "best.overrides"),
                                 "keys": ["algorithm.client_lr"]})
    cfg = load_config(expand(s)[0].overrides)
    assert cfg["algorithm"]["client_lr"] == 0.0789 and cfg["rounds"] == BASE["rounds"]


@pytest.mark.parametrize("grid, key", [({"algorithm.no_such_key": [1, 2]}, "algorithm.no_such_key"),
                                       ({"rounds": [3, 0]}, "rounds"),
                                       ({"results_dir": ["a", "b"]}, "sweep.grid")])
def test_a_bad_point_stops_the_sweep_before_any_file(tmp_path, grid, key):
    s = spec(tmp_path, grid=grid)
    with pytest.raises(ConfigError, match=key):
        run_sweep(s, echo=lambda line: None)
    assert not (tmp_path / "res").exists()


def test_unknown_sweep_settings_are_named(tmp_path):
    with pytest.raises(ConfigError, match="sweep.protocol.name"):
        spec(tmp_path, protocol={"name": "magic"})
    with pytest.raises(ConfigError, match="sweep"):
        spec(tmp_path, grids={"rounds": [1]})
    with pytest.raises(ConfigError, match="sweep.zip"):
        spec(tmp_path, grid={"rounds": [1, 2], "seed": [1, 2, 3]}, zip=[["rounds", "seed"]])


# A Dirichlet split of digits' 1797 samples cannot give 20 clients 1000 each: that fails when the run
# builds its data (composition cannot know the data set's size), not when the sweep is expanded.
FAILS_WHEN_BUILT = {"dataset": "digits", "dataset.num_clients": 20, "partition": "dirichlet", "rounds": 4,
                    "eval_every": 2, "heterogeneity": False}


def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path):
    s = spec(tmp_path, base=FAILS_WHEN_BUILT, grid={"partition.min_size": [1, 1000, 2]})
    lines = []
    result = run_sweep(s, echo=lines.append)
    assert result.counts() == {"ok": 2, "failed": 1}
    runs = {r["run_id"]: r for r in ds.dataset(tmp_path / "res" / "runs", partitioning="hive").to_table().to_pylist()}
    assert len(runs) == 3 and all(r["study"] == "t" for r in runs.values())
    failed = [r for r in runs.values() if r["status"] == "failed"]
    assert len(failed) == 1 and "partition.min_size" in failed[0]["error"]
    rounds = ds.dataset(tmp_path / "res" / "rounds", partitioning="hive").to_table()
    assert set(rounds.column("run_id").to_pylist()) == {r for r, v in runs.items() if v["status"] == "ok"}
    assert any("failed" in ln and "error:" in ln for ln in lines) and "2 ok" in lines[-1]
    manifest = json.loads((tmp_path / "res" / result.manifest).read_text())
    assert sorted(j["status"] for j in manifest["jobs"]) == ["failed", "ok", "ok"]
    assert manifest["grid_keys"] == ["partition.min_size"]




@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 26 s idle
def test_jobs_run_as_ray_tasks_and_a_failure_does_not_stop_them(tmp_path, local_ray):
    """The real runner: one Ray task per point with its CPU request, in Ray's worker processes."""
    import os

    import ray

    s = spec(tmp_path, runner="ray", base=FAILS_WHEN_BUILT, grid={"partition.min_size": [1, 1000, 2]},
             resources={"num_cpus": 1})
    result = run_sweep(s, echo=lambda line: None)
    assert result.counts() == {"ok": 2, "failed": 1}
    workers = {o.worker for o in result.outcomes.values()}
    assert all(w and int(w.rsplit(":", 1)[1]) != os.getpid() for w in workers)  # ran in Ray worker processes
    statuses = sorted(r["status"] for r in ds.dataset(tmp_path / "res" / "runs", partitioning="hive")
                      .to_table().to_pylist())
    assert statuses == ["failed", "ok", "ok"]
    assert ray.is_initialized()  # a sweep leaves a Ray it did not start alone


def test_a_request_no_node_can_meet_is_named_before_any_file(tmp_path, local_ray):
    s = spec(tmp_path, runner="ray", grid={"seed": [0]}, resources={"num_cpus": 1, "num_gpus": 1})
    with pytest.raises(ConfigError, match="sweep.resources.num_gpus"):
        run_sweep(s, echo=lambda line: None)
    assert not (tmp_path / "res").exists()



def _shipped(tmp_path):
    from fedharness.config.compose import group_options
    from fedharness.studies.sweep import load_spec

    (tmp_path / "best.overrides").write_text("algorithm.client_lr=0.02\nalgorithm.server_lr=1.5\n")
    for name in group_options("sweep"):
        s = load_spec(name, [f"protocol.file={tmp_path / 'best.overrides'}"] if name == "tuned" else [])
        s.results_dir = str(tmp_path / name)
        yield name, s


def test_every_shipped_study_config_parses(tmp_path):
    found = {}
    studies = {"speedup_quadratic", "speedup_synthetic", "local_steps", "algorithms", "partitions", "tuned"}
    for name, s in _shipped(tmp_path):
        found[name] = len(grid_points(s))
        assert name not in studies or s.report.get("targets"), name  # the scaling studies name their targets
    assert studies <= set(found)
    assert all(count >= 4 for count in found.values()), found


@pytest.mark.slow
def test_every_shipped_study_config_composes(tmp_path):
    """expand composes every point (a ConfigError otherwise), the points that share their group choices once: the
    first and the last point of each study composed as Hydra composes them whole give the same config."""
    from fedharness.config.compose import choices_and_values

    for name, s in _shipped(tmp_path):
        jobs = expand(s)
        for job in (jobs[0], jobs[-1]):
            choices, values = choices_and_values(job.overrides)
            whole = load_config(job.overrides)
            assert whole["study"] == name and load_config(choices, values=values) == whole


def test_choices_and_values_splits_as_hydra_applies_them():
    from fedharness.config.compose import choices_and_values

    ovs = ["attack=alie", "algorithm.client_lr=0.1", "dataset=digits", "rounds=3", "model=2nn"]
    assert choices_and_values(ovs) == (["attack=alie", "dataset=digits", "model=2nn"],
                                       ["algorithm.client_lr=0.1", "rounds=3"])
    assert choices_and_values(["rounds=3", "~attack", "seed=1"]) == (["rounds=3", "~attack", "seed=1"], [])
    choices, values = choices_and_values(ovs)
    assert load_config(choices, values=values) == load_config(ovs)


ZIPPED = {"grid": {"algorithm.clients_per_round": [1, 2, 4], "rounds": [40, 20, 10], "eval_every": [4, 2, 1]},
          "zip": [["algorithm.clients_per_round", "rounds", "eval_every"]]}


def _cli(tmp_path, *args: str):
    _, _, plain, sweeps = split_args(["sweep=x", *args])
    return grid_points(apply_cli(spec(tmp_path, **ZIPPED), plain, sweeps))


def test_fixing_one_zipped_key_keeps_the_zip(tmp_path):
    s = apply_cli(spec(tmp_path, **ZIPPED), *split_args(["sweep=x", "rounds=30"])[2:])
    assert grid_points(s) == [{"algorithm.clients_per_round": n, "eval_every": e}
                              for n, e in (("1", "4"), ("2", "2"), ("4", "1"))]
    assert all(load_config(job.overrides)["rounds"] == 30 for job in expand(s))
    assert _cli(tmp_path, "rounds=30", "eval_every=1", "algorithm.clients_per_round=2") == [{}]  # all fixed: one run


def test_a_list_for_a_zipped_key_replaces_its_column(tmp_path):
    assert _cli(tmp_path, "rounds=8,6,4") == [{"algorithm.clients_per_round": n, "rounds": r, "eval_every": e}
                                              for n, r, e in (("1", "8", "4"), ("2", "6", "2"), ("4", "4", "1"))]
    assert len(_cli(tmp_path, "rounds=8,6,4", "seed=1,2")) == 6  # an unzipped list still multiplies
    with pytest.raises(ConfigError) as err:
        _cli(tmp_path, "rounds=8,6")
    assert err.value.key == "rounds" and "3 comma-separated values" in err.value.allowed


def test_cli_dry_run_counts_a_fixed_zipped_key_once(capsys):
    from fedharness.cli import main

    assert main(["sweep", "sweep=speedup_quadratic", "rounds=300", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "5 runs (dry run: nothing started)"
    assert sorted(int(line.split("algorithm.clients_per_round=")[1].split()[0]) for line in lines[:-1]) \
        == [1, 2, 4, 8, 16]
    assert all(" rounds=300 " in line for line in lines[:-1])
