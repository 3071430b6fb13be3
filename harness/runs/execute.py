"""Runs from their settings (harness/settings.py): build everything (validating), then train and record each run
to its results store. One lifecycle for every run: a solo run, a batch of runs trained as one (harness/runs/batch.py),
a sweep point, a tuning trial (`execute_runs`); each run recorded through its RunRecord (harness/runs/lifecycle.py)."""

from __future__ import annotations

import datetime as _dt
import inspect
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from fedharness.references.closed_forms import heterogeneity
from fedharness.contracts import Callback
from fedharness.registry.groups import METRICS
from fedharness.core.checkpoint import checkpointed, load_resume
from fedharness.core.engine import BatchedEngine, Engine
from fedharness.core.planning import NetworkModel, client_bytes
from fedharness.core.executors import InlineExecutor, LoopExecutor
from fedharness.core.kernels import resolve_kernel
from fedharness.core.personal import Personal
from fedharness.core.slots import SlotSet
from fedharness.core.stages import Stages
from fedharness.algorithms.series import build_series
from fedharness.problems.client_eval import evaluated_clients
from fedharness.base.extras import require_extra
from fedharness.runs.batch import Slot, batch_settings, check_batch, per_copy_values
from fedharness.runs.lifecycle import (EvalFunction, RunInterrupted, RunRecord, end_status, error_text,
                                       interrupts_raised)
from fedharness.assembly.build import algorithm_for, build_parts, check_slots, stages_for
from fedharness.assembly.privacy import calibrated
from fedharness.assembly.systems import cadence_for, clock_for
from fedharness.base.runtime import apply_runtime, auto_threads, step_work, use_threads
from fedharness.assembly.reference_policy import run_client_minima, run_reference
from fedharness.errors import require
from fedharness.settings import RunSettings
from fedharness.results.store import ResultsStore, open_store, write_behind


@dataclass
class RunResult:
    run_id: str
    status: str
    rows: list[dict]
    results_dir: str  # the results store's url: an absolute path or an object-store URL
    error: str | None = None  # what ended the run early (execute raises it instead)


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def build_executor(settings: RunSettings, problem, solver):
    if settings.executor == "loop":
        return LoopExecutor(problem, solver, exact_sums=settings.sums == "exact",
                            on_disk=settings.client_slots_on_disk)
    if settings.executor == "ray":
        require_extra("ray", "executor", "ray")  # without the extra: one line naming fedharness[ray]
        from fedharness.backends.ray_executor import RayExecutor

        return RayExecutor(settings, problem, solver)
    return InlineExecutor(problem, solver, settings.num_shards, settings.sums == "exact",
                          settings.client_slots_on_disk)


@dataclass
class Prepared:
    """A run built and checked, before any file: its settings as the run records them (the kernel resolved), the
    problem, the algorithm, the exact reference (or None), and the replica layout and series hooks."""

    settings: RunSettings
    problem: Any
    algorithm: Any
    reference: Any
    layout: Any
    series: list
    stages: Any = None  # the update stages (core/stages.py Stages: attack, dp, a user's), in their order
    clock: Any = None  # the systems clock (core/clock.py SystemsClock); None: every client the network's
    cadence: Any = None  # the shape of a server step (contracts.Cadence); None: synchronous rounds


def prepare_run(settings: RunSettings, store: ResultsStore | None = None) -> Prepared:
    """Build problem, algorithm and exact reference: every check that can fail happens here, before any file.
    `store`: where a resumed run's checkpoint is (default: settings.results_dir's store)."""
    problem, algorithm = build_parts(settings)
    settings = resolve_threads(settings, problem, store)  # before kernel timing and the reference
    settings = calibrated(settings)  # dp.target_epsilon: the noise multiplier, before the run starts
    layout, series = build_series(settings.replicas, **settings.algorithm.params)  # rr=H needs a fixed H
    stages = stages_for(settings, algorithm, problem)  # before kernel timing and the reference solve: a refused
    # stage (a compressor on a model with buffers, ...) costs nothing and writes no cache entry
    check_slots(settings, problem, algorithm.solver, stages)  # the clients' slots fit the budget, before any work
    resumed_kernel = checkpointed(settings, "kernel", store) if settings.resume else None
    settings = settings.replace(kernel=resolve_kernel(settings, problem, resumed_kernel))
    cadence = cadence_for(settings, algorithm, problem, stages)
    clock = clock_for(settings, algorithm, problem, client_bytes(problem, algorithm.solver, stages or Stages()),
                      cadence)
    reference = run_reference(settings, problem)  # per `reference: auto | on | off`
    return Prepared(settings, problem, algorithm, reference, layout, series, stages, clock, cadence)


