"""The personalization tables (conf/table/personalization.yaml, personalization_label_flip.yaml,
docs/personalization.md) on a tiny sweep: every number of the rendered Markdown against the Parquet files read
with pyarrow; Ditto's label flipping (the one attack a personal method takes) with a fixed set of Byzantine
clients (attack.fixed), and the other attacks and personal methods still refused in one line."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow.dataset as ds
import pytest
from study_sweeps import tiny_sweep

from fedharness.algorithms.attacks import LabelFlip
from fedharness.algorithms.byzantine import Adversary, fixed_byzantine
from fedharness.cli import main
from fedharness.studies import tables

N, UNSEEN, ROUNDS, REPLICAS = 10, 0.2, 2, 2
POISONED = {"dataset.unseen_clients": [0], "attack": ["label_flip"], "attack.fixed": [True],
            "attack.fraction": [0.5], "eval.clients_table": [True], "eval.per_client": [True]}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> str:
    """FedAvg + fine-tuning and Ditto with a fifth of the clients unseen; both under label flipping with half
    the clients Byzantine for the whole run."""
    tmp = tmp_path_factory.mktemp("ptable")
    grid = [{"algorithm": ["fedavg"], "dataset.unseen_clients": [UNSEEN], "eval.personal": [["global", "finetune"]]},
            {"algorithm": ["ditto"], "dataset.unseen_clients": [UNSEEN],
             "eval.personal": [["global", "finetune", "personal"]]},
            {"algorithm": ["fedavg"], "eval.personal": [["global"]], **POISONED},
            {"algorithm": ["ditto"], "eval.personal": [["global", "personal"]], **POISONED}]
    return tiny_sweep(tmp, grid, ok=4, num_clients=N, sampler="scheme_i", clients_per_round=4, rounds=ROUNDS,
                      replicas=REPLICAS, model="2nn", partition="dirichlet", **{"partition.alpha": 0.5},
                      eval_every=ROUNDS)


def parquet(res: str, table: str):
    return ds.dataset(f"{res}/{table}", format="parquet", partitioning="hive").to_table().to_pandas()


def last_rows(res: str, method: str, poisoned: bool):
    """The final rounds/ row of each replica of the run of `method` (poisoned or not), from the Parquet files."""
    runs, rounds = parquet(res, "runs"), parquet(res, "rounds")
    runs["cfg"] = runs["config_json"].map(json.loads)
    attacked = [(c.get("attack") or {}).get("name", "none") != "none" for c in runs["cfg"]]
    run = runs[[c["algorithm"]["name"] == method and a == poisoned for c, a in zip(runs["cfg"], attacked)]]
    assert len(run) == 1
    r = rounds[(rounds["run_id"] == run["run_id"].iloc[0]) & (rounds["series"] == "iterate")
               & (rounds["round"] == ROUNDS)]
    assert sorted(r["replica"]) == list(range(REPLICAS))
    return run.iloc[0], r


def cell(values, c: str) -> list[float]:
    """A table cell's numbers from the seeds' rows: mean over seeds, std over seeds, p10 and p90 means, in %."""
    return [100 * values[f"{c}_mean"].mean(), 100 * values[f"{c}_mean"].std(), 100 * values[f"{c}_p10"].mean(),
            100 * values[f"{c}_p90"].mean()]


def matches(text: str, expected: list[float] | str) -> bool:
    """Whether a cell "m ± s (p10–p90)" shows `expected`: each number within half a unit of its last printed digit
    (the table rounds to it) plus 1e-9 (the runner's sums over seeds and pandas' differ in the last bits)."""
    if isinstance(expected, str):
        return text == expected  # a text cell: the dash of a method without personal models
    shown = re.findall(r"-?\d+(?:\.\d+)?", text)
    return len(shown) == len(expected) and all(
        abs(float(v) - e) <= 0.5 * 10.0 ** -len(v.partition(".")[2]) + 1e-9 for v, e in zip(shown, expected))


def test_the_table_matches_the_parquet_rows(sweep, tmp_path):
    out = tmp_path / "docs"
    assert tables.main(["personalization", sweep, "--out", str(out)]) == 0
    lines = (out / "table.md").read_text().splitlines()
    assert lines[0].startswith(f"**digits, {N} clients split Dirichlet(0.5), model 2nn**: {REPLICAS} seeds, "
                               f"{ROUNDS} rounds")
    rows = {line.strip("| ").split(" | ")[0]: line.strip("| ").split(" | ") for line in lines
            if line.startswith("| ") and not line.startswith("| method")}
    assert set(rows) == {"FedAvg + fine-tuning", "Ditto"}  # the poisoned runs are the other table's
    _, fedavg = last_rows(sweep, "fedavg", poisoned=False)
    _, ditto = last_rows(sweep, "ditto", poisoned=False)
    for name, r in (("FedAvg + fine-tuning", fedavg), ("Ditto", ditto)):
        expected = [name, cell(r, "client_acc"), cell(r, "client_acc_finetune"),
                    cell(r, "client_acc_personal") if name == "Ditto" else "–",
                    cell(r, "unseen_client_acc"), cell(r, "unseen_client_acc_finetune"),
                    cell(r, "unseen_client_acc_personal") if name == "Ditto" else "–"]
        assert rows[name][0] == name and all(matches(t, e) for t, e in zip(rows[name][1:7], expected[1:])), name
    gap = 100 * (ditto["client_acc_personal_mean"].mean() - fedavg["client_acc_finetune_mean"].mean())
    assert matches(rows["Ditto"][7], [gap]) and rows["FedAvg + fine-tuning"][7] == "–"
    # not vacuous: the personal and unseen columns were written
    assert ditto["client_acc_personal_mean"].notna().all() and fedavg["unseen_client_acc_finetune_mean"].notna().all()


def benign_mean(res: str, method: str, protocol: str) -> np.ndarray:
    """Per replica: the mean accuracy over the clients outside fixed_byzantine's set, from clients/ alone."""
    run, _ = last_rows(res, method, poisoned=True)
    clients = parquet(res, "clients")
    c = clients[(clients["run_id"] == run["run_id"]) & (clients["round"] == ROUNDS)
                & (clients["protocol"] == protocol)]
    out = []
    for rep in range(REPLICAS):
        bad = fixed_byzantine(0.5, int(run["cfg"]["seed"]), rep, N)
        assert len(bad) == N // 2  # floor(0.5 x 10)
        mine = c[(c["replica"] == rep) & ~c["client"].isin(bad) & c["acc"].notna()]
        assert len(mine) > 0
        out.append(mine["acc"].mean())
    return np.array(out)


