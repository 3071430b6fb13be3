"""A checkpoint of a run whose clients' slots hold 10^4 clients: the client store (each shard writes only the rows
changed since its last checkpoint) against the code before it (commit b496318: every client's state pickled whole
into state.pt by torch.save at every checkpoint), each running the same configuration.

The workload: SCAFFOLD (a control variate c_i of `dim` float64 a client) on quadratic_lazy with N = 10^4 clients,
P clients a round, 2 local steps, a checkpoint every C rounds (so K = P x C sampled, fewer distinct clients change
between two checkpoints). P = 2,000 draws a round of 10^4 (with replacement, the default sampler: about 1,813
distinct clients) miss a given client with probability (1 - 10^-4)^2000 = e^-0.2, so after r rounds about
10^4 e^(-0.2 r) clients hold no slot yet: the checkpoints timed are those from round `--from-round` on (46: about
one client left out), and each one's count of clients with a slot is recorded. Each process runs the same seed, so
both versions train the same clients and write the same values. The client store writes every shard's whole table
at a compaction (core/client_store.py COMPACT_AFTER: round 49 of those timed): those checkpoints are reported apart,
and the mean over a cycle of COMPACT_AFTER checkpoints (COMPACT_AFTER - 1 of changed rows, one compacting).

A checkpoint's time is the wall clock of Checkpointer.save (the shards' files, state.pt, the rows part); its bytes
are those the results store writes under checkpoints/ during it (state.pt and the clients/ files, counted apart).
The baseline runs from `git archive <rev>` of this repository unpacked in a temporary folder, imported in place of
this checkout (a path finder ahead of the installed one), with this checkout's Python and packages.

Pairs of processes, one of each version back to back, their order alternating from pair to pair; a process's
figure is the median of its timed checkpoints; the table gives each pair's and the median over pairs.

    python benchmarks/bench_client_store.py [--pairs 5 --dim 500 --per-round 2000 --every 1]

Writes benchmarks/out/client_store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from outputs import publish  # noqa: E402

from fedharness.core.client_store import COMPACT_AFTER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "b496318"  # the commit before the client store

CHILD = r"""
import io, json, os, statistics, sys, time
import torch
root = {root!r}
if root:  # the baseline checkout's folders in place of the installed ones
    from importlib.machinery import PathFinder
    from importlib.util import spec_from_file_location
    PACKAGES = {{"fedharness": "harness", "fedharness.algorithms": "algorithms",
                "fedharness.partitions": "partitions"}}
    class Baseline:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name in PACKAGES:
                folder = os.path.join(root, PACKAGES[name])
                return spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                               submodule_search_locations=[folder])
            return None
    sys.meta_path.insert(0, Baseline)
import fedharness
assert fedharness.__file__.startswith(root or {this!r}), fedharness.__file__
from fedharness.config.load import load_settings
from fedharness.core.checkpoint import Checkpointer
from fedharness.results.store import FileStore
from fedharness.runs.execute import execute

written = {{"state": 0, "clients": 0}}
parts = []  # the clients/ files of the checkpoint (the client store's only)
plain_write = FileStore.write
def counting_write(self, key, data):
    if key.startswith("checkpoints/"):
        written["clients" if "/clients/" in key else "state"] += len(data)
        if "/clients/" in key:
            parts.append(data)
    plain_write(self, key, data)
FileStore.write = counting_write

checkpoints = []
plain_save = Checkpointer.save
def timed_save(self, state):
    written.update(state=0, clients=0)
    parts.clear()
    start = time.perf_counter()
    plain_save(self, state)
    seconds = time.perf_counter() - start
    if state.round >= {from_round}:  # the population's slots filled: counted outside the timed save
        rows = sum(len(part["client"]) for data in parts
                   for part in torch.load(io.BytesIO(data), weights_only=True)["slots"].values())
        files = getattr(self, "client_files", [])  # the client store's: a compaction lists this round's alone
        checkpoints.append({{"round": state.round, "seconds": seconds, **written, "rows_in_clients_files": rows,
                             "clients_with_slots": len(self.executor.get_state()),
                             "full": bool(files) and all("/round={{:08d}}-".format(state.round) in k for k in files)}})
Checkpointer.save = timed_save

s = load_settings({overrides!r})
execute(s)
print(json.dumps({{"median_seconds": statistics.median(c["seconds"] for c in checkpoints),
                   "checkpoints": checkpoints}}))