def prepare(settings: RunSettings):
    """`prepare_run`'s problem, algorithm and exact reference."""
    run = prepare_run(settings)
    return run.problem, run.algorithm, run.reference


def exact_references(settings: RunSettings, problem, reference) -> dict:
    """F* and Li et al.'s heterogeneity Gamma = F* - sum p_k F_k* for the run row (null where not known)."""
    if reference is None:
        return {"f_star": None, "gamma_heterogeneity": None}
    minima = run_client_minima(settings, problem, reference)
    return {"f_star": reference.f_star,
            "gamma_heterogeneity": None if minima is None else heterogeneity(problem, reference.f_star, minima)}


def set_threads(settings: RunSettings) -> None:
    """The process's torch settings: `precision` and `deterministic` (harness/base/runtime.py), and intra-op
    threads where `threads` is set (resolve_threads sets them once the problem is built)."""
    apply_runtime(settings.precision, settings.deterministic)  # cuBLAS reads `deterministic` at its first matmul
    if settings.threads is not None:
        use_threads(settings.threads)


def resolve_threads(settings: RunSettings, problem, store: ResultsStore | None = None) -> RunSettings:
    """`settings` with `threads: null` resolved, and torch set to it: threads_for now, or, for a resumed run, the
    count its checkpoint recorded (torch splits a long sum between its threads, so the bits depend on the count:
    the resumed rounds must repeat the uninterrupted ones whatever the load now). The runs/ row, the checkpoint and every Ray shard get the count. A
    checkpoint that recorded null (written before the count was recorded) keeps null, with the work's count."""
    threads = settings.threads
    if threads is None and settings.resume:
        threads = checkpointed(settings, "threads", store)
        if threads is None:
            use_threads(threads_for(settings, problem, load=False))
            return settings
    if threads is None:
        threads = threads_for(settings, problem)
    use_threads(threads)
    return settings.replace(threads=threads)


def threads_for(settings: RunSettings, problem, load: bool = True) -> int:
    """`threads: null`: from the work of one local step (dim x clients per round x batch x replicas), not the
    model's name, so a user's tiny net gets 1 thread like a built-in linear model and a big one gets more; with
    `load`, at most the cores other processes leave free on this machine (not measured for shards on a Ray
    cluster elsewhere, `ray.address` set: their nodes' load is not this machine's)."""
    algo = settings.algorithm
    clients = problem.num_clients if algo.sampler == "full" else min(problem.num_clients, algo.clients_per_round)
    here = settings.executor != "ray" or settings.ray.address is None
    return auto_threads(step_work(problem.dim, clients, settings.algorithm.batch_size, settings.replicas),
                        load=load and here)


def skips_grad_norm(problem) -> bool:
    """Whether the problem's evaluate takes grad_norm (every built-in's does): a user's own Problem written before
    eval.grad_norm existed keeps working, with grad_norm_sq computed as it always was."""
    return "grad_norm" in inspect.signature(problem.evaluate).parameters


