"""Tune and sweep specs are declared like the run config: `fedharness config tune|sweep` and `--help` list every key
with its default and doc, an unknown key is one line and exit 2 with nothing written; override text has one writer
(format_value) whose values Hydra reads back as themselves; which keys a batch's slots may vary is declared on
their Keys."""

from __future__ import annotations

import json
import re

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from fedharness.cli import main
from fedharness.config.overrides import format_value

TUNE_KEYS = (r"tune\.batch = 1", r"tune\.n_trials = 20", r"tune\.sampler\.name = tpe", r"tune\.budget\.total = 2000")
SWEEP_KEYS = (r"sweep\.runner = ray", r"sweep\.batch = true", r"sweep\.protocol\.name = fixed")


def _lists(out: str, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        assert re.search(rf"^  {pattern} +\S", out, re.M), pattern  # key = default, then its doc


def test_config_tune_and_sweep_list_every_key_with_default_and_doc(capsys):
    assert main(["config", "tune"]) == 0
    out = capsys.readouterr().out
    _lists(out, TUNE_KEYS)
    assert "quadratic_lr" in out  # the tune configs
    assert main(["config", "tune", "quadratic_lr"]) == 0
    _lists(capsys.readouterr().out, (r"tune\.budget\.kind = rounds", r"tune\.budget\.total = 30"))
    assert main(["config", "sweep"]) == 0
    _lists(capsys.readouterr().out, SWEEP_KEYS)
    assert main(["config", "sweep", "local_steps"]) == 0
    _lists(capsys.readouterr().out, (r"sweep\.protocol\.name = theory", r"sweep\.protocol\.c1 = 0\.5"))


@pytest.mark.parametrize("command, patterns", [("tune", TUNE_KEYS), ("sweep", SWEEP_KEYS)])
def test_help_lists_the_keys(capsys, command, patterns):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: fedharness {command}" in out
    _lists(out, patterns)


@pytest.mark.parametrize("args, key", [
    (["tune", "tune=default", "+tune.nope=1"], "tune.nope"),
    (["tune", "tune=default", "tune.nope=1"], "tune.nope"),
    (["tune", "tune=default", "tune.sampler.nope=1"], "tune.sampler.nope"),
    (["sweep", "sweep=local_steps", "+sweep.nope=1"], "sweep.nope"),
    (["sweep", "sweep=local_steps", "sweep.nope=1"], "sweep.nope"),
    (["sweep", "sweep=local_steps", "sweep.protocol.nope=1"], "sweep.protocol.nope"),
])
def test_an_unknown_study_key_is_one_line_exit_2_nothing_written(tmp_path, capsys, args, key):
    results = tmp_path / "results"
    assert main([*args, f"results_dir={results}", "dataset=quadratic"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedharness: error: invalid value for '{key}'"), captured.err
    assert "no such key" in lines[0] and captured.out == ""
    assert not results.exists()


VALUES = ["true", "false", "null", "None", "1e-3", "01", "1", "-2.5", "inf", "NaN", "", "a b", "it's", "back\\slash",
          "end\\", "s3://bucket/x", "results/x", "x-y", "${x}", "a,b", True, False, None, 0, -3, 0.1, 1e-05, -0.0,
          float("inf"), [1, "true", None, 0.5], {"a": 1, "b": "null"}]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_format_value_round_trips_through_hydra(value):
    parsed = OverridesParser.create().parse_overrides([f"key={format_value(value)}"])[0].value()
    assert parsed == value and type(parsed) is type(value)


def test_run_records_a_string_that_yaml_would_read_as_a_bool(tmp_path):
    import fedharness

    result = fedharness.run({"wandb.project": "true", "rounds": 2, "dataset": "quadratic",
                             "results_dir": str(tmp_path), "progress": False})
    assert result.status == "ok"
    assert json.loads(result.runs["config_json"][0])["wandb"]["project"] == "true"


def test_batchable_keys_are_read_from_their_declarations():
    from fedharness.runs.batch import BATCHABLE_KEYS

    assert set(BATCHABLE_KEYS) == {"seed", "rounds", "eval_every", "replicas", "algorithm.client_lr",
                                   "algorithm.server_lr", "algorithm.local_steps", "algorithm.mu",
                                   "algorithm.momentum", "algorithm.server_momentum", "algorithm.lr_schedule",
                                   "algorithm.lr_beta", "algorithm.lr_gamma", "algorithm.decay_at",
                                   "algorithm.decay_factor", "algorithm.lr_decay"}


def test_a_config_name_that_starts_with_a_digit_stays_bare_in_a_sweep_point():
    """A sweep's grid values are its points' labels: `model: [logreg, 2nn]` gives points model=2nn, not '2nn'
    (the reproductions select their rows by these labels)."""
    from fedharness.config.overrides import format_value
    from fedharness.studies.sweep import expand, load_spec

    assert [format_value(v) for v in ("2nn", "3d", "true", "1e-3", "a b")] == ["2nn", "3d", "'true'", "'1e-3'",
                                                                              "'a b'"]
    assert {job.point["model"] for job in expand(load_spec("repro_yang_noniid", []))} == {"logreg", "2nn"}
