"""One rank of the shared-cache torchrun test (tests/test_torchrun.py::TestTorchrun::
test_two_ranks_share_one_shard_cache); not a test itself.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/dist_remote_worker.py OUT URL...

Both ranks read the same remote shards through one node-local cache (``$GPUPIPE_TEST_CACHE``):
two shuffled epochs with each installed backend; writes what this rank yielded to
``OUT/rank<r>.json``.
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
    out, urls = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = gp.WebDataset(urls, cache_dir=os.environ["GPUPIPE_TEST_CACHE"])
    pipeline = gp.Pipeline(source, [T.RandomResizedCrop(16), T.ToDtype(torch.float32, scale=True)])
    result: dict = {"rank": rank}
    for backend in BACKENDS:
        epochs = []
        with gp.Loader(
            pipeline,
            3,
            backend=backend,
            device="cpu",
            num_workers=1,
            shuffle=True,
            seed=5,
            worker_timeout=WORKER_TIMEOUT,
        ) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                batches = []
                for batch in loader:
                    dist.barrier()
                    batches.append((batch.keys, batch.valid.tolist()))
                epochs.append(batches)
        result[backend] = epochs
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
