"""Checkpoints and resume: `checkpoint_every` rounds, and `fedharness run ... resume=<run_id>`.

Layout: `<results_dir>/checkpoints/run_id=<id>/meta.json` (the run's config, written when
the run starts) and `state.pt` (the latest RunState and every client's state, replaced
atomically). A checkpoint first flushes the Parquet sink, so a `rounds/` part never
straddles a checkpoint; resuming drops the parts past the checkpoint and replays from it.
Random streams are keyed by round, so the RunState (round, model, server state and
context, counters, series state) and the clients' state are all a run needs to continue
on exactly the same trajectory.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from harness.engine import RunState
from harness.errors import ConfigError, require

FORMAT = 1
# Keys that may differ between a run and its resumption: where and how it executes, not what it computes.
RESUME_FREE = ("resume", "progress", "executor", "num_shards", "ray", "checkpoint_every", "results_dir", "wandb")
_RUN_ID = re.compile(r"^[A-Za-z0-9._=-]+$")


def validate_checkpoint_config(cfg: dict[str, Any]) -> None:
    every = cfg.get("checkpoint_every", 0)
    require(isinstance(every, int) and not isinstance(every, bool) and every >= 0, "checkpoint_every", every,
            "must be an integer >= 0 (0: no checkpoints)")
    run_id = cfg.get("resume")
    require(run_id is None or (isinstance(run_id, str) and _RUN_ID.match(run_id) is not None and run_id != ".."),
            "resume", run_id, "null, or the run_id of a checkpointed run (letters, digits, . _ - =)")


def checkpoint_dir(results_dir: str | Path, run_id: str) -> Path:
    return Path(results_dir) / "checkpoints" / f"run_id={run_id}"


def _atomic(path: Path, write) -> None:
    """Write through a unique temporary name in the same folder, fsync, rename: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _plain(cfg: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(cfg, sort_keys=True, default=str))


class Checkpointer:
    """Saves a run's state every `checkpoint_every` rounds (the engine calls `save`)."""

    def __init__(self, cfg: dict[str, Any], run_id: str, started: str, sink, executor):
        self.dir = checkpoint_dir(cfg["results_dir"], run_id)
        self.sink, self.executor = sink, executor
        self.round: int | None = None  # the last round saved (a resumed run sets its checkpoint's)
        meta = self.dir / "meta.json"
        if not meta.exists():  # a resumed run keeps its original meta
            text = json.dumps({"format": FORMAT, "run_id": run_id, "started_at": started, "config": _plain(cfg)},
                              sort_keys=True, indent=1)
            _atomic(meta, lambda f: f.write(text.encode()))

    def save(self, state: RunState) -> None:
        self.sink.flush()  # rows up to this round are on disk before the state that follows them
        payload = {"format": FORMAT, "round": state.round, "run_state": _moved(state, torch.device("cpu")),
                   "client_state": self.executor.get_state()}
        _atomic(self.dir / "state.pt", lambda f: torch.save(payload, f))
        self.round = state.round


def _moved(state: RunState, device: torch.device) -> RunState:
    return RunState(state.round, _to(state.x, device), _to(state.server_state, device), dict(state.counters),
                    _to(state.server_ctx, device), _to(state.series_state, device), state.wall_s)


def _to(obj, device: torch.device):
    """`obj` with every tensor inside dicts, lists and tuples moved to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


@dataclass
class Resume:
    """What `resume=<run_id>` continues from; `state` is None when no round was checkpointed yet."""

    run_id: str
    started: str
    state: RunState | None
    client_state: dict

    @property
    def round(self) -> int:
        return -1 if self.state is None else self.state.round


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _differences(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    free = lambda k: k.split(".")[0] in RESUME_FREE  # noqa: E731
    return [f"{k} (was {a.get(k)!r}, now {b.get(k)!r})" for k in sorted(set(a) | set(b))
            if not free(k) and a.get(k) != b.get(k)]


def _run_status(results_dir: str | Path, run_id: str) -> str | None:
    path = Path(results_dir) / "runs" / f"run_id={run_id}" / "run.parquet"
    if not path.exists():
        return None
    return pq.read_table(path, columns=["status"]).column("status")[0].as_py()


def load_resume(cfg: dict[str, Any]) -> Resume:
    """Check that `cfg["resume"]` names a checkpointed, unfinished run with the same config; load its state.

    Raises ConfigError (before anything is written) when it does not.
    """
    run_id = cfg["resume"]
    d = checkpoint_dir(cfg["results_dir"], run_id)
    meta_path = d / "meta.json"
    if not meta_path.exists():
        raise ConfigError("resume", run_id, f"no checkpoint of this run under {d.parent}/ (runs write "
                          "checkpoints when checkpoint_every > 0, under the same results_dir)")
    meta = json.loads(meta_path.read_text())
    diffs = _differences(meta["config"], _plain(cfg))
    require(not diffs, "resume", run_id, "the config differs from the checkpointed run's in: " + "; ".join(diffs))
    status = _run_status(cfg["results_dir"], run_id)
    require(status not in ("ok", "diverged"), "resume", run_id, f"this run already finished (status {status})")
    state_path = d / "state.pt"
    if not state_path.exists():
        return Resume(run_id, meta["started_at"], None, {})
    # our own file (written by Checkpointer.save), so unpickling it is as safe as running the harness
    payload = torch.load(state_path, map_location="cpu", weights_only=False)
    return Resume(run_id, meta["started_at"], _moved(payload["run_state"], torch.device(cfg["device"])),
                  payload["client_state"])
