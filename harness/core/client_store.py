"""The client store: what parts keep per (replica, client) across rounds, owned by the shard that owns the client.

A part declares its slots (contracts.ClientSlot: name, shape, dtype, initial value; contracts.KeepsClientState):
SCAFFOLD's c_i, FedBN's buffers, error feedback's residual, a user's personal model. Each ClientShard keeps its
clients' values in a ClientStore: one table per slot, a row for each (replica, client) that has one (a lazy
population of 10^8 clients holds rows only for the clients that took part), in memory or, with
`client_slots_on_disk`, in a memory-mapped file per slot and shard. The driver never holds the population's
slots: each shard writes its own checkpoint files (only the rows changed since its last checkpoint), re-keys its
rows when slots of a batch leave, and restores its clients' rows from every shard's files on resume (at any shard
count). Values go in and come out as the same bits.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import tempfile
import warnings
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from fedharness.contracts import ClientSlot, ClientState, KeepsClientState, Problem
from fedharness.errors import ConfigError, require

FORMAT = 3  # a checkpoint's slot files: {"format", "slots": {name: {replica, client, values}}}
ON_DISK_KEY = "client_slots_on_disk"
_FIRST_ROWS = 16  # a table's first capacity; it doubles as clients take part
# Once the slot files a resume (or a restarted Ray shard) would read come from COMPACT_AFTER checkpoints (snapshots),
# the next one writes every shard's whole table and the files before it are deleted: a reader reads one full table
# and at most COMPACT_AFTER - 1 files of changed rows a shard.
COMPACT_AFTER = 8


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype holding a torch dtype's bits (bfloat16 as its 16-bit words)."""
    return np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


READERS = ("checkpoint", "snapshot")  # who takes the changed rows, each at its own pace (snapshot: Ray's restarts)


