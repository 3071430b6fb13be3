"""Linear speedup where the answer is known, its loss under non-IID partial participation, and the byte and
simulated wall-clock accounting every run records."""

from __future__ import annotations

import pyarrow.dataset as ds
import pytest

from fedharness.studies.reports import build_report, load_results, parse_target
from fedharness.runs.execute import execute
from fedharness.studies.sweep import run_sweep, spec_from_dict

# Yang et al.'s theory schedule eta_L = c1 / (K sqrt(T)), eta = c2 sqrt(K n), with each n given the horizon
# T = T0 / n that linear speedup predicts, and evaluations every e0 / n rounds so that the resolution of
# "first evaluated round at the target" is the same fraction of T for every n (no bias in the fitted slope).
NS = [1, 2, 4, 8]


def horizon_grid(T0: int, e0: int) -> dict:
    return {"algorithm.clients_per_round": NS, "rounds": [T0 // n for n in NS], "eval_every": [e0 // n for n in NS]}


def study(tmp_path, base: dict, grid: dict, zips: list, protocol: dict, target: str):
    data = {"results_dir": str(tmp_path / "res"), "runner": "local", "base": base, "grid": grid, "zip": zips,
            "protocol": protocol}
    result = run_sweep(spec_from_dict(data, "scaling"), echo=lambda line: None)
    assert result.counts() == {"ok": len(result.jobs)}
    t = parse_target(target)
    report = build_report(load_results(tmp_path / "res"), [t], bootstrap=1000, figures=False)
    assert report.tables[f"to_target_{t.slug}"]["censored"].sum() == 0
    return report.tables[f"fit_{t.slug}"].set_index("group")


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 10 s idle
def test_iid_quadratic_with_the_theory_schedule_has_linear_speedup(tmp_path):
    """One curvature for every client: local steps cause no drift, FedAvg is SGD whose noise (gradient noise and
    the sampled clients) averages over n, so T(n) = T(1) / n exactly in the small-step limit."""
    base = {"dataset": "quadratic", "dataset.num_clients": 20, "dataset.spread": 1.0, "dataset.noise": 0.5,
            "dataset.data_seed": 0, "algorithm.sampler": "scheme_i", "algorithm.local_steps": 5, "replicas": 32}
    fit = study(tmp_path, base, horizon_grid(800, 8), [["algorithm.clients_per_round", "rounds", "eval_every"]],
                {"name": "theory", "c1": 0.05, "c2": 1.0}, "subopt<=0.1")
    row = fit.loc["all runs"]
    assert row["points"] == 4 and row["bootstrap"] == 1000
    assert row["b_lo"] <= 1.0 <= row["b_hi"], row.to_dict()
    assert row["b_hi"] - row["b_lo"] < 0.15  # an interval that could have excluded 1


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 16 s idle
def test_non_iid_partial_participation_loses_the_linear_speedup(tmp_path):
    """Same protocol, same n, only the data differ: Synthetic(0,0) split IID against Synthetic(1,1) with one
    generator per client, n of 30 clients per round without replacement. Client drift from the K local steps
    does not shrink with n, so the non-IID exponent is measurably below the IID one."""
    base = {"dataset": "synthetic", "dataset.num_clients": 30, "dataset.samples_per_client": 10,
            "dataset.data_seed": 0, "heterogeneity": False, "algorithm.sampler": "scheme_ii",
            "algorithm.batch_size": 5, "algorithm.local_steps": 5, "replicas": 12}
    grid = {**horizon_grid(400, 8), "partition": ["iid", "natural"], "dataset.alpha": [0.0, 1.0],
            "dataset.beta": [0.0, 1.0]}
    fit = study(tmp_path, base, grid, [["algorithm.clients_per_round", "rounds", "eval_every"],
                                       ["partition", "dataset.alpha", "dataset.beta"]],
                {"name": "theory", "c1": 0.5, "c2": 0.25}, "train_loss<=1.0")
    iid, non_iid = fit.loc["partition.name=iid"], fit.loc["partition.name=natural"]
    assert iid["b_lo"] >= 0.95, iid.to_dict()
    assert non_iid["b_hi"] < 0.92 and non_iid["b_hi"] < iid["b_lo"] - 0.05, (non_iid.to_dict(), iid.to_dict())


def _rows(path) -> list[dict]:
    rows = ds.dataset(path / "rounds", partitioning="hive").to_table().to_pylist()
    return sorted((r for r in rows if r["series"] == "iterate"), key=lambda r: (r["replica"], r["round"]))


@pytest.mark.parametrize("algorithm, factor", [("fedavg", 1), ("scaffold", 2)])
def test_bytes_and_simulated_seconds_follow_the_network_model(run_config, tmp_path, algorithm, factor):
    """Each sampled client moves the model (SCAFFOLD: and its control variate) down and up over its own
    2 MB/s link, then makes tau_k local steps at 0.01 s each: sim_s adds 2 x bytes / bandwidth + max tau x 0.01."""
    cfg = run_config("dataset=quadratic", "dataset.dim=25", f"algorithm={algorithm}", "algorithm.sampler=scheme_i",
                     "algorithm.clients_per_round=4", "algorithm.local_work=random_steps", "algorithm.steps_low=1",
                     "algorithm.steps_high=9", "rounds=6", "eval_every=1", "replicas=3",
                     "network.bandwidth_MB_per_s=2", "network.compute_s_per_step=0.01")
    execute(cfg)
    rows = _rows(tmp_path / "results")
    per_client = 25 * 4 * factor  # float32 parameters (and control variates)
    for prev, row in zip(rows, rows[1:]):
        if row["replica"] != prev["replica"]:
            continue
        up = row["bytes_up"] - prev["bytes_up"]
        assert up == row["bytes_down"] - prev["bytes_down"] and up % per_client == 0
        assert 1 <= up // per_client <= 4  # distinct sampled clients (scheme I draws with replacement)
        steps = row["local_steps"] - prev["local_steps"]  # the round's max tau
        assert 1 <= steps <= 9
        expected = 2 * per_client / 2e6 + steps * 0.01
        assert row["sim_s"] - prev["sim_s"] == pytest.approx(expected, rel=1e-9)
    assert rows[0]["sim_s"] == 0.0 and rows[-1]["sim_s"] > 0


def test_scaffold_sends_twice_the_bytes_of_fedavg(run_config, tmp_path):
    totals = {}
    for algorithm in ("fedavg", "scaffold"):
        cfg = run_config("dataset=quadratic", f"algorithm={algorithm}", "rounds=5", "eval_every=5",
                         f"results_dir={tmp_path / algorithm}")
        execute(cfg)
        last = _rows(tmp_path / algorithm)[-1]
        totals[algorithm] = (last["bytes_up"], last["bytes_down"], last["sim_s"])
    assert totals["scaffold"][0] == 2 * totals["fedavg"][0] and totals["scaffold"][1] == 2 * totals["fedavg"][1]
    assert totals["scaffold"][2] == pytest.approx(2 * totals["fedavg"][2], rel=1e-12)  # compute_s_per_step = 0
