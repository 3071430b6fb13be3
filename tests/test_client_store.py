"""The client store (harness/core/client_store.py): a slot a user's part declares is kept per client in the shard
that owns it, checkpointed by that shard (only what changed), resumed, and the same bits on 1 and 3 shards, on Ray,
and on disk; a run whose slots exceed the memory budget is refused before any work, naming the slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedharness
from fedharness import cli
from fedharness.algorithms.solvers import LocalSGD
from fedharness.config.load import load_settings
from fedharness.contracts import Callback, ClientSlot
from fedharness.registry.groups import PARTS
from fedharness.core import client_store
from fedharness.core.client_store import ClientStore, checkpointed_values
from fedharness.results import layout
from fedharness.results.store import FileStore, open_store
from fedharness.runs.execute import execute
from ray_support import read_rounds


def _start_at_server(w0: torch.Tensor, server_ctx) -> torch.Tensor:
    return w0.double()


class PersonalSGD(LocalSGD):
    """A notebook's part: each client keeps a personal model (its last local model, float64 [dim]; at its first
    round the server's) and every local step pulls towards it by `pull` (g + pull (w - personal))."""

    def __init__(self, pull: float = 0.5):
        super().__init__()
        self.pull = pull

    def client_slots(self, problem) -> tuple[ClientSlot, ...]:
        return (ClientSlot("personal", (problem.dim,), torch.float64, _start_at_server),)

    def init_state(self, w0, server_ctx=None, saved=None):
        state = super().init_state(w0, server_ctx, saved)
        kept = w0 if saved is None else torch.stack([s["personal"] for s in saved])  # None: sizing a step
        state["personal"] = kept.to(w0.dtype)
        return state

    def update(self, w, g, lr, state):
        n = len(w)  # the copies still training: a prefix of the round's
        return super().update(w, g + self.pull * (w - state["personal"][:n]), lr, state)

    def finish(self, w0, w, lr_sum, state, p):
        return {"personal": w.double()}, {}


@pytest.fixture(autouse=True, scope="module")
def personal_sgd():
    """The user's solver registered as from a notebook, and the part registries restored afterwards (a key of its
    own, `pull`, must not leak into other test files that run in this process)."""
    saved = [(reg, dict(reg), dict(reg.option_keys)) for reg in PARTS.values()]
    fedharness.register_part("solver", "personal_sgd", PersonalSGD, keys={"pull": fedharness.keys.number("pull", lo=0)})
    yield
    for reg, options, keys in saved:
        reg.clear()
        reg.update(options)
        reg.option_keys.clear()
        reg.option_keys.update(keys)

RUN = ["dataset=quadratic", "dataset.num_clients=12", "dataset.dim=6", "dataset.curvature=diagonal", "dtype=float64",
       "replicas=2", "algorithm.sampler=scheme_ii", "algorithm.clients_per_round=4", "algorithm.local_steps=3",
       "algorithm.client_lr=0.1", "algorithm.solver=personal_sgd", "rounds=6", "eval_every=1", "reference=off",
       "heterogeneity=false", "progress=false", "threads=1"]
METRICS = ("train_loss", "grad_norm_sq", "local_steps", "bytes_up")


class CrashAt(Callback):
    def __init__(self, rnd: int):
        self.rnd = rnd

    def on_evaluation(self, context) -> None:
        if context.round == self.rnd:
            raise RuntimeError(f"crashed at round {self.rnd}")


def _rows(results, run_id: str) -> list[tuple]:
    return [(r["round"], r["replica"], *(r[m] for m in METRICS)) for r in read_rounds(results, run_id)]