class SlotTable:
    """One slot's values, a row per (replica, client) that holds one; `dirty[reader]`: rows written since that
    reader's last `take_changed`."""

    def __init__(self, slot: ClientSlot, directory: str | None, file_id: int):
        self.slot, self.directory, self.file_id = slot, directory, file_id
        self.np_dtype = numpy_dtype(slot.dtype)
        self.rows: dict[tuple[int, int], int] = {}
        self.dirty: dict[str, set[int]] = {reader: set() for reader in READERS}
        self.generation = 0
        self.data = self._alloc(_FIRST_ROWS)

    def _path(self, generation: int) -> str:
        return os.path.join(self.directory, f"slot{self.file_id}.{generation}.bin")

    def _alloc(self, capacity: int) -> np.ndarray:
        shape = (capacity, *self.slot.shape)
        if self.directory is None:
            return np.zeros(shape, dtype=self.np_dtype)
        self.generation += 1
        return np.memmap(self._path(self.generation), dtype=self.np_dtype, mode="w+", shape=shape)

    def _grow(self, rows: int) -> None:
        if rows <= len(self.data):
            return
        old, n = self.data, len(self.rows)
        self.data = self._alloc(max(rows, 2 * len(old)))
        self.data[:n] = old[:n]
        if self.directory is not None:  # the old file goes once its rows are copied
            del old
            os.remove(self._path(self.generation - 1))

    def has(self, keys: Sequence[tuple[int, int]]) -> np.ndarray:
        return np.array([key in self.rows for key in keys], dtype=bool)

    def read(self, keys: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The values of `keys` (every one held) [m, *shape], a copy."""
        return _to_torch(np.array(self.data[[self.rows[key] for key in keys]]), self.slot.dtype)

    def write(self, keys: Sequence[tuple[int, int]], values: torch.Tensor) -> None:
        new = [key for key in dict.fromkeys(keys) if key not in self.rows]
        self._grow(len(self.rows) + len(new))
        for key in new:
            self.rows[key] = len(self.rows)
        at = [self.rows[key] for key in keys]
        self.data[at] = _to_numpy(values.detach().to("cpu", self.slot.dtype), self.np_dtype)
        for dirty in self.dirty.values():
            dirty.update(at)

    def take_changed(self, reader: str, every: bool = False) -> dict[str, torch.Tensor]:
        """The rows written since `reader`'s last call (`every`: all rows), as (replica, client, values) tensors;
        none are dirty for it after."""
        keys = sorted((row, key) for key, row in self.rows.items() if every or row in self.dirty[reader])
        self.dirty[reader] = set()
        rows = [row for row, _ in keys]
        pairs = np.array([key for _, key in keys], dtype=np.int64).reshape(-1, 2)
        return {"replica": torch.from_numpy(pairs[:, 0].copy()), "client": torch.from_numpy(pairs[:, 1].copy()),
                "values": _to_torch(np.array(self.data[rows]), self.slot.dtype)}

    def keep_replicas(self, new_row: Mapping[int, int]) -> None:
        """Only the rows of replicas in `new_row` (old -> new replica), renumbered; all of them dirty."""
        kept = [(key, row) for key, row in self.rows.items() if key[0] in new_row]
        values = np.array(self.data[[row for _, row in kept]])
        self.rows = {(new_row[r], k): i for i, ((r, k), _) in enumerate(kept)}
        self.data = self._alloc(max(_FIRST_ROWS, len(kept)))
        if self.directory is not None:
            os.remove(self._path(self.generation - 1))
        self.data[:len(kept)] = values
        self.dirty = {reader: set(range(len(kept))) for reader in READERS}

    @property
    def nbytes(self) -> int:
        return len(self.rows) * self.slot.nbytes


def _to_numpy(values: torch.Tensor, np_dtype: np.dtype) -> np.ndarray:
    return values.view(torch.int16).numpy() if values.dtype == torch.bfloat16 else values.numpy()


def _to_torch(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(values)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


class ClientStore:
    """A shard's slots: one SlotTable per declared slot (a slot written without a declaration is declared by its
    first value: its shape and dtype, no initial value). `on_disk`: keep every table in a memory-mapped file in a
    directory of its own (removed by `close`)."""

    def __init__(self, slots: Iterable[ClientSlot] = (), on_disk: bool = False):
        self.directory = tempfile.mkdtemp(prefix="fedharness-slots-") if on_disk else None
        self.tables: dict[str, SlotTable] = {}
        for slot in slots:
            self.declare(slot)

    def declare(self, slot: ClientSlot) -> None:
        table = self.tables.get(slot.name)
        if table is None:
            self.tables[slot.name] = SlotTable(slot, self.directory, len(self.tables))
        elif (table.slot.shape, table.slot.dtype) != (tuple(slot.shape), slot.dtype):
            raise ValueError(f"client slot {slot.name!r} declared twice, as {table.slot} and as {slot}")

    def __bool__(self) -> bool:
        return any(table.rows for table in self.tables.values())

    def read(self, replica: np.ndarray, clients: np.ndarray, w0: torch.Tensor,
             server_ctx: Mapping[str, torch.Tensor]) -> list[ClientState]:
        """Each entry's slots by name: its kept value, or at its first participation the slot's initial value
        (from the copies' w0 [m, dim] and server context rows), or nothing where the slot has no initial value."""
        keys = list(zip(replica.tolist(), clients.tolist()))
        saved: list[dict] = [{} for _ in keys]
        for name, table in self.tables.items():
            held = table.has(keys)
            if held.any():
                at = np.flatnonzero(held)
                for i, value in zip(at, table.read([keys[i] for i in at]).to(w0.device)):
                    saved[i][name] = value
            if table.slot.init is not None and not held.all():
                at = np.flatnonzero(~held)
                index = torch.as_tensor(at, device=w0.device)
                first = table.slot.init(w0[index], {k: v[index] for k, v in server_ctx.items()})
                for i, value in zip(at, first):
                    saved[i][name] = value
        return saved

    def get(self, name: str, replica: np.ndarray, clients: np.ndarray) -> list[torch.Tensor | None]:
        """Slot `name`'s kept value of each entry, None where it has none (ClientWork.kept's contract)."""
        keys = list(zip(replica.tolist(), clients.tolist()))
        table = self.tables.get(name)
        out: list[torch.Tensor | None] = [None] * len(keys)
        if table is not None and table.rows:
            at = np.flatnonzero(table.has(keys))
            if len(at):
                for i, value in zip(at, table.read([keys[i] for i in at])):
                    out[i] = value
        return out

    def write(self, name: str, replica: np.ndarray, clients: np.ndarray, values: torch.Tensor) -> None:
        """Slot `name`'s new values [m, *shape] of the entries (declared by them if it was not)."""
        if name not in self.tables:
            self.declare(ClientSlot(name, tuple(values.shape[1:]), values.dtype))
        self.tables[name].write(list(zip(replica.tolist(), clients.tolist())), values)

    def take_changed(self, reader: str = "checkpoint", every: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """Every slot's rows written since `reader`'s last call (a checkpoint's part); `every`: all of its rows (a
        full table, which the files before it need not be read with)."""
        return {name: table.take_changed(reader, every) for name, table in self.tables.items()
                if (table.rows if every else table.dirty[reader])}

    def load(self, part: Mapping[str, Mapping[str, torch.Tensor]], owns: Callable[[np.ndarray], np.ndarray]) -> None:
        """The rows of a checkpoint part whose client `owns` says are this shard's (later parts overwrite)."""
        for name, rows in part.items():
            mine = owns(rows["client"].numpy())
            if mine.any():
                at = torch.as_tensor(np.flatnonzero(mine))
                self.write(name, rows["replica"].numpy()[mine], rows["client"].numpy()[mine], rows["values"][at])

    def settle(self) -> None:
        """What was just loaded is what the checkpoint holds: nothing to write again."""
        for table in self.tables.values():
            table.dirty = {reader: set() for reader in READERS}

    def keep_replicas(self, rows: np.ndarray) -> None:
        """The slots of replicas `rows` only, renumbered 0.. in that order (slots of a batch left)."""
        new_row = {int(old): new for new, old in enumerate(rows)}
        for table in self.tables.values():
            table.keep_replicas(new_row)

    def values(self) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        """Every kept value by (replica, client) and name: for inspection (tests); the engine never asks."""
        out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for name, table in self.tables.items():
            keys = list(table.rows)
            for key, value in zip(keys, table.read(keys) if keys else []):
                out.setdefault(key, {})[name] = value
        return out

    @property
    def nbytes(self) -> int:
        return sum(table.nbytes for table in self.tables.values())

    def held_bytes(self, new_clients: int) -> int:
        """Memory the slots take once `new_clients` more (replica, client) pairs hold a row (an upper end: some may
        hold one already); none on disk."""
        if self.directory is not None:
            return 0
        return self.nbytes + new_clients * sum(table.slot.nbytes for table in self.tables.values())

    def close(self) -> None:
        self.tables = {}
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


# --- checkpoint parts -------------------------------------------------------------------------------------------


def encode_part(changed: Mapping[str, Mapping[str, torch.Tensor]]) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "slots": dict(changed)}, buf)
    return buf.getvalue()


