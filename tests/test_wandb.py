"""Weights & Biases, offline: the run's .wandb file read back holds the config, a history of one step per
evaluated round with the replicas' mean and std of the Parquet rows, the summary and the Parquet artifact; the report's figures and tables go to a report run."""

from __future__ import annotations

import json
import sys
import struct
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds
import pytest

from fedharness.runs.execute import execute

BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of 7-byte-headed chunks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    """Every `Record` protobuf in a .wandb file (wandb ships no reader in 0.31)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        chunk += data[pos:pos + length]
        pos += length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _items(items) -> dict:
    return {".".join(i.nested_key) if i.nested_key else i.key: json.loads(i.value_json) for i in items}


def history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({k: v for k, v in _items(r.history.item).items() if not k.startswith("_")})
    return rows


def history_keys(records) -> set[str]:
    """Top-level history keys (an image or table is logged as a nested value under its key)."""
    return {i.nested_key[0] if i.nested_key else i.key
            for r in records if r.WhichOneof("record_type") == "history" for i in r.history.item}


def summary(records) -> dict:
    out: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            out.update(_items(r.summary.update))
    return out


def wandb_file(wandb_dir: Path) -> Path:
    """The one offline run's log, after wandb's service process has flushed it (finish() may return sooner)."""
    import wandb

    wandb.teardown()
    files = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return wandb_dir


def _expected_steps(parquet: list[dict], per_replica: bool) -> list[dict]:
    """The history written here independently: per round one step; per series and numeric column the numpy mean
    and population std over the replicas with a value, iterate unprefixed, other series prefixed."""
    import numpy as np

    steps = []
    for rnd in sorted({r["round"] for r in parquet}):
        step = {"round": rnd}
        for row_series in sorted({r["series"] for r in parquet}):
            rows = [r for r in parquet if r["round"] == rnd and r["series"] == row_series]
            pre = "" if row_series == "iterate" else row_series + "/"
            for col in rows[0]:
                if col in ("round", "replica", "series", "run_id"):
                    continue
                have = [r for r in rows if r[col] is not None]
                if have:
                    step[pre + col] = float(np.mean([r[col] for r in have]))
                    step[pre + col + "_std"] = float(np.std([r[col] for r in have]))
                    if per_replica:
                        step.update({f"{pre}{col}/replica_{r['replica']}": r[col] for r in have})
        # the time-to-accuracy curves: the iterate's means again, on the sim_s axis
        step.update({f"by_sim_s/{c}": step[c] for c in ("train_loss", "subopt", "test_loss", "test_acc") if c in step})
        steps.append(step)
    return steps


def _assert_steps_equal(got: list[dict], expected: list[dict]) -> None:
    assert [g["round"] for g in got] == [e["round"] for e in expected]  # one step per evaluated round, in order
    for g, e in zip(got, expected):
        assert set(g) == set(e), set(g) ^ set(e)
        for k, v in e.items():
            assert g[k] == pytest.approx(v, rel=1e-12, abs=1e-300), k


def test_offline_history_is_one_step_per_round_with_replica_mean_and_std(run_config, offline, tmp_path, caplog):
    caplog.set_level("INFO", logger="fedharness")
    cfg = run_config("dataset=quadratic", "dataset.noise=0.3", "rounds=6", "eval_every=2", "replicas=3",
                     "wandb.enabled=true", "wandb.project=fh-test", "wandb.tags=[a,b]", "study=wb")
    result = execute(cfg)
    records = read_records(wandb_file(offline))

    parquet = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    assert len(parquet) == 3 * 4  # 3 replicas x rounds 0, 2, 4, 6: per-replica values stay in Parquet
    got = history(records)
    assert len(got) == 4  # not 12: one step per evaluated round
    _assert_steps_equal(got, _expected_steps(parquet, per_replica=False))
    assert got[-1]["subopt_std"] > 0 and not any("/replica_" in k for k in got[-1])

    axes = {m.glob_name or m.name: m.step_metric for m in (r.metric for r in records
                                                            if r.WhichOneof("record_type") == "metric")}
    assert axes == {"round": "", "sim_s": "", "by_sim_s/*": "sim_s", "*": "round"}  # sim_s: time-to-accuracy's x
    assert "by_sim_s/subopt" in got[-1] and "by_sim_s/test_acc" not in got[-1]  # a quadratic has no test_acc

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = _items(run.config.update)
    assert config["run_id"] == result.run_id and config["dataset"]["name"] == "quadratic"
    assert config["rounds"] == 6 and run.project == "fh-test" and run.run_group == "wb"
    assert list(run.tags) == ["a", "b"]

    s = summary(records)
    assert s["status"] == "ok" and s["run_id"] == result.run_id and s["rounds_done"] == 6
    final = [r["subopt"] for r in parquet if r["round"] == 6]
    assert s["final/subopt_mean"] == pytest.approx(sum(final) / 3, rel=1e-12)

    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert len(artifacts) == 1
    paths = {e.path for e in artifacts[0].manifest.contents}
    assert f"runs/run_id={result.run_id}/run.parquet" in paths
    assert any(p.startswith(f"rounds/run_id={result.run_id}/part-") and p.endswith(".parquet") for p in paths)
    assert "wandb sync" in caplog.text  # says how to upload later (the CLI shows it on stderr)


def test_per_replica_series_and_other_series_are_prefixed(run_config, offline, tmp_path):
    """rr=gamma adds the `rr` series (Richardson-Romberg), average=true the averaged ones: each series gets
    its own prefixed mean and std, and wandb.per_replica=true adds every replica's value as its own series."""
    cfg = run_config("dataset=quadratic", "dataset.noise=0.3", "rounds=4", "eval_every=2", "replicas=2",
                     "algorithm.rr=gamma", "algorithm.average=true", "wandb.enabled=true",
                     "wandb.per_replica=true")
    execute(cfg)
    got = history(read_records(wandb_file(offline)))
    parquet = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    assert {r["series"] for r in parquet} == {"iterate", "average", "rr", "rr_average"}
    assert len(got) == 3  # rounds 0, 2, 4
    _assert_steps_equal(got, _expected_steps(parquet, per_replica=True))
    assert {"train_loss", "average/train_loss_std", "rr/subopt", "train_loss/replica_1",
            "rr/subopt/replica_0"} <= set(got[-1])


