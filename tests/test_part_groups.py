"""Part groups (attack, and the stage groups to come) are discoverable like every other group: `fedharness config
GROUP [OPTION]` lists the options with what each does and its keys with defaults and docs, `run --help` names every
option's keys, and an unknown key names the keys the chosen option has; one line, exit 2, nothing written. The
same code describes any part group, a user's part registered from Python included (its signature is its schema)."""

from __future__ import annotations

import re

import pytest
from hydra.core.config_store import ConfigStore

import fedharness
from fedharness.cli import main
from fedharness.config import schema
from fedharness.config.help import describe_group
from fedharness.errors import ConfigError
from fedharness.keys import number
from fedharness.registry.binding import Registry
from fedharness.registry.groups import ATTACKS

FRACTION, FIXED = ATTACKS.common["fraction"].doc, ATTACKS.common["fixed"].doc
WIDTH = 34  # help.py's "key = default" column


def _line(key: str, doc: str) -> str:
    return f"{key:<{WIDTH}}  {doc}"


# Each option's keys as `attack=OPTION attack.nope=1` names them (sorted), and as `config attack OPTION` lists them.
ATTACK_KEYS = {
    "none": ["fixed", "fraction"], "label_flip": ["fixed", "fraction"], "sign_flip": ["fixed", "fraction"],
    "gaussian": ["fixed", "fraction", "noise_std"], "scaling": ["factor", "fixed", "fraction"],
    "alie": ["fixed", "fraction", "z"], "ipm": ["epsilon", "fixed", "fraction"],
}


def test_every_registered_attack_is_covered_here():
    assert set(ATTACK_KEYS) == set(schema.part_options("attack"))


