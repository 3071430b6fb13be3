"""results_dir as an object-store URL (s3://bucket/prefix): runs, rounds, checkpoints, sweep manifests, trials and
`fedharness report` on a real S3-compatible server on 127.0.0.1 (tests/s3_support.py), through pyarrow's real S3
client over HTTP; credentials only from the standard variables and never in a result or a message; a bucket that
is missing or refuses the credentials stops the command with one line, exit 2, before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from fedharness import cli
from fedharness.errors import ConfigError
from fedharness.results.store import ArrowStore, FileStore, open_store
from ray_support import QUADRATIC, assert_rows_match, read_rounds
from s3_support import ACCESS_KEY, SECRET_KEY, moto_server, s3_env

REPO = Path(__file__).resolve().parent.parent
RUN = ["dataset=quadratic", "rounds=6", "eval_every=2", "replicas=2", "progress=false"]


def _table(s3, path: str):
    """A hive-partitioned folder of the bucket as one table, read with pyarrow's S3 client."""
    return ds.dataset(path, filesystem=s3.filesystem(), format="parquet", partitioning="hive").to_table()


def _s3_rounds(s3, path: str, run_id: str) -> list[dict]:
    """Like ray_support.read_rounds, from the bucket."""
    table = ds.dataset(f"{path}/rounds/run_id={run_id}", filesystem=s3.filesystem(), format="parquet").to_table()
    return sorted(table.to_pylist(), key=lambda r: (r["series"], r["round"], r["replica"]))


def _assert_no_credentials(s3, bucket: str, *texts: str) -> None:
    """Neither the access key nor the secret appears in any object of the bucket or in the given output."""
    for key in s3.keys(bucket):
        data = s3.read(bucket, key)
        assert ACCESS_KEY.encode() not in data and SECRET_KEY.encode() not in data, key
    for text in texts:
        assert ACCESS_KEY not in text and SECRET_KEY not in text


def test_open_store_picks_the_store_by_scheme_and_refuses_credentials_in_the_url(tmp_path):
    assert isinstance(open_store(tmp_path), FileStore) and open_store(tmp_path).url == str(tmp_path)
    store = open_store("s3://bucket/some/prefix/")
    assert isinstance(store, ArrowStore) and store.url == "s3://bucket/some/prefix"
    assert store.root == "bucket/some/prefix"
    with pytest.raises(ConfigError) as err:
        open_store(f"s3://{ACCESS_KEY}:{SECRET_KEY}@bucket/x")
    assert err.value.key == "results_dir" and "without credentials" in str(err.value)
    assert ACCESS_KEY not in str(err.value) and SECRET_KEY not in str(err.value)
    for bad in ("ftp://host/x", "s3:///x", "s3://bucket/x?endpoint_override=y"):
        with pytest.raises(ConfigError, match="s3://bucket/prefix or gs://bucket/prefix"):
            open_store(bad)


def test_a_run_lands_in_the_bucket_and_reads_back_with_pyarrow(s3, tmp_path, monkeypatch, capsys):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/exp/one"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", f"results_dir={url}", *RUN]) == 0
    out = capsys.readouterr()
    assert f"results in {url}/" in out.out
    assert not any(tmp_path.iterdir())  # nothing on the local disk (today's code made a folder named s3:)
    runs = _table(s3, f"{bucket}/exp/one/runs").to_pylist()
    assert len(runs) == 1 and runs[0]["status"] == "ok" and runs[0]["rounds_done"] == 6
    run_id = runs[0]["run_id"]
    assert json.loads(runs[0]["config_json"])["results_dir"] == url
    assert s3.keys(bucket) == [f"exp/one/rounds/run_id={run_id}/part-000000000-000000006.parquet",
                               f"exp/one/runs/run_id={run_id}/run.parquet"]
    assert cli.main(["run", f"results_dir={tmp_path / 'local'}", *RUN]) == 0  # the same run to a folder
    local = read_rounds(tmp_path / "local", _table_run_id(tmp_path / "local"))
    assert_rows_match(_s3_rounds(s3, f"{bucket}/exp/one", run_id), local, rel=0)
    _assert_no_credentials(s3, bucket, out.out, out.err)