def test_a_user_metric_reaches_the_history_and_the_summary(run_config, offline, tmp_path, monkeypatch):
    import numpy as np

    from fedharness.contracts import Metric
    from fedharness.registry.groups import METRICS

    monkeypatch.setitem(METRICS, "sq_norm", Metric("sq_norm", lambda w, s: (w.double() ** 2).sum(1)))
    execute(run_config("dataset=quadratic", "rounds=4", "eval_every=2", "replicas=3", "metrics=[sq_norm]",
                       "wandb.enabled=true"))
    records = read_records(wandb_file(offline))
    parquet = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    _assert_steps_equal(history(records), _expected_steps(parquet, per_replica=False))
    final = [r["sq_norm"] for r in parquet if r["round"] == 4]
    assert summary(records)["final/sq_norm_mean"] == pytest.approx(np.mean(final), rel=1e-12)


def test_auto_mode_without_a_key_is_offline(monkeypatch, tmp_path):
    from fedharness.sinks.wandb_sink import resolve_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_mode("online") == "offline"  # the environment wins


def test_bad_wandb_settings_stop_before_any_file(run_config, offline, tmp_path):
    from fedharness.errors import ConfigError

    with pytest.raises(ConfigError, match="wandb.mode"):  # the schema stops it when the config is loaded
        execute(run_config("dataset=quadratic", "rounds=2", "wandb.enabled=true", "wandb.mode=sometimes"))
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 4 s idle
def test_report_figures_and_tables_are_logged(run_config, offline, tmp_path):
    from dataclasses import replace

    from fedharness.config.load import load_settings
    from fedharness.studies.reports import build_report, load_results, parse_target
    from fedharness.sinks.wandb_sink import log_report

    for n in (1, 2):
        execute(run_config("dataset=quadratic", "rounds=20", "eval_every=1", "replicas=2", "study=wbr",
                           f"algorithm.clients_per_round={n}"))
    report = build_report(load_results(tmp_path / "results"), [parse_target("subopt<=0.1")], bootstrap=20)
    log_report(report, replace(load_settings([]).wandb, project="fh-test"))
    records = read_records(wandb_file(offline))
    keys = history_keys(records)
    assert {f"figures/{name}" for name in report.figures} <= keys
    assert "tables/to_target_subopt_le_0.1" in keys and "tables/fit_subopt_le_0.1" in keys
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.job_type == "report" and run.run_group == "wbr"