def test_config_attack_lists_every_option_with_its_doc_and_keys(capsys):
    assert main(["config", "attack"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [
        "attack options (`attack=OPTION`, * the default; `fedharness config attack OPTION` shows one):",
        "  attack     none*, label_flip, sign_flip, gaussian, scaling, alie, ipm", "",
        "what each does, and its keys (key = default  doc), set as attack.KEY=value:"]
    for line in ("attack=none: no attack (the default: a run without `attack=`)",
                 "attack=sign_flip: Each Byzantine client sends its own update negated.",
                 "attack=ipm: IPM (Xie, Koyejo and Gupta 2020): every Byzantine client sends -epsilon times the "
                 "honest updates' mean.",
                 _line("  attack.fraction = 0.0", FRACTION),
                 _line("  attack.noise_std = 1.0", "the standard deviation of each coordinate sent"),
                 _line("  attack.z = null", "the standard deviations below the honest mean"),
                 _line("  attack.epsilon = 0.1", "the Byzantine clients send -epsilon times the honest mean")):
        assert line in lines, line
    headers = [line.split(":")[0] for line in lines if line.startswith("attack=")]
    assert headers == [f"attack={name}" for name in schema.part_options("attack")]


def test_config_attack_alie_lists_its_keys(capsys):
    assert main(["config", "attack", "alie"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "attack options (`attack=OPTION`, * the one shown; `fedharness config attack` shows every one):",
        "  attack     none, label_flip, sign_flip, gaussian, scaling, alie*, ipm", "",
        "what it does, and its keys (key = default  doc), set as attack.KEY=value:",
        "attack=alie: ALIE (Baruch et al. 2019): every Byzantine client sends mu - z sigma, the honest updates' "
        "coordinate-wise mean and standard deviation (unbiased, as torch.std and Blades); z: z_max of the round's "
        "n and b unless set.",
        _line("  attack.fraction = 0.2", FRACTION),
        _line("  attack.fixed = false", FIXED),
        _line("  attack.z = null", "the standard deviations below the honest mean")]


def test_config_names_the_groups_and_options_there_are(capsys):
    assert main(["config", "attack", "nope"]) == 2
    assert capsys.readouterr().err.strip() == ("fedharness: error: invalid value for 'attack': 'nope' (one of: none, "
                                               "label_flip, sign_flip, gaussian, scaling, alie, ipm)")
    assert main(["config", "nope"]) == 2
    assert capsys.readouterr().err.strip() == ("fedharness: error: invalid value for 'group': 'nope' (one of: "
                                               "algorithm, attack, availability, cadence, compress, dataset, model, "
                                               "partition, speed, stages, staleness, sweep, tune)")


def test_run_help_names_every_attacks_keys(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"^  attack     none\*, label_flip, sign_flip, gaussian, scaling, alie, ipm$", out, re.M)
    for key, default in (("fraction", "0.0"), ("noise_std", "1.0"), ("factor", "10.0"), ("z", "null"),
                         ("epsilon", "0.1")):
        assert re.search(rf"^  attack\.{key} = {default} +\S", out, re.M), key
    assert "attack=alie: ALIE (Baruch et al. 2019)" in out


def _refused(argv: list[str], tmp_path, capsys, monkeypatch) -> str:
    """The one error line of a command that must stop before any work: exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    assert main([*argv, f"results_dir={results}", "progress=false"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert not results.exists() and list(tmp_path.iterdir()) == []
    return lines[0]


@pytest.mark.parametrize("attack", ATTACK_KEYS)
def test_an_unknown_attack_key_names_that_attacks_keys(attack, tmp_path, capsys, monkeypatch):
    line = _refused(["run", f"attack={attack}", "attack.nope=1"], tmp_path, capsys, monkeypatch)
    assert line == ("fedharness: error: invalid value for 'attack.nope': '1' (no such key; keys of 'attack': "
                    f"{', '.join(ATTACK_KEYS[attack])})")


@pytest.mark.parametrize("argv, message", [
    (["attack=alie", "+attack.nope=1"], "'attack.nope': 1 (no such key; keys of 'attack': fraction, fixed, z)"),
    (["attack.nope=1"], "'attack.nope': '1' (no such key: no attack is chosen; choose one first, attack=NAME "
                        "(one of: alie, gaussian, ipm, label_flip, none, scaling, sign_flip))"),
    (["dataset=mnist", "dataset.nope=1"], "'dataset.nope': '1' (no such key; keys of 'dataset': data_dir, "
                                          "data_seed, download, num_clients, unseen_clients)"),
])
def test_an_unknown_key_names_the_keys_of_the_chosen_option(argv, message, tmp_path, capsys, monkeypatch):
    assert _refused(["run", *argv], tmp_path, capsys, monkeypatch) == f"fedharness: error: invalid value for {message}"


# --- a user's attack, registered from Python: described and checked from its constructor's signature -----------

class Damped:
    """Byzantine clients send their own update times `gain`. Nothing else."""

    def __init__(self, gain: float = 0.5):
        self.gain = gain

    def forge(self, own, honest, keys):
        return self.gain * own


@pytest.fixture
def registered_damped():
    fedharness.register_attack("damped", Damped, fraction=0.3, gain=0.25)
    yield
    ATTACKS.pop("damped")
    del ConfigStore.instance().repo["attack"]["damped.yaml"]


def test_a_users_attack_is_described_and_its_keys_checked(registered_damped, tmp_path, capsys, monkeypatch):
    assert main(["config", "attack", "damped"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  attack     none, label_flip, sign_flip, gaussian, scaling, alie, ipm, damped*", "",
        "what it does, and its keys (key = default  doc), set as attack.KEY=value:",
        "attack=damped: Byzantine clients send their own update times `gain`.",
        _line("  attack.fraction = 0.3", FRACTION),
        _line("  attack.fixed = false", FIXED),
        _line("  attack.gain = 0.25", schema.UNDECLARED)]
    for argv, shown, keys in ((["attack=damped", "attack.nope=1"], "'1'", "fixed, fraction, gain"),
                              (["attack=damped", "+attack.nope=1"], "1", "fraction, fixed, gain")):
        assert _refused(["run", *argv], tmp_path, capsys, monkeypatch) == (
            f"fedharness: error: invalid value for 'attack.nope': {shown} (no such key; keys of 'attack': {keys})")


# --- any part group: the next stage groups are one entry of schema.PART_GROUPS -----------------------------

class TopK:
    """Keep the largest `ratio` of each update's coordinates. The rest are zero."""

    def __init__(self, ratio: float = 0.1):
        self.ratio = ratio


def test_a_new_part_group_is_described_and_checked_by_the_same_code(monkeypatch):
    prune = Registry("prune")
    prune.add("topk", TopK, {"ratio": number("the share of coordinates kept", lo=0, hi=1)})
    monkeypatch.setitem(schema.PART_GROUPS, "prune", prune)
    assert describe_group("prune").splitlines() == [
        "prune options (`prune=OPTION`, * the default; `fedharness config prune OPTION` shows one):",
        "  prune      none*, topk", "",
        "what each does, and its keys (key = default  doc), set as prune.KEY=value:",
        "prune=none: no prune (the default: a run without `prune=`)",
        "prune=topk: Keep the largest `ratio` of each update's coordinates.",
        _line("  prune.ratio = 0.1", "the share of coordinates kept")]
    with pytest.raises(ConfigError, match=r"^invalid value for 'prune.nope': 1 \(no such key; keys of "
                                          r"'prune': ratio\)$"):
        schema.part_groups_known({"prune": {"name": "topk", "ratio": 0.2, "nope": 1}})
    with pytest.raises(ConfigError, match=r"'prune.ratio': 2 \(a finite number in \[0, 1\]\)"):
        schema.part_groups_known({"prune": {"name": "topk", "ratio": 2}})
    with pytest.raises(ConfigError, match=r"'prune': 'nope' \(one of: none, topk\)"):
        schema.part_groups_known({"prune": {"name": "nope"}})