def build_engine(run: Prepared, executor, hooks: Sequence[Sequence[Callback]] = ((),),
                 slots: SlotSet | None = None) -> Engine:
    """The engine of a prepared run: alone (its own parts, replica layout and series), or the batch `slots` (several
    runs, trained with the prepared run's solver); `hooks[i]`: slot i's."""
    options = dict(reference=run.reference, network=NetworkModel.of(run.settings.network), clock=run.clock,
                   cadence=run.cadence,
                   metrics=[METRICS[name] for name in run.settings.metrics], end_status=end_status,
                   stages=run.stages, client_eval=clients_to_evaluate(run.settings, run.problem),
                   personal=personal_of(run.settings),
                   grad_norm=run.settings.eval.grad_norm or not skips_grad_norm(run.problem))
    if slots is not None:
        return BatchedEngine(run.problem, slots, run.algorithm.solver, executor, hooks=hooks, **options)
    s = run.settings
    return Engine(run.problem, run.algorithm, executor, rounds=s.rounds, seed=s.seed, replicas=s.replicas,
                  eval_every=s.eval_every, layout=run.layout, series=run.series, hooks=hooks[0], **options)


def personal_of(settings: RunSettings) -> Personal:
    """eval.personal's protocols and finetune's keys, as the engine takes them."""
    ev = settings.eval
    return Personal(ev.personal, ev.finetune_steps, ev.finetune_lr, ev.finetune_every)


def clients_to_evaluate(settings: RunSettings, problem) -> np.ndarray | None:
    """eval.per_client's clients: all, or `eval.clients` of them drawn by the data seed (so every slot of a batch,
    which share the data, scores the same ones); None when per-client evaluation is off."""
    if not settings.eval.per_client:
        return None
    return evaluated_clients(settings.data_seed, problem.num_clients, settings.eval.clients)


def slot_set(run: Prepared, settings: Sequence[RunSettings]) -> SlotSet | None:
    """Several runs' slots, each with its own parts (None for one run: it trains alone). Raises ConfigError when a
    per-copy solver key differs where the solver takes none."""
    if len(settings) == 1:
        return None
    return SlotSet(list(range(len(settings))), [algorithm_for(s, run.problem) for s in settings],
                   *(np.array([getattr(s, k) for s in settings]) for k in ("seed", "replicas", "rounds", "eval_every")),
                   per_copy_values(settings, run.algorithm.solver))


def execute_runs(slots: Sequence[Slot], batch_id: str | None = None,
                 store: ResultsStore | None = None) -> list[RunResult]:
    """Train the runs (several: as one batched run, each slot recorded as its own run with `batch_id`); one
    RunResult per slot, in order. Raises ConfigError, before writing anything, if a config is bad or the runs
    cannot share a batch. An exception ends the runs it reaches with status failed (pruned for optuna.TrialPruned;
    RunResult.error says why); SIGINT/SIGTERM (in the main thread) end every run still training `interrupted` and
    raise RunInterrupted, telling where the run stood. Either way the rounds so far are flushed and `rounds_done` is
    the last completed round. `store` (harness/results/store.py) receives every object the runs write and holds
    the checkpoint a resumed run continues from; default: the store `results_dir` names."""
    return [_result(record) for record in _execute(slots, batch_id, store)]


def execute(settings: RunSettings, run_id: str | None = None, on_eval: Callable | None = None,
            callbacks: Sequence[Callback] = (), hooks: Sequence[Callback] = (),
            store: ResultsStore | None = None) -> RunResult:
    """One run (its settings: fedharness.config.load.load_settings) end to end, as execute_runs, but an exception
    that ended it is raised once it is recorded. `on_eval(rows, state)` is called after every evaluation;
    `callbacks` (harness/contracts.py Callback) see every round and evaluation, one returning True ends the run
    with status stopped; `hooks`: the caller's own (a progress bar)."""
    record = _execute([Slot(settings, run_id, on_eval, callbacks, hooks)], None, store)[0]
    if record.outcome.error is not None:
        raise record.outcome.error
    return _result(record)


def execute_batch(slots: Sequence[Slot], batch_id: str | None = None,
                  store: ResultsStore | None = None) -> list[RunResult]:
    """The slots as one batched run, also a batch of one: refused (ConfigError) where a slot checkpoints, resumes,
    or keeps Richardson-Romberg or averaged series, which only a run alone has; else execute_runs."""
    check_batch([slot.settings for slot in slots])
    return execute_runs(slots, batch_id or new_run_id(), store)


