"""The models of the federated text and FEMNIST benchmarks (issue 28): the papers' parameter counts, the
functional LSTM against torch.nn.LSTM, its padding mask, int64 token ids through NetObjective, the vectorized
clients against the per-client path, an end-to-end run, and bad combinations named in one line."""

from __future__ import annotations

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
from fedharness.runs.execute import prepare

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
    for kernel in ("vmap", "loop"):
        problem.objective.kernel = kernel
        grads[kernel] = problem.grad(w, problem.round_batches(keys, 1), 0)
    assert grads["vmap"].abs().max() > 1e-3 and not torch.equal(grads["vmap"][0], grads["vmap"][1])
    assert_close_to_scale(grads["loop"], grads["vmap"], rtol=1e-12)


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
