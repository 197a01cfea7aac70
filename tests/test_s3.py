"""s3:// shards from a real S3-compatible object store (SeaweedFS on the loopback address) through
s3fs: every backend reads what local disk gives; the driver's environment works; index files are
written beside the objects; a re-uploaded object is fetched again."""

from __future__ import annotations

import json
import os

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.cli._main import main
from gpupipe.storage._remote import RemoteStorage

from .support.checkers import val
from .support.data import SHARD_SIZES
from .support.s3_server import s3

pytest.importorskip("s3fs")

BUCKET = "gpupipe-data"


@pytest.fixture(scope="module")
def objects(s3_endpoint, shards) -> list[str]:
    """``shards`` uploaded to ``s3://gpupipe-data/``."""
    fs = s3(s3_endpoint)
    fs.mkdir(BUCKET)
    urls = []
    for path in shards:
        url = f"s3://{BUCKET}/{os.path.basename(path)}"
        fs.put_file(path, url)
        urls.append(url)
    return urls


def options_of(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": "gpupipe", "secret": "gpupipe"}


@pytest.fixture
def cache(tmp_path) -> str:
    return str(tmp_path / "shard-cache")


def epoch(loader: gp.Loader) -> list[tuple[list[str], torch.Tensor]]:
    return [(b.keys, b.images.cpu().clone()) for b in loader]


class TestS3:
    def test_every_backend_reads_what_local_disk_gives(self, backend, s3_endpoint, objects, shards, cache):
        source = gp.WebDataset(objects, storage_options=options_of(s3_endpoint), cache_dir=cache)
        with backend.loader(val(source), 4, num_workers=1, shuffle=True, seed=3) as loader:
            got = epoch(loader)
        with backend.loader(val(shards), 4, num_workers=1, shuffle=True, seed=3) as loader:
            want = epoch(loader)
        assert len(got) == len(want)
        for (k1, i1), (k2, i2) in zip(got, want, strict=True):
            assert k1 == k2 and torch.equal(i1, i2)

    def test_the_drivers_environment_is_enough(self, s3_endpoint, objects, cache, monkeypatch):
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "gpupipe")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "gpupipe")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        pattern = f"s3://{BUCKET}/train-{{000000..000002}}.tar"
        with gp.Loader(val(gp.WebDataset(pattern, cache_dir=cache)), 4, backend="torch", device="cpu") as loader:
            assert sum(len(b.keys) for b in loader) == sum(SHARD_SIZES)

    def test_index_files_beside_the_objects(self, s3_endpoint, objects, cache, monkeypatch, tmp_path, capsys):
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "gpupipe")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "gpupipe")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        assert main(["index", *objects, "--beside", "--workers", "0"]) == 0
        assert "3 index files written beside the shards" in capsys.readouterr().out
        fs = s3(s3_endpoint)
        assert all(fs.exists(u + ".gpupipe.json") for u in objects)
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "new-node"))  # a node that never saw them
        index = gp.WebDataset(objects, cache_dir=cache).index()
        assert len(index) == sum(SHARD_SIZES) and not os.path.exists(cache)  # nothing downloaded
        index.close()

    def test_the_commands_take_storage_options(self, s3_endpoint, objects, capsys):
        options = json.dumps(options_of(s3_endpoint))
        assert main(["check", *objects, "--storage-options", options, "--no-write", "--quiet", "--workers", "0"]) == 0
        assert "checked 16 samples in 3 shards: all good" in capsys.readouterr().out
        assert main(["index", *objects, "--storage-options", options, "--workers", "0"]) == 0
        assert main(["index", *objects, "--storage-options", "[1]"]) == 2
        assert "--storage-options must be a JSON object" in capsys.readouterr().err

    def test_a_reuploaded_object_is_fetched_again(self, s3_endpoint, shards, cache):
        fs = s3(s3_endpoint)
        url = f"s3://{BUCKET}/changing.tar"
        fs.put_file(shards[0], url)
        first = RemoteStorage("s3", storage_options=options_of(s3_endpoint), cache_dir=cache).local_path(url)
        fs.put_file(shards[1], url)
        again = RemoteStorage("s3", storage_options=options_of(s3_endpoint), cache_dir=cache).local_path(url)
        assert first != again and os.path.getsize(again) == os.path.getsize(shards[1])

    def test_a_rank_downloads_only_its_parts_of_split_shards(self, backend, s3_endpoint, objects, shards, monkeypatch,
                                                             tmp_path):  # fmt: skip
        options = options_of(s3_endpoint)
        assert main(["index", *objects, "--beside", "--storage-options", json.dumps(options), "--workers", "0"]) == 0
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "node"))  # a node that never saw them
        cache = str(tmp_path / "node" / "shards")
        source = gp.WebDataset(objects, storage_options=options, cache_dir=cache)
        with backend.loader(val(source), 2, rank=1, world_size=4, num_workers=0) as loader:
            got = epoch(loader)
        with backend.loader(val(shards), 2, rank=1, world_size=4, num_workers=0) as loader:
            want = epoch(loader)
        for (k1, i1), (k2, i2) in zip(got, want, strict=True):
            assert k1 == k2 and torch.equal(i1, i2)
        # rank 1 reads samples 4..7: 3 of shard 0's 7, 1 of shard 1's 5: a byte range of each
        entries = sorted(e.name for e in os.scandir(cache) if e.is_file())
        assert len(entries) == 2 and all("+" in e for e in entries)
        assert sum(os.path.getsize(os.path.join(cache, e)) for e in entries) < os.path.getsize(shards[0]) / 2


class TestGrowing:
    def test_a_prefix_listed_again_each_epoch(self, backend, s3_endpoint, shards, cache):
        """``s3://bucket/growing/train-*.tar`` with ``relist=True``: an object uploaded between
        epochs is in the next epoch (fsspec's cached listing is not trusted)."""
        fs = s3(s3_endpoint)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        prefix = f"s3://{BUCKET}/growing-{backend.backend}"
        fs.put_file(shards[0], f"{prefix}/train-000000.tar")
        source = gp.WebDataset(f"{prefix}/train-*.tar", relist=True, storage_options=options_of(s3_endpoint),
                               cache_dir=cache)  # fmt: skip
        with backend.loader(gp.Pipeline(source, [T.CenterCrop(16)]), 4, num_workers=1) as loader:
            loader.set_epoch(0)
            assert sum(len(b.keys) for b in loader) == SHARD_SIZES[0]
            fs.put_file(shards[1], f"{prefix}/train-000001.tar")
            loader.set_epoch(1)
            assert sum(len(b.keys) for b in loader) == SHARD_SIZES[0] + SHARD_SIZES[1]
            assert loader.state_dict()["listing"] == [f"{prefix}/train-000000.tar", f"{prefix}/train-000001.tar"]
