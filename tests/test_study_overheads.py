"""What a study's trials no longer pay per trial, and that it changes nothing: a trial's config is its values set
into a copy of the study's composed base (plain dict, where it holds no interpolation)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from fedharness.config import compose as compose_module
from fedharness.config.compose import compose_values
from fedharness.config.load import load_config

W1 = ["dataset.samples_per_client=200", "dataset.num_clients=100", "algorithm.clients_per_round=10"]  # benchmarks W1
VALUES = ["algorithm.client_lr=1e-05", "algorithm.local_steps=20", "seed=3"]


def test_values_on_a_base_without_interpolations_go_into_its_plain_dict(monkeypatch):
    """No OmegaConf update (nor a copy of the DictConfig) per trial; the config equals a full composition, types
    included (1 stays an int, 1e-05 a float)."""
    full = load_config([*W1, *VALUES])
    load_config(W1, values=["seed=4"])  # the study's base, composed once (through OmegaConf)
    monkeypatch.setattr(OmegaConf, "update", lambda *a, **k: pytest.fail("took the DictConfig path"))
    cfg = load_config(W1, values=VALUES)
    assert cfg == full and cfg["algorithm"]["local_steps"] == 20 and type(cfg["algorithm"]["client_lr"]) is float
    again = load_config(W1, values=["algorithm.client_lr=1", "algorithm.local_steps=2"])
    assert type(again["algorithm"]["client_lr"]) is int and again["algorithm"]["local_steps"] == 2
    assert load_config(W1, values=VALUES) == full  # the cached base was not changed by the trials before


def test_interpolations_take_the_omegaconf_path():
    """li_toy's rounds follow E through an interpolation: the plain dict cannot hold that, so it is not used."""
    assert compose_module._plain(tuple(compose_module.user_search_path() + ["experiment=li_toy"]), "config") is None
    assert load_config(["experiment=li_toy"], values=["algorithm.local_steps=7"])["rounds"] == 3000 // 7
    value = ["algorithm.server_lr=${algorithm.client_lr}"]  # a value that is an interpolation
    assert compose_values(W1, value) == compose_values([*W1, *value], [])
    assert compose_values(W1, value)["algorithm"]["server_lr"] == compose_values(W1, [])["algorithm"]["client_lr"]
