"""Parquet tables in a results store: one object as a pyarrow Table, and a hive-partitioned table (runs/, rounds/)
of many runs as one pandas DataFrame, the reader of the Python API's `Result` and of `fedharness report`."""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from fedharness.results import layout
from fedharness.results.store import ResultsStore

if TYPE_CHECKING:
    import pandas as pd  # imported where a table is read: a run's process never loads pandas (0.3 s)

log = logging.getLogger(__name__)


def table_bytes(table: pa.Table) -> bytes:
    """The table as the bytes of one Parquet file."""
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    return buf.getvalue().to_pybytes()


def write_table(store: ResultsStore, key: str, table: pa.Table) -> None:
    store.write(key, table_bytes(table))


def read_table(store: ResultsStore, key: str, columns: Sequence[str] | None = None) -> pa.Table | None:
    """The Parquet object under `key`; None when there is none. A broken file or a missing column raises
    (ArrowInvalid, OSError). Read as one ParquetFile: pq.read_table builds a dataset, and importing pyarrow.dataset
    is a noticeable part of a short run's start-up (docs/performance.md, Start-up)."""
    data = store.read(key)
    if data is None:
        return None
    file = pq.ParquetFile(pa.BufferReader(data))
    missing = [c for c in columns or () if c not in file.schema_arrow.names]
    if missing:
        raise pa.ArrowInvalid(f"{key} has no column {missing[0]!r}")
    return file.read(columns=columns)


def run_table_keys(store: ResultsStore, table: str, run_ids: Iterable[str] | None = None) -> list[str]:
    """The keys `<table>/run_id=<id>/<file>` of runs/ (run.parquet) or rounds/ (its parts), sorted; of the
    given runs only, or of every run."""
    name = layout.RUN_FILE if table == layout.RUNS else layout.PART_PATTERN
    if run_ids is None:
        keys = store.list(table)
    else:
        keys = [k for run_id in run_ids for k in store.list(layout.run_folder(table, run_id))]
    return [k for k in keys if layout.run_of(k) is not None and fnmatch.fnmatchcase(k.rpartition("/")[2], name)]


def read_run_table(store: ResultsStore, keys: Iterable[str], skipped: list[str] | None = None) -> pd.DataFrame:
    """The objects `keys` (of run_table_keys: runs/ or rounds/) as one DataFrame, with the run_id their hive
    partition names as the first column; runs may add metric columns (null in the others). An unreadable file
    (truncated, not Parquet) raises, or, given a `skipped` list, is named there and on this module's logger and left
    out, so one bad file does not hide all the others. No file: an empty frame with a run_id column."""
    import pandas as pd

    tables = []
    for key in keys:
        try:
            t = read_table(store, key)
        except (pa.ArrowException, OSError) as err:
            if skipped is None:
                raise
            _skip(store, key, err, skipped)
            continue
        if t is None:  # removed since it was listed
            continue
        if "run_id" in t.column_names:
            t = t.drop(["run_id"])
        tables.append(t.add_column(0, "run_id", pa.array([layout.run_of(key)] * t.num_rows, pa.string())))
    if not tables:
        return pd.DataFrame({"run_id": pd.Series(dtype="string")})
    return pa.concat_tables(tables, promote_options="permissive").to_pandas()


def _skip(store: ResultsStore, key: str, err: Exception, skipped: list[str]) -> None:
    path = f"{store.url}/{key}"
    message = (str(err).splitlines() or [""])[0].replace(path, "file").replace("`", "'")
    why = f"{path}: {type(err).__name__}: {message[:160]}"
    log.warning(f"skipped an unreadable file, {why}")
    skipped.append(why)