def test_the_label_flip_table_matches_the_clients_files(sweep, tmp_path):
    out = tmp_path / "docs"
    assert tables.main(["personalization_label_flip", sweep, "--out", str(out)]) == 0
    rows = [line.strip("| ").split(" | ") for line in (out / "table.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| method")]
    fedavg_global = benign_mean(sweep, "fedavg", "global")
    ditto_personal = benign_mean(sweep, "ditto", "personal")
    ditto_global = benign_mean(sweep, "ditto", "global")
    pm = lambda v: f"{100 * v.mean():.1f} ± {100 * v.std(ddof=1):.1f}"  # noqa: E731
    assert rows == [["FedAvg", "50%", pm(fedavg_global), "–", "–"],
                    ["Ditto", "50%", pm(ditto_global), pm(ditto_personal),
                     f"{100 * (ditto_personal.mean() - fedavg_global.mean()):+.1f}"]]


def test_fixed_byzantine_clients_are_the_same_every_round():
    adversary = Adversary(LabelFlip(), 0.3, fixed=True, clients=20)
    bad = fixed_byzantine(0.3, 7, 1, 20)
    assert len(bad) == 6 and len(set(bad)) == 6  # floor(0.3 x 20)
    ids = np.array([0, 3, 5, 8, 11, 14, 17, 19])
    for rnd in (1, 2, 50):
        assert (adversary.mask(7, 1, rnd, ids) == np.isin(ids, bad)).all()
    assert not (fixed_byzantine(0.3, 7, 0, 20) == bad).all()  # each replica its own


ACCEPTED = [["algorithm=ditto", "attack=label_flip", "attack.fraction=0.25"],
            ["algorithm=ditto", "attack=label_flip", "attack.fixed=true", "attack.fraction=0.5"],
            ["algorithm=fedavg", "attack=label_flip", "attack.fixed=true", "attack.fraction=0.8",
             "eval.personal=[global]"]]
REFUSED = [
    (["algorithm=ditto", "attack=sign_flip", "algorithm.aggregator=mean"], "invalid value for 'attack': 'sign_flip' "
     "(none or label_flip with algorithm.solver=ditto (not yet combined with personal models))"),
    (["algorithm=apfl", "attack=label_flip"], "invalid value for 'attack': 'label_flip' (none with "
     "algorithm.solver=apfl (not yet combined with personal models))"),
    (["algorithm=pfedme", "attack=label_flip"], "invalid value for 'attack': 'label_flip' (none with "
     "algorithm.solver=pfedme (not yet combined with personal models))"),
    (["algorithm=ditto", "attack=label_flip", "attack.fraction=0.5"], "invalid value for 'attack.fraction': 0.5 "
     "(a finite number in [0, 0.5) (or in [0, 1) with attack.fixed=true: a fixed share of the training clients))"),
]
TINY = ["dataset=digits", "dataset.num_clients=6", "model=2nn", "rounds=1", "eval_every=1", "threads=1",
        "algorithm.local_steps=1", "algorithm.clients_per_round=2", "reference=off", "progress=false"]


@pytest.mark.parametrize("overrides", ACCEPTED)
def test_ditto_takes_label_flipping(tmp_path, overrides):
    personal = [] if "eval.personal=[global]" in overrides else ["eval.personal=[global,personal]"]
    assert main(["run", *TINY, *personal, *overrides, f"results_dir={tmp_path / 'r'}"]) == 0


@pytest.mark.parametrize("overrides, message", REFUSED)
def test_other_attacks_and_methods_are_refused(tmp_path, capsys, overrides, message):
    results = tmp_path / "r"
    assert main(["run", *TINY, "eval.personal=[global,personal]", *overrides, f"results_dir={results}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fedharness: error: {message}"]
    assert not results.exists()
