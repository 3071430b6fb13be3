"""How runs end when they cannot finish: SIGTERM/SIGINT (one line, status interrupted, the true rounds_done,
rounds flushed, a resume command that works), exceptions (failed, the true rounds_done), and SIGKILL (the next
command marks the row lost). Real processes, real signals."""

from __future__ import annotations

import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fedharness.core.checkpoint import load_resume
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.runs.lifecycle import mark_lost_runs, process_alive, process_start
from fedharness.runs.execute import execute
from fedharness.sinks.parquet import ParquetSink
from fedharness.results.store import FileStore

REPO = Path(__file__).resolve().parent.parent
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
# Far more rounds than the test waits for: the run is always mid-way when the signal lands.
ENDLESS = ["dataset=quadratic", "rounds=10000000", "eval_every=1"]


def _run_row(results: Path, run_id: str | None = None) -> dict:
    files = list((results / "runs").glob(f"run_id={run_id or '*'}/run.parquet"))
    assert len(files) == 1
    return {**pq.read_table(files[0]).to_pylist()[0], "run_id": files[0].parent.name.split("=", 1)[1]}


def _last_round_in_parquet(results: Path, run_id: str) -> int:
    parts = sorted((results / "rounds" / f"run_id={run_id}").glob("part-*.parquet"))
    return max(max(pq.read_table(p, columns=["round"]).column("round").to_pylist()) for p in parts)


