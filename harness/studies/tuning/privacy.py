"""What a study on private data spent: every DP trial looked at the clients' data, so the study's privacy cost is
the composition of all its trials (algorithms/accounting.py composed_epsilon), not the best trial's epsilon."""

from __future__ import annotations

import json

from fedharness.algorithms.accounting import composed_epsilon
from fedharness.results import layout
from fedharness.results.store import ResultsStore
from fedharness.results.tables import read_table


def trial_mechanisms(store: ResultsStore, run_ids: list[str]) -> list[dict]:
    """Each DP trial run's accountant, delta, sampling rate q, noise multiplier z and rounds done (its runs/ row)."""
    found = []
    for run_id in run_ids:
        table = read_table(store, layout.run_key(run_id), columns=["config_json", "rounds_done"])
        if table is None:
            continue
        config = json.loads(table.column("config_json")[0].as_py())
        dp = config.get("dp") or {}
        if dp.get("noise_multiplier") is None:
            continue
        q = config["algorithm"]["clients_per_round"] / config["dataset"]["num_clients"]
        found.append({"accountant": dp["accountant"], "delta": dp["delta"], "q": q, "z": dp["noise_multiplier"],
                      "rounds": table.column("rounds_done")[0].as_py()})
    return found


def study_epsilon(store: ResultsStore, run_ids: list[str]) -> tuple[float, int, dict] | None:
    """(epsilon of all DP trials together, how many, the first one's mechanism); None: no trial used DP. The trials
    of one study share their dp keys (the base config), so the first one's accountant and delta hold for all."""
    trials = trial_mechanisms(store, run_ids)
    if not trials:
        return None
    first = trials[0]
    eps = composed_epsilon(first["accountant"], [(t["q"], t["z"], t["rounds"]) for t in trials], first["delta"])
    return eps, len(trials), first
