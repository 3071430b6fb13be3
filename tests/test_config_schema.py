"""harness/config/schema.py: every key declared once, every bad value stopped through the real CLI (exit 2, one line
naming the key, no files), cross-key rules, memory, results_dir, and the YAML and the schema agreeing."""

from __future__ import annotations

import errno
import os

import pytest

from fedharness.config import schema
from fedharness.cli import main
from fedharness.config.compose import group_options
from fedharness.config.load import load_config, load_settings
from fedharness.errors import ConfigError

CASES = [  # (overrides, the key the message must name, words of what is allowed)
    (["dataset.alpha=nan"], "dataset.alpha", "finite"),
    (["dataset.beta=nan"], "dataset.beta", "finite"),
    (["dataset.alpha=-1"], "dataset.alpha", ">= 0"),
    (["dataset.beta=inf"], "dataset.beta", "finite"),
    (["results_dir="], "results_dir", "non-empty"),
    (["results_dir=/proc/fedharness-results"], "results_dir", "writable"),
    (["results_dir=a_file"], "results_dir", "not an existing file"),
    (["results_dir=a_file/below"], "results_dir", "is a file"),
    (["dataset.num_clients=1000000000"], "dataset.num_clients", "GiB of memory"),
    (["replicas=100000000"], "replicas", "GiB of memory"),
    (["dataset=quadratic", "dataset.num_clients=100000", "dataset.dim=1000"], "dataset.num_clients", "memory"),
    (["progress=maybe"], "progress", "true or false"),
    (["partition=shards", "dataset=quadratic"], "partition", "auto"),
    (["partition=natural", "dataset=digits"], "partition", "generated"),
    (["partition=iid", "dataset=synthetic_lazy"], "partition", "natural"),
    (["ray.num_shards=4"], "ray.num_shards", "executor=ray"),
    (["num_shards=101"], "num_shards", "number of clients"),
    (["executor=ray", "num_shards=2"], "num_shards", "ray.num_shards"),
    (["executor=ray", "ray.num_shards=200"], "ray.num_shards", "number of clients"),
    (["executor=ray", "ray.gpus_per_shard=0.5"], "ray.gpus_per_shard", "device=cuda"),
    (["dataset.foo=1"], "dataset.foo", "alpha"),
    (["+nosuchkey=1"], "nosuchkey", "rounds"),
    (["seed=1.5"], "seed", "integer"),
    (["rounds=true"], "rounds", "integer"),
    (["threads=0"], "threads", ">= 1"),
    (["device=tpu"], "device", "cuda"),
    (["resume=../x"], "resume", "run_id"),
    (["model.l2=-1"], "model.l2", ">= 0"),
    (["dataset=quadratic", "model=logreg"], "model", "quadratic"),
    (["dataset=quadratic", "dataset.mu=2"], "dataset.mu", "mu <= L"),
    (["dataset=quadratic", "dataset.curvature=flat"], "dataset.curvature", "diagonal"),
    (["dataset=blobs", "dataset.variant=mixed"], "dataset.variant", "heterogeneous"),
    (["algorithm.momentum=1.0"], "algorithm.momentum", "[0, 1)"),
    (["algorithm.dropout=1"], "algorithm.dropout", "[0, 1)"),
    (["algorithm.server_lr=nan"], "algorithm.server_lr", "finite"),
    (["algorithm.decay_at=[0.75,0.5]"], "algorithm.decay_at", "increasing"),
    (["algorithm.steps_low=5", "algorithm.steps_high=3"], "algorithm.steps_high", "steps_low"),
    (["algorithm.local_work=per_client"], "algorithm.client_steps", "one per client"),
    (["algorithm.aggregator=fednova", "algorithm.tau_eff=fixed"], "algorithm.tau_eff_value", "tau_eff=fixed"),
    (["algorithm.sampler=yang_s2", "algorithm.clients_per_round=101"], "algorithm.clients_per_round",
     "without replacement"),
    (["algorithm.local_work_min=1"], "algorithm.local_work_min", "true or false"),
    (["network.bandwidth_MB_per_s=0"], "network.bandwidth_MB_per_s", "> 0"),
    (["wandb.mode=sometimes"], "wandb.mode", "offline"),
    (["wandb.tags=3"], "wandb.tags", "list of strings"),
]


