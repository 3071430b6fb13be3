"""A DP run with its defaults (issue 35): adaptive clipping's default count noise satisfies sigma_b > z/2 at any z;
the CLI's summary says epsilon, delta and the noise multiplier z used; the accountant's absl logging leaves the
root logger as it found it, so no log line of a DP run is printed twice (W&B's included)."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

import dp_accounting
import pyarrow.dataset as ds
import pytest

from fedharness.algorithms import accounting
from fedharness.algorithms.privacy import DPFedAvg
from fedharness.cli import main

DIGITS = ["dataset=digits", "rounds=2", "eval_every=1", "progress=false", "threads=1", "reference=off",
          "heterogeneity=false"]  # digits: 20 clients, K = 10 per round (q = 0.5)
PRIVACY_LINE = re.compile(r"^privacy: epsilon = (\S+) at delta = (\S+) after (\d+) rounds \((\w+)\); "
                          r"noise multiplier z = (\S+) \((.+)\)$", re.M)


def library_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """dp-accounting's RDP answer, composed here without the harness."""
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    return dp_accounting.rdp.RdpAccountant().compose(event, rounds).get_epsilon(delta)


def run_config(results_dir) -> tuple[dict, float]:
    """The config and final epsilon of the one run in `results_dir`."""
    row, = ds.dataset(results_dir / "runs", format="parquet").to_table().to_pylist()
    return json.loads(row["config_json"]), row["epsilon"]


@contextmanager
def bare_root_logger() -> Iterator[logging.Logger]:
    """The root logger as in a fresh `fedharness` process: pytest's capture handlers (added as each test's call
    starts) set aside meanwhile."""
    saved = logging.root.handlers
    logging.root.handlers = []
    try:
        yield logging.root
    finally:
        logging.root.handlers = saved


# --- adaptive clipping's default count noise -------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 10, 100, 1000])
@pytest.mark.parametrize("z", [0.3, 1.0, 5.0, 50.0, 500.0])
def test_the_default_count_noise_keeps_the_update_noise_finite_and_at_most_2_over_sqrt3_z(k, z):
    dp = DPFedAvg(z, 1.0, expected_clients=k, sampling_rate=0.1, delta=1e-5, adaptive=True)
    sigma_b = dp.count_noise
    assert 2 * sigma_b > z
    assert z < dp.update_noise <= z * 2 / 3 ** 0.5 * (1 + 1e-12)  # Andrew et al.'s z_Delta, raised at most 15.5%
    if k / 20 >= z:
        assert sigma_b == k / 20  # Andrew et al.'s suggestion, kept wherever it is valid


def test_adaptive_clipping_with_its_defaults_runs_where_k_over_20_is_below_z_over_2(tmp_path, capsys):
    """The issue's command: digits (K = 10) at z = 1 was refused, K/20 = 0.5 not above z/2. Its summary line
    shows the accountant's epsilon and the z given; the accountant left no handler on the root logger."""
    with bare_root_logger() as root:
        assert main(["run", f"results_dir={tmp_path}", *DIGITS, "algorithm=dp_fedavg", "dp.noise_multiplier=1.0", "dp.adaptive=true"]) == 0
        assert root.handlers == []
    (eps, delta, rounds, kind, z, source), = PRIVACY_LINE.findall(capsys.readouterr().out)
    assert (delta, rounds, kind, z, source) == ("1e-05", "2", "rdp", "1", "dp.noise_multiplier")
    assert float(eps) == pytest.approx(library_epsilon(0.5, 1.0, 2, 1e-5), rel=1e-3)  # printed to 4 digits
    assert float(eps) == pytest.approx(run_config(tmp_path)[1], rel=1e-3)


@pytest.mark.slow  # ~10 s on the loaded 2-core machine: calibration composes the rounds some 20 times
def test_a_calibrated_runs_summary_shows_the_z_it_used_and_its_epsilon(tmp_path, capsys):
    assert main(["run", f"results_dir={tmp_path}", *DIGITS, "algorithm=dp_fedavg", "dp.target_epsilon=3"]) == 0
    (eps, delta, rounds, kind, z, source), = PRIVACY_LINE.findall(capsys.readouterr().out)
    config, recorded = run_config(tmp_path)
    used = config["dp"]["noise_multiplier"]
    assert source == "calibrated to dp.target_epsilon = 3" and float(z) == pytest.approx(used, rel=1e-3)
    assert float(eps) == pytest.approx(library_epsilon(0.5, used, 2, 1e-5), rel=1e-3)
    assert float(eps) == pytest.approx(3, rel=1e-3)


def test_a_run_without_dp_prints_no_privacy_line(tmp_path, capsys):
    assert main(["run", f"results_dir={tmp_path}", *DIGITS, "rounds=1"]) == 0
    out = capsys.readouterr().out
    assert "status=ok" in out and "privacy:" not in out


# --- each log line once ------------------------------------------------------------------------------------

def test_the_accountant_adds_no_root_handler():
    """absl's log() calls logging.basicConfig() when the root has no handler: that handler stayed and printed
    every later line a second time. q = 0.5 makes the RDP accountant log its non-converging orders."""
    with bare_root_logger() as root:
        accounting.epsilon("rdp", 0.5, 1.0371, 3, 1e-5)  # arguments no other test uses: not from the cache
        assert root.handlers == []


def test_a_users_own_root_handler_still_gets_every_record_once():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    with bare_root_logger() as root:
        root.addHandler(handler)
        level = root.level
        root.setLevel(logging.INFO)
        try:
            accounting.composed_epsilon("rdp", [(0.5, 1.0373, 3)], 1e-5)
            logging.getLogger("user.program").info("after the accountant")
        finally:
            root.setLevel(level)
        assert root.handlers == [handler]
    assert [r.getMessage() for r in records] == ["after the accountant"]


@pytest.mark.slow  # ~15 s: a fresh interpreter and W&B's service process
def test_a_dp_run_with_wandb_offline_prints_each_line_once(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    done = subprocess.run([sys.executable, "-m", "fedharness.cli", "run", f"results_dir={tmp_path / 'out'}",
                           *DIGITS, "algorithm=dp_fedavg", "progress=true", "dp.noise_multiplier=1.0", "wandb.enabled=true",
                           "wandb.mode=offline"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    # each message, whichever handler printed it: the CLI's (`fedharness: `) or basicConfig's (`INFO:name:`)
    messages = [re.sub(r"^(fedharness: |[A-Z]+:[\w.]+:)", "", line)
                for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert any(m.startswith("wandb: offline run saved") for m in messages), messages  # logged after the accountant
    assert [m for m, n in collections.Counter(messages).items() if n > 1] == []
