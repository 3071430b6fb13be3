"""Result sinks. Parquet, hive-partitioned by run_id, every object written whole through the results store
(harness/results/store.py)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from fedharness.results import layout
from fedharness.contracts import CLIENT_COLUMNS, Callback, ClientScores, RoundContext
from fedharness.results.store import ResultsStore
from fedharness.results.tables import table_bytes, write_table

ROUND_SCHEMA = pa.schema([
    ("replica", pa.int64()), ("series", pa.string()), ("round", pa.int64()),
    ("local_steps", pa.int64()), ("grad_evals", pa.int64()),
    ("bytes_up", pa.int64()), ("bytes_down", pa.int64()), ("wall_s", pa.float64()), ("sim_s", pa.float64()),
    ("participants", pa.int64()),  # the clients that took part in the round just done (0: nobody; the model held)
    ("train_loss", pa.float64()), ("train_loss_se", pa.float64()),  # se: null where train_loss is exact
    ("subopt", pa.float64()), ("dist_to_opt", pa.float64()),
    ("grad_norm_sq", pa.float64()), ("test_loss", pa.float64()), ("test_acc", pa.float64()),
    ("lr", pa.float64()), ("server_lr", pa.float64()),
    ("tau_eff", pa.float64()), ("chi2", pa.float64()), ("slowdown", pa.float64()),
    ("epsilon", pa.float64()), ("dp_clip_norm", pa.float64()),  # DP runs (algorithms/privacy.py); else null
    # eval.per_client: the distribution over clients of their held-out accuracy and loss (se: null when every
    # client is evaluated); null when per-client evaluation is off
    *((name, pa.float64()) for name in CLIENT_COLUMNS),
])

CLIENT_SCHEMA = pa.schema([  # clients/ (eval.clients_table): a row per (replica, evaluated round, client, protocol)
    ("replica", pa.int64()), ("round", pa.int64()), ("client", pa.int64()), ("n", pa.int64()),
    ("loss", pa.float64()), ("acc", pa.float64()),  # null where the client has no held-out sample (n = 0)
    ("owner", pa.string()),  # the client's owner (a writer, a role, a user: natural clients); null: unnamed
    ("protocol", pa.string()),  # eval.personal: the models scored, global or finetune
])

RUN_SCHEMA = pa.schema([
    ("study", pa.string()), ("experiment", pa.string()), ("algorithm", pa.string()),
    ("dataset", pa.string()), ("partition", pa.string()), ("model", pa.string()),
    ("seed", pa.int64()), ("n_replicas", pa.int64()), ("status", pa.string()), ("rounds_done", pa.int64()),
    ("config_json", pa.string()), ("git_sha", pa.string()), ("started_at", pa.string()),
    ("finished_at", pa.string()), ("versions_json", pa.string()), ("host", pa.string()),
    ("error", pa.string()), ("trial", pa.int64()),
    ("f_star", pa.float64()), ("gamma_heterogeneity", pa.float64()),
    ("pid", pa.int64()), ("pid_start", pa.int64()),  # the writing process: a `running` row whose one is gone is lost
    ("callbacks", pa.string()), ("metrics", pa.string()),  # JSON lists: the run's callbacks and its own metrics
    ("split_invariant", pa.bool_()),  # rows independent of the shard split (docs/cluster.md, Same bits)
    ("batch_id", pa.string()),  # the batched run it trained in as one slot (harness/runs/batch.py); null: alone
    ("epsilon", pa.float64()),  # a DP run's privacy spent at dp.delta after rounds_done (null: no DP, or no noise)
])


def _table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """pa.Table.from_pylist(rows, schema), each column built by `column`."""
    return pa.Table.from_arrays([column([row.get(f.name) for row in rows], f.type) for f in schema], schema=schema)


_NUMPY_TYPES = {pa.int64(): np.int64, pa.float64(): np.float64}


def column(values: list, type_: pa.DataType) -> pa.Array:
    """pa.array(values, type_) for the column types of these tables (int64, float64, string, bool; None is null),
    built from Arrow buffers: pa.array imports pandas to test its input against pandas' types, and that import is
    a tenth of a one-round run's whole process (docs/performance.md, Start-up)."""
    valid = np.array([v is not None for v in values], dtype=bool)
    nulls = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    if type_ == pa.string():
        data = [b"" if v is None else str.encode(v) for v in values]
        offsets = np.cumsum([0, *map(len, data)], dtype=np.int32)
        buffers = [nulls, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
    elif type_ == pa.bool_():
        bits = np.array([v is not None and bool(v) for v in values], dtype=bool)
        buffers = [nulls, pa.py_buffer(np.packbits(bits, bitorder="little"))]
    else:
        buffers = [nulls, pa.py_buffer(np.array([0 if v is None else v for v in values], dtype=_NUMPY_TYPES[type_]))]
    return pa.Array.from_buffers(type_, len(values), buffers)


def client_table(scores: list[tuple[int, ClientScores]], names: list[str] | None = None) -> pa.Table:
    """clients/ rows of evaluated rounds' scores, (round, scores) each, built from the arrays; `names`: each
    client's owner (None: the owner column is null)."""
    parts = []
    for rnd, s in scores:
        replicas, clients = s.loss.shape[0], len(s.clients)
        loss, acc = s.loss.reshape(-1), s.acc.reshape(-1)
        parts.append({"replica": np.repeat(np.arange(replicas, dtype=np.int64), clients),
                      "round": np.full(replicas * clients, rnd, dtype=np.int64),
                      "client": np.tile(s.clients, replicas), "n": np.tile(s.n, replicas),
                      "loss": pa.array(loss, mask=np.isnan(loss)), "acc": pa.array(acc, mask=np.isnan(acc)),
                      "owner": [None if names is None else names[c] for c in np.tile(s.clients, replicas)],
                      "protocol": [s.protocol] * (replicas * clients)})
    return pa.table({f.name: pa.concat_arrays([pa.array(p[f.name], f.type) for p in parts]) for f in CLIENT_SCHEMA},
                    schema=CLIENT_SCHEMA)


class ParquetSink(Callback):
    """`runs/run_id=<id>/run.parquet` and `rounds/run_id=<id>/part-*.parquet` in a results store (and, with
    `clients_table`, `clients/run_id=<id>/part-*.parquet`); as a hook of the run, it buffers each evaluation's rows
    and writes them when the run ends (and at each checkpoint)."""

    def __init__(self, store: ResultsStore, run_id: str, extra_columns: Sequence[str] = (),
                 clients_table: bool = False, client_names: list[str] | None = None):
        """`extra_columns`: the run's own metrics (the `metrics` key), float64 columns after the built-in ones.
        `clients_table` (eval.clients_table): also write each evaluation's per-client scores to clients/, each
        client's owner from `client_names` (Problem.client_names)."""
        self.store, self.run_id, self.clients_table = store, run_id, clients_table
        self.client_names = client_names
        self.round_schema = pa.schema([*ROUND_SCHEMA, *(pa.field(name, pa.float64()) for name in extra_columns)])
        self.pending: list[dict] = []
        self.pending_clients: list[tuple[int, ClientScores]] = []

    def write_run(self, row: dict) -> None:
        write_table(self.store, layout.run_key(self.run_id), _table([row], RUN_SCHEMA))

    def add_rounds(self, rows: list[dict]) -> None:
        self.pending.extend(rows)

    def on_evaluation(self, context: RoundContext) -> None:
        self.add_rounds(context.rows)
        if self.clients_table:
            self.pending_clients.extend((context.round, s) for s in (context.clients, context.tuned, context.own)
                                        if s is not None)

    def on_end(self, outcome) -> None:
        self.flush()

    def pending_part(self) -> tuple[str, bytes] | None:
        """The buffered rows as one Parquet part: (file name by its round range, bytes); None when none."""
        if not self.pending:
            return None
        rounds = [r["round"] for r in self.pending]
        return layout.part_name(min(rounds), max(rounds)), table_bytes(_table(self.pending, self.round_schema))

    def part_key(self, name: str) -> str:
        return layout.part_key(self.run_id, name)

    def write_part(self, part: tuple[str, bytes]) -> None:
        name, data = part
        self.store.write(self.part_key(name), data)

    def flush(self, part: tuple[str, bytes] | None = None) -> None:
        """Write the buffered rows as one part named by its round range (resume drops parts past a checkpoint);
        `part`: them as pending_part gave them. The buffer empties only once the part is written, so a signal
        that cuts this short leaves the rows for the flush that records the run's end."""
        self.flush_clients()
        part = part or self.pending_part()
        if part is not None:
            self.write_part(part)
        self.pending = []

    def flush_clients(self) -> None:
        """Write the buffered per-client scores as one clients/ part named by its round range. A checkpoint writes
        them before its state: a run killed between the two resumes from the checkpoint before, which drops them."""
        if self.pending_clients:
            rounds = [rnd for rnd, _ in self.pending_clients]
            name = layout.part_name(min(rounds), max(rounds))
            self.store.write(layout.part_key(self.run_id, name, layout.CLIENTS),
                             table_bytes(client_table(self.pending_clients, self.client_names)))
        self.pending_clients = []

    def drop_after(self, last_round: int) -> None:
        """Remove parts holding rounds after `last_round`, so a resumed run writes each round once."""
        for name in layout.round_parts(self.store, self.run_id):
            if layout.part_rounds(name)[0] > last_round:
                self.store.delete(self.part_key(name))
        for name in layout.round_parts(self.store, self.run_id, layout.CLIENTS):
            if layout.part_rounds(name)[0] > last_round:
                self.store.delete(layout.part_key(self.run_id, name, layout.CLIENTS))
