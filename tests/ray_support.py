"""Shared pieces of the Ray tests: a local instance per module, trajectories, Parquet read-back, process lookup."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import torch

from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.assembly.build import build_parts
from fedharness.settings import RunSettings

# Small problems: these tests check equality of trajectories, not learning.
SMALL = ["dataset.num_clients=12", "dataset.samples_per_client=30", "dtype=float64", "replicas=2",
         "algorithm.batch_size=10", "algorithm.local_steps=4", "algorithm.clients_per_round=5",
         "heterogeneity=false"]
# Noisy heterogeneous quadratics: closed-form reference (runs through execute() start fast), stochastic
# gradients drawn from the (seed, replica, round, client) streams like minibatches are.
QUADRATIC = ["dataset=quadratic", "dataset.num_clients=12", "dataset.dim=8", "dataset.curvature=diagonal",
             "dataset.mu=0.5", "dataset.L=2.0", "dataset.noise=0.5", "dtype=float64", "replicas=2",
             "algorithm.local_steps=4", "algorithm.clients_per_round=5", "heterogeneity=false"]
COMPARED = ("train_loss", "grad_norm_sq", "test_loss", "test_acc", "subopt", "dist_to_opt", "local_steps",
            "grad_evals", "bytes_up", "bytes_down", "lr", "tau_eff", "chi2")


def trajectory(settings: RunSettings, executor, rounds: int, problem=None, algorithm=None):
    """Models after every round [rounds + 1, R, D] and the final state, on `executor`."""
    if problem is None:
        problem, algorithm = build_parts(settings)
    engine = Engine(problem, algorithm, executor, rounds=rounds, seed=settings.seed, replicas=settings.replicas,
                    eval_every=rounds)
    state = engine.initial_state()
    xs = [state.x.clone()]
    for _ in range(rounds):
        state = engine.step(state)
        xs.append(state.x.clone())
    return torch.stack(xs), state


def inline_trajectory(settings: RunSettings, rounds: int):
    problem, algorithm = build_parts(settings)
    executor = InlineExecutor(problem, algorithm.solver, 1)
    xs, state = trajectory(settings, executor, rounds, problem, algorithm)
    return xs, state, executor


def eventually(condition, timeout_s: float = 60.0, every_s: float = 0.2) -> bool:
    """Whether `condition()` becomes true within `timeout_s` (for Ray's asynchronous bookkeeping)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest per-round relative difference ||a_r - b_r|| / ||b_r|| (rounds on the first axis)."""
    num = (a - b).flatten(1).norm(dim=1)
    den = b.flatten(1).norm(dim=1).clamp_min(1e-300)
    return float((num / den).max())


def read_rounds(results_dir: Path, run_id: str) -> list[dict]:
    """Every row of a run's rounds/ parts, sorted by (series, round, replica)."""
    table = ds.dataset(Path(results_dir) / "rounds" / f"run_id={run_id}", format="parquet").to_table()
    return sorted(table.to_pylist(), key=lambda r: (r["series"], r["round"], r["replica"]))


def assert_rows_match(got: list[dict], want: list[dict], rel: float = 1e-6) -> None:
    """Each (series, round, replica) exactly once, and metrics equal to `want` within `rel`."""
    keys = [(r["series"], r["round"], r["replica"]) for r in got]
    assert len(keys) == len(set(keys)), "a round is recorded twice"
    assert keys == [(r["series"], r["round"], r["replica"]) for r in want], "rounds missing or extra"
    for g, w in zip(got, want):
        for name in COMPARED:
            if w.get(name) is None:
                assert g.get(name) is None, (name, g["round"])
            else:
                assert np.isclose(g[name], w[name], rtol=rel, atol=1e-12), (name, g["round"], g[name], w[name])


def descendants(root: int | None = None) -> dict[int, str]:
    """{pid: command line} of every process below `root` (default: this one), read from /proc."""
    parent, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    found, frontier = {}, [os.getpid() if root is None else root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = cmdline.get(child, "")
                frontier.append(child)
    return found


def shard_actor_pids() -> list[int]:
    """Processes of ShardActors started under this test process (never anyone else's)."""
    return sorted(pid for pid, cmd in descendants().items() if "ShardActor" in cmd)


def override_values(overrides: list[str]) -> dict:
    """Command-line overrides as a sweep's `base` mapping: each key (with its `+`) to the value Hydra parses from
    its text (`rounds=4` -> 4), as a sweep YAML file would hold it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.input_line.split("=", 1)[0]: o.value() for o in parsed}
