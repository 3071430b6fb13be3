"""harness/settings.py: the validated config as one frozen, typed RunSettings, built once at load time; the
schema's run-level keys are its fields; below the config layer nothing reads the config by a string key."""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections import Counter
from pathlib import Path

import pytest

from fedharness.config import schema
from fedharness.cli import main
from fedharness.config.load import load_config, load_settings
from fedharness.errors import ConfigError
from fedharness.settings import (NetworkSettings, PartSettings, RaySettings, RunSettings, WandbSettings, keys_of,
                                 sections_of)

ROOT = Path(__file__).resolve().parents[1]
# A read of the config by a string key: cfg["rounds"], acfg.get("sampler"), dcfg[...], config[...], params[...]
READ = re.compile(r"""\b\w*(?:cfg|config|params)\s*(?:\[\s*f?["']|\.get\(\s*f?["'])""")
# Areas that read only typed fields: packages, and single modules by their path
TYPED = ("harness/core", "harness/backends", "harness/sinks", "harness/runs/execute.py")


def area_of(path: Path) -> str:
    """A source file's area: a module of TYPED by its own path, else harness/<package>, harness/(top), algorithms,
    partitions."""
    parts = path.relative_to(ROOT).parts
    if "/".join(parts) in TYPED:
        return "/".join(parts)
    if parts[0] != "harness":
        return parts[0]
    return "/".join(parts[:2]) if len(parts) > 2 else "harness/(top)"


def sources() -> list[Path]:
    return [path for top in ("harness", "algorithms", "partitions") for path in sorted((ROOT / top).rglob("*.py"))]


def string_key_reads() -> Counter:
    """String-key reads of the config per area."""
    counts: Counter = Counter()
    for path in sources():
        counts[area_of(path)] += len(READ.findall(path.read_text()))
    return counts


def test_the_core_backends_sinks_and_runner_read_no_string_key():
    counts = string_key_reads()
    assert {area: counts[area] for area in TYPED} == dict.fromkeys(TYPED, 0)


def test_every_typed_area_holds_files_the_count_reads():
    """A typed area that no file maps to (a moved module, a mistyped path) would pass the check above vacuously."""
    files = Counter(area_of(path) for path in sources())
    assert all(files[area] > 0 for area in TYPED), {area: files[area] for area in TYPED}
    assert files["harness/runs/execute.py"] == 1 and files["harness/runs"] > 0
    assert area_of(ROOT / "harness/runs/execute.py") == "harness/runs/execute.py"


def test_the_count_sees_string_key_reads():
    assert READ.findall('cfg["rounds"]; acfg.get("sampler"); settings.config["seed"]; algorithm.params["mu"]') \
        and len(READ.findall('cfg["a"] cfg.get("b") x.params["c"] rcfg[\'d\']')) == 4
    assert not READ.findall("settings.rounds; config_json[0]; cfg[key]")


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> RunSettings:
    return load_settings([f"results_dir={tmp_path_factory.mktemp('r')}", "progress=false"])


def test_built_from_the_default_config_with_the_right_types(settings):
    assert isinstance(settings.ray, RaySettings) and isinstance(settings.network, NetworkSettings)
    assert isinstance(settings.wandb, WandbSettings) and isinstance(settings.algorithm, PartSettings)
    assert (settings.rounds, settings.seed, settings.replicas, settings.eval_every) == (100, 0, 1, 10)
    assert settings.executor == "inline" and settings.kernel == "auto" and settings.progress is False
    assert settings.resume is None and settings.threads is None and settings.trial is None
    assert settings.wandb.tags == () and settings.ray.num_shards == 2 and settings.network.bandwidth_MB_per_s == 20
    assert settings.dataset.name == "synthetic" and settings.dataset.num_clients == 100
    assert settings.algorithm.name == "fedavg" and settings.algorithm.batch_size == 24
    assert settings.algorithm.params["sampler"] == settings.algorithm.sampler
    assert "name" not in settings.algorithm.params and settings.algorithm.as_dict()["name"] == "fedavg"
    assert settings.config == load_config([f"results_dir={settings.results_dir}", "progress=false"])
    with pytest.raises(AttributeError, match="no key 'nope'"):
        settings.algorithm.nope  # noqa: B018


