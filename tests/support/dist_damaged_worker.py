"""One rank of the damaged-corpus torchrun test (tests/test_torchrun.py::TestTorchrun::
test_a_damaged_corpus_under_skip); not a test itself.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/dist_damaged_worker.py OUT SHARD...

For each installed backend, under ``on_error="skip"``: an evaluation epoch (``shuffle=False``),
then two shuffled epochs with ``drop_last=False``, the second also interrupted after its first
batch and resumed in a fresh loader from the saved state. Writes what this rank yielded and
skipped to ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import gpupipe as gp
from gpupipe import backends
from gpupipe import transforms as T

# CPython 3.11 can freeze a torch worker inside os.fork (seen under load): the stuck-worker watchdog
# recovers the epoch after worker_timeout, here 60 s rather than the default 600 (the test allows 300).
WORKER_TIMEOUT = 60.0

BACKENDS = [name for name in backends.names() if backends.get(name).available()]


def main() -> None:
    out, shards = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pipeline = gp.Pipeline(shards, [T.RandomResizedCrop(16), T.ToDtype(torch.float32, scale=True)])
    result: dict = {"rank": rank}

    def loader(backend: str, **options) -> gp.Loader:
        return gp.Loader(pipeline, 3, backend=backend, device="cpu", num_workers=1, on_error="skip",
                         max_skipped=None, worker_timeout=WORKER_TIMEOUT, **options)  # fmt: skip

    def epoch(it) -> list:
        batches = []
        for batch in it:
            step = batch.valid.sum().reshape(1)
            dist.all_reduce(step)  # every rank takes part in every step: a hang would time out here
            batches.append((batch.keys, batch.valid.tolist()))
        return batches

    for backend in BACKENDS:
        with loader(backend) as evaluation:
            eval_batches = epoch(evaluation)
        with loader(backend, shuffle=True, seed=7) as train:
            epochs = []
            for e in range(2):
                train.set_epoch(e)
                epochs.append(epoch(train))
            skipped = [(s.key, s.shard, s.kind, s.epoch) for s in train.skipped]
        with loader(backend, shuffle=True, seed=7) as interrupted:
            interrupted.set_epoch(1)
            first = next(iter(interrupted))
            state = interrupted.state_dict()
        with loader(backend, shuffle=True, seed=7) as resumed:
            resumed.load_state_dict(state)
            resumed.set_epoch(1)
            rest = epoch(resumed)
            resumed_skipped = [(s.key, s.shard, s.kind, s.epoch) for s in resumed.skipped]
        result[backend] = {
            "eval": eval_batches,
            "train": epochs,
            "skipped": skipped,
            "resumed_first": (first.keys, first.valid.tolist()),
            "resumed_rest": rest,
            "resumed_skipped": resumed_skipped,
        }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
