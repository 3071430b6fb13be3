"""Per-client evaluation (`eval.per_client`): each client's own held-out data, and its loss and accuracy on it.

Whose held-out data is which (docs/results.md, Per-client evaluation):

* a data set that names each test sample's owner (PooledData.test_owner: LEAF and TFF have a test split per
  client, and the generated data sets draw each client's test samples from that client's own distribution), under
  `partition=natural`: each client's own test samples. Test samples of an owner with no training samples belong to
  no client.
* otherwise (digits, MNIST, CIFAR-10, a partitioner over pooled data): the pooled test set is split so that each
  client's share matches its training label mix. The test samples of class c, in an order shuffled by the data
  seed, go to the clients in contiguous runs proportional to n_{k,c}, the client's training samples of class c
  (rounded at the cumulative sums, so each run's length is within one sample of its share). Every test sample of
  a class some client trains on goes to exactly one client; a client's share is empty when its n_{k,c} are small.

Scores are computed in one pass over the evaluated clients' held-out samples, a chunk at a time: the model gives
each sample's loss and correctness for every replica (contracts.SampleTerms) and the sums are scattered by client,
so the clients and the replicas are one computation. A client with its own buffers (model.buffers=local, FedBN)
has its own model: such clients are scored in batches, each replica's parameters with every client's own buffers
on that client's samples padded to the longest in the batch, the buffer sets under vmap
(contracts.BufferTerms). A model without these capabilities is evaluated one client at a time (loss_terms).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import BufferTerms, ClientScores, Model, SampleTerms
from fedharness.problems.pooled import PooledData

SPLIT_TAG = 28  # the data seed's generator for the label-matched split: np.random.default_rng([seed, SPLIT_TAG])


def client_test_index(pooled: PooledData, index: list[np.ndarray], natural: bool, seed: int) -> list[np.ndarray]:
    """Each client's held-out samples, as indices into pooled.x_test (see the module's doc); `index` is the
    partition's (each client's training sample indices), `natural` whether the partition is the data's owners."""
    if natural and pooled.test_owner is not None and pooled.owner is not None:
        return _by_owner(pooled.owner, pooled.test_owner, len(index))
    return label_matched_split(pooled.y, index, pooled.y_test, seed)


