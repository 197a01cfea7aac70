"""One rank of the torchrun test (tests/test_torchrun.py::TestTorchrun); not a test itself.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/dist_worker.py OUT SHARD...

Initializes gloo, then for each installed backend of the table runs an evaluation epoch
(``drop_last=False``, counting valid samples with ``all_reduce`` as a DDP evaluation would) and
two training epochs (``shuffle=True``, ``drop_last=True``, ``seed=None`` so that rank 0's seed is
broadcast), and writes what this rank yielded to ``OUT/rank<r>.json``.
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
    pipeline = gp.Pipeline(shards, [T.Resize(24), T.CenterCrop(16), T.ToDtype(torch.float32, scale=True)])
    result: dict = {"rank": rank, "world_size": dist.get_world_size()}
    for backend in BACKENDS:
        evaluation = gp.Loader(pipeline, 4, backend=backend, device="cpu", num_workers=1, worker_timeout=WORKER_TIMEOUT)
        batches, counted = [], torch.zeros(1, dtype=torch.int64)
        for batch in evaluation:
            images, labels = batch
            assert images.shape[0] == labels.shape[0] == len(batch.keys)
            step = batch.valid.sum().reshape(1)
            dist.all_reduce(step)  # every rank takes part in every step: a hang would time out here
            counted += step
            batches.append((batch.keys, batch.valid.tolist()))
        train = gp.Loader(
            pipeline,
            2,
            shuffle=True,
            drop_last=True,
            backend=backend,
            device="cpu",
            num_workers=1,
            worker_timeout=WORKER_TIMEOUT,
        )
        epochs = []
        for epoch in range(2):
            train.set_epoch(epoch)
            keys = []
            for batch in train:
                dist.barrier()
                keys.append((batch.keys, batch.valid.tolist()))
            shards_read = sorted({train.index.shards[train.index.locate(int(s))[0]].path for s in train.plan().samples})
            epochs.append({"batches": keys, "shards": shards_read})
        result[backend] = {
            "eval_len": len(evaluation),
            "eval": batches,
            "eval_counted": int(counted),
            "train_len": len(train),
            "train_seed": train.seed,
            "train": epochs,
        }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
