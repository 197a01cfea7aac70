"""The training process's CPU time per batch (all its threads; worker processes not counted):
gpupipe's backends against the torchvision DataLoader, on the V2 recipe. CPU the training process
spends competes with the workers on a small machine, and with the training step everywhere.

    python bench/training_process_cpu.py torch|dali|baseline SHARDS [--one-thread]

Results: bench/results/2026-11-26-v2-training-thread-cpu.md.
"""

import os
import sys
import time

import torch

import gpupipe as gp
from gpupipe.cli._bench import baseline_loader

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
which, urls = sys.argv[1], sys.argv[2]
if "--one-thread" in sys.argv:
    torch.set_num_threads(1)
pipe = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train_v2"))(urls, num_classes=1000)


def run(it_factory, epochs=3):
    """Per epoch: images/s and the training process's CPU ms per batch."""
    rows = []
    for e in range(epochs):
        t0, c0 = time.perf_counter(), time.process_time()
        n = b = 0
        for batch in it_factory(e):
            n += len(batch[1])
            b += 1
        rows.append((n / (time.perf_counter() - t0), (time.process_time() - c0) / max(b, 1) * 1000))
    return rows


if which == "torch" or which == "dali":
    loader = gp.Loader(pipe, 64, backend=which, device="cpu", num_workers=2, shuffle=True, drop_last=True, seed=0)

    def epoch(e):
        loader.set_epoch(e)
        return loader

    rows = run(epoch)
    loader.close()
else:
    loader, steps = baseline_loader(pipe, batch_size=64, workers=2, decoder="torchvision")
    rows = run(lambda e: loader)
for r in rows:
    print(f"{which}: {r[0]:.0f} img/s, main-process CPU {r[1]:.1f} ms/batch")