def _start_cli(results: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    err = results.parent / "stderr.txt"
    proc = subprocess.Popen([sys.executable, "-m", "fedharness.cli", "run", f"results_dir={results}", *overrides],
                            cwd=REPO, env=ONE_THREAD, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=open(err, "w"))
    return proc, err


def _wait_for(proc: subprocess.Popen, ready, err: Path) -> None:
    deadline = time.monotonic() + 300  # a guard against a hang, not a timing assertion
    while not ready():
        assert proc.poll() is None, err.read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 10 s idle
def test_signal_ends_a_run_with_one_line_interrupted_and_resumable(tmp_path, signum):
    results = tmp_path / "results"
    run = [*ENDLESS, "checkpoint_every=5", "progress=false"]
    proc, err = _start_cli(results, *run)
    _wait_for(proc, lambda: any((results / "checkpoints").glob("run_id=*/state.pt")), err)
    proc.send_signal(signum)
    assert proc.wait(timeout=120) == 128 + signum
    lines = err.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedharness: interrupted at round "), lines
    row = _run_row(results)
    assert row["status"] == "interrupted" and row["error"] == f"interrupted by {signum.name}"
    assert row["rounds_done"] >= 5 and row["rounds_done"] == _last_round_in_parquet(results, row["run_id"])
    assert f"interrupted at round {row['rounds_done']} " in lines[0]
    # the printed command resumes this run from its last checkpoint
    command = shlex.split(lines[0].split("resume with: ")[1].split(" (continues")[0])
    assert command[:2] == ["fedharness", "run"] and command[-1] == f"resume={row['run_id']}"
    resume = load_resume(load_settings(command[2:]))
    assert resume.run_id == row["run_id"] and resume.round % 5 == 0 and resume.round > 0
    assert f"(continues from round {resume.round}, its last checkpoint)" in lines[0]


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_interrupted_run_without_checkpoints_says_it_cannot_be_resumed(tmp_path):
    results = tmp_path / "results"
    proc, err = _start_cli(results, *ENDLESS, "progress=true")
    _wait_for(proc, lambda: "rounds:" in err.read_text(), err)  # the progress bar: rounds are running
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    text = err.read_text()
    assert "Traceback" not in text
    last = text.splitlines()[-1]
    row = _run_row(results)
    assert row["status"] == "interrupted" and row["rounds_done"] >= 1
    assert row["rounds_done"] == _last_round_in_parquet(results, row["run_id"])  # flushed on the way out
    assert last == (f"fedharness: interrupted at round {row['rounds_done']} (SIGINT); run {row['run_id']} cannot "
                    "be resumed: no checkpoint (set checkpoint_every=N to make runs resumable)")


def test_a_failed_run_records_the_rounds_it_completed(run_config, tmp_path):
    def on_eval(rows, state):
        if state.round == 7:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        execute(run_config("dataset=quadratic", "rounds=20", "eval_every=1"), run_id="r", on_eval=on_eval)
    row = _run_row(tmp_path / "results", "r")
    assert (row["status"], row["rounds_done"], row["error"]) == ("failed", 7, "RuntimeError: boom")
    assert _last_round_in_parquet(tmp_path / "results", "r") == 7
    assert row["pid"] == os.getpid() and row["pid_start"] == process_start(os.getpid())


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 4 s idle
def test_sigkilled_run_is_marked_lost_by_the_next_command(tmp_path, capsys):
    results = tmp_path / "results"
    proc, err = _start_cli(results, *ENDLESS, "checkpoint_every=5", "progress=false")
    _wait_for(proc, lambda: any((results / "checkpoints").glob("run_id=*/state.pt")), err)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    victim = _run_row(results)
    assert victim["status"] == "running" and victim["pid"] == proc.pid
    assert main(["run", f"results_dir={results}", "dataset=quadratic", "rounds=2", "progress=false"]) == 0
    lost = _run_row(results, victim["run_id"])
    recorded = _last_round_in_parquet(results, victim["run_id"])
    assert lost["status"] == "lost" and lost["rounds_done"] == recorded and recorded % 5 == 0 and recorded > 0
    assert f"run {victim['run_id']} was left running by process {proc.pid}" in capsys.readouterr().err
    resume = load_resume(load_settings([f"results_dir={results}", *ENDLESS, "checkpoint_every=5",
                                      f"resume={victim['run_id']}"]))
    assert resume.round == recorded  # a lost run resumes from its checkpoint


def _running_row(results: Path, run_id: str, host: str, pid: int, pid_start: int | None) -> None:
    ParquetSink(FileStore(results), run_id).write_run({"status": "running", "rounds_done": 0, "host": host,
                                                       "pid": pid, "pid_start": pid_start})


def test_only_rows_of_gone_processes_on_this_host_are_marked_lost(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)
    me, started = os.getpid(), process_start(os.getpid())
    assert process_alive(me, started) and not process_alive(me, started + 1) and not process_alive(dead, None)
    host = platform.node()
    _running_row(tmp_path, "alive", host, me, started)
    _running_row(tmp_path, "reused-pid", host, me, started + 1)  # this pid now belongs to another process
    _running_row(tmp_path, "dead", host, dead, None)
    _running_row(tmp_path, "elsewhere", host + "-other", dead, None)
    assert sorted(mark_lost_runs(FileStore(tmp_path))) == ["dead", "reused-pid"]
    assert [_run_row(tmp_path, r)["status"] for r in ("alive", "reused-pid", "dead", "elsewhere")] \
        == ["running", "lost", "lost", "running"]


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 6 s idle
def test_sigterm_ends_a_local_sweep_with_one_line_and_its_run_interrupted(tmp_path):
    results = tmp_path / "results"
    (tmp_path / "s.yaml").write_text("runner: local\nbase: {dataset: quadratic, rounds: 10000000, eval_every: 1, "
                                     "checkpoint_every: 5}\ngrid: {seed: [0, 1]}\n")
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen([sys.executable, "-m", "fedharness.cli", "sweep", f"sweep={tmp_path / 's.yaml'}",
                             f"results_dir={results}"], cwd=REPO, env=ONE_THREAD, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    _wait_for(proc, lambda: any((results / "checkpoints").glob("run_id=*/state.pt")), err)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert err.read_text().splitlines() == [f"fedharness: sweep s interrupted (SIGTERM); the runs that finished are "
                                            f"in {results}/ and listed in its sweeps/ manifest"]
    row = _run_row(results)  # the second point never started
    assert row["status"] == "interrupted" and row["rounds_done"] == _last_round_in_parquet(results, row["run_id"])
    assert len(list((results / "sweeps").glob("s-*.json"))) == 1


@pytest.mark.slow  # 24 s (two 10,000-round trials, twice); the run's and the sweep's signal tests stay in the default run
def test_sigterm_ends_a_study_with_one_line_and_the_same_command_continues_it(tmp_path):
    """The trial that was cut short is FAIL (status interrupted), so it does not count and its slot runs again."""
    import optuna

    results = tmp_path / "results"
    # two trials of 10000 GD rounds on a small quadratic: seconds each, so the signal lands mid-run
    args = ["tune", "tune=quadratic_lr", "tune.space.client_lr.high=0.02", "tune.plots=false", "tune.study=s",
            "tune.n_trials=2", "tune.budget.total=10000", f"results_dir={results}"]
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen([sys.executable, "-m", "fedharness.cli", *args], cwd=REPO, env=ONE_THREAD,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    _wait_for(proc, lambda: any((results / "runs").glob("run_id=*/run.parquet")), err)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    text = err.read_text()
    assert "Traceback" not in text
    assert text.splitlines() == [f"fedharness: study s interrupted (SIGTERM) with 0 of 2 trials finished; the same "
                                 f"command continues it: fedharness {shlex.join(args)}"]
    row = _run_row(results)
    assert row["status"] == "interrupted" and row["trial"] == 0
    storage = f"sqlite:///{results}/optuna.db"
    [cut] = optuna.load_study(study_name="s", storage=storage).get_trials()
    assert cut.state.name == "FAIL" and cut.user_attrs["status"] == "interrupted"

    rerun = subprocess.run([sys.executable, "-m", "fedharness.cli", *args], cwd=REPO, env=ONE_THREAD,
                           capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    states = [t.state.name for t in optuna.load_study(study_name="s", storage=storage).get_trials()]
    assert states == ["FAIL", "COMPLETE", "COMPLETE"]


def test_a_sweep_from_python_marks_rows_of_killed_runs_lost(tmp_path):
    """The Python API's sweep takes the CLI's path: rows a killed process left `running` become `lost`."""
    import fedharness

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    results = tmp_path / "res"
    _running_row(results, "killed", platform.node(), dead, None)
    (tmp_path / "tiny.yaml").write_text("name: tiny\nrunner: local\nbase:\n  dataset: quadratic\n  rounds: 2\n"
                                        "grid:\n  seed: [0]\n")
    done = fedharness.sweep([f"sweep={tmp_path / 'tiny.yaml'}", f"results_dir={results}", "progress=false"])
    assert list(done.statuses.values()) == ["ok"] and _run_row(results, "killed")["status"] == "lost"


def test_killed_between_a_checkpoint_and_its_rows_loses_no_round(run_config, tmp_path, monkeypatch):
    """The window the SIGKILL test can land in: state.pt of round 10 is written, its rows part is not. The next
    command puts the checkpoint's rows in place, so the lost run's rounds_done is its checkpoint's round, and the
    resumed run holds every round once, equal to a run that was never cut."""
    results = tmp_path / "results"
    run = ["dataset=quadratic", "rounds=20", "eval_every=1", "checkpoint_every=5"]

    class Killed(BaseException):
        pass

    real_write_part = ParquetSink.write_part

    def die_at_round_10(sink, part):
        if part[0].endswith("-000000010.parquet"):
            raise Killed
        real_write_part(sink, part)

    monkeypatch.setattr(ParquetSink, "write_part", die_at_round_10)
    with pytest.raises(Killed):
        execute(run_config(*run), run_id="cut")
    monkeypatch.setattr(ParquetSink, "write_part", real_write_part)
    assert _last_round_in_parquet(results, "cut") == 5  # the part of rounds 6-10 never landed
    _running_row(results, "cut", platform.node(), 2 ** 22 + 1, None)  # what a SIGKILL leaves (no such pid)

    assert mark_lost_runs(FileStore(results)) == ["cut"]
    assert _run_row(results, "cut")["rounds_done"] == 10 == _last_round_in_parquet(results, "cut")
    assert load_resume(run_config(*run, "resume=cut")).round == 10
    execute(run_config(*run, "resume=cut"))
    execute(run_config(*run), run_id="whole")
    rounds = pq.read_table(results / "rounds").to_pandas()
    cut, whole = (rounds[rounds.run_id == r].sort_values(["round", "replica"]) for r in ("cut", "whole"))
    assert cut["round"].tolist() == list(range(21)) == whole["round"].tolist()
    assert cut["train_loss"].tolist() == whole["train_loss"].tolist()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_between_the_round_done_and_its_rows_waits_for_the_rows(tmp_path, monkeypatch, signum):
    """The signal arrives as round 3's rows are handed to the hooks, before the sink has them (the CI failure of
    28 Nov: rounds_done 9, rows to round 8): the run ends after the hooks, and says the rounds its results hold."""
    handed = ParquetSink.on_evaluation

    def signalled_first(sink, context):
        if context.round == 3:
            os.kill(os.getpid(), signum)  # the handler runs at once, here, in this (the main) thread
        handed(sink, context)

    monkeypatch.setattr(ParquetSink, "on_evaluation", signalled_first)
    results = tmp_path / "results"
    settings = load_settings([*ENDLESS, f"results_dir={results}", "progress=false", "reference=off"])
    with pytest.raises(KeyboardInterrupt):
        execute(settings)
    row = _run_row(results)
    assert row["status"] == "interrupted" and row["error"] == f"interrupted by {signal.Signals(signum).name}"
    assert row["rounds_done"] == 3 == _last_round_in_parquet(results, row["run_id"])