def _by_owner(owner: np.ndarray, test_owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Test samples grouped by owner, clients numbered as the natural partitioner numbers them (sorted owners)."""
    owners = np.unique(owner)
    pos = np.minimum(np.searchsorted(owners, test_owner), len(owners) - 1)
    client = np.where(owners[pos] == test_owner, pos, -1)
    return _group(client, num_clients)


def _group(client: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Sample indices grouped by `client` (-1: nobody's), each group in ascending order."""
    order = np.argsort(client, kind="stable")
    counts = np.bincount(client[client >= 0], minlength=num_clients)
    owned = order[np.count_nonzero(client < 0):]
    return np.split(owned, np.cumsum(counts)[:-1])


def label_matched_split(y_train: np.ndarray, index: list[np.ndarray], y_test: np.ndarray,
                        seed: int) -> list[np.ndarray]:
    """The test set split so that each client's share of class c is proportional to its training samples of c."""
    n = len(index)
    client_of = np.repeat(np.arange(n), [len(ix) for ix in index])
    labels = y_train[np.concatenate(index)] if n else np.zeros(0, np.int64)
    pairs, counts = np.unique(labels.astype(np.int64) * n + client_of, return_counts=True)
    pair_class, pair_client = pairs // n, pairs % n
    shuffled = np.random.default_rng([seed, SPLIT_TAG]).permutation(len(y_test))
    shuffled = shuffled[np.argsort(y_test[shuffled], kind="stable")]  # by class, shuffled within each
    classes, starts, sizes = np.unique(y_test[shuffled], return_index=True, return_counts=True)
    client = np.full(len(y_test), -1, dtype=np.int64)
    lo = np.searchsorted(pair_class, classes, side="left")
    hi = np.searchsorted(pair_class, classes, side="right")
    for start, size, a, b in zip(starts, sizes, lo, hi):
        if a == b:
            continue  # no client trains on this class
        share = np.cumsum(counts[a:b])
        ends = np.rint(size * share / share[-1]).astype(np.int64)
        client[shuffled[start:start + size]] = np.repeat(pair_client[a:b], np.diff(ends, prepend=0))
    return _group(client, n)


def evaluated_clients(seed: int, num_clients: int, count: int | None) -> np.ndarray:
    """The clients per-client evaluation scores, ascending: all of them (count None or >= N), or a uniform sample of
    `count` without replacement, a pure function of (seed, N, count): the same clients every evaluation."""
    if count is None or count >= num_clients:
        return np.arange(num_clients, dtype=np.int64)
    keys = streams.uniform(streams.stream_key(seed, streams.EVAL_SAMPLE, 1, 0, 0), num_clients)
    return np.sort(np.argsort(keys, kind="stable")[:count]).astype(np.int64)


def client_scores(objective: Model, x: torch.Tensor, y: torch.Tensor, held_out: list[np.ndarray], w: torch.Tensor,
                  clients: np.ndarray, chunk: int,
                  buffers: Mapping[tuple[int, int], torch.Tensor] | None = None) -> ClientScores:
    """Scores of `clients` on their `held_out` rows of (x, y) for the models w [R, dim], `chunk` samples at a time.
    `buffers`: (row of w, client) -> the client's own buffers, written over w's last buffer_dim entries."""
    sizes = np.array([len(held_out[k]) for k in clients], dtype=np.int64)
    loss = torch.zeros(w.shape[0], len(clients), dtype=torch.float64, device=w.device)
    correct = torch.zeros_like(loss)
    buffers = buffers or {}
    own = {k for _, k in buffers}
    together = [j for j, k in enumerate(clients) if int(k) not in own]
    alone = [j for j, k in enumerate(clients) if int(k) in own]
    with torch.no_grad():
        if isinstance(objective, SampleTerms):
            _scatter_sums(objective, x, y, held_out, w, clients, np.array(together, dtype=np.int64), chunk,
                          loss, correct)
        else:
            alone = list(range(len(clients)))
        if alone and isinstance(objective, BufferTerms):
            alone = _own_buffer_sums(objective, x, y, held_out, w, clients, alone, buffers, chunk, loss, correct)
        for j in alone:
            k = int(clients[j])
            wk = _with_buffers(w, k, buffers, objective.buffer_dim) if k in own else w
            loss[:, j], correct[:, j] = _client_sums(objective, x, y, held_out[k], wk, chunk)
    n = torch.as_tensor(sizes, dtype=torch.float64, device=w.device)
    return ClientScores(np.asarray(clients, dtype=np.int64), sizes, (loss / n).cpu().numpy(),
                        (correct / n).cpu().numpy(), len(held_out))


def _scatter_sums(objective: SampleTerms, x: torch.Tensor, y: torch.Tensor, held_out: list[np.ndarray],
                  w: torch.Tensor, clients: np.ndarray, cols: np.ndarray, chunk: int, loss: torch.Tensor,
                  correct: torch.Tensor) -> None:
    """Columns `cols` of loss and correct: their clients' sums, one pass over their samples, scattered by client."""
    if len(cols) == 0:
        return
    rows = np.concatenate([held_out[int(clients[j])] for j in cols])
    col = np.repeat(cols, [len(held_out[int(clients[j])]) for j in cols])
    rows_t, col_t = torch.as_tensor(rows, device=x.device), torch.as_tensor(col, device=w.device)
    for start in range(0, len(rows), chunk):
        take = rows_t[start:start + chunk]
        l, c = objective.sample_terms(w, x.index_select(0, take), y.index_select(0, take))
        loss.index_add_(1, col_t[start:start + chunk], l.double())
        correct.index_add_(1, col_t[start:start + chunk], c.double())


def _own_buffer_sums(objective: BufferTerms, x: torch.Tensor, y: torch.Tensor, held_out: list[np.ndarray],
                     w: torch.Tensor, clients: np.ndarray, cols: list[int],
                     buffers: Mapping[tuple[int, int], torch.Tensor], chunk: int, loss: torch.Tensor,
                     correct: torch.Tensor) -> list[int]:
    """Columns `cols` (clients with their own buffers) of loss and correct, batches of clients at once: each
    replica's parameters with every client's buffers, on the client's samples padded to the batch's longest (at
    most `chunk` padded samples). Returns the columns left over: clients with more than `chunk` samples."""
    sizes = {j: len(held_out[int(clients[j])]) for j in cols}
    order = sorted((j for j in cols if sizes[j] <= chunk), key=sizes.get)
    batch: list[int] = []
    for j in order:  # ascending sizes: a batch's longest is its last
        if batch and (len(batch) + 1) * sizes[j] > chunk:
            _own_buffer_batch(objective, x, y, held_out, w, clients, batch, buffers, loss, correct)
            batch = []
        batch.append(j)
    if batch:
        _own_buffer_batch(objective, x, y, held_out, w, clients, batch, buffers, loss, correct)
    return [j for j in cols if sizes[j] > chunk]


def _own_buffer_batch(objective: BufferTerms, x: torch.Tensor, y: torch.Tensor, held_out: list[np.ndarray],
                      w: torch.Tensor, clients: np.ndarray, batch: list[int],
                      buffers: Mapping[tuple[int, int], torch.Tensor], loss: torch.Tensor,
                      correct: torch.Tensor) -> None:
    longest, b = max(len(held_out[int(clients[j])]) for j in batch), objective.buffer_dim
    index = np.zeros((len(batch), longest), dtype=np.int64)  # padding reads row 0 and is masked out
    mask = np.zeros((len(batch), longest), dtype=bool)
    for i, j in enumerate(batch):
        rows = held_out[int(clients[j])]
        index[i, :len(rows)], mask[i, :len(rows)] = rows, True
    flat = torch.as_tensor(index.reshape(-1), device=x.device)
    xs = x.index_select(0, flat).view(len(batch), longest, *x.shape[1:])
    ys = y.index_select(0, flat).view(len(batch), longest)
    keep, cols = torch.as_tensor(mask, device=w.device), torch.as_tensor(batch, device=w.device)
    for r in range(w.shape[0]):  # a client that has not trained in replica r: the server's buffers
        sets = torch.stack([buffers.get((r, int(clients[j])), w[r, -b:]).to(w.device, w.dtype) for j in batch])
        l, c = objective.buffer_sample_terms(w[r], sets, xs, ys)
        loss[r, cols] = (l.double() * keep).sum(-1)
        correct[r, cols] = (c.double() * keep).sum(-1)


def copy_scores(objective: Model, x: torch.Tensor, y: torch.Tensor, held_out: list[np.ndarray], w: torch.Tensor,
                clients: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Model w[m] ([M, dim], its buffers in its last entries) on client clients[m]'s `held_out` rows of (x, y): the
    held-out samples n [M], mean loss and accuracy [M] (contracts.CopyEvaluation). Each copy is scored alone, by
    loss_terms on its client's samples, so its bits depend on nothing but the copy (not on the copies beside it,
    as a batch's would: the shard split, a batch of slots)."""
    n = np.array([len(held_out[int(k)]) for k in clients], dtype=np.int64)
    loss = torch.zeros(len(clients), dtype=torch.float64, device=w.device)
    correct = torch.zeros_like(loss)
    with torch.no_grad():
        for m, k in enumerate(clients.tolist()):
            l, c = _client_sums(objective, x, y, held_out[k], w[m:m + 1], chunk)
            loss[m], correct[m] = l[0], c[0]
    size = torch.as_tensor(n, dtype=torch.float64, device=w.device)
    return n, (loss / size).cpu().numpy(), (correct / size).cpu().numpy()


def _client_sums(objective: Model, x: torch.Tensor, y: torch.Tensor, rows: np.ndarray, w: torch.Tensor,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's summed loss and correct predictions per replica ([R], [R]) by the model's loss_terms."""
    loss = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device)
    correct = torch.zeros_like(loss)
    rows_t = torch.as_tensor(rows, device=x.device)
    for start in range(0, len(rows), chunk):
        take = rows_t[start:start + chunk]
        l, c = objective.loss_terms(w, x.index_select(0, take), y.index_select(0, take))
        loss, correct = loss + l.double(), correct + c.double()
    return loss, correct


def _with_buffers(w: torch.Tensor, client: int, buffers: Mapping[tuple[int, int], torch.Tensor], b: int) -> torch.Tensor:
    """w with the client's own buffers in the rows that have some (the others keep the server's)."""
    out = w.clone()
    for row in range(len(w)):
        if (row, client) in buffers:
            out[row, -b:] = buffers[(row, client)].to(out.device, out.dtype)
    return out
