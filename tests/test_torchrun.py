"""Real ``torchrun --nproc_per_node=2`` jobs (gloo, CPU) over uneven shards, both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gpupipe as gp

from .checkers import all_keys, check_epoch_partition
from .conftest import DIST_ENV, UNEVEN_SIZES
from .dist_worker import BACKENDS


class TestTorchrun:
    """Real ``torchrun --nproc_per_node=2`` jobs (gloo, CPU) over uneven shards, both backends."""

    def test_two_ranks(self, uneven_shards, tmp_path):
        pytest.importorskip("nvidia.dali")
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="error::DeprecationWarning:gpupipe")
        worker = os.path.join(os.path.dirname(__file__), "dist_worker.py")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                worker,
                str(tmp_path),
                *uneven_shards,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        keys = all_keys(gp.WebDataset(uneven_shards).index())
        assert len(keys) == sum(UNEVEN_SIZES) == 17
        for backend in BACKENDS:
            res = [r[backend] for r in ranks]
            assert res[0]["eval_len"] == res[1]["eval_len"] == len(res[0]["eval"]) == len(res[1]["eval"]) == 3
            check_epoch_partition([r["eval"] for r in res], keys, world_size=2, batch_size=4, drop_last=False)
            assert res[0]["eval_counted"] == res[1]["eval_counted"] == 17  # all_reduce of valid counts
            assert res[0]["train_seed"] == res[1]["train_seed"]  # seed=None: rank 0's, broadcast
            for epoch in range(2):
                per_rank = [r["train"][epoch]["batches"] for r in res]
                check_epoch_partition(per_rank, keys, world_size=2, batch_size=2, drop_last=True)
                train_keys = [{k for b, _ in batches for k in b} for batches in per_rank]
                assert not train_keys[0] & train_keys[1]
                shards = [set(r["train"][epoch]["shards"]) for r in res]
                assert len(shards[0] & shards[1]) <= 1  # at most the boundary shard, split by byte range