def _table_run_id(results: Path) -> str:
    """The one run of a local results folder."""
    (folder,) = (results / "runs").glob("run_id=*")
    return folder.name.split("=", 1)[1]


@pytest.mark.slow
def test_a_sweep_and_its_report_on_the_bucket(s3, tmp_path, capsys):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/sweeps"
    assert cli.main(["sweep", "sweep=algorithms", "sweep.runner=local", "algorithm=fedavg,fednova",
                     "algorithm.clients_per_round=3", "dataset.num_clients=5", "rounds=4", "replicas=1",
                     "dataset.samples_per_client=20", "algorithm.local_steps=2", f"sweep.results_dir={url}"]) == 0
    runs = _table(s3, f"{bucket}/sweeps/runs").to_pylist()
    assert sorted(r["algorithm"] for r in runs) == ["fedavg", "fednova"] and {r["status"] for r in runs} == {"ok"}
    manifests = [k for k in s3.keys(bucket) if k.startswith("sweeps/sweeps/")]
    assert len(manifests) == 1
    manifest = json.loads(s3.read(bucket, manifests[0]))
    assert sorted(j["run_id"] for j in manifest["jobs"]) == sorted(r["run_id"] for r in runs)
    assert sorted(j["status"] for j in manifest["jobs"]) == ["ok", "ok"]

    out = tmp_path / "report"
    assert cli.main(["report", url, "--out", str(out)]) == 0
    report_runs = (out / "tables" / "runs.csv").read_text().splitlines()
    assert len(report_runs) == 1 + 2 and all(r["run_id"] in "\n".join(report_runs) for r in runs)
    assert f"# Scaling report: `{url}`" in (out / "report.md").read_text()
    printed = capsys.readouterr()
    _assert_no_credentials(s3, bucket, printed.out, printed.err, (out / "report.md").read_text())


@pytest.mark.slow
def test_a_tuning_study_records_its_trials_in_the_bucket(s3, tmp_path):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/tune"
    args = ["tune", "tune=quadratic_lr", "tune.n_trials=3", "tune.budget.total=5", "tune.plots=true",
            f"results_dir={url}", "progress=false"]
    assert cli.main(args) == 2  # null storage means SQLite under results_dir, which a bucket cannot hold
    assert cli.main([*args, f"tune.storage=journal:{tmp_path / 'study.log'}"]) == 0
    trials = pq.read_table(f"{bucket}/tune/trials/study=quadratic_lr-fedavg/trials.parquet",
                           filesystem=s3.filesystem()).to_pylist()
    runs = _table(s3, f"{bucket}/tune/runs").to_pylist()
    assert sorted(t["trial"] for t in trials) == [0, 1, 2]
    assert sorted(t["run_id"] for t in trials) == sorted(r["run_id"] for r in runs)
    keys = s3.keys(bucket)
    assert {"tune/tune/quadratic_lr-fedavg/best.overrides", "tune/tune/quadratic_lr-fedavg/history.png"} <= set(keys)
    assert s3.read(bucket, "tune/tune/quadratic_lr-fedavg/history.png")[:8] == b"\x89PNG\r\n\x1a\n"
    _assert_no_credentials(s3, bucket)


_KILLED = """
import os, signal, sys
from fedharness.config.load import load_settings
from fedharness.runs.execute import execute
stop_round, *overrides = sys.argv[1:]

def on_eval(rows, state):
    if state.round == int(stop_round):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-way: rows past the last checkpoint are only in memory

execute(load_settings(overrides), run_id="victim", on_eval=on_eval)
"""


