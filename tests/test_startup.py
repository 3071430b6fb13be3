"""Start-up: a run's process loads only what it uses (pandas, pyarrow.dataset, Optuna, Ray, W&B, matplotlib are
imported where they are used), and the result tables it writes are the same bytes as pyarrow's own conversion.
The time itself is measured in the benchmark (benchmarks/bench_tune.py, docs/performance.md, Start-up)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from fedharness.results.tables import read_table, table_bytes
from fedharness.sinks.parquet import ROUND_SCHEMA, RUN_SCHEMA, _table
from fedharness.results.store import FileStore

HEAVY = ("pandas", "pyarrow.dataset", "optuna", "ray", "wandb", "matplotlib", "scipy", "torchvision")


def _loaded_after(code: str, cwd) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    out = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _value(rnd: random.Random, type_: pa.DataType):
    if rnd.random() < 0.3:
        return None
    if type_ == pa.int64():
        return rnd.choice([0, -1, 2**62, rnd.randint(-10**9, 10**9), np.int64(7)])
    if type_ == pa.float64():
        return rnd.choice([math.nan, math.inf, -math.inf, 0.1, -0.0, rnd.random(), np.float32(0.1), 1e-300, 3])
    if type_ == pa.string():
        return rnd.choice(["", "abc", "ü€😀", "x" * 1000, np.str_("n")])
    return rnd.choice([True, False, np.bool_(True)])


@pytest.mark.parametrize("schema", [ROUND_SCHEMA, RUN_SCHEMA], ids=["rounds", "runs"])
def test_tables_are_the_bytes_pyarrow_writes(schema):
    """Nulls, NaN and infinities, numpy scalars, non-ASCII text, keys left out, 0 to 100 rows: the same file."""
    rnd = random.Random(0)
    for n in (0, 1, 7, 8, 9, 100):
        for _ in range(5):
            rows = [{f.name: _value(rnd, f.type) for f in schema if rnd.random() < 0.9} for _ in range(n)]
            ours = _table(rows, schema)
            ours.validate(full=True)
            theirs = pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema)
            assert table_bytes(ours) == table_bytes(theirs)
            assert [c.null_count for c in ours.columns] == [c.null_count for c in theirs.columns]


def test_read_table_names_a_missing_column(tmp_path):
    store = FileStore(tmp_path)
    store.write("t.parquet", table_bytes(_table([{"status": "ok"}], RUN_SCHEMA)))
    assert read_table(store, "t.parquet", columns=["status"]).to_pylist() == [{"status": "ok"}]
    assert read_table(store, "none.parquet") is None
    with pytest.raises(pa.ArrowInvalid, match="no column 'nope'"):
        read_table(store, "t.parquet", columns=["status", "nope"])


def test_writing_and_reading_results_imports_neither_pandas_nor_pyarrow_dataset(tmp_path):
    code = textwrap.dedent(f"""
        from fedharness.results.layout import run_key
        from fedharness.results.tables import read_table
        from fedharness.sinks.parquet import ParquetSink
        from fedharness.results.store import FileStore
        store = FileStore({str(tmp_path)!r})
        sink = ParquetSink(store, "r1", extra_columns=["mine"])
        sink.write_run({{"status": "ok", "seed": 3, "f_star": 0.5, "split_invariant": True}})
        sink.add_rounds([{{"replica": 0, "series": "avg", "round": 1, "train_loss": 2.0, "mine": 1.5}}])
        sink.flush()
        assert read_table(store, run_key("r1")).to_pylist()[0]["seed"] == 3
    """)
    assert _loaded_after(code, tmp_path) == []


@pytest.mark.slow  # a whole run in a fresh interpreter (torch's import): a few seconds
def test_a_run_imports_no_heavy_module_it_does_not_use(tmp_path):
    code = "import fedharness\nfedharness.run(['rounds=1', 'reference=off', 'heterogeneity=false', 'progress=false'])"
    assert _loaded_after(code, tmp_path) == []


def test_a_run_config_is_composed_once(monkeypatch):
    """validate() reads the `ray` defaults from conf/config.yaml instead of composing the default config too."""
    import fedharness.config.compose as compose
    from fedharness.config.load import load_config

    calls = []
    hydra_compose = compose.compose
    monkeypatch.setattr(compose, "compose", lambda **kw: calls.append(kw) or hydra_compose(**kw))
    compose._composed.cache_clear()
    compose.own_section_defaults.cache_clear()
    load_config(["rounds=1"])
    assert len(calls) == 1
    assert compose.own_section_defaults("ray") == compose.defaults()["ray"]  # what validate() compared with before


def test_the_command_ends_after_threads_handlers_and_flushes(tmp_path):
    """The installed command (cli.entry) skips the interpreter's teardown, not what a normal exit does before it:
    a non-daemon thread still running when main returns finishes, atexit handlers run, buffered stdout arrives, and
    main's status is the process's. Its main runs with the command's collector thresholds."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedharness"] == "fedharness.cli:entry"
    code = textwrap.dedent(f"""
        import atexit, sys, threading, time
        from pathlib import Path
        from fedharness import cli
        out = Path({str(tmp_path)!r})
        def late():
            time.sleep(0.3)
            (out / "thread").write_text("done")
        threading.Thread(target=late).start()
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        import gc
        cli.main = lambda: (sys.stdout.write("x" * 100000 + repr(gc.get_threshold())), 3)[1]  # more than a pipe holds
        sys.argv = ["fedharness"]
        cli.entry()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    from fedharness.cli import GC_THRESHOLDS

    assert (done.returncode, done.stdout, done.stderr) == (3, "x" * 100000 + repr(GC_THRESHOLDS), "")
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
