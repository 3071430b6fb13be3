"""Recurrent networks of the federated text benchmarks, over int64 token ids [B, seq_len]:

* ``char_lstm``  LEAF's Shakespeare model (shakespeare/stacked_lstm.py): embedding 8, two LSTM layers of 256,
                 the next character from the last output                 817,872 params (vocabulary 80)
* ``word_lstm``  Reddi et al. 2021's StackOverflow next-word model: embedding 96, one LSTM layer of 670, dense
                 96, dense vocabulary; pad tokens (id 0, TFF's) are skipped   4,050,748 params (vocabulary 10,004)
* ``sent_lstm``  LEAF's Sent140 classifier (sent140/stacked_lstm.py) with a trained embedding of 100 in place of
                 GloVe's 300: two LSTM layers of 100, dense 128 (ReLU), dense to the classes, from the last
                 output; pad tokens (id 0) are skipped              1,174,186 params (10,000 words, 2 classes)

The LSTM is written with torch ops, one time step after another, so that torch.func.vmap batches it over the
client copies like any other layer: nn.LSTM's fused kernel has no batching rule, and under vmap it falls back to
a slow loop over the copies (a warning says so). Its gates are nn.LSTM's (input, forget, cell, output, the same
initialisation) with one bias per layer, as the TensorFlow/Keras LSTMs of LEAF and Reddi et al. have, so the
parameter counts are the papers'; nn.LSTM with bias_ih = bias and bias_hh = 0 computes the same function.
With `LSTM.fused` set (NetObjective sets it for kernel=fused and for evaluation, never under vmap) the same
parameters run through torch's own LSTM kernel (torch.lstm, nn.LSTM's: one fused op for all time steps and layers,
with its fused backward), the same function up to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fedharness.errors import ConfigError
from fedharness.keys import integer
from fedharness.problems.objectives import L2
from fedharness.registry.groups import MODELS

PAD_ID = integer("word_lstm: the padding token's id, whose steps leave the LSTM state as it was (TFF's "
                 "StackOverflow: 0); null: no padding", lo=0, null="no padding")  # `model.pad_id`


def lstm_cell(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM cell update from the gates' pre-activations [B, 4H] (nn.LSTM's order: input, forget, cell,
    output) and the cell state [B, H] to (h, c)."""
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class LSTMLayer(nn.Module):
    """One LSTM layer over [B, T, input_size] -> outputs [B, T, H], from a zero state. `keep` [B, T] (bool,
    optional): where False the step leaves h and c as they were and outputs the previous h, so a padded sequence
    ends in the state of its real tokens, padded on either side."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.empty(4 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)  # nn.LSTM's initialisation
        for p in (self.weight_ih, self.weight_hh, self.bias):
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        # The input's share of every step's gates in one product; only h's share is sequential.
        # Unbound once: indexing projected[:, t] at every step would make autograd add up T zero tensors of the
        # whole projection's size in the backward pass (8.6 GB allocated a char_lstm step, issue 47).
        steps = F.linear(x, self.weight_ih, self.bias).unbind(1)
        h = c = x.new_zeros(x.shape[0], self.hidden_size)
        recurrent = self.weight_hh.T
        outputs = []
        for t, projected in enumerate(steps):
            h_new, c_new = lstm_cell(torch.addmm(projected, h, recurrent), c)
            if keep is not None:
                mask = keep[:, t, None]
                h_new, c_new = torch.where(mask, h_new, h), torch.where(mask, c_new, c)
            h, c = h_new, c_new
            outputs.append(h)
        return torch.stack(outputs, dim=1)


class LSTM(nn.Module):
    """Stacked LSTM layers: the last one's outputs [B, T, H]; `keep` as LSTMLayer's, for every layer. `last`: the
    last layer's output at the last step, on torch's fused LSTM kernel where `fused` is set."""

    fused = False  # NetObjective.fused_lstms sets it where torch.func does not transform the module

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1):
        super().__init__()
        sizes = [input_size] + [hidden_size] * (num_layers - 1)
        self.layers = nn.ModuleList(LSTMLayer(n, hidden_size) for n in sizes)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, keep)
        return x

    def last(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """[B, H]: the last layer's output at the last step, i.e. its state after each sequence's last kept step."""
        if not self.fused:
            return self(x, keep)[:, -1]
        # nn.LSTM's flat weights, layer by layer: weight_ih, weight_hh, bias_ih (our bias), bias_hh (zero: b + 0 is b)
        params = [t for layer in self.layers for t in (layer.weight_ih, layer.weight_hh, layer.bias,
                                                       torch.zeros_like(layer.bias))]
        hidden = self.layers[0].hidden_size
        zero = x.new_zeros(len(self.layers), x.shape[0], hidden)
        if keep is None:
            return torch.lstm(x, (zero, zero), params, True, len(self.layers), 0.0, self.training, False, True)[1][-1]
        return _packed_last(x, keep, (zero, zero), params, len(self.layers), self.training)


def _packed_last(x: torch.Tensor, keep: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                 params: list[torch.Tensor], layers: int, train: bool) -> torch.Tensor:
    """The fused LSTM's last state over each sequence's kept steps: skipped steps leave the state as it was, so the
    state after the last kept step is the LSTM's over the kept steps alone, moved to the front (a stable sort keeps
    their order) and packed by their count. A sequence with no kept step keeps the zero state."""
    kept = keep.sum(1)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True)[1]
    front = x.gather(1, order[..., None].expand(-1, -1, x.shape[-1]))
    packed = nn.utils.rnn.pack_padded_sequence(front, kept.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
    h = torch.lstm(packed.data, packed.batch_sizes, state, params, True, layers, 0.0, train, False)[1][-1]
    return h.index_select(0, packed.unsorted_indices) * (kept > 0)[:, None].to(h.dtype)


class CharLSTM(nn.Module):
    """LEAF's Shakespeare next-character model: embedding 8, two LSTM layers of 256, a dense layer on the last
    output to the vocabulary (the 80 characters LEAF uses)."""

    head_module = "fc"  # the head (FedRep, FedBABU): the last layer

    def __init__(self, vocab_size: int = 80, embed: int = 8, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm = LSTM(embed, hidden, layers)
        self.fc = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.lstm.last(self.embedding(x)))


class WordLSTM(nn.Module):
    """Reddi et al.'s StackOverflow next-word model (TFF's create_recurrent_model): embedding 96, one LSTM layer
    of 670, a dense projection to 96 (no activation), a dense layer to the vocabulary (its 10,000 words and the
    pad, out-of-vocabulary, beginning and end ids). Here one next token per sequence, read from the last output;
    steps on `pad_id` are skipped, as Keras' mask_zero does."""

    head_module = "fc"  # the head (FedRep, FedBABU): the last layer

    def __init__(self, vocab_size: int = 10_004, embed: int = 96, hidden: int = 670, pad_id: int | None = 0):
        super().__init__()
        self.pad_id = pad_id
        self.embedding = nn.Embedding(vocab_size, embed)
        self.lstm = LSTM(embed, hidden, 1)
        self.projection = nn.Linear(hidden, embed)
        self.fc = nn.Linear(embed, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = None if self.pad_id is None else x != self.pad_id
        return self.fc(self.projection(self.lstm.last(self.embedding(x), keep)))


class SentLSTM(nn.Module):
    """LEAF's Sent140 model: an embedding of the `token_vocab` ids (the data set's: its words, pad 0 and oov 1),
    two LSTM layers, dense 128 with ReLU, dense to the classes, from the last output; steps on `pad_id` are
    skipped, so a tweet padded after its words is classified by the state its words leave."""

    head_module = "fc"  # the head (FedRep, FedBABU): the last layer

    def __init__(self, num_classes: int = 2, token_vocab: int = 10_002, embed: int = 100, hidden: int = 100,
                 pad_id: int | None = 0):
        super().__init__()
        self.pad_id = pad_id
        self.embedding = nn.Embedding(token_vocab, embed)
        self.lstm = LSTM(embed, hidden, 2)
        self.dense = nn.Linear(hidden, 128)
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = None if self.pad_id is None else x != self.pad_id
        return self.fc(torch.relu(self.dense(self.lstm.last(self.embedding(x), keep))))


def _sequence_length(name: str, in_shape: tuple[int, ...]) -> int:
    if len(in_shape) != 1:
        raise ConfigError("model", name, f"token sequences of shape (seq_len,) (int64 ids), got samples of shape "
                          f"{tuple(in_shape)}")
    return int(in_shape[0])


def _build_char_lstm(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    _sequence_length("char_lstm", in_shape)
    return CharLSTM(vocab_size=num_classes)


def _build_word_lstm(in_shape: tuple[int, ...], num_classes: int, pad_id: int | None = 0) -> nn.Module:
    _sequence_length("word_lstm", in_shape)
    return WordLSTM(vocab_size=num_classes, pad_id=pad_id)


def _build_sent_lstm(in_shape: tuple[int, ...], num_classes: int, token_vocab: int | None = None,
                     pad_id: int | None = 0) -> nn.Module:
    _sequence_length("sent_lstm", in_shape)
    if token_vocab is None:
        raise ConfigError("model", "sent_lstm", "a data set of int64 token ids (dataset=leaf's Sent140)")
    return SentLSTM(num_classes, token_vocab, pad_id=pad_id)


TOKEN_MODELS = ("char_lstm", "word_lstm", "sent_lstm")  # the built-in models that read int64 token ids
MODELS.add("char_lstm", _build_char_lstm, {"l2": L2})
MODELS.add("word_lstm", _build_word_lstm, {"l2": L2, "pad_id": PAD_ID})
MODELS.add("sent_lstm", _build_sent_lstm, {"l2": L2, "pad_id": PAD_ID})