def test_a_users_slot_is_kept_checkpointed_resumed_and_the_same_on_1_and_3_shards(tmp_path):
    whole = tmp_path / "whole"
    execute(load_settings([f"results_dir={whole}", *RUN, "checkpoint_every=2"]), run_id="whole")
    want = _rows(whole, "whole")
    execute(load_settings([f"results_dir={tmp_path / 'three'}", *RUN, "num_shards=3"]), run_id="three")
    assert _rows(tmp_path / "three", "three") == want  # the same bits on 3 shards
    plain = tmp_path / "plain"
    execute(load_settings([f"results_dir={plain}", *RUN, "algorithm.solver=sgd"]), run_id="plain")
    assert _rows(plain, "plain")[-1] != want[-1]  # the slot steers the trajectory: a lost one would show

    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="crashed at round 5"):
        execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=2"]), run_id="victim",
                callbacks=[CrashAt(5)])
    settings = load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=2", "num_shards=3", "resume=victim"])
    state = torch.load(cut / "checkpoints" / "run_id=victim" / "state.pt", weights_only=True)
    files = state["client_files"]
    assert state["round"] == 4 and len(files) == 2  # one shard, checkpoints at rounds 2 and 4
    kept = checkpointed_values(open_store(str(cut)), files)
    assert kept and all(set(s) == {"personal"} and s["personal"].shape == (6,) for s in kept.values())
    store = open_store(str(cut))
    first = torch.load(store.url + "/" + files[0], weights_only=True)["slots"]["personal"]
    second = torch.load(store.url + "/" + files[1], weights_only=True)["slots"]["personal"]
    # only changed rows: each file holds the (replica, client) pairs that trained in its two rounds, once each
    assert len(first["client"]) <= 2 * 2 * 4 and len(second["client"]) <= 2 * 2 * 4
    assert len(set(zip(first["replica"].tolist(), first["client"].tolist()))) == len(first["client"])
    execute(settings)  # resumed on 3 shards: each reads its own clients' rows from the single shard's files
    assert _rows(cut, "victim") == want


def _clients_folder(results) -> list[str]:
    return open_store(str(results)).list(layout.checkpoint_clients_folder("victim"))


def test_the_chain_of_slot_files_is_compacted_and_a_resume_after_it_gives_the_same_bits(tmp_path, monkeypatch):
    """With COMPACT_AFTER = 2, a checkpoint every round: rounds 1, 2 write changed rows, round 3 every shard's whole
    table (the files before it deleted), round 4 changed rows again; cut at round 5 and resumed on 3 shards, the
    run has the bits of the uninterrupted one."""
    monkeypatch.setattr(client_store, "COMPACT_AFTER", 2)
    whole = tmp_path / "whole"
    execute(load_settings([f"results_dir={whole}", *RUN]), run_id="whole")
    want = _rows(whole, "whole")
    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="crashed at round 5"):
        execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=1", "num_shards=2"]), run_id="victim",
                callbacks=[CrashAt(5)])
    files = torch.load(cut / "checkpoints" / "run_id=victim" / "state.pt", weights_only=True)["client_files"]
    names = [key.rsplit("/", 1)[-1] for key in files]
    assert names == ["round=00000003-clients=0-6.pt", "round=00000003-clients=6-12.pt",
                     "round=00000004-clients=0-6.pt", "round=00000004-clients=6-12.pt"]  # both shards trained
    assert _clients_folder(cut) == files  # rounds 1 and 2's files are gone
    # the full tables of round 3 hold what the chain of rounds 1-3 of a run that never compacts holds, bit for bit
    monkeypatch.setattr(client_store, "COMPACT_AFTER", 100)
    chain = tmp_path / "chain"
    with pytest.raises(RuntimeError, match="crashed at round 4"):
        execute(load_settings([f"results_dir={chain}", *RUN, "checkpoint_every=1"]), run_id="chain",
                callbacks=[CrashAt(4)])
    kept = torch.load(chain / "checkpoints" / "run_id=chain" / "state.pt", weights_only=True)["client_files"]
    assert len(kept) == 3  # one shard, rounds 1, 2 and 3
    full, unmerged = (checkpointed_values(open_store(str(where)), keys) for where, keys in ((cut, files[:2]),
                                                                                          (chain, kept)))
    assert full.keys() == unmerged.keys() and len(full) > 8  # more pairs than one round's 2 x 4
    assert all(torch.equal(full[key]["personal"], unmerged[key]["personal"]) for key in full)
    execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=1", "num_shards=3", "resume=victim"]))
    assert _rows(cut, "victim") == want