"""


def overrides(args, out: str) -> list[str]:
    return ["dataset=quadratic_lazy", "dataset.num_clients=10000", f"dataset.dim={args.dim}", "algorithm=scaffold",
            f"algorithm.clients_per_round={args.per_round}", "algorithm.local_steps=2", "algorithm.client_lr=0.01",
            f"rounds={args.rounds}", f"checkpoint_every={args.every}", f"eval_every={args.every}",
            "progress=false", "threads=1", "reference=off", "dtype=float64", f"results_dir={out}"]


def measure(root: str, args) -> dict:
    """One process of the version at `root` ("": this checkout): its timed checkpoints."""
    with tempfile.TemporaryDirectory(prefix="fedharness-bench-client-store-") as out:
        code = CHILD.format(root=root, this=str(ROOT / "harness"), from_round=args.from_round,
                            overrides=overrides(args, out))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{root or 'this checkout'} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def unpack(rev: str, into: str) -> str:
    """`rev` of this repository as files under `into` (no worktree registered)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def median_of(runs: list[dict], key: str, full: bool | None = None) -> float | None:
    """The median over processes of each one's median over its timed checkpoints (`full`: those that compacted,
    or not; None: all) of `key`; None where no process had one."""
    per_run = [statistics.median(c[key] for c in run["checkpoints"] if full is None or c["full"] == full)
               for run in runs if any(full is None or c["full"] == full for c in run["checkpoints"])]
    return statistics.median(per_run) if per_run else None


def cells(run: dict, full: bool) -> str:
    """A process's median seconds and MB (state.pt + clients/) of its checkpoints that compacted (`full`) or not."""
    mine = [c for c in run["checkpoints"] if c["full"] == full]
    if not mine:
        return "- | -"
    return (f"{statistics.median(c['seconds'] for c in mine):.3f} | "
            f"{statistics.median(c['state'] + c['clients'] for c in mine) / 1e6:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dim", type=int, default=500, help="c_i's length: dim x 8 bytes a client")
    parser.add_argument("--per-round", type=int, default=2000, help="P: clients a round")
    parser.add_argument("--every", type=int, default=1, help="C: rounds between checkpoints")
    parser.add_argument("--rounds", type=int, default=56)
    parser.add_argument("--from-round", type=int, default=46, help="the first checkpoint timed")
    parser.add_argument("--baseline", default=BASELINE, help="the commit before the client store")
    args = parser.parse_args()
    load = os.getloadavg()
    lines = [f"SCAFFOLD on quadratic_lazy, N = 10^4, dim {args.dim} float64 ({8 * args.dim:,} bytes of c_i a "
             f"client), P = {args.per_round} a round, a checkpoint every {args.every} round(s), checkpoints of "
             f"rounds {args.from_round}-{args.rounds - 1} timed, 1 thread; load average {load[0]:.2f} {load[1]:.2f} "
             f"{load[2]:.2f} at the start", "",
             "| pair | first | before, s | before, MB | after, s | after, MB | rows written | after, compacting, s "
             "| after, compacting, MB |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    pairs = []
    with tempfile.TemporaryDirectory(prefix="fedharness-baseline-") as tmp:
        versions = {"before": unpack(args.baseline, tmp), "after": ""}
        for i in range(args.pairs):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            run = {name: measure(versions[name], args) for name in order}
            pairs.append({"first": order[0], **run})
            rows = statistics.median(c["rows_in_clients_files"] for c in run["after"]["checkpoints"] if not c["full"])
            lines.append(f"| {i + 1} | {order[0]} | {cells(run['before'], False)} | {cells(run['after'], False)} | "
                         f"{rows:,.0f} | {cells(run['after'], True)} |")
            print(lines[-1], flush=True)
    before, after = [p["before"] for p in pairs], [p["after"] for p in pairs]
    slots = sorted({c["clients_with_slots"] for r in before + after for c in r["checkpoints"]})
    record = {"overrides": overrides(args, "<tmp>"), "baseline": args.baseline, "loadavg_at_start": load,
              "compact_after": COMPACT_AFTER, "clients_with_slots": slots, "pairs": pairs}
    for name, runs, full in (("before", before, None), ("after", after, False), ("after_compacting", after, True)):
        record[f"median_seconds_{name}"] = median_of(runs, "seconds", full)
        state, clients = median_of(runs, "state", full), median_of(runs, "clients", full)
        record[f"median_bytes_{name}"] = None if state is None else state + clients
    lines.append(f"median over {args.pairs} pairs: before {record['median_seconds_before']:.3f} s and "
                 f"{record['median_bytes_before'] / 1e6:.2f} MB a checkpoint; after {record['median_seconds_after']:.3f}"
                 f" s and {record['median_bytes_after'] / 1e6:.2f} MB a checkpoint of changed rows")
    if record["median_bytes_after_compacting"] is not None:
        cycle = {unit: ((COMPACT_AFTER - 1) * record[f"median_{unit}_after"]
                        + record[f"median_{unit}_after_compacting"]) / COMPACT_AFTER for unit in ("seconds", "bytes")}
        record["cycle_mean"] = cycle
        lines[-1] += (f", {record['median_seconds_after_compacting']:.3f} s and "
                      f"{record['median_bytes_after_compacting'] / 1e6:.2f} MB at a compaction; over a cycle of "
                      f"{COMPACT_AFTER} checkpoints {cycle['seconds']:.3f} s and {cycle['bytes'] / 1e6:.2f} MB on "
                      "average")
    lines.append(f"clients with a slot at the timed checkpoints: {slots[0]:,}-{slots[-1]:,}; load average "
                 f"{os.getloadavg()[0]:.2f} at the end")
    print("\nsummary:", flush=True)
    publish(record, lines, "client_store")


if __name__ == "__main__":
    main()
