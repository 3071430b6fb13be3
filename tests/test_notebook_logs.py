"""Notebook and log friendliness: the matplotlib backend is left alone, progress in a non-interactive stream is a
few plain lines (no carriage-return frames), a terminal gets a tqdm.auto bar, and `threads: null` follows the
work of a step, not the model's name."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def _python(script: str, tmp_path: Path, **env: str) -> tuple[str, str]:
    """Run a script in a fresh interpreter with stderr going to a file (not a terminal); (stdout, stderr)."""
    err = tmp_path / "stderr.txt"
    with open(err, "w") as f:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, stderr=f,
                             text=True, cwd=tmp_path, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **env})
    text = err.read_text()
    assert out.returncode == 0, text[-3000:]
    return out.stdout, text


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 15 s idle
def test_reports_and_tuning_plots_leave_the_matplotlib_backend_as_it_is(tmp_path):
    """A process whose backend is svg (as a notebook's is inline): importing the report modules, drawing a
    report's figures and a tuning study's plots keep it; so does the reproduce module's figure helper."""
    out, _ = _python(f"""
        import matplotlib
        import fedharness
        from fedharness.studies.reports import plots, build_report  # noqa: F401, importing must not switch
        from fedharness.studies import reproduce
        before = matplotlib.get_backend()
        r = "{tmp_path / 'results'}"
        for n in (1, 2):
            fedharness.run(["dataset=quadratic", "rounds=20", "replicas=2", "study=mpl", "progress=false",
                            f"algorithm.clients_per_round={{n}}", "results_dir=" + r])
        report = fedharness.report(r, ["subopt<=0.1"], bootstrap=20)
        fedharness.tune(["tune=quadratic_lr", "tune.n_trials=3", "tune.budget.total=10", "tune.study=mplt",
                         "results_dir=" + r])
        fig, ax = reproduce._figure(2)
        reproduce._save(fig, __import__("pathlib").Path(r), "x.png")
        print(before, matplotlib.get_backend(), len(report.figures))
    """, tmp_path, MPLBACKEND="svg")
    before, after, figures = out.split()[-3:]
    assert before == "svg" and after == "svg" and int(figures) >= 2
    assert (tmp_path / "results" / "tune" / "mplt" / "history.png").stat().st_size > 0


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_progress_to_a_file_is_a_few_plain_lines(tmp_path):
    """`fedharness run` with its stderr in a file (a CI log): no carriage-return frames, at most one line per
    LOG_EVERY_S (5 s) plus the last; the last line says where the run ended."""
    _, err = _python(f"""
        import sys, time
        from fedharness.base import progress
        from fedharness.cli import main
        start = time.monotonic()
        code = main(["run", "dataset=quadratic", "rounds=300", "eval_every=1", "results_dir={tmp_path / 'results'}"])
        print(f"elapsed {{time.monotonic() - start}} every {{progress.LOG_EVERY_S}}", file=sys.stderr)
        raise SystemExit(code)
    """, tmp_path)
    lines = [line for line in err.splitlines() if line.startswith("rounds:")]
    _, elapsed, _, every = next(line for line in err.splitlines() if line.startswith("elapsed")).split()
    assert "\r" not in err
    # its first line, one per LOG_EVERY_S of the run's time (none on an idle machine), and its last
    assert 1 <= len(lines) <= math.floor(float(elapsed) / float(every)) + 2, err[-2000:]
    assert lines[-1].startswith("rounds: 300/300 rnd, train_loss=")


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 7 s idle
def test_progress_lines_are_spaced_in_time_and_the_solver_status_too(tmp_path):
    """2 s of round updates at 5 ms each with lines every 0.5 s: about 5 lines, not 400 frames; the exact
    solver's status (shown once a solve takes a second) the same way."""
    _, err = _python("""
        import time
        from fedharness.base import progress
        from fedharness.assembly.reference_policy import _status
        progress.LOG_EVERY_S = 0.5
        bar = progress.ProgressBar(400, True)
        start = time.monotonic()
        for rnd in range(1, 401):
            bar(rnd, [{"train_loss": 1.0 / rnd}])
            time.sleep(0.005)
        bar.close()
        print(f"elapsed {time.monotonic() - start}", file=__import__("sys").stderr)
        start = time.monotonic()
        with _status(True, "exact reference w*") as tick:
            for i in range(300):
                tick(0, i, 0.5 ** i)
                time.sleep(0.005)
        print(f"solved {time.monotonic() - start}", file=__import__("sys").stderr)
        with _status(True, "quick solve") as tick:  # under a second: nothing at all
            tick(0, 1, 1.0)
    """, tmp_path)
    assert "\r" not in err
    rounds = [line for line in err.splitlines() if line.startswith("rounds:")]
    elapsed = float(next(line for line in err.splitlines() if line.startswith("elapsed")).split()[1])
    assert 2 <= len(rounds) <= math.floor(elapsed / 0.5) + 2, rounds
    assert rounds[0].startswith("rounds: 1/400 rnd") and rounds[-1].startswith("rounds: 400/400 rnd, train_loss=0.0025")
    solve = [line for line in err.splitlines() if line.startswith("exact reference w*")]
    solved = float(next(line for line in err.splitlines() if line.startswith("solved")).split()[1])
    # ~1.5 s: nothing in the first second, then one line per 0.5 s (3 lines on an idle machine), and the last
    assert 1 <= len(solve) <= math.floor(max(solved - 1.0, 0.0) / 0.5) + 2, solve
    assert solve[-1].startswith("exact reference w*: Newton step 1, CG step 299, ||grad F|| = ")
    assert "quick solve" not in err


def test_a_terminal_gets_a_tqdm_auto_bar():
    from tqdm.auto import tqdm

    from fedharness.base.progress import LogLines, progress_bar

    main, other = os.openpty()
    with os.fdopen(other, "w") as tty:
        bar = progress_bar("rounds", 10, "rnd", file=tty)
        assert isinstance(bar, tqdm)
        bar.close()
    os.close(main)
    with open(os.devnull, "w") as file:
        assert isinstance(progress_bar("rounds", 10, "rnd", file=file), LogLines)
        assert isinstance(progress_bar("rounds", 10, "rnd", enabled=False, file=file), tqdm)  # disabled: silent


class Mlp(nn.Module):
    """A user's net: one hidden layer."""

    def __init__(self, in_shape, num_classes, hidden=16):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(in_shape), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@pytest.fixture
def four_threads(monkeypatch):
    """A process whose torch default is 4 threads, on a quiet machine (all 4 cores free, whatever this machine's
    load); the tests' 1 thread restored afterwards."""
    from fedharness.base import runtime

    monkeypatch.setattr(runtime, "_SET", None)
    monkeypatch.setattr(runtime, "free_cores", lambda *args, **kwargs: 4)
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def user_net():
    from hydra.core.config_store import ConfigStore

    import fedharness
    from fedharness.problems import MODELS

    models = dict(MODELS)
    repo = ConfigStore.instance().repo
    stored = set(repo.get("model", {}))
    fedharness.register_model("mlp_threads", Mlp, hidden=16)
    yield
    MODELS.clear()
    MODELS.update(models)
    for name in set(repo.get("model", {})) - stored:
        del repo["model"][name]


def _expected(dim: int, clients: int, batch: int, replicas: int) -> int:
    """The documented rule: one thread per 2^20 multiply-adds of a step, at least 1, at most the 4 available."""
    return max(1, min(4, dim * clients * batch * replicas // 2**20))


@pytest.mark.parametrize("overrides, dim, replicas", [
    (["model=logreg"], (60 + 1) * 10, 1),  # built-in linear model: 146k per step, 1 thread
    (["model=mlp_threads"], 60 * 16 + 16 + 16 * 10 + 10, 1),  # a user's tiny net: 1 thread (was torch's 4)
    (["model=mlp_threads", "model.hidden=2048"], 60 * 2048 + 2048 + 2048 * 10 + 10, 1),  # a big one: all 4
    (["model=mlp_threads", "model.hidden=128"], 60 * 128 + 128 + 128 * 10 + 10, 1),  # 2.2M per step: 2
    (["model=logreg"], (60 + 1) * 10, 16),  # 16 replicas: 2.3M per step, 2 threads
])
def test_null_threads_follow_the_work_of_a_step(run_config, four_threads, user_net, overrides, dim, replicas):
    from fedharness.runs.execute import prepare_run

    settings = run_config("dataset=synthetic", "reference=off", "kernel=vmap", f"replicas={replicas}", *overrides)
    run = prepare_run(settings)
    assert run.problem.dim == dim  # the measure uses the problem's real size
    expected = _expected(dim, 10, 24, replicas)
    assert torch.get_num_threads() == expected
    if expected < 4:  # a later big run in the same process gets the 4 back, not the 1 a tiny run set
        prepare_run(run_config("dataset=synthetic", "reference=off", "kernel=vmap", "model=mlp_threads",
                               "model.hidden=2048"))
        assert torch.get_num_threads() == 4


def test_explicit_threads_win(run_config, four_threads):
    from fedharness.runs.execute import prepare_run

    prepare_run(run_config("dataset=synthetic", "reference=off", "threads=3", "model=logreg"))
    assert torch.get_num_threads() == 3
