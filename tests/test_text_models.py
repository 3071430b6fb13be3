"""The models of the federated text and FEMNIST benchmarks (issue 28): the papers' parameter counts, the
functional LSTM against torch.nn.LSTM, its padding mask, int64 token ids through NetObjective, the vectorized
clients against the per-client path, an end-to-end run, and bad combinations named in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hydra.core.config_store import ConfigStore
from torch import nn

import fedharness
from closeness import assert_close_to_scale
from fedharness.contracts import ClientKeys
from fedharness.core import kernels
from fedharness.errors import ConfigError
from fedharness.problems import DATASETS
from fedharness.problems.nets import build_net, count_params
from fedharness.problems.objectives import NetObjective
from fedharness.problems.text_nets import LSTM
from fedharness.runs.execute import execute, prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

SEQ, VOCAB = 80, 80  # LEAF's Shakespeare: 80 characters to the next one, an 80-letter vocabulary


def _lstm_params(inputs: int, hidden: int) -> int:
    return 4 * hidden * (inputs + hidden) + 4 * hidden  # one bias per layer, as TF/Keras


def test_parameter_counts_are_the_papers():
    conv = (5 * 5 * 1 * 32 + 32) + (5 * 5 * 32 * 64 + 64)
    assert count_params(build_net("femnist_cnn", (1, 28, 28), 62)) == conv + (7 * 7 * 64 * 2048 + 2048) \
        + (2048 * 62 + 62) == 6_603_710
    char = VOCAB * 8 + _lstm_params(8, 256) + _lstm_params(256, 256) + (256 * VOCAB + VOCAB)
    assert count_params(build_net("char_lstm", (SEQ,), VOCAB)) == char == 817_872
    # Reddi et al. 2021, StackOverflow next-word prediction: 10,000 words + pad, oov, bos, eos
    words = 10_004 * 96 + _lstm_params(96, 670) + (670 * 96 + 96) + (96 * 10_004 + 10_004)
    assert count_params(build_net("word_lstm", (20,), 10_004)) == words == 4_050_748


def test_femnist_cnn_takes_leafs_flat_samples_as_images():
    torch.manual_seed(0)
    net = build_net("femnist_cnn", (784,), 62)
    x = torch.randn(3, 1, 28, 28)
    out = net(x.reshape(3, 784))
    assert out.shape == (3, 62)
    torch.testing.assert_close(out, net(x), rtol=0, atol=0)


def _same_as_torch(lstm: LSTM) -> nn.LSTM:
    """torch.nn.LSTM with `lstm`'s weights: its one bias as bias_ih, bias_hh zero."""
    layer0 = lstm.layers[0]
    ref = nn.LSTM(layer0.weight_ih.shape[1], layer0.hidden_size, len(lstm.layers), batch_first=True)
    ref = ref.to(layer0.weight_ih.dtype)
    with torch.no_grad():
        for k, layer in enumerate(lstm.layers):
            getattr(ref, f"weight_ih_l{k}").copy_(layer.weight_ih)
            getattr(ref, f"weight_hh_l{k}").copy_(layer.weight_hh)
            getattr(ref, f"bias_ih_l{k}").copy_(layer.bias)
            getattr(ref, f"bias_hh_l{k}").zero_()
    return ref


def test_functional_lstm_equals_torch_lstm_outputs_and_gradients():
    torch.manual_seed(0)
    lstm = LSTM(8, 32, num_layers=2).double()
    ref = _same_as_torch(lstm)
    x = torch.randn(5, 12, 8, dtype=torch.float64)
    weights = torch.randn(5, 12, 32, dtype=torch.float64)  # a loss that reads every output
    out, (ref_out, _) = lstm(x), ref(x)
    assert_close_to_scale(out.detach(), ref_out.detach(), rtol=1e-12)
    (out * weights).sum().backward()
    (ref_out * weights).sum().backward()
    for k, layer in enumerate(lstm.layers):
        assert_close_to_scale(layer.weight_ih.grad, getattr(ref, f"weight_ih_l{k}").grad, rtol=1e-12)
        assert_close_to_scale(layer.weight_hh.grad, getattr(ref, f"weight_hh_l{k}").grad, rtol=1e-12)
        assert_close_to_scale(layer.bias.grad, getattr(ref, f"bias_ih_l{k}").grad, rtol=1e-12)


