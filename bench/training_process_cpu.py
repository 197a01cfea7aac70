"""The training process's CPU time per batch (all its threads; worker processes not counted):
gpupipe's backends against the torchvision DataLoader, on the V2 recipe. CPU the training process
spends competes with the workers on a small machine, and with the training step everywhere.

    python bench/training_process_cpu.py torch|dali|baseline SHARDS [--one-thread] [--epochs N]

On Linux it also splits that time by thread (``/proc/self/task``): the training thread, torch's
intra-op threads (OpenMP's, which have no Python name), DALI's and gpupipe's own threads.

Results: bench/results/2026-11-26-v2-training-thread-cpu.md,
bench/results/2026-11-26-training-thread-omp.md.
"""

import collections
import os
import sys
import threading
import time

import torch

import gpupipe as gp
from gpupipe.cli._bench import baseline_loader

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
which, urls = sys.argv[1], sys.argv[2]
if "--one-thread" in sys.argv:
    torch.set_num_threads(1)
pipe = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train_v2"))(urls, num_classes=1000)


EPOCHS = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 3


def by_thread() -> dict[str, float]:
    """CPU seconds so far of this process's threads, by kind (Linux; empty elsewhere)."""
    out: dict[str, float] = collections.defaultdict(float)
    if not os.path.isdir("/proc/self/task"):
        return out
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        name = names.get(int(tid))
        kind = ("training thread" if name == "MainThread" else "gpupipe threads" if name else
                "DALI threads" if comm.startswith("[DALI]") else "intra-op and other threads")  # fmt: skip
        out[kind] += (int(fields[11]) + int(fields[12])) / tick
    return out


def run(it_factory, epochs=EPOCHS):
    """Per epoch: images/s, the training process's CPU ms per batch, and that by thread."""
    rows = []
    for e in range(epochs):
        t0, c0, k0 = time.perf_counter(), time.process_time(), by_thread()
        n = b = 0
        for batch in it_factory(e):
            n += len(batch[1])
            b += 1
        per = {k: (v - k0.get(k, 0.0)) / max(b, 1) * 1000 for k, v in sorted(by_thread().items())}
        rows.append((n / (time.perf_counter() - t0), (time.process_time() - c0) / max(b, 1) * 1000, per))
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
    split = ", ".join(f"{k} {v:.1f}" for k, v in r[2].items())
    print(f"{which}: {r[0]:.0f} img/s, main-process CPU {r[1]:.1f} ms/batch" + (f" ({split})" if split else ""))