def decode_part(data: bytes, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """A part as plain tensors (torch.load weights_only: a planted file runs no code)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError("resume", where, f"not a client-slot file fedharness wrote ({type(err).__name__})") \
            from None
    require(isinstance(payload, dict) and payload.get("format") == FORMAT, "resume", where,
            f"a format-{FORMAT} client-slot file")
    return payload["slots"]


def checkpointed_values(results, keys: Sequence[str]) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Every client's slots as a checkpoint's files `keys` hold them (to inspect a checkpoint; a resume reads them
    in the shards)."""
    store = ClientStore()
    for key in keys:
        store.load(decode_part(results.read(key), f"{results.url}/{key}"), lambda k: np.ones(len(k), dtype=bool))
    return store.values()


# --- what a run's slots are and whether they fit ---------------------------------------------------------------


def declared_slots(problem: Problem, parts: Iterable[object]) -> tuple[ClientSlot, ...]:
    """The slots of every part that keeps client state (contracts.KeepsClientState), FedBN's buffers included."""
    from fedharness.core.buffers import buffer_slots

    slots = list(buffer_slots(problem))
    for part in parts:
        if isinstance(part, KeepsClientState):
            slots.extend(part.client_slots(problem))
    return tuple(slots)


def require_slots_fit(slots: Sequence[ClientSlot], budget: int | None, holders: int, replicas: int,
                      copy_bytes: int, copies: int, on_disk: bool) -> None:
    """ConfigError naming the largest slot and client_slots_on_disk unless a shard's slots (slot bytes x the
    clients of a shard that can hold one x replicas) and its largest batched step fit the memory budget. The step
    is `copies` client copies of `copy_bytes` each, or as many as the budget leaves beside the slots (the shard's
    chunks: ClientShard.chunk_entries), at least one."""
    if budget is None or on_disk or not slots:
        return
    per_client = sum(slot.nbytes for slot in slots)
    held = per_client * holders * replicas
    batch = min(copies, max(1, (budget - held) // copy_bytes))
    need = held + batch * copy_bytes
    largest = max(slots, key=lambda slot: slot.nbytes)
    require(need <= budget, "memory_budget_gb", budget / 1e9,
            f"at least {need / 1e9:.3g} GB a shard: the client slot {largest.name!r} ({largest.nbytes:,} bytes a "
            f"client; all slots {per_client:,}) x {holders:,} clients that can hold one x {replicas} replicas, "
            f"plus a batched step of {batch:,} client cop{'y' if batch == 1 else 'ies'} ({batch * copy_bytes / 1e9:.3g} GB); "
            f"set "
            f"{ON_DISK_KEY}=true to keep the slots in a memory-mapped file per shard, or add shards")


def slot_holders(num_clients: int, num_shards: int, rounds: int, per_round: int) -> int:
    """The most clients of one shard that can hold a slot: its share of N, at most every client a round
    reaches in `rounds` rounds (a lazy population holds rows only for the clients that took part)."""
    return int(min(math.ceil(num_clients / num_shards), rounds * per_round))