def test_padded_steps_leave_the_state_as_it_was():
    """word_lstm skips pad tokens: a sequence padded on either side predicts what the bare one does."""
    torch.manual_seed(0)
    net = build_net("word_lstm", (9,), 50).double()
    net.pad_id = 0
    tokens = torch.randint(1, 50, (3, 6))
    pad = torch.zeros(3, 3, dtype=torch.int64)
    bare = net(tokens)
    for padded in (torch.cat([pad, tokens], 1), torch.cat([tokens, pad], 1)):
        assert_close_to_scale(net(padded).detach(), bare.detach(), rtol=1e-12)
    net.pad_id = None  # without a pad id the pad tokens are read like words
    assert (net(torch.cat([pad, tokens], 1)) - bare).abs().max() > 1e-3


def _text(seed: int, n: int = 48, seq: int = SEQ, vocab: int = VOCAB, floats: bool = False):
    """int64 windows of `seq` token ids and the next token (the last one plus one: learnable), train and test."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(n, seq), dtype=np.int64)
    y = (x[:, -1] + 1) % vocab
    x = x.astype(np.float32) if floats else x
    return (x, y), (x[:12], y[:12])


@pytest.fixture
def text_data(monkeypatch):
    """`text` (int64 token windows) and `text_floats` registered for the test only (monkeypatch undoes both
    entries and the config store's dataset group afterwards)."""
    repo = ConfigStore.instance().repo
    monkeypatch.setitem(repo, "dataset", dict(repo.get("dataset", {})))
    for name in ("text", "text_floats"):
        monkeypatch.setitem(DATASETS, name, None)
    fedharness.register_dataset("text", _text, num_clients=4, n=48, seq=SEQ, vocab=VOCAB)
    fedharness.register_dataset("text_floats", _text, num_clients=4, floats=True)


def _text_run(run_config, *extra: str):
    return run_config("dataset=text", "model=char_lstm", "algorithm.clients_per_round=2", "algorithm.local_steps=2",
                      "algorithm.batch_size=5", "rounds=2", "eval_every=1", *extra)


def test_token_ids_reach_the_model_as_int64(run_config, text_data):
    settings = _text_run(run_config, "kernel=vmap", "dataset.seq=10")
    problem, _, _ = prepare(settings)
    (x, _), (x_test, _) = _text(settings.seed, seq=10)
    assert problem.x.dtype == torch.int64 and problem.x_test.dtype == torch.int64
    assert sorted(map(tuple, problem.x.tolist())) == sorted(map(tuple, x.tolist()))  # the ids as written
    assert torch.equal(problem.x_test, torch.from_numpy(x_test))


@pytest.mark.parametrize("model", ["char_lstm", "word_lstm"])
def test_vectorized_clients_equal_the_per_client_path(run_config, text_data, model):
    problem, _, _ = prepare(_text_run(run_config, f"model={model}", "dtype=float64", "kernel=vmap",
                                      "dataset.seq=5"))
    assert problem.objective.vmappable  # the functional LSTM batches under vmap: no per-client fallback
    keys = ClientKeys(np.arange(4), np.zeros(4, dtype=np.int64), 0, 0)
    w = problem.init_params(4, 0)  # four different models
    grads = {}
    for kernel in ("vmap", "loop", "fused"):
        problem.objective.kernel = kernel
        grads[kernel] = problem.grad(w, problem.round_batches(keys, 1), 0)
    assert grads["vmap"].abs().max() > 1e-3 and not torch.equal(grads["vmap"][0], grads["vmap"][1])
    # float64: each formulation sums the same products in another order, about 1e-16 relative a step, and the
    # 5 steps of 1-2 layers keep that far below 1e-12 of the gradient's scale (as the nn.LSTM test above)
    assert_close_to_scale(grads["loop"], grads["vmap"], rtol=1e-12)
    assert_close_to_scale(grads["fused"], grads["vmap"], rtol=1e-12)


# What a checkpoint of char_lstm holds (the flat vector's layout, ModuleLayout's order), as before kernel=fused
CHAR_LSTM_STATE = [("embedding.weight", (VOCAB, 8)), ("lstm.layers.0.weight_ih", (1024, 8)),
                   ("lstm.layers.0.weight_hh", (1024, 256)), ("lstm.layers.0.bias", (1024,)),
                   ("lstm.layers.1.weight_ih", (1024, 256)), ("lstm.layers.1.weight_hh", (1024, 256)),
                   ("lstm.layers.1.bias", (1024,)), ("fc.weight", (VOCAB, 256)), ("fc.bias", (VOCAB,))]


@pytest.mark.parametrize("model", ["char_lstm", "word_lstm", "sent_lstm"])
def test_the_fused_lstm_computes_the_functional_cells_outputs_and_gradients(model):
    """torch's fused LSTM (LSTM.fused) on the same parameters: the same outputs and gradients, in float64 to 1e-12
    of their scale (as nn.LSTM against the cell above); word and sent skip pad tokens before, after and between
    the words (packed: each sequence's kept tokens moved to the front), and a sequence of pads alone keeps the
    zero state."""
    torch.manual_seed(0)
    net = build_net(model, (9,), 50, **({"token_vocab": 50} if model == "sent_lstm" else {})).double()
    x = torch.randint(1, 50, (5, 9))
    x[1, :3], x[2, -4:], x[3, 2:5], x[4] = 0, 0, 0, 0  # pads before, after, between; all pads
    out, grads = {}, {}
    for fused in (False, True):
        net.lstm.fused = fused
        net.zero_grad()
        out[fused] = net(x)
        (out[fused] * torch.linspace(-1, 1, out[fused].shape[1], dtype=torch.float64)).sum().backward()
        grads[fused] = [p.grad.clone() for p in net.parameters()]
    assert out[False].abs().max() > 1e-3
    assert_close_to_scale(out[True].detach(), out[False].detach(), rtol=1e-12)
    for fused_grad, cell_grad in zip(grads[True], grads[False]):
        assert_close_to_scale(fused_grad, cell_grad, rtol=1e-12)


def test_a_checkpoint_of_char_lstm_loads_and_both_paths_read_it(tmp_path):
    """kernel=fused keeps the parameterization: a state dict of char_lstm's names and shapes (one bias a layer)
    loads strictly, and both LSTM paths compute the same next-character logits from it."""
    torch.manual_seed(1)
    saved = {name: torch.randn(shape) * 0.1 for name, shape in CHAR_LSTM_STATE}
    torch.save(saved, tmp_path / "char_lstm.pt")
    net = build_net("char_lstm", (SEQ,), VOCAB)
    assert [(n, tuple(t.shape)) for n, t in net.state_dict().items()] == CHAR_LSTM_STATE
    net.load_state_dict(torch.load(tmp_path / "char_lstm.pt"), strict=True)
    x = torch.randint(0, VOCAB, (3, SEQ))
    with torch.no_grad():
        cell = net(x)
        net.lstm.fused = True
        fused = net(x)
    # float32 over 2 x 80 steps: about 160 roundings of 1e-7 relative each on values of order 1: 1e-5 of the scale
    assert_close_to_scale(fused, cell, rtol=1e-5)


def test_kernel_fused_is_refused_for_a_net_without_lstm_layers(run_config, tmp_path):
    with pytest.raises(ConfigError, match="'kernel': 'fused'.*fused: a net with fused LSTM layers"):
        prepare(run_config("dataset=digits", "model=2nn", "rounds=1", "kernel=fused"))


def test_a_fused_run_has_the_same_bits_on_one_and_three_shards(run_config, text_data):
    rows = [execute(_text_run(run_config, "kernel=fused", "dataset.seq=10", shards)).rows
            for shards in ("num_shards=1", "num_shards=3")]
    losses = [[r["train_loss"] for r in run] for run in rows]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_kernel_auto_times_token_models_on_token_ids():
    """kernel=auto's timing feeds the model token ids of its shape (float samples would fail in the embedding)."""
    objective = NetObjective(build_net("char_lstm", (6,), VOCAB), "char_lstm", 0.0, (6,), tokens=True)
    assert objective.inputs(2, 3).dtype == torch.int64 and objective.inputs(2, 3).shape == (2, 3, 6)
    timings = kernels.measure(objective, 2, 3, torch.device("cpu"), torch.float32)
    assert list(timings) == ["vmap", "loop", "fused"] and all(0 < s < 60 for s in timings.values())


def test_a_char_lstm_run_on_a_registered_text_data_set_ends_ok(tmp_path, text_data):
    result = fedharness.run(["dataset=text", "dataset.n=24", "model=char_lstm", "algorithm.clients_per_round=2",
                             "algorithm.local_steps=1", "algorithm.batch_size=4", "rounds=2", "eval_every=2",
                             "kernel=vmap", "eval.per_client=true", "progress=false",
                             f"results_dir={tmp_path / 'results'}"])
    row = result.runs.loc[0]
    assert (result.status, row["model"], row["dataset"]) == ("ok", "char_lstm", "text")
    loss = result.rounds["train_loss"].to_numpy()
    assert len(loss) == 2 and np.isfinite(loss).all()  # rounds 0 and 2
    assert abs(loss[0] - np.log(VOCAB)) < 0.2  # about uniform over the vocabulary at the start
    assert result.rounds["test_acc"].between(0, 1).all()
    spread = result.rounds[["client_acc_p10", "client_acc_p90"]].to_numpy()  # each client on its own data
    assert spread.shape == (2, 2) and ((spread >= 0) & (spread <= 1)).all()


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # nn.LSTM under vmap: its batching fallback
def test_activation_estimate_counts_every_lstm_step():
    """An LSTM keeps, at each of its 2 x 80 steps, at least 6 H values for the backward pass (sigmoid of three
    gates, tanh of the fourth, the previous c, tanh of c) and at most 16 H; the estimate is twice that a sample
    (SAVED_FACTOR), linear in the batch. A module returning a tuple (nn.LSTM's output, (h, c)) is measured too."""
    objective = NetObjective(build_net("char_lstm", (SEQ,), VOCAB), "char_lstm", 0.0, (SEQ,), tokens=True)
    steps, hidden = 2 * SEQ, 256
    one = objective.activation_bytes(1, 4)
    assert 2 * 4 * 6 * hidden * steps <= one <= 2 * 4 * 16 * hidden * steps
    assert objective.activation_bytes(10, 4) == 10 * one

    class TorchLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 4, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0][:, -1]

    plain = NetObjective(TorchLSTM(), "torch_lstm", 0.0, (5, 3))
    assert plain.activation_bytes(2, 4) >= 3 * 2 * 4 * (5 * 4 + 4 + 4)  # at least its output, h_n and c_n


