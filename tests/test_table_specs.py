"""The study tables as specs (conf/table/, studies/tables.py): each spec's fields of every composed point of its
sweep against the row fields today's table modules gave them (tests/table_points.json, written by
studies/robustness.py, compression.py, systems.py and async_table.py before they became specs), each point its own
cell, and bad input refused in one line. The Markdown from Parquet results: test_*_table.py, test_rfa_cclip.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedharness.base.mappings import flatten
from fedharness.config.compose import choices_and_values, group_options
from fedharness.config.load import load_config
from fedharness.studies import tables
from fedharness.studies.sweep import expand, load_spec
from fedharness.studies.table_spec import fields, read_spec

TODAY = json.loads((Path(__file__).parent / "table_points.json").read_text())
# The sweeps' systems.* keys as issue 52 renamed them (config/compose.py MOVED refuses the old spellings): the
# points were recorded before the rename, their values are unchanged
RENAMED = {"systems.mode": "cadence", "systems.speed": "speed", **{f"systems.{key}": f"cadence.{key}" for key in (
    "deadline_s", "concurrency", "late_work", "over_selection", "buffer", "alpha")}}


def renamed(point: dict) -> dict:
    """deadline_s is now the sync cadence's own key: the asynchronous points no longer carry its null."""
    asynchronous = point.get("systems.mode", "sync") != "sync"
    return {RENAMED.get(key, key): value for key, value in point.items()
            if not (asynchronous and key == "systems.deadline_s")}


def plain(value):
    """NaN as None (JSON's null), numpy scalars as Python's: the recorded rows' spelling."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value.item() if hasattr(value, "item") else value


@pytest.mark.parametrize("name", [pytest.param("robustness", marks=pytest.mark.slow), "compression", "systems",
                                  "async"])  # robustness: 260 points composed, 73 and 98 s at load 5 and 6
def test_each_spec_gives_every_point_of_its_sweep_todays_row(name):
    spec = read_spec(name)
    jobs = expand(load_spec(spec["sweep"], []))
    today = TODAY[name]
    assert [job.point for job in jobs] == [renamed(point) for point, _ in today]  # the same points, in order
    cells = set()
    for job, (_, row) in zip(jobs, today):
        choices, values = choices_and_values(job.overrides)
        cfg = flatten(load_config(choices, values=values))
        problem = {"problem": str(cfg["dataset.name"])}  # what a seed row holds before the fields
        mine = {**problem, **fields(spec, {**cfg, **problem})}
        assert {k: plain(mine[k]) for k in row} == row, job.point
        cells.add(tuple(plain(mine[k]) for k in spec["cell"]))
    assert len(cells) == len(jobs)  # each point its own cell of the table


def test_the_specs_are_the_tables():
    assert group_options("table") == ["async", "compression", "personalization", "personalization_label_flip",
                                      "robustness", "systems"]  # _clients is included only


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert tables.main(["nosuch", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedharness.studies.tables: error: invalid value for 'table': 'nosuch' (one of: async, "
                   "compression, personalization, personalization_label_flip, robustness, systems)"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("sweep: systems\ncolums: []\n")
    assert tables.main([str(bad), str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedharness.studies.tables: error: invalid value for 'table bad': "
                                               "['colums'] (keys: ")
    assert tables.main(["systems", str(tmp_path), "--target", "digits=test_acc=0.9", "--out", str(out)]) == 2
    assert "'--target'" in capsys.readouterr().err
    assert not out.exists()



def test_the_spec_in_extending_md_makes_its_table(tmp_path, capsys):
    import fedharness

    doc = (Path(__file__).parent.parent / "docs" / "extending.md").read_text()
    start = doc.index("# conf/table/local_steps.yaml")
    spec = tmp_path / "local_steps.yaml"
    spec.write_text(doc[start:doc.index("```", start)])
    res = tmp_path / "res"
    base = [f"results_dir={res}", "progress=false", "dataset=synthetic", "dataset.num_clients=10",
            "dataset.samples_per_client=20", "rounds=4", "replicas=2", "algorithm.clients_per_round=2"]
    runs = [fedharness.run([*base, f"algorithm.local_steps={E}"]) for E in (5, 1)]
    assert tables.main([str(spec), str(res), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "table.md").read_text().splitlines()
    assert text[0] == "**synthetic**: target train_loss<=1.1, 2 seeds"
    assert text[2:4] == ["| E | K | reached | rounds to target | final test accuracy (%) |", "|---|---|---:|---:|---:|"]
    for line, run, E in zip(text[4:6], runs[::-1], (1, 5)):  # in order: E = 1 first
        last = run.rounds[(run.rounds["round"] == 4) & (run.rounds["series"] == "iterate")]["test_acc"] * 100
        assert line.startswith(f"| {E} | 2 | ") and line.endswith(f" | {last.mean():.1f} ± {last.std():.1f} |")
    assert (tmp_path / "out" / "accuracy_vs_mb.png").stat().st_size > 0
    spec.write_text(spec.read_text().replace('cell: "{K}"', 'cell: "{k}"'))  # a typo: one line, nothing written
    assert tables.main([str(spec), str(res), "--out", str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedharness.studies.tables: error: invalid value for 'table text "
                                               "'{k}'': 'k' (a config key or one of: ")
    assert ", K, " in err[0] and not (tmp_path / "typo").exists()