@pytest.mark.slow
def test_a_run_killed_mid_way_resumes_from_its_checkpoint_in_the_bucket(s3, tmp_path):
    bucket = s3.new_bucket()
    url = f"s3://{bucket}/killed"
    overrides = ["algorithm=scaffold", "algorithm.client_lr=0.1", *QUADRATIC, "rounds=20", "eval_every=1",
                 "checkpoint_every=5", "progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", _KILLED, "13", f"results_dir={url}", *overrides], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    keys = s3.keys(bucket)
    assert "killed/checkpoints/run_id=victim/state.pt" in keys and "killed/checkpoints/run_id=victim/meta.json" in keys
    assert "killed/rounds/run_id=victim/part-000000006-000000010.parquet" in keys  # up to the checkpoint at 10
    assert not any(k.endswith("-000000013.parquet") for k in keys)
    runs = _table(s3, f"{bucket}/killed/runs").to_pylist()
    assert [r["status"] for r in runs] == ["running"]  # what a SIGKILL leaves

    resumed = subprocess.run([sys.executable, "-m", "fedharness.cli", "run", f"results_dir={url}", *overrides,
                              "resume=victim"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["status"] for r in _table(s3, f"{bucket}/killed/runs").to_pylist()] == ["ok"]
    reference = tmp_path / "reference"
    assert cli.main(["run", f"results_dir={reference}", *overrides]) == 0
    want = read_rounds(reference, _table_run_id(reference))
    got = _s3_rounds(s3, f"{bucket}/killed", "victim")
    assert_rows_match(got, want, rel=0)  # each round once, the uninterrupted trajectory's values
    _assert_no_credentials(s3, bucket, killed.stdout, killed.stderr, resumed.stdout, resumed.stderr)


def _one_line_error(capsys, command: list[str]) -> str:
    assert cli.main(command) == 2, command
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedharness: error: invalid value for "), err
    return err


def _commands(url: str, tmp_path: Path) -> list[list[str]]:
    """run, sweep and tune, each writing to `url`."""
    return [["run", f"results_dir={url}", *RUN],
            ["sweep", "sweep=algorithms", "sweep.runner=local", "algorithm=fedavg,fednova", "rounds=2",
             f"sweep.results_dir={url}"],
            ["tune", "tune=quadratic_lr", "tune.n_trials=2", "tune.budget.total=3", f"results_dir={url}",
             f"tune.storage=journal:{tmp_path / 'study.log'}"]]


def test_a_bucket_that_does_not_exist_stops_each_command_with_one_line(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    url = "s3://fh-no-such-bucket/results"
    for command in _commands(url, tmp_path):
        err = _one_line_error(capsys, command)
        assert f"'results_dir': '{url}'" in err and "NO_SUCH_BUCKET" in err, err
    assert not any(tmp_path.iterdir())  # no journal, no local folder, nothing
    err = _one_line_error(capsys, ["report", url])
    assert f"'RESULTS_DIR': '{url}'" in err


def test_credentials_the_store_refuses_stop_each_command_with_one_line(tmp_path, monkeypatch, capsys):
    """A server of its own that knows no access key (moto with authentication on): every request is refused."""
    monkeypatch.chdir(tmp_path)
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        for name, value in s3_env(endpoint).items():
            monkeypatch.setenv(name, value)
        url = "s3://fh-bucket/results"
        for command in [*_commands(url, tmp_path), ["report", url]]:
            err = _one_line_error(capsys, command)
            assert f"'{url}'" in err and "INVALID_ACCESS_KEY_ID" in err, err
            assert ACCESS_KEY not in err and SECRET_KEY not in err
    assert not any(tmp_path.iterdir())


def test_a_results_dir_the_driver_cannot_write_stops_each_command_with_one_line(tmp_path, capsys):
    """/proc takes no new files, even from root (CI runs as root, so a chmod would not do)."""
    url = "/proc/fedharness-results"
    for command in _commands(url, tmp_path):
        err = _one_line_error(capsys, command)
        assert f"'results_dir': '{url}' (a writable directory; cannot write in '/proc'" in err, err
    assert not Path(url).exists() and not any(tmp_path.iterdir())