SECRET = "Pl4nted-S3cret-pw"


def _leaks(root: Path, secret: str) -> list[str]:
    """Files under root holding the secret: raw bytes, or the text of a Parquet file (compressed pages)."""
    import pyarrow.parquet as pq

    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        text = path.read_bytes()
        if path.suffix == ".parquet":
            text += repr(pq.read_table(path).to_pylist()).encode()
        if secret.encode() in text:
            found.append(str(path.relative_to(root)))
    return found


def test_a_storage_password_reaches_no_file_and_no_output(offline, tmp_path, monkeypatch, capfd):
    """A tuning study on PostgreSQL (its password on the command line) with W&B on: the password is in no file
    the trials' runs, the study's export or W&B write, nor in what the tuner prints; nor is a password in a
    URL of the run config. The storage is SQLite behind
    the PostgreSQL URL, so everything before the connection (argv, spec, messages) sees the real URL."""
    import optuna

    from fedharness import cli
    from fedharness.studies.tuning import storage as study_mod

    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(offline / var.lower()))  # artifact staging copies too
    sqlite = f"sqlite:///{tmp_path}/optuna.db"  # stands in for the server: not a file the harness writes
    monkeypatch.setattr(study_mod, "check_reachable", lambda spec: None)
    monkeypatch.setattr(study_mod, "open_storage", lambda spec: optuna.storages.RDBStorage(sqlite))
    args = ["tune", "tune=quadratic_lr", "tune.n_trials=2", "tune.budget.total=4", "tune.sampler.name=random",
            f"tune.storage=postgresql://fh:{SECRET}@127.0.0.1:5432/optuna", f"results_dir={tmp_path / 'r'}",
            f"wandb.group=https://fh:{SECRET}@example.org/data", "wandb.enabled=true", "wandb.project=fh-test"]
    monkeypatch.setattr(sys, "argv", ["fedharness", *args])  # what W&B would record as the command line
    assert cli.main(args) == 0
    import wandb

    wandb.teardown()
    assert len(list(offline.glob("wandb/offline-run-*"))) == 2  # one W&B run per trial
    out = capfd.readouterr()
    assert "fh:***@127.0.0.1" in out.out and SECRET not in out.out + out.err
    assert _leaks(tmp_path / "r", SECRET) == [] and _leaks(offline, SECRET) == []
    config = json.loads(pd.read_parquet(tmp_path / "r" / "runs").config_json[0])
    assert config["wandb"]["group"] == "https://fh:***@example.org/data"  # the run's config, masked


def test_per_client_distribution_reaches_the_history(run_config, offline, tmp_path):
    import numpy as np

    cfg = run_config("dataset=synthetic", "dataset.num_clients=12", "rounds=2", "eval_every=1", "replicas=2",
                     "eval.per_client=true", "eval.clients_table=true", "wandb.enabled=true")
    execute(cfg)
    records = read_records(wandb_file(offline))
    parquet = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    clients = pd.read_parquet(tmp_path / "results" / "clients")
    got = history(records)
    _assert_steps_equal([{k: v for k, v in g.items() if "_hist." not in k} for g in got],
                        _expected_steps(parquet, per_replica=False))
    for step in got:
        mine = clients[clients["round"] == step["round"]]
        for name in ("acc", "loss"):
            hist = f"client_{name}_hist."  # a nested value: its fields under their own keys
            assert step[hist + "_type"] == "histogram" and sum(step[hist + "values"]) == len(mine) == 2 * 12
            counts, edges = np.histogram(mine[name], bins=len(step[hist + "bins"]) - 1)  # W&B's is numpy's
            assert step[hist + "values"] == counts.tolist()
            assert step[hist + "bins"] == pytest.approx(edges.tolist(), rel=1e-6)
        assert step["client_acc_mean"] == pytest.approx(mine.groupby("replica").acc.mean().mean(), rel=1e-12)
    assert np.isfinite(got[-1]["client_loss_p90_std"])
