"""The models of the federated text and FEMNIST benchmarks (issue 28), vectorized across clients vs per client:
ms per round at K=10 sampled clients on CPU.

* Shakespeare-shaped: windows of 80 int64 character ids, an 80-letter vocabulary, batch 10 (LEAF's), char_lstm
  (the functional LSTM) with kernel=vmap and kernel=loop, and the same network built on torch.nn.LSTM (its fused
  kernel; registered here as `torch_char_lstm`) with kernel=loop and with kernel=vmap (nn.LSTM has no batching
  rule: vmap falls back to a loop over the copies, with a warning).
* FEMNIST-shaped: 1x28x28 images, 62 classes, batch 10, femnist_cnn with each kernel.

FedAvg, 20 clients, 10 sampled a round, `--steps` local steps, float32, no evaluation between the timed rounds.
The first round (torch's lazy initialisation) is not timed; the variants take turns round by round, so a change
in the machine's load falls on all of them, and the median round counts: wall-clock ms, and the process's CPU ms
(with one thread, what the round costs whatever else the machine runs). Writes benchmarks/out/text_models.json.

    python benchmarks/bench_text_models.py [--rounds 3] [--steps 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import fedharness
from fedharness.algorithms.series import build_series
from fedharness.assembly.build import build_parts
from fedharness.config.load import load_settings
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import Prepared, build_engine

SEQ, VOCAB, CLASSES, BATCH, K = 80, 80, 62, 10, 10


def shakespeare_shaped(seed: int, n: int = 2000):
    """Random character windows and next characters (a step's time does not depend on the ids)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (n, SEQ), dtype=np.int64), rng.integers(0, VOCAB, n)), None


def femnist_shaped(seed: int, n: int = 2000):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, CLASSES, n)), None


class TorchCharLSTM(nn.Module):
    """char_lstm's architecture on torch.nn.LSTM (two biases a layer: 2,048 parameters more)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, 8)
        self.lstm = nn.LSTM(8, 256, num_layers=2, batch_first=True)
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.lstm(self.embedding(x))[0][:, -1])


def engine_for(dataset: str, model: str, kernel: str, steps: int):
    cfg = load_settings([f"dataset={dataset}", "dataset.num_clients=20", f"algorithm.clients_per_round={K}",
                         f"algorithm.local_steps={steps}", f"algorithm.batch_size={BATCH}", "algorithm.client_lr=0.5",
                         f"model={model}", f"kernel={kernel}", "memory_budget_gb=0.5", "progress=false"])
    problem, algorithm = build_parts(cfg)  # not prepare_run: the process's threads stay the benchmark's
    engine = build_engine(Prepared(cfg, problem, algorithm, None, *build_series(cfg.replicas)),
                          InlineExecutor(problem, algorithm.solver))
    return engine, engine.step(engine.initial_state())  # the warm-up round, not timed


VARIANTS = [  # (label, data set, model, kernel)
    ("char_lstm, functional LSTM, vectorized (vmap)", "shakespeare_shaped", "char_lstm", "vmap"),
    ("char_lstm, functional LSTM, per client (loop)", "shakespeare_shaped", "char_lstm", "loop"),
    ("nn.LSTM (fused), per client (loop)", "shakespeare_shaped", "torch_char_lstm", "loop"),
    ("nn.LSTM under vmap (batching fallback)", "shakespeare_shaped", "torch_char_lstm", "vmap"),
    ("femnist_cnn, vectorized (vmap)", "femnist_shaped", "femnist_cnn", "vmap"),
    ("femnist_cnn, per client (loop)", "femnist_shaped", "femnist_cnn", "loop"),
    ("femnist_cnn, per client, channels-last", "femnist_shaped", "femnist_cnn", "loop_channels_last"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="There is a performance drop")  # nn.LSTM under vmap, said above
    fedharness.register_dataset("shakespeare_shaped", shakespeare_shaped, num_clients=20)
    fedharness.register_dataset("femnist_shaped", femnist_shaped, num_clients=20)
    fedharness.register_model("torch_char_lstm", TorchCharLSTM)
    running = {label: engine_for(dataset, model, kernel, args.steps) for label, dataset, model, kernel in VARIANTS}
    wall: dict[str, list[float]] = {label: [] for label in running}
    cpu: dict[str, list[float]] = {label: [] for label in running}
    for _ in range(args.rounds):
        for label, (engine, state) in running.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            running[label] = (engine, engine.step(state))
            wall[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
    ms = {label: 1e3 * statistics.median(s) for label, s in wall.items()}
    cpu_ms = {label: 1e3 * statistics.median(s) for label, s in cpu.items()}
    print(f"{'':48s} {'wall ms/round':>14s} {'CPU ms/round':>13s}")
    for label in ms:
        print(f"{label:48s} {ms[label]:14.0f} {cpu_ms[label]:13.0f}", flush=True)
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
           "load_average": os.getloadavg(), "rounds": args.rounds, "local_steps": args.steps, "ms_per_round": ms,
           "cpu_ms_per_round": cpu_ms}
    path = Path(__file__).parent / "out" / "text_models.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
