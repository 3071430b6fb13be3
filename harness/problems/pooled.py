"""A data set's samples pooled, as a data set's factory returns them, before a partitioner splits them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PooledData:
    x: np.ndarray  # training samples
    y: np.ndarray  # their int64 labels
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    owner: np.ndarray | None = None  # each training sample's own client (generated data: partition=natural)
    # each test sample's own client, where the data set has a held-out split per client (LEAF, TFF): the
    # per-client evaluation's data under partition=natural; owners are named as in `owner`
    test_owner: np.ndarray | None = None
    # the number of classes (a text task: the vocabulary) when the data set knows it; None: max label + 1
    num_classes: int | None = None
    # uint8 images stored as codes (federated file data sets): each pixel is code * x_scale, made float one
    # minibatch or evaluation chunk at a time (DataProblem); None: x as it is (floats, or integer token ids)
    x_scale: float | None = None
    # token ids: how many ids there are (an embedding's rows: 0 .. token_vocab - 1) when the data set knows it
    # (a vocabulary with pad and oov ids); None: the largest id + 1, where a model asks
    token_vocab: int | None = None
    # the model the data set's papers train on these samples (a natural data set's: char_lstm, femnist_cnn, ...),
    # model=auto's choice (harness/config/load.py); None: model=auto is logistic regression
    model: str | None = None
    # the owners' names, indexed by the codes in `owner` and `test_owner` (a federated file's writers, roles,
    # users); None: the owners are their codes
    owner_names: list[str] | None = None