def test_a_kill_mid_compaction_leaves_the_checkpoint_before_readable(tmp_path, monkeypatch):
    """state.pt's third write (round 3, the compaction) fails after the shards wrote their whole tables: the
    checkpoint of round 2 and its files are intact, the resume gives the uninterrupted bits and its own compaction
    drops the files the kill left."""
    monkeypatch.setattr(client_store, "COMPACT_AFTER", 2)
    whole = tmp_path / "whole"
    execute(load_settings([f"results_dir={whole}", *RUN]), run_id="whole")
    plain_write, states = FileStore.write, []

    def killed_at_third_state(self, key, data):
        if key.endswith("state.pt"):
            states.append(key)
            if len(states) == 3:
                raise KeyboardInterrupt("killed")
        plain_write(self, key, data)

    cut = tmp_path / "cut"
    monkeypatch.setattr(FileStore, "write", killed_at_third_state)
    with pytest.raises(KeyboardInterrupt):
        execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=1"]), run_id="victim")
    monkeypatch.setattr(FileStore, "write", plain_write)
    state = torch.load(cut / "checkpoints" / "run_id=victim" / "state.pt", weights_only=True)
    assert state["round"] == 2 and len(state["client_files"]) == 2  # one shard, rounds 1 and 2
    left = [key for key in _clients_folder(cut) if key not in state["client_files"]]
    assert [key.rsplit("/", 1)[-1] for key in left] == ["round=00000003-clients=0-12.pt"]  # the full table
    execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=1", "resume=victim"]))
    assert _rows(cut, "victim") == _rows(whole, "whole")


def test_the_store_returns_the_bits_it_was_given_in_memory_and_on_disk():
    torch.manual_seed(0)
    for on_disk in (False, True):
        store = ClientStore([ClientSlot("v", (3,), torch.float64), ClientSlot("h", (2,), torch.bfloat16)], on_disk)
        replica, clients = np.repeat([0, 1], 20), np.tile(np.arange(20), 2)  # 40 rows: the tables grow twice
        values, halves = torch.randn(40, 3, dtype=torch.float64), torch.randn(40, 2).bfloat16()
        store.write("v", replica, clients, values)
        store.write("h", replica, clients, halves)
        assert torch.equal(torch.stack(store.get("v", replica, clients)), values)
        assert torch.equal(torch.stack(store.get("h", replica, clients)).view(torch.int16), halves.view(torch.int16))
        assert store.get("v", np.array([2]), np.array([0])) == [None]  # a pair that never wrote one
        assert len(store.take_changed()["v"]["client"]) == 40
        store.write("v", replica[:3], clients[:3], values[:3] * 2)
        changed = store.take_changed()
        assert list(changed) == ["v"] and torch.equal(changed["v"]["values"], values[:3] * 2)  # only those 3
        store.keep_replicas(np.array([1]))  # replica 1 alone, renumbered 0
        assert torch.equal(torch.stack(store.get("v", np.zeros(20, dtype=np.int64), np.arange(20))), values[20:])
        store.close()


BUDGET = ["dataset.num_clients=200", "dataset.dim=100", "algorithm.sampler=full", "rounds=2", "eval_every=2"]


def test_slots_beyond_the_budget_are_refused_before_any_work_and_run_on_disk(tmp_path, capsys):
    """200 clients x 2 replicas x 800 bytes = 320 kB of personal models, above a 200 kB budget."""
    refused = tmp_path / "refused"
    assert cli.main(["run", f"results_dir={refused}", *RUN, *BUDGET, "memory_budget_gb=0.0002"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'memory_budget_gb'" in err and "the client slot 'personal' (800 bytes" in err
    assert "x 200 clients that can hold one x 2 replicas" in err and "client_slots_on_disk=true" in err
    assert "plus a batched step of 1 client copy (" in err  # the slots leave no room: one copy at least
    assert not refused.exists()  # nothing written
    execute(load_settings([f"results_dir={tmp_path / 'disk'}", *RUN, *BUDGET, "memory_budget_gb=0.0002",
                           "client_slots_on_disk=true"]), run_id="disk")
    execute(load_settings([f"results_dir={tmp_path / 'memory'}", *RUN, *BUDGET]), run_id="memory")
    assert _rows(tmp_path / "disk", "disk") == _rows(tmp_path / "memory", "memory")


@pytest.mark.slow
def test_a_users_slot_on_ray_is_the_inline_bits(local_ray, tmp_path):
    execute(load_settings([f"results_dir={tmp_path / 'inline'}", *RUN]), run_id="inline")
    execute(load_settings([f"results_dir={tmp_path / 'ray'}", *RUN, "executor=ray", "ray.num_shards=2",
                           "checkpoint_every=2"]), run_id="ray")
    assert _rows(tmp_path / "ray", "ray") == _rows(tmp_path / "inline", "inline")