def test_a_model_that_cannot_read_the_samples_is_named(run_config, text_data):
    with pytest.raises(ConfigError, match="'model': '2nn'.*int64 token ids.*of shape \\(80,\\)"):
        prepare(_text_run(run_config, "model=2nn"))
    with pytest.raises(ConfigError, match="'model': 'char_lstm'.*token sequences of shape \\(seq_len,\\).*"
                                          "\\(1, 8, 8\\)"):
        prepare(run_config("dataset=digits", "model=char_lstm", "rounds=1"))
    with pytest.raises(ConfigError, match="'model': 'char_lstm'.*takes float samples of shape \\(80,\\)"):
        prepare(_text_run(run_config, "dataset=text_floats"))


def test_a_bad_model_exits_2_and_writes_nothing(tmp_path, text_data, capsys):
    from fedharness.cli import main

    results = tmp_path / "results"
    code = main(["run", "dataset=text", "model=2nn", "rounds=1", "progress=false", f"results_dir={results}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not results.exists()
    assert len(err) == 1 and "model" in err[0] and "2nn" in err[0] and "int64 token ids" in err[0]


@pytest.fixture
def timings(monkeypatch, tmp_path):
    """kernel=auto with the candidates it times recorded (fused fastest) and an empty cache."""
    calls = []

    def fake_measure(objective, copies, batch, device, dtype, names=None):
        calls.append(names)
        return {name: 1e-3 * (1 + (name != "fused")) for name in names}

    monkeypatch.setattr(kernels, "measure", fake_measure)
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "cache"))
    return calls


