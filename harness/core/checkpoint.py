"""Checkpoints and resume: `checkpoint_every` rounds, and `fedharness run ... resume=<run_id>`.

Layout: `<results_dir>/checkpoints/run_id=<id>/meta.json` (the run's config, written when
the run starts), `state.pt` (the latest RunState, replaced whole, and the list of client-slot files it continues
from) and `clients/`: each shard's slots (core/client_store.py) written since its last checkpoint, one file per shard
and checkpoint, written by the shard itself (the driver never holds the clients' slots) before state.pt names it
(once the files listed come from COMPACT_AFTER checkpoints, the next one writes each shard's whole table and the
files before it are deleted);
all through the run's results store (harness/results/store.py). Resuming, each shard reads every listed file (in
order, later ones overwriting) and keeps its own clients' rows, at any shard count. A checkpoint carries the rows evaluated
since the last one as a Parquet part, and writes that part to `rounds/` only after state.pt: a process killed
between the two leaves the part in the checkpoint, and `restore_rows` (resume, and the command that finds the run
lost) puts it in place. So a `rounds/` part never straddles a checkpoint, and the rows on disk always reach the
checkpoint's round; resuming drops the parts past it and replays from it.
Random streams are keyed by round, so the RunState (round, model, server state and
context, counters, series state, the updates in flight of asynchronous aggregation: algorithms/cadences.py) and the
clients' state are all a run needs to continue
on exactly the same trajectory. state.pt holds plain data only, so that it loads with
torch.load(weights_only=True): a planted file cannot run code when a run is resumed.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fedharness.contracts import Callback, RoundContext
from fedharness.base.mappings import differences
from fedharness.core import client_store
from fedharness.core.engine import RunState
from fedharness.errors import ConfigError, require
from fedharness.settings import RunSettings
from fedharness.results import layout
from fedharness.results.store import ResultsStore, open_store

FORMAT = 3  # 3: the clients' slots in the shards' own files (2: in state.pt, read by the driver: refused)
_NDARRAY = "__ndarray__"  # marks an encoded numpy array in a checkpoint
# Keys that may differ between a run and its resumption: where and how it executes, not what it computes.
RESUME_FREE = ("resume", "progress", "executor", "num_shards", "ray", "checkpoint_every", "results_dir", "wandb",
               "reference_timeout_s", "client_slots_on_disk")


def _store(settings: RunSettings, store: ResultsStore | None) -> ResultsStore:
    return open_store(settings.results_dir) if store is None else store


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(config, sort_keys=True, default=str))


class Checkpointer(Callback):
    """Saves a run's state every `checkpoint_every` rounds, a hook of the run (after the round's rows, so they land
    in the part the checkpoint closes), not after the last round."""

    def __init__(self, settings: RunSettings, run_id: str, started: str, sink, executor):
        """`sink`: the run's ParquetSink; the checkpoint goes to the same results store."""
        self.run_id = run_id
        self.sink, self.store, self.executor = sink, sink.store, executor
        self.every, self.eval_every, self.rounds = settings.checkpoint_every, settings.eval_every, settings.rounds
        payload = _load_state(self.store, run_id)  # a resumed run's files so far (the shards add what changed)
        self.client_files: list[str] = [] if payload is None else list(payload["client_files"])
        meta = layout.checkpoint_meta_key(run_id)
        if not self.store.exists(meta):  # a resumed run keeps its original meta
            text = json.dumps({"format": FORMAT, "run_id": run_id, "started_at": started,
                               "config": _plain(settings.config)},
                              sort_keys=True, indent=1)
            self.store.write(meta, text.encode())

    def _due(self, rnd: int) -> bool:
        return 0 < rnd < self.rounds and rnd % self.every == 0

    def saved_round(self) -> int:
        """The round of the checkpoint in the store (0: none yet), read back rather than noted when saved: a signal
        can land after state.pt is in place (the store's rename done, its fsync not) and before a note is taken,
        and a "resume with" line must name the checkpoint a resume will load."""
        payload = _load_state(self.store, self.run_id)
        return 0 if payload is None else int(payload["round"])

    def on_round_end(self, context: RoundContext) -> None:
        if self._due(context.round) and context.round % self.eval_every != 0:  # no rows this round
            self.save(context.state)

    def on_evaluation(self, context: RoundContext) -> None:
        if self._due(context.round):
            self.save(context.state)

    def save(self, state: RunState) -> None:
        self.sink.flush_clients()  # before the state: a kill between the two resumes from the checkpoint before
        part = self.sink.pending_part()  # the rows up to this round: in the state first, then in rounds/
        run_state = dict(vars(state))  # its fields by name; the parts' states are named tensors (harness/contracts.py)
        # each shard writes its changed slots first: a kill before state.pt leaves files no checkpoint names
        folder = layout.checkpoint_clients_folder(self.run_id)
        full = checkpoints_in(self.client_files) >= client_store.COMPACT_AFTER  # whole tables, the chain dropped
        written = self.executor.checkpoint(self.store, folder, state.round, full)
        files = written if full else self.client_files + written
        payload = {"format": FORMAT, "round": state.round, "run_state": _map(_to(run_state, "cpu"), _encode_array),
                   "client_files": files, "rows_part": part}
        buf = io.BytesIO()
        torch.save(payload, buf)
        self.store.write(layout.checkpoint_state_key(self.run_id), buf.getvalue())
        self.client_files = files
        if full:  # state.pt names the full tables alone now: the older files (and any a kill left) go
            for key in set(self.store.list(folder)) - set(files):
                self.store.delete(key)
        self.sink.flush(part)


def checkpoints_in(client_files: list[str]) -> int:
    """How many checkpoints wrote the chain of client-slot files (one file a shard and checkpoint, named by round)."""
    return len({key.rsplit("/", 1)[-1].split("-clients=")[0] for key in client_files})