def test_frozen(settings):
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.rounds = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.ray.num_shards = 4
    with pytest.raises(TypeError):
        settings.algorithm.params["client_lr"] = 1.0


def test_replace_gives_new_settings_and_config(settings):
    changed = settings.replace(rounds=7, kernel="loop", trial=3,
                               wandb=dataclasses.replace(settings.wandb, tags=("a", "b")))
    assert (changed.rounds, changed.kernel, changed.trial, changed.wandb.tags) == (7, "loop", 3, ("a", "b"))
    assert changed.config["rounds"] == 7 and changed.config["trial"] == 3
    assert changed.config["wandb"]["tags"] == ["a", "b"]
    assert settings.rounds == 100 and settings.config["rounds"] == 100 and "trial" not in settings.config
    with pytest.raises(ConfigError, match=r"invalid value for 'rounds': 0 \(an integer >= 1\)"):
        settings.replace(rounds=0)


def test_settings_travel_as_their_config(settings):
    again = pickle.loads(pickle.dumps(settings))
    assert again == settings and again.config == settings.config and again is not settings


def test_the_schema_top_keys_and_sections_are_the_dataclass_fields():
    assert schema.TOP == keys_of(RunSettings)
    assert schema.SECTIONS == {name: keys_of(cls) for name, cls in sections_of(RunSettings).items()}
    groups = {"dataset", "partition", "model", "algorithm", "attack", "compress", "cadence", "speed", "availability",
              "staleness"}  # attack, compress: optional groups
    assert {f.name for f in dataclasses.fields(RunSettings)} == set(schema.TOP) | set(schema.SECTIONS) | groups | \
        {"trial", "config"}
    for name, cls in sections_of(RunSettings).items():
        assert [f.name for f in dataclasses.fields(cls)] == list(schema.SECTIONS[name])


def test_a_bad_value_is_still_one_line_naming_key_value_and_allowed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "results_dir=out", "ray.placement=everywhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedharness: error: invalid value for 'ray.placement': 'everywhere' (one of: spread, pack)"]
    with pytest.raises(ConfigError, match=r"^invalid value for 'eval_every': 0 \(an integer >= 1\)$"):
        load_settings(["results_dir=out", "eval_every=0"])
    assert list(tmp_path.iterdir()) == []


def test_the_data_seed_is_the_datasets_else_the_runs(settings, tmp_path):
    assert settings.dataset.data_seed is None and settings.data_seed == settings.seed == 0
    pinned = load_settings([f"results_dir={tmp_path}", "seed=3", "dataset.data_seed=5"])
    assert (pinned.seed, pinned.data_seed) == (3, 5)
    assert load_settings([f"results_dir={tmp_path}", "seed=3"]).data_seed == 3


def test_a_config_recorded_before_a_key_existed_reads_with_todays_default():
    """A runs/ row's config_json from before network.upload_MB_per_s and the systems section: read with their
    defaults (the compression study builds each recorded run's problem again), every recorded value kept."""
    import json

    from fedharness.config.load import load_config, recorded_settings

    old = json.loads(json.dumps(load_config(["network.bandwidth_MB_per_s=3", "rounds=7"])))
    del old["network"]["upload_MB_per_s"], old["cadence"], old["speed"], old["availability"], old["staleness"]
    with pytest.raises(KeyError):
        RunSettings.from_config(old)
    settings = recorded_settings(old)
    assert settings.network.upload_MB_per_s is None and settings.speed.name == "equal"
    assert settings.network.bandwidth_MB_per_s == 3 and settings.rounds == 7
    # a `systems` section (recorded before the cadence and profile groups): its choices and keys in the groups
    old["systems"] = {"mode": "fedbuff", "concurrency": 6, "buffer": 2, "speed": "lognormal", "speed_sigma": 0.3,
                      "availability": "always", "staleness": "hinge", "staleness_exponent": 2.0, "deadline_s": None}
    settings = recorded_settings(old)
    assert settings.cadence.as_dict() == {"name": "fedbuff", "retry_s": 60.0, "concurrency": 6, "buffer": 2,
                                          "refill": "arrival", "max_staleness": None}
    assert settings.speed.as_dict() == {"name": "lognormal", "step_sigma": 0.3, "bandwidth_sigma": 0.5}
    assert settings.staleness.as_dict() == {"name": "hinge", "slope": 2.0, "cutoff": 4}
