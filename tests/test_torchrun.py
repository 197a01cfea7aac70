"""Real ``torchrun --nproc_per_node=2`` jobs (gloo, CPU) over uneven shards, both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

import gpupipe as gp

from .support.checkers import all_keys, check_epoch_partition
from .support.data import UNEVEN_SIZES, truncated_jpeg, write_webdataset_shards
from .support.dist_worker import BACKENDS
from .support.http_server import shard_gets
from .support.targets import DIST_ENV


def torchrun(worker: str, out, shards: list[str], **extra_env: str) -> None:
    """Runs ``tests/support/<worker>`` as a 2-rank ``torchrun`` job (gloo, CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="error::DeprecationWarning:gpupipe", **extra_env)
    path = os.path.join(os.path.dirname(__file__), "support", worker)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", path, str(out)]
    proc = subprocess.run([*argv, *shards], env=env, capture_output=True, text=True, timeout=300)
    first = [line for line in proc.stderr.splitlines() if "[rank0]" in line][-40:]  # the first to fail, often
    assert proc.returncode == 0, "\n".join(first) + "\n" + proc.stdout[-2000:] + proc.stderr[-3000:]


class TestTorchrun:
    """Real ``torchrun --nproc_per_node=2`` jobs (gloo, CPU) over uneven shards, both backends."""

    def test_two_ranks(self, uneven_shards, tmp_path):
        pytest.importorskip("nvidia.dali")
        torchrun("dist_worker.py", tmp_path, uneven_shards)
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

    def test_a_damaged_corpus_under_skip(self, tmp_path):
        """Issue 11: under ``on_error="skip"``, every good sample of a damaged corpus is yielded
        exactly once per epoch across 2 ranks, on every backend, and resume still holds."""
        pytest.importorskip("nvidia.dali")
        runtime = {1: {"jpg": truncated_jpeg(1)}, 9: {"jpg": b"not an image"}, 12: {"cls": b"seven"}}
        indexed = {4: {"cls": None}, 15: {"jpg": None}}  # found when indexing
        starts = [sum(UNEVEN_SIZES[:s]) for s in range(len(UNEVEN_SIZES))]

        def key(n: int) -> str:
            return f"img/{max(s for s, start in enumerate(starts) if start <= n):02d}/{n:06d}"

        urls = write_webdataset_shards(str(tmp_path), UNEVEN_SIZES, prefix="dmg", patch={**runtime, **indexed})
        with tarfile.open(urls[-1]) as tar:
            cut = tar.getmember(f"{key(16)}.jpg").offset_data + 100
        os.truncate(urls[-1], cut)  # an interrupted copy: the file ends inside the last sample
        shards = [*urls, str(tmp_path / "dmg-missing.tar")]
        index = gp.WebDataset(shards).index(on_error="skip")
        good = sorted(set(all_keys(index)) - {key(n) for n in runtime})
        assert len(good) == 17 - 3 - 2 - 1  # the cut sample (16) is lost with the tail of its shard
        torchrun("dist_damaged_worker.py", tmp_path, shards)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        for backend in BACKENDS:
            res = [r[backend] for r in ranks]
            for per_rank in (
                [r["eval"] for r in res],
                [r["train"][0] for r in res],
                [r["train"][1] for r in res],
            ):
                assert len(per_rank[0]) == len(per_rank[1])
                valid = [k for batches in per_rank for keys, v in batches for k, ok in zip(keys, v, strict=True) if ok]
                assert sorted(valid) == good, (backend, valid)
            for r in res:  # resumed after one batch: exactly the rest of the uninterrupted epoch
                assert [r["resumed_first"], *r["resumed_rest"]] == r["train"][1]
            for r in res:  # what indexing found: listed on every rank, with its shard
                before = {(k, os.path.basename(shard), kind) for k, shard, kind, epoch in r["skipped"] if epoch is None}
                assert before == {
                    (key(4), "dmg-000000.tar", "no-label"),
                    (key(15), "dmg-000003.tar", "no-image"),
                    (None, "dmg-000003.tar", "truncated-shard"),
                    (None, "dmg-missing.tar", "missing-shard"),
                }
            found = {k: kind for r in res for k, _, kind, epoch in r["skipped"] if epoch is not None}
            assert found == {key(1): "undecodable", key(9): "undecodable", key(12): "bad-label"}
            for r in res:
                assert {tuple(s) for s in r["resumed_skipped"]} >= {tuple(s) for s in r["skipped"] if s[3] is None}

    def test_two_ranks_share_one_shard_cache(self, tmp_path, http_server):
        """Issue 12: two ranks of a node read remote shards through one cache: each shard is
        downloaded once for both (the first index included), and every sample is yielded exactly
        once per epoch across the ranks, on every backend."""
        pytest.importorskip("nvidia.dali")
        pytest.importorskip("aiohttp")
        (tmp_path / "data").mkdir()
        local = write_webdataset_shards(str(tmp_path / "data"), (5, 4, 6, 3, 5, 4), prefix="remote")
        server = http_server(str(tmp_path / "data"))
        urls = [f"{server.url}/{os.path.basename(p)}" for p in local]
        torchrun("dist_remote_worker.py", tmp_path, urls, GPUPIPE_TEST_CACHE=str(tmp_path / "shard-cache"),
                 GPUPIPE_CACHE_DIR=str(tmp_path / "index-cache"))  # fmt: skip
        gets = shard_gets(server)
        assert gets == {os.path.basename(p): 1 for p in local}  # one download each, for both ranks
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        keys = all_keys(gp.WebDataset(local).index())
        for backend in BACKENDS:
            for epoch in range(2):
                per_rank = [r[backend][epoch] for r in ranks]
                check_epoch_partition(per_rank, keys, world_size=2, batch_size=3, drop_last=False)
