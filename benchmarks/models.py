"""Per-client path vs vectorized path (kernel=loop vs kernel=vmap), ms per round, for the smoke-size CNN and the
ResNet-18 with BatchNorm on CPU.

Smoke size: random 1x16x16 images in 10 classes, 10 clients, 5 sampled per round, 2 local steps of batch 8,
float32, FedAvg. Both paths compute the same updates (tests/test_any_model.py); this times them. The first
round (torch's lazy initialisation) is not timed. Writes benchmarks/out/models.json.

    python benchmarks/models.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

import fedharness
from fedharness.config.load import load_settings
from fedharness.algorithms.series import build_series
from fedharness.assembly.build import build_parts
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import Prepared, build_engine

SMOKE = ["dataset=noise_images", "dataset.num_clients=10", "algorithm.clients_per_round=5",
         "algorithm.local_steps=2", "algorithm.batch_size=8", "algorithm.client_lr=0.05", "progress=false"]


def noise_images(seed: int, n: int = 400, size: int = 16):
    """Random images (the time of a step does not depend on the pixels)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, size, size)).astype(np.float32)
    return (x, rng.integers(0, 10, n)), None


def ms_per_round(model: str, kernel: str, rounds: int) -> float:
    cfg = load_settings([*SMOKE, f"model={model}", f"kernel={kernel}"])
    problem, algorithm = build_parts(cfg)  # not prepare_run: the process's threads stay the benchmark's
    engine = build_engine(Prepared(cfg, problem, algorithm, None, *build_series(cfg.replicas)),
                          InlineExecutor(problem, algorithm.solver))
    state = engine.step(engine.initial_state())  # warm-up round, not timed
    start = time.perf_counter()
    for _ in range(rounds):
        state = engine.step(state)
    return 1e3 * (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fedharness.register_dataset("noise_images", noise_images, num_clients=10)
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__,
           "ms_per_round": {}}
    for model in ("cnn", "resnet18_bn"):
        for kernel in ("vmap", "loop"):
            ms = ms_per_round(model, kernel, args.rounds)
            out["ms_per_round"][f"{model} {kernel}"] = ms
            print(f"{model:12s} {'vectorized (vmap)' if kernel == 'vmap' else 'per-client (loop)':18s} "
                  f"{ms:9.1f} ms/round", flush=True)
    path = Path(__file__).parent / "out" / "models.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