def _execute(slots: Sequence[Slot], batch_id: str | None, store: ResultsStore | None) -> list[RunRecord]:
    require(len(slots) > 0, "slots", [], "at least one run to train")
    settings = [slot.settings for slot in slots]
    if len(slots) > 1:
        check_batch(settings)
        batch_id = batch_id or new_run_id()
    base = batch_settings(settings)
    set_threads(base)
    store = open_store(base.results_dir) if store is None else store
    run = prepare_run(base, store)
    recorded = [run.settings] if len(slots) == 1 else [s.replace(kernel=run.settings.kernel, dp=run.settings.dp,
                                                                 threads=run.settings.threads) for s in settings]
    slots_of_batch = slot_set(run, recorded)
    exact = exact_references(run.settings, run.problem, run.reference)
    resumed = load_resume(run.settings, store) if run.settings.resume else None  # before any cluster or file
    executor = build_executor(run.settings, run.problem, run.algorithm.solver)
    # A batch's runs write their many small objects together, each run's in order (a batch keeps no checkpoints,
    # whose order against the rows matters across runs' keys: harness/runs/batch.py check_batch)
    writes = write_behind(store) if len(slots) > 1 else None
    records = [RunRecord(s, resumed.run_id if resumed else slot.run_id or new_run_id(), writes or store, executor,
                         exact=exact, hooks=_caller_hooks(slot), callbacks=slot.callbacks, batch_id=batch_id,
                         resumed=resumed, client_names=getattr(run.problem, "client_names", None))
               for s, slot in zip(recorded, slots)]
    engine = build_engine(run, executor, [record.hooks for record in records], slots_of_batch)
    # From the `running` rows on, a signal records the runs as interrupted; also while recording their ends, so a
    # second signal cannot cut that short.
    with interrupts_raised():
        try:
            for record in records:
                record.start()
            if writes is not None:
                writes.drain()  # every run is recorded running before any trains
            if resumed is not None and resumed.state is not None:
                executor.restore(store, resumed.client_files)  # each shard reads its own clients' slots
            engine.run(resumed.state if resumed else None)
        except BaseException as err:  # every run still training ends with it, recorded; a signal goes on up
            engine.abort(err)
            if not isinstance(err, Exception):
                _where_it_stood(err, records, engine.rounds_done)
                raise
        finally:
            executor.close()
            if writes is not None:
                writes.close()  # every object written before the runs' results are returned
    return records


def _result(record: RunRecord) -> RunResult:
    outcome = record.outcome
    return RunResult(record.run_id, outcome.status, outcome.rows, record.sink.store.url, error_text(outcome))


def _caller_hooks(slot: Slot) -> list[Callback]:
    return [*([EvalFunction(slot.on_eval)] if slot.on_eval is not None else []), *slot.hooks]


def _where_it_stood(err: BaseException, records: list[RunRecord], rounds_done: int) -> None:
    """A solo run's RunInterrupted says which run it cut, where, and its last checkpoint."""
    if isinstance(err, RunInterrupted) and len(records) == 1:
        err.run_id, err.rounds_done, err.checkpoint_round = records[0].run_id, rounds_done, records[0].checkpoint_round


# eval.per_client's accuracy over clients, in the CLI summary
CLIENT_ACC = ("client_acc_mean", "client_acc_se", "client_acc_p10", "client_acc_p50", "client_acc_p90")


def summary_table(rows: list[dict]) -> str:
    """A short text table of the last evaluated round: mean and std over replicas."""
    last = max(r["round"] for r in rows)
    final = [r for r in rows if r["round"] == last and r["series"] == "iterate"]
    lines = [f"{'metric':<16}{'mean':>14}{'std':>12}   (round {last}, {len(final)} replica(s))"]
    for name in ("train_loss", "train_loss_se", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss", "test_acc",
                 *CLIENT_ACC, "wall_s"):  # train_loss_se: only where train_loss is an estimate
        vals = np.array([r[name] for r in final if r.get(name) is not None], dtype=float)
        if len(vals):
            lines.append(f"{name:<16}{vals.mean():>14.6g}{vals.std():>12.3g}")
    return "\n".join(lines)
