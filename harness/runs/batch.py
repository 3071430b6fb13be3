"""Batched runs: several runs that differ only in batchable keys (step sizes, E, mu, momenta, schedule parameters,
seed) trained as one, one slot of the replica axis per run (docs/tuning.md, Batched trials).

Each slot is recorded as its own run in runs/ and rounds/, exactly as if run alone, plus the `batch_id` of the
batch it ran in. A slot that diverges, is pruned (its `on_eval` raises optuna.TrialPruned), fails, or finishes
its rounds leaves the batch without disturbing the others.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from fedharness.algorithms.solvers import PER_COPY, LocalSGD
from fedharness.registry.groups import METRICS
from fedharness.core.engine import NetworkModel
from fedharness.core.slots import BatchedEngine, SlotEnd, SlotSet
from fedharness.errors import ConfigError, require
from fedharness.runs.lifecycle import interrupts_raised
from fedharness.assembly.build import algorithm_for
from fedharness.runs.execute import (RunResult, _end_status, _exact_references, _now, _run_row, build_executor,
                               new_run_id, prepare_run, set_threads)
from fedharness.settings import PartSettings, RunSettings
from fedharness.sinks.parquet import ParquetSink
from fedharness.sinks.wandb_sink import open_sink as open_wandb
from fedharness.results.store import ResultsStore, open_store

# The keys a slot may set on its own; every other key must be equal across the slots of one batch.
# (`seed` also picks the data unless dataset.data_seed is set, so slots of different seeds share a batch only then.)
BATCHABLE_KEYS = ("seed", "rounds", "eval_every", "replicas", "algorithm.client_lr", "algorithm.server_lr",
                  "algorithm.local_steps", "algorithm.mu", "algorithm.momentum", "algorithm.server_momentum",
                  "algorithm.lr_schedule", "algorithm.lr_beta", "algorithm.lr_gamma", "algorithm.decay_at",
                  "algorithm.decay_factor", "algorithm.lr_decay")
# Recorded per run but no part of what is computed: the study, a tuning trial's number, its W&B tag `trial=<n>`.
RECORDED_PER_SLOT = ("study", "trial", "wandb.tags")


@dataclass
class Slot:
    """One run of a batch: its settings as if run alone, its run id, and its `on_eval(rows, state)` (an exception
    from it ends this slot only: status pruned for optuna.TrialPruned, else failed)."""

    settings: RunSettings
    run_id: str | None = None
    on_eval: Callable[[list[dict], Any], None] | None = None


def batch_key(settings: RunSettings) -> str:
    """The run's config without the keys a slot may set on its own, as text: runs with equal keys can share a
    batch. The data seed stays in it (the run's seed where dataset.data_seed is null)."""
    config = copy.deepcopy(settings.config)
    if isinstance(config.get("dataset"), dict) and config["dataset"].get("data_seed") is None:
        config["dataset"]["data_seed"] = settings.seed
    for dotted in (*BATCHABLE_KEYS, *RECORDED_PER_SLOT):
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return json.dumps(config, sort_keys=True, default=str)


def batchable(a: RunSettings, b: RunSettings) -> bool:
    """Whether the two runs can train in one batch."""
    return batch_key(a) == batch_key(b)


@dataclass
class _Record:
    """A slot's recording: its settings as recorded, sink, W&B run, rows and end."""

    settings: RunSettings
    run_id: str
    sink: ParquetSink
    wb: Any
    on_eval: Callable | None
    started: str = ""
    rows: list[dict] = field(default_factory=list)
    end: SlotEnd | None = None


def execute_batch(slots: Sequence[Slot], progress=None, batch_id: str | None = None,
                  store: ResultsStore | None = None) -> list[RunResult]:
    """Train the slots as one batched run; one RunResult per slot, in order, each recorded as its own run with
    `batch_id`. Raises ConfigError, before writing anything, if the slots cannot share a batch. An error while
    training ends every slot still in the batch with status failed (RunResult.error says why); a signal ends them
    interrupted and is raised. `store`: where every slot records (default: the results_dir's, one for all: it is
    not a batchable key), as for execute."""
    require(len(slots) > 0, "slots", [], "at least one run to train")
    batch_id = batch_id or new_run_id()
    settings = [slot.settings for slot in slots]
    check_batch(settings)
    base = _batch_settings(settings)
    set_threads(base)
    run = prepare_run(base)
    trainer = run.algorithm.solver
    per_copy = _per_copy_values(settings, trainer)
    recorded = [s.replace(kernel=run.settings.kernel) for s in settings]  # as its solo run records it
    slot_set = SlotSet(list(range(len(slots))), [algorithm_for(s, run.problem) for s in recorded],
                       *(np.array([getattr(s, k) for s in recorded]) for k in ("seed", "replicas", "rounds",
                                                                               "eval_every")), per_copy)
    exact = _exact_references(run.settings, run.problem, run.reference)
    executor = build_executor(run.settings, run.problem, trainer)
    store = store or open_store(base.results_dir)
    records = [_Record(s, slot.run_id or new_run_id(), None, None, slot.on_eval) for s, slot in zip(recorded, slots)]
    for rec in records:
        rec.sink = ParquetSink(store, rec.run_id, extra_columns=rec.settings.metrics)
        rec.wb = open_wandb(rec.settings, rec.run_id)

    def write_run(rec: _Record, status: str, rounds_done: int, error: str | None = None) -> None:
        rec.sink.write_run({**_run_row(rec.settings, status, rounds_done, rec.started, error), **exact,
                            "batch_id": batch_id})

    def on_rows(i: int, rows: list[dict], state) -> None:
        rec = records[i]
        rec.sink.add_rounds(rows)
        rec.rows.extend(rows)
        if rec.wb is not None:
            rec.wb.log_rows(rows)
        if rec.on_eval is not None:
            rec.on_eval(rows, state)

    def on_end(i: int, end: SlotEnd) -> None:
        rec = records[i]
        rec.end = end
        rec.sink.flush()
        write_run(rec, end.status, end.rounds_done, _error_text(end))
        if rec.wb is not None:
            rec.wb.finish(end.status, rec.sink.store, rec.rows)

    engine = BatchedEngine(run.problem, slot_set, trainer, executor, on_rows=on_rows, on_end=on_end,
                           end_status=_end_status, reference=run.reference, progress=progress,
                           network=NetworkModel.of(base.network), metrics=[METRICS[m] for m in base.metrics])
    with interrupts_raised():
        try:
            for rec in records:
                rec.started = _now()
                write_run(rec, "running", 0)
            engine.run()
        except Exception as err:  # the batch itself failed: every slot still in it ends failed, recorded
            for i in engine.slots.ids:
                on_end(i, SlotEnd("failed", engine.rounds_done, err))
        except BaseException as err:  # a signal: recorded as interrupted, then raised
            for i in engine.slots.ids:
                on_end(i, SlotEnd(_end_status(err), engine.rounds_done, err))
            raise
        finally:
            executor.close()
    return [RunResult(rec.run_id, rec.end.status, rec.rows, store.url, _error_text(rec.end)) for rec in records]


def _error_text(end: SlotEnd) -> str | None:
    """How a slot's runs/ row and RunResult name the exception that ended it (None: none did)."""
    return None if end.error is None else f"{type(end.error).__name__}: {end.error}"


def check_batch(settings: Sequence[RunSettings]) -> None:
    """ConfigError naming the first key that keeps these runs from one batch."""
    first = settings[0]
    for s in settings:
        require(s.checkpoint_every == 0, "checkpoint_every", s.checkpoint_every,
                "0 in a batched run (a batch is not checkpointed; run it alone to checkpoint)")
        require(s.resume is None, "resume", s.resume, "null in a batched run (a batch is not checkpointed)")
        params = s.algorithm.params
        require(params.get("rr", "none") == "none", "algorithm.rr", params.get("rr"),
                "none in a batched run (Richardson-Romberg couples replicas; run it alone)")
        require(not params.get("average", False), "algorithm.average", params.get("average"),
                "false in a batched run (run Polyak averaging alone)")
        if batch_key(s) != batch_key(first):
            key, value, value0 = _first_difference(first.config, s.config)
            raise ConfigError(key, value, f"equal in every run of a batch (the first has {value0!r}); only "
                                          f"{', '.join(BATCHABLE_KEYS)} may differ")


def _first_difference(a: dict, b: dict, prefix: str = "") -> tuple[str, Any, Any]:
    for name in sorted(set(a) | set(b)):
        dotted = f"{prefix}{name}"
        if dotted in BATCHABLE_KEYS or dotted in RECORDED_PER_SLOT or a.get(name) == b.get(name):
            continue
        if isinstance(a.get(name), dict) and isinstance(b.get(name), dict):
            return _first_difference(a[name], b[name], dotted + ".")
        return dotted, b.get(name), a.get(name)
    return "dataset.data_seed", b.get("seed"), a.get("seed")  # equal configs but the seed picks different data


def _batch_settings(settings: Sequence[RunSettings]) -> RunSettings:
    """The settings the batch is built from (problem, threads, kernel, reference, the shards' solver): the first
    slot's, with every slot's replicas, the most rounds, and each per-copy solver key at its largest value."""
    algorithm = settings[0].algorithm.as_dict()
    for name in PER_COPY:
        if name in algorithm:
            algorithm[name] = max(s.algorithm.params[name] for s in settings)
    return settings[0].replace(replicas=sum(s.replicas for s in settings), rounds=max(s.rounds for s in settings),
                               algorithm=PartSettings.of(algorithm))


def _per_copy_values(settings: Sequence[RunSettings], trainer) -> dict[str, np.ndarray]:
    """Each per-copy solver key whose value differs across the slots: [slots] values."""
    out = {}
    for name in PER_COPY:
        values = [s.algorithm.params.get(name) for s in settings]
        if values[0] is not None and len(set(values)) > 1:
            require(isinstance(trainer, LocalSGD), f"algorithm.{name}", values,
                    f"equal in every slot: solver {settings[0].algorithm.params.get('solver')} takes no per-copy "
                    f"{name}")
            out[name] = np.array(values, dtype=np.float64)
    return out