def test_auto_takes_fused_untimed_where_the_data_are_fewer_than_timing_reads(run_config, text_data, timings,
                                                                            tmp_path):
    """Timing vmap, loop and fused reads (1 + REPEATS) x 3 x 2 copies x 5 windows = 120 windows' gradients: a
    training set of 119 windows takes fused untimed (and remembers nothing), one of 120 is timed."""
    threshold = (1 + kernels.REPEATS) * 3 * 2 * 5
    for n, timed in ((threshold - 1, []), (threshold, [("vmap", "loop", "fused")])):
        problem, _, _ = prepare(_text_run(run_config, f"dataset.n={n}", "dataset.seq=6"))
        assert len(problem.y) == n and problem.objective.kernel == "fused" and timings == timed
    assert len(json.loads((tmp_path / "cache" / "kernels.json").read_text())) == 1  # the timed choice alone


def test_auto_times_no_candidate_over_the_memory_budget(run_config, text_data, timings):
    """A budget between one copy's step and the two copies vmap holds at once: vmap is not timed; a budget below
    one copy's step leaves fused, taken untimed."""
    settings = _text_run(run_config, "dataset.n=400", "dataset.seq=6", "kernel=loop")
    problem, _, _ = prepare(settings)
    one = kernels.step_bytes(problem.objective, "loop", 2, 5, 4)
    assert kernels.step_bytes(problem.objective, "vmap", 2, 5, 4) == 2 * one
    auto = settings.replace(kernel="auto")
    for budget, chosen, timed in ((int(1.5 * one), "fused", [("loop", "fused")]), (one // 2, "fused", [])):
        problem.memory_budget = budget
        timings.clear()
        assert kernels.resolve_kernel(auto, problem) == chosen and timings == timed