def _map(obj, leaf: Callable[[Any], Any]):
    """`obj` with `leaf` applied to everything inside dicts, lists and tuples (an encoded array is a leaf)."""
    if isinstance(obj, dict) and set(obj) != {_NDARRAY}:
        return {k: _map(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, leaf) for v in obj)
    return leaf(obj)


def _to(obj, device: torch.device | str):
    """`obj` with every tensor inside dicts, lists and tuples moved to `device`."""
    return _map(obj, lambda v: v.detach().to(device) if isinstance(v, torch.Tensor) else v)


def _encode_array(value):
    """A numpy array or scalar as (dtype, shape, bytes, is_scalar): plain data that torch.load(weights_only=True)
    reads without unpickling any class, and that gives back the same bits."""
    if not isinstance(value, (np.ndarray, np.generic)):
        return value
    arr = np.asarray(value)
    if arr.dtype.hasobject:
        raise TypeError(f"cannot checkpoint a numpy array of Python objects ({arr.dtype})")
    return {_NDARRAY: (arr.dtype.str, arr.shape, np.ascontiguousarray(arr).tobytes(), isinstance(value, np.generic))}


def _decode_array(value):
    """The inverse of `_encode_array`."""
    if not (isinstance(value, dict) and set(value) == {_NDARRAY}):
        return value
    dtype, shape, raw, scalar = value[_NDARRAY]
    arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    return arr[()] if scalar else arr


@dataclass
class Resume:
    """What `resume=<run_id>` continues from; `state` is None when no round was checkpointed yet."""

    run_id: str
    started: str
    state: RunState | None
    client_files: list[str]  # the shards' client-slot files (core/client_store.py), in the order written

    @property
    def round(self) -> int:
        return -1 if self.state is None else self.state.round


def _differences(old: dict, new: dict) -> list[str]:
    return [f"{k} (was {a!r}, now {b!r})" for k, a, b in differences(old, new) if k.split(".")[0] not in RESUME_FREE]


def _run_status(store: ResultsStore, run_id: str) -> str | None:
    data = store.read(layout.run_key(run_id))
    return None if data is None else pq.read_table(pa.BufferReader(data), columns=["status"])["status"][0].as_py()


def _meta(store: ResultsStore, run_id: str) -> dict | None:
    data = store.read(layout.checkpoint_meta_key(run_id))
    return None if data is None else json.loads(data)


def checkpointed(settings: RunSettings, key: str, store: ResultsStore | None = None) -> Any:
    """The value of `key` in the config the checkpoint of the run that `resume` names recorded; None without a
    readable one (load_resume says why, later). `store`: the results store (default: settings.results_dir's)."""
    try:
        return _meta(_store(settings, store), settings.resume)["config"].get(key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_resume(settings: RunSettings, store: ResultsStore | None = None) -> Resume:
    """Check that `resume` names a checkpointed, unfinished run with the same config; load its state.
    `store`: the results store (default: settings.results_dir's).

    Raises ConfigError (before anything is written) when it does not.
    """
    run_id, store = settings.resume, _store(settings, store)
    meta = _meta(store, run_id)
    if meta is None:
        raise ConfigError("resume", run_id, f"no checkpoint of this run under {store.url}/checkpoints/ (runs "
                          "write checkpoints when checkpoint_every > 0, under the same results_dir)")
    if settings.threads is None:  # null resumes on the count the run recorded (runs/execute.py resolve_threads)
        settings = settings.replace(threads=meta["config"].get("threads"))
    diffs = _differences(meta["config"], _plain(settings.config))
    require(not diffs, "resume", run_id, "the config differs from the checkpointed run's in: " + "; ".join(diffs))
    status = _run_status(store, run_id)
    require(status not in ("ok", "diverged"), "resume", run_id, f"this run already finished (status {status})")
    payload = _load_state(store, run_id)
    if payload is None:
        return Resume(run_id, meta["started_at"], None, [])
    run_state = RunState(**_to(_map(payload["run_state"], _decode_array), torch.device(settings.device)))
    return Resume(run_id, meta["started_at"], run_state, list(payload["client_files"]))


def restore_rows(sink, run_id: str) -> int | None:
    """Put the latest checkpoint's rows part in `sink`'s rounds/ if its process died before writing it; returns
    the checkpoint's round (None: no readable checkpoint)."""
    payload = _load_state(sink.store, run_id)
    if payload is None:
        return None
    part = payload.get("rows_part")
    if part is not None and not sink.store.exists(sink.part_key(part[0])):
        sink.write_part(part)
    return payload["round"]


def _load_state(store: ResultsStore, run_id: str) -> dict | None:
    """state.pt read as plain data only (tensors, numbers, strings, bytes, containers): a planted file
    naming any other class or function is refused, never run. None when the run has none."""
    key = layout.checkpoint_state_key(run_id)
    data = store.read(key)
    if data is None:
        return None
    path = f"{store.url}/{key}"  # as the user can find it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about pickle protocols before refusing a foreign file
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for a foreign pickle, RuntimeError or EOFError for a broken file
        raise ConfigError("resume", run_id, f"{path} is not a checkpoint fedharness wrote; refused to load it "
                          f"({_why_refused(err)})") from None
    written = payload.get("format") if isinstance(payload, dict) else None
    require(written == FORMAT, "resume", run_id, f"{path} is a format-{written} checkpoint, this version resumes "
            f"format {FORMAT} only (format 2 and before kept the clients' state in state.pt; start the run again)")
    return payload


def _why_refused(err: Exception) -> str:
    """The line of torch's long refusal that says what the file asked for."""
    boilerplate = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(boilerplate)]
    return useful[0] if useful else type(err).__name__