@pytest.mark.parametrize("overrides,key,allowed", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_value_one_line_exit_2_no_files(overrides, key, allowed, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # `results_dir=` would write into the current directory
    (tmp_path / "a_file").write_text("not a directory")
    argv = ["run", "progress=false", *overrides]
    if not any(o.startswith("results_dir=") for o in overrides):
        argv.insert(1, "results_dir=out")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"fedharness: error: invalid value for '{key}': "), err[0]
    assert allowed in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 8 s idle
def test_every_yaml_key_is_declared_and_every_declared_key_is_in_the_yaml():
    top = schema.defaults()
    assert set(top) - {"dataset", "partition", "model", "algorithm", *schema.CHOSEN} == \
        set(schema.TOP) - {"scale", "scales", "tune"} | set(schema.SECTIONS)
    for section, keys in schema.SECTIONS.items():
        assert set(top[section]) == set(keys), section
    for group in schema.CHOSEN:  # cadence, speed, availability, staleness: each option's YAML is its keys
        assert top[group]["name"] == schema.CHOSEN[group]
        for option in group_options(group):
            assert set(schema.defaults(group, option)) == set(schema.part_section_keys(group, option)), (group, option)
    for group in ("dataset", "partition", "model", "algorithm"):
        for option in group_options(group):
            yaml_keys = set(schema.defaults(group, option))
            declared = schema.group_keys(group, schema.defaults(group, option)["name"])
            assert declared is not None and yaml_keys == set(declared), (group, option)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 13 s idle
def test_every_option_and_experiment_validates():
    for group in ("dataset", "partition", "model", "algorithm"):
        for option in group_options(group):
            extra = {"partition": ["dataset=digits"], "model": ["dataset=cifar10"]}.get(group, [])
            if (group, option) in (("partition", "natural"), ("model", "quadratic")):
                extra = ["dataset=quadratic"] if option == "quadratic" else []
            if group == "dataset" and option in ("quadratic", "li_toy"):
                extra = []
            load_config([f"{group}={option}", *extra])
    for name in group_options("experiment"):
        load_config([f"experiment={name}"])


def test_a_part_registered_at_run_time_is_accepted(monkeypatch):
    from fedharness.algorithms.registry import PARTS

    with pytest.raises(Exception, match="algorithm.sampler"):
        load_config(["algorithm.sampler=mine"])
    monkeypatch.setitem(PARTS["sampler"], "mine", PARTS["sampler"]["full"])
    assert load_config(["algorithm.sampler=mine"])["algorithm"]["sampler"] == "mine"


def test_a_full_disk_during_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    import fedharness.runs.lifecycle

    class FullDisk(fedharness.runs.lifecycle.ParquetSink):
        def write_run(self, row):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fedharness.runs.lifecycle, "ParquetSink", FullDisk)
    results = tmp_path / "res"
    assert main(["run", f"results_dir={results}", "progress=false", "dataset=quadratic", "rounds=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedharness: error: cannot write results to '{results}': No space left on device"]


@pytest.mark.parametrize("algorithm,override,key", [
    ("fedexp", "algorithm.aggregator=fednova", "algorithm.aggregator"),
    ("fedexp", "algorithm.aggregator=median", "algorithm.aggregator"),
    ("fedexp", "cadence=fedbuff", "cadence"),
    ("mime", "algorithm.server_optimizer=adam", "algorithm.server_optimizer"),
    ("mime", "algorithm.aggregator=fednova", "algorithm.aggregator"),
    ("mimelite", "algorithm.momentum=0.5", "algorithm.momentum"),
    ("mime", "cadence=fedbuff", "cadence"),
])
def test_fedexp_and_mime_refuse_combinations_their_papers_do_not_define(tmp_path, algorithm, override, key):
    with pytest.raises(ConfigError) as err:
        load_settings([f"results_dir={tmp_path}", "dataset=quadratic", f"algorithm={algorithm}", override])
    assert err.value.key == key and ("mime" if "mime" in algorithm else "fedexp") in str(err.value)
