"""Remote shards through fsspec and the node-local shard cache: fsspec's memory filesystem and a
real HTTP server on the loopback address (range requests on and off, connections dropped
mid-shard, errors), on every backend; what is cached, and what never appears in messages."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe.cli._main import main
from gpupipe.plan._prefetch import parts
from gpupipe.shards import _indexing
from gpupipe.shards._indexfile import Samples, write_index_file
from gpupipe.shards._indexing import shard_samples
from gpupipe.shards._shard import ShardIndex
from gpupipe.sources import LocalStorage
from gpupipe.sources._index import Index
from gpupipe.storage._base import Stat
from gpupipe.storage._cache import ShardCache
from gpupipe.storage._fsspec import canonical_url
from gpupipe.storage._remote import RemoteStorage

from .support.checkers import all_keys, val
from .support.data import SHARD_SIZES, write_webdataset_shards
from .support.http_server import HttpServer, shard_gets
from .support.locks import lock_is_free

pytest.importorskip("aiohttp")


@pytest.fixture(params=[True, False], ids=["ranges", "no-ranges"])
def server(request, shards, http_server) -> HttpServer:
    return http_server(os.path.dirname(shards[0]), ranges=request.param)


MANY = (4,) * 12


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> list[str]:
    """12 shards of 4 samples."""
    return write_webdataset_shards(str(tmp_path_factory.mktemp("many")), MANY, prefix="many")


@pytest.fixture
def many_server(many_shards, http_server) -> HttpServer:
    return http_server(os.path.dirname(many_shards[0]))


@pytest.fixture
def cache(tmp_path) -> str:
    return str(tmp_path / "shard-cache")


def names(shards: list[str]) -> list[str]:
    return [os.path.basename(s) for s in shards]


def epoch(loader: gp.Loader) -> list[tuple[list[str], torch.Tensor]]:
    return [(b.keys, b.images.cpu().clone()) for b in loader]


def same_epochs(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (k1, i1), (k2, i2) in zip(a, b, strict=True):
        assert k1 == k2 and torch.equal(i1, i2)


class TestHttp:
    def test_every_backend_reads_what_local_disk_gives(self, backend, shards, server, cache):
        urls = [f"{server.url}/{n}" for n in names(shards)]
        remote = gp.WebDataset(urls, cache_dir=cache)
        with backend.loader(val(remote), 4, num_workers=1) as loader:
            got = epoch(loader)
        with backend.loader(val(shards), 4, num_workers=1) as loader:
            same_epochs(got, epoch(loader))
        assert shard_gets(server) == dict.fromkeys(names(shards), 1)  # each downloaded once, then read locally
        assert len([f for f in os.listdir(cache) if f.endswith(".tar")]) == len(shards)

    def test_a_second_loader_reads_the_cache(self, shards, server, cache):
        urls = [f"{server.url}/{n}" for n in names(shards)]
        for _ in range(2):
            with gp.Loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, backend="torch", device="cpu") as loader:
                assert sum(len(b.keys) for b in loader) == sum(SHARD_SIZES)
        assert shard_gets(server) == dict.fromkeys(names(shards), 1)

    def test_a_dropped_connection_is_retried_and_never_read(self, shards, server, cache, monkeypatch):
        monkeypatch.setattr(RemoteStorage, "__init__", _fast_retries(RemoteStorage.__init__))
        name = names(shards)[0]
        server.drops[name] = 2
        storage = RemoteStorage("http", cache_dir=cache)
        path = storage.local_path(f"{server.url}/{name}")
        with open(path, "rb") as f, open(shards[0], "rb") as g:
            assert f.read() == g.read()
        assert server.gets[name] == 3
        assert not [f for f in os.listdir(cache) if ".part-" in f]

    def test_a_stalled_transfer_is_cut_and_tried_again(self, shards, server, cache, monkeypatch):
        """A server that stops sending mid-body: after ``HTTP_STALL_S`` without a byte the read
        fails and the download is tried again, instead of waiting out aiohttp's 5 minutes."""
        from gpupipe.storage import _fsspec

        monkeypatch.setattr(_fsspec, "HTTP_STALL_S", 1.0)
        monkeypatch.setattr(RemoteStorage, "__init__", _fast_retries(RemoteStorage.__init__))
        name = names(shards)[0]
        server.stalls[name], server.stall_s = 1, 60.0
        storage = RemoteStorage("http", cache_dir=cache)
        started = time.monotonic()
        path = storage.local_path(f"{server.url}/{name}")
        with open(path, "rb") as f, open(shards[0], "rb") as g:
            assert f.read() == g.read()
        assert server.gets[name] == 2 and time.monotonic() - started < 30
        storage.close()

    def test_a_download_never_writes_past_the_shards_size(self, tmp_path):
        """Whatever the filesystem's stream gives (a driver that reads past the object's size, a
        shard rewritten meanwhile), a try stops one chunk past the size and says why."""
        import io
        import threading

        from gpupipe.storage import _transfer

        class Endless:
            def open(self, url: str, mode: str, **kwargs: object) -> io.BytesIO:
                return io.BytesIO(bytes(5 * _transfer.CHUNK))

        with open(tmp_path / "out", "w+b") as out:
            with pytest.raises(OSError, match=r"sent more than the 1000 bytes the shard has"):
                _transfer.download(Endless(), "http://h/s.tar", out, size=1000, span=None, stream=True,
                                   stopping=threading.Event())  # fmt: skip
            assert out.tell() == 1001

    def test_http_waits_are_bounded_and_a_transfer_is_not(self):
        """gpupipe's aiohttp timeout: a connection 30 s, each read 60 s, the whole transfer
        unbounded (aiohttp's own 5 minutes for a request and its body failed every try of a large
        shard on a slow link); a user's own timeout kept; other protocols untouched."""
        import aiohttp

        from gpupipe.storage._fsspec import http_options

        timeout = http_options("https", {})["client_kwargs"]["timeout"]
        assert (timeout.total, timeout.sock_connect, timeout.sock_read) == (None, 30.0, 60.0)
        theirs = {"timeout": aiohttp.ClientTimeout(total=10), "trust_env": True}
        assert http_options("http", {"client_kwargs": theirs})["client_kwargs"] == theirs
        kept = http_options("http", {"client_kwargs": {"trust_env": True}})["client_kwargs"]
        assert kept["trust_env"] is True and kept["timeout"].total is None
        assert http_options("s3", {"anon": True}) == {"anon": True}

    @pytest.mark.parametrize("part", [False, True], ids=["whole", "part"])
    def test_a_shard_rewritten_during_its_download_is_downloaded_again(self, tmp_path, cache, caplog, part,
                                                                        http_server):  # fmt: skip
        """No cache entry mixes two versions: the version is asked again after each download."""
        root = tmp_path / "served"
        root.mkdir()
        (root / "a.tar").write_bytes(bytes(range(256)) * 64)
        srv = http_server(str(root))
        url = f"{srv.url}/a.tar"
        storage = RemoteStorage("http", cache_dir=cache)
        if part:
            storage.expect_parts({url: (1000, 9000)})
        srv.rewrites["a.tar"] = 1
        caplog.set_level(logging.WARNING, logger="gpupipe")
        assert storage.read(url, 4000, 16) == (root / "a.tar").read_bytes()[4000:4016]
        assert "changed during its download" in caplog.text and srv.gets["a.tar"] == 2
        assert srv.rewrites["a.tar"] == 0
        srv.rewrites["a.tar"] = 99  # rewritten after every download: refused, not mixed
        other = RemoteStorage("http", cache_dir=str(tmp_path / "other"))
        if part:
            other.expect_parts({url: (1000, 9000)})
        with pytest.raises(OSError, match="changed during each of 3 downloads"):
            other.read(url, 4000, 16)
        storage.close()
        other.close()

    def test_after_the_last_try_the_error_names_the_url_and_status(self, shards, server, cache, monkeypatch):
        monkeypatch.setattr(RemoteStorage, "__init__", _fast_retries(RemoteStorage.__init__))
        name = names(shards)[1]
        server.status[name] = 503
        url = f"{server.url}/{name}"
        with pytest.raises(gp.ShardError, match=r"cannot be read.*failed after 3 tries \(HTTP 503\)") as info:
            gp.WebDataset([f"{server.url}/{names(shards)[0]}", url], cache_dir=cache).index()
        assert info.value.shard == url and info.value.kind is gp.Damage.UNREADABLE_SHARD
        index = gp.WebDataset([f"{server.url}/{names(shards)[0]}", url], cache_dir=cache).index(on_error="skip")
        assert len(index) == SHARD_SIZES[0] and [p.kind for p in index.problems] == [gp.Damage.UNREADABLE_SHARD]

    def test_a_shard_unreachable_while_training_is_skipped_once(self, backend, many_shards, many_server, cache,
                                                                monkeypatch, caplog):  # fmt: skip
        """Under skip, its samples are left out and reported, the batches stay equal, and the
        shard costs one round of tries, not one per sample."""
        monkeypatch.setattr(RemoteStorage, "__init__", _fast_retries(RemoteStorage.__init__))
        urls = [f"{many_server.url}/{n}" for n in names(many_shards)]
        gp.WebDataset(urls, cache_dir=cache).index().close()
        shutil.rmtree(cache)
        down = names(many_shards)[3]
        many_server.gets.clear()
        with backend.loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, num_workers=0, on_error="skip",
                            max_skipped=None) as loader:  # fmt: skip
            many_server.status[down] = 503  # indexed; gone when read
            batches = [(b.keys, b.valid.tolist()) for b in loader]
            skipped = loader.skipped
        assert len(batches) == len(loader) == sum(MANY) // 4 and all(len(k) == 4 for k, _ in batches)
        valid = [k for keys, v in batches for k, ok in zip(keys, v, strict=True) if ok]
        assert len(valid) == sum(MANY) - 4 and not any(k.startswith("img/03/") for k in valid)
        assert {s.key for s in skipped} == {f"img/03/{n:06d}" for n in range(12, 16)}
        assert all("HTTP 503" in s.reason and down in str(s.shard) for s in skipped)
        assert many_server.gets[down] <= 3 * 2  # one round of 3 tries (twice at most: prefetch and read)

    def test_a_missing_shard(self, shards, server, cache):
        index = gp.WebDataset([f"{server.url}/{names(shards)[0]}", f"{server.url}/gone.tar"], cache_dir=cache)
        with pytest.raises(gp.ShardError, match=r"gone\.tar") as info:
            index.index()
        assert info.value.kind is gp.Damage.MISSING_SHARD

    def test_a_shard_changed_remotely_is_fetched_again(self, tmp_path, shards, server, cache):
        name = names(shards)[2]
        url = f"{server.url}/{name}"
        storage = RemoteStorage("http", cache_dir=cache)
        first = storage.local_path(url)
        path = os.path.join(os.path.dirname(shards[0]), name)
        st = os.stat(path)
        try:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version (ETag)
            again = RemoteStorage("http", cache_dir=cache).local_path(url)
            assert again != first and server.gets[name] == 2
        finally:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    def test_concurrent_readers_download_once(self, shards, server, cache):
        url = f"{server.url}/{names(shards)[0]}"
        paths: list[str] = []
        threads = [
            threading.Thread(target=lambda: paths.append(RemoteStorage("http", cache_dir=cache).local_path(url)))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(paths)) == 1 and server.gets[names(shards)[0]] == 1


def _fast_retries(init):
    def fast(self, *args, **kwargs):
        kwargs.update(retries=2, backoff=0.01)
        init(self, *args, **kwargs)

    return fast


def cached(cache: str) -> list[str]:
    return [f for f in os.listdir(cache) if f.endswith(".tar")] if os.path.isdir(cache) else []


def _mapped_deleted(root: str) -> int:
    """Files under ``root`` this process still maps though they were deleted."""
    with open("/proc/self/maps") as f:
        return len({line.split(None, 5)[-1] for line in f if root in line and line.rstrip().endswith("(deleted)")})


@contextlib.contextmanager
def _forked_child() -> Iterator[None]:
    """A forked child that lives while the block runs, as a torch worker would; the block starts
    once the child's after-fork hooks have run."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(stop_w)  # (else its own copy keeps the pipe open: no end of file)
        os.write(ready_w, b"x")
        os.read(stop_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.close(stop_r)
    try:
        assert os.read(ready_r, 1) == b"x"
        yield
    finally:
        os.close(stop_w)
        os.close(ready_r)
        os.waitpid(pid, 0)


class TestBoundedCache:
    def test_a_cache_smaller_than_the_dataset_loses_nothing(self, backend, many_shards, many_server, cache, caplog):
        """Eviction while training: every sample exactly once per epoch, two epochs, the cache
        within its bound (plus the shards in use) and a warning that it is too small."""
        urls = [f"{many_server.url}/{n}" for n in names(many_shards)]
        shard_bytes = os.path.getsize(many_shards[0])
        source = gp.WebDataset(urls, cache_dir=cache, cache_size=3 * shard_bytes)
        with backend.loader(val(source), 4, num_workers=1) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
                assert sorted(keys) == sorted(set(keys)) and len(keys) == sum(MANY)
        assert "smaller than what 1 rank(s) of this node keep at hand" in caplog.text
        assert 3 <= len(cached(cache)) < len(many_shards)  # evicted while training
        assert sum(shard_gets(many_server).values()) > len(many_shards)  # the second epoch fetched again

    def test_evicted_shards_are_not_kept_mapped(self, many_shards, many_server, cache):
        """DALI's CPU reader maps the cached shards: once a shard is let go and evicted, its map
        goes too (with the batches that used it), so that its disk space is freed while training."""
        if not gp.backends.get("dali").available():
            pytest.skip("needs DALI")
        urls = [f"{many_server.url}/{n}" for n in names(many_shards)]
        source = gp.WebDataset(urls, cache_dir=cache, cache_size=3 * os.path.getsize(many_shards[0]))
        deleted = []
        with gp.Loader(val(source), 4, backend="dali", device="cpu") as loader:
            for _ in loader:
                deleted.append(_mapped_deleted(cache))
        assert len(cached(cache)) < len(many_shards)  # evicted while training
        assert max(deleted) <= 2, deleted  # at most the maps of batches still in flight

    @pytest.mark.parametrize("ahead", [None, 0, 2])
    def test_shards_are_downloaded_ahead_of_the_plan(self, many_shards, many_server, cache, ahead):
        urls = [f"{many_server.url}/{n}" for n in names(many_shards)]
        gp.WebDataset(urls, cache_dir=cache).index().close()  # the first index reads every shard...
        shutil.rmtree(cache)  # ...later ones only ask for sizes and versions (the index is cached)
        with gp.Loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, backend="torch", device="cpu",
                       num_workers=0, shards_ahead=ahead) as loader:  # fmt: skip
            assert not cached(cache)
            batches = iter(loader)
            next(batches)  # batch 0 read shard 0; batch 1 needs shard 1: by default shards 2-5 ahead
            expected = 2 + (4 if ahead is None else ahead)
            deadline = time.monotonic() + 30
            while len(cached(cache)) < expected and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.2)
            assert sorted(f[-8:-4] for f in cached(cache)) == [f"{i:04d}" for i in range(expected)]
            del batches

    def test_a_forked_child_does_not_keep_the_parents_pins(self, many_shards, many_server, cache):
        """A torch worker forked while the loader pins shards must not hold those pins after the
        loader lets them go (a flock is shared by the fd copies a fork makes)."""
        url = f"{many_server.url}/{names(many_shards)[0]}"
        storage = RemoteStorage("http", cache_dir=cache, cache_size=1)
        storage.local_path(url)
        with _forked_child():  # a worker that lives on
            storage.close()  # the parent lets its pin go
            assert ShardCache(cache, 1).evict() == 1 and not cached(cache)

    def test_a_forked_child_does_not_keep_a_download_lock(self, cache):
        """The same for a download in flight when a worker is forked: once the parent's download
        ends, the lock is free, not held by the child's copy for its whole life."""
        import fcntl

        from gpupipe.storage import _cache

        shard_cache = ShardCache(cache)
        where = os.path.join(shard_cache.root, "x-a.tar")
        fd = shard_cache._lock(where, "dl", fcntl.LOCK_EX)
        with _forked_child():
            assert not lock_is_free(shard_cache, where)  # the parent's download holds it
            _cache._close(fd)  # the parent's download ended
            assert lock_is_free(shard_cache, where)  # and no copy in the living child holds it on

    def test_a_lock_file_opened_during_a_fork_is_not_kept_by_the_child(self, cache, monkeypatch):
        """A fork while another thread is inside ``os.open`` of a lock file (which releases the
        GIL): the child must not keep that lock (it did, and a worker waited forever)."""
        import fcntl

        from gpupipe.storage import _cache

        shard_cache, where = ShardCache(cache), os.path.join(cache, "x-a.tar")
        real_open, opening = os.open, threading.Event()

        def slow_open(path, *args, **kwargs):
            fd = real_open(path, *args, **kwargs)
            if str(path).endswith(".dl"):
                opening.set()
                time.sleep(0.3)  # the GIL is free: the main thread forks now
            return fd

        monkeypatch.setattr(_cache.os, "open", slow_open)
        held: list[int] = []
        thread = threading.Thread(target=lambda: held.append(shard_cache._lock(where, "dl", fcntl.LOCK_EX)))
        thread.start()
        opening.wait()
        with _forked_child():
            thread.join()
            monkeypatch.undo()
            assert len(held) == 1 and not lock_is_free(shard_cache, where)  # the parent's download holds it
            _cache._close(held[0])  # the parent's download ended
            assert lock_is_free(shard_cache, where)  # and no copy in the living child holds it on

    def test_a_failed_prefetch_does_not_block_the_read(self, many_shards, many_server, cache, monkeypatch):
        monkeypatch.setattr(RemoteStorage, "__init__", _fast_retries(RemoteStorage.__init__))
        url = f"{many_server.url}/{names(many_shards)[5]}"
        storage = RemoteStorage("http", cache_dir=cache)
        many_server.status[names(many_shards)[5]] = 503
        storage.prefetch([url])
        deadline = time.monotonic() + 30
        while many_server.gets.get(names(many_shards)[5], 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        del many_server.status[names(many_shards)[5]]  # the server is back
        assert os.path.exists(storage.local_path(url))  # tried again, not refused for 60 s
        storage.close()
        assert not [t for t in threading.enumerate() if t.name == "gpupipe-prefetch"]

    @pytest.mark.parametrize(("size", "expected"), [("500GB", 5 * 10**11), ("1.5 TB", 15 * 10**11),
                                                   ("800MiB", 800 * 2**20), (4096, 4096)])  # fmt: skip
    def test_cache_size_in_units(self, size, expected):
        assert gp.WebDataset("https://host/a.tar", cache_size=size).cache_size == expected

    @pytest.mark.parametrize("size", ["lots", "5 XB", 0, -1, 2.5])
    def test_bad_cache_sizes(self, size):
        with pytest.raises(gp.ConfigError, match="cache_size"):
            gp.WebDataset("https://host/a.tar", cache_size=size)

    def test_pinned_shards_are_never_evicted(self, many_shards, many_server, cache):
        urls = [f"{many_server.url}/{n}" for n in names(many_shards)]
        holder = RemoteStorage("http", cache_dir=cache, cache_size=1)
        first = holder.local_path(urls[0])
        other = RemoteStorage("http", cache_dir=cache, cache_size=1)
        for url in urls[1:4]:
            other.local_path(url)
        assert os.path.exists(first)  # pinned by holder: kept over the bound
        other.close()
        holder.close()
        assert ShardCache(cache, 1).evict() == 4 and not cached(cache)


@pytest.fixture
def served_copy(many_shards, tmp_path, http_server) -> tuple[HttpServer, list[str]]:
    """A copy of ``many_shards`` that a test may write beside, served over HTTP."""
    root = tmp_path / "served"
    root.mkdir()
    for path in many_shards:
        shutil.copy(path, root)
    return http_server(str(root)), [str(root / n) for n in names(many_shards)]


def new_node(monkeypatch, tmp_path, name: str) -> str:
    """A node that has never seen the dataset: its own index cache; returns its shard cache."""
    monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / name))
    return str(tmp_path / name / "shards")


class TestIndexFiles:
    def test_a_new_node_starts_without_downloading(self, backend, served_copy, monkeypatch, tmp_path, capsys):
        srv, local = served_copy
        assert main(["index", *local, "--beside", "--workers", "2"]) == 0
        assert "12 index files written beside the shards" in capsys.readouterr().out
        assert all(os.path.exists(p + ".gpupipe.json") for p in local)
        urls = [f"{srv.url}/{n}" for n in names(local)]
        cache = new_node(monkeypatch, tmp_path, "node")
        index = gp.WebDataset(urls, cache_dir=cache).index()
        assert len(index) == sum(MANY) and not shard_gets(srv) and not cached(cache)  # sizes and index files only
        index.close()
        with backend.loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, num_workers=1, shuffle=True) as loader:
            keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
        assert sorted(keys) == sorted(all_keys(gp.WebDataset(local).index()))
        assert shard_gets(srv) == dict.fromkeys(names(local), 1)  # each downloaded once, for the plan

    def test_without_them_the_cost_is_said(self, served_copy, monkeypatch, tmp_path, caplog):
        srv, local = served_copy
        urls = [f"{srv.url}/{n}" for n in names(local)]
        monkeypatch.setattr(_indexing, "_told", False)
        gp.WebDataset(urls, cache_dir=new_node(monkeypatch, tmp_path, "node")).index().close()
        assert caplog.text.count("without index files beside them") == 1 and "--beside" in caplog.text
        assert shard_gets(srv) == dict.fromkeys(names(local), 1)

    def test_they_hold_every_samples_place_and_label(self, served_copy, monkeypatch, tmp_path):
        srv, local = served_copy
        assert main(["index", *local, "--beside", "--workers", "0"]) == 0
        doc = _read_json(local[0] + ".gpupipe.json")
        assert doc["version"] == 3 and doc["samples"] == MANY[0] == len(doc["keys"]) == len(doc["labels"])
        urls = [f"{srv.url}/{n}" for n in names(local)]
        index = gp.WebDataset(urls, cache_dir=new_node(monkeypatch, tmp_path, "node")).index()
        expected = gp.WebDataset(local).index()
        located = index.locate_batch(np.arange(len(index)))
        truth = expected.locate_batch(np.arange(len(expected)))
        assert located.keys == truth.keys
        np.testing.assert_array_equal(located.labels, truth.labels)
        np.testing.assert_array_equal(located.ranges, truth.ranges)
        assert not shard_gets(srv)  # all of it from the index files: no shard read
        assert index.shards[0].dali_index is not None  # kept in the index cache, in DALI's format
        index.close()

    def test_they_carry_the_images_sizes(self, served_copy, monkeypatch, tmp_path, capsys):
        """``index --beside --sizes`` (issue 53): a new node takes the images' sizes from the index
        files into its index cache, and a DALI loader's first epoch reads no header."""
        pytest.importorskip("nvidia.dali")
        from gpupipe import transforms as T
        from gpupipe.backends._dali._headers import rules

        from .support.headers import header_reads

        srv, local = served_copy
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "writer"))
        assert main(["index", *local[:2], "--beside", "--sizes", "--workers", "0"]) == 0
        assert "2 index files written beside the shards; 8 image sizes recorded" in capsys.readouterr().out
        doc = _read_json(local[0] + ".gpupipe.json")
        hw = doc["sizes"]["hw"]
        assert doc["version"] == 3 and doc["sizes"]["rules"] == rules() and len(hw) == 2 * MANY[0] and min(hw) > 0
        urls = [f"{srv.url}/{n}" for n in names(local[:2])]
        cache = new_node(monkeypatch, tmp_path, "node")
        read = header_reads(monkeypatch)
        pipe = gp.Pipeline(gp.WebDataset(urls, cache_dir=cache), [T.RandomResizedCrop(16)])
        with gp.Loader(pipe, 4, backend="dali", device="cpu", seed=0) as loader:
            assert sum(len(b.keys) for b in loader) == 2 * MANY[0]
        assert read == []

    def test_sizes_of_other_rules_or_damaged_are_not_used(self, served_copy, monkeypatch, tmp_path, caplog):
        srv, local = served_copy
        assert main(["index", local[0], "--beside", "--workers", "0"]) == 0
        doc = _read_json(local[0] + ".gpupipe.json")
        assert doc["version"] == 3 and doc["sizes"] is None
        for sizes, used in (({"rules": "../../x", "hw": [1, 1] * MANY[0]}, False),  # a path, not a tag
                            ({"rules": "abc", "hw": [1] * MANY[0]}, False),  # not two per sample
                            ({"rules": "abc", "hw": [-1, 5] * MANY[0]}, False),
                            ({"rules": "abc", "hw": [3, 5] * MANY[0]}, True)):  # fmt: skip
            with open(local[0] + ".gpupipe.json", "w") as f:
                json.dump({**doc, "sizes": sizes}, f)
            caplog.clear()
            cache = new_node(monkeypatch, tmp_path, f"n{len(os.listdir(tmp_path))}")
            index = gp.WebDataset(f"{srv.url}/{names(local)[0]}", cache_dir=cache).index()
            assert ("cannot use the index file" in caplog.text) is not used and len(index) == MANY[0]
            index.close()
        from gpupipe.shards import _indexcache

        path = index.shards[0].dali_index
        assert path is not None
        found = _indexcache.load_sizes(path, "abc", MANY[0])
        assert found is not None and found.tolist() == [[3, 5]] * MANY[0]

    def test_version_2_files_are_read(self, served_copy, monkeypatch, tmp_path):
        srv, local = served_copy
        assert main(["index", local[0], "--beside", "--workers", "0"]) == 0
        doc = _read_json(local[0] + ".gpupipe.json")
        del doc["sizes"]
        with open(local[0] + ".gpupipe.json", "w") as f:
            json.dump({**doc, "version": 2}, f)
        index = gp.WebDataset(f"{srv.url}/{names(local)[0]}", cache_dir=new_node(monkeypatch, tmp_path, "n")).index()
        assert len(index) == MANY[0] and not shard_gets(srv)
        index.close()

    @pytest.mark.parametrize(
        "damage",
        [
            {"image_range": [0, 1]},  # not one range per sample
            {"keys": None},
            {"labels": ["x"] * MANY[0]},
            {"image_range": [1 << 40, 10] * MANY[0]},  # outside the shard
            {"image_range": [(1 << 62) + (1 << 61), 1 << 62] * MANY[0]},  # wraps around in int64
            {"image_range": [0.5, 10.7] * MANY[0]},  # not integers
            {"labels": [True] * MANY[0]},
            {"exts": ["gif"] * MANY[0]},  # not an extension asked for
            {"exts": ["j pg"] * MANY[0]},
            {"samples": MANY[0] + 1},  # a count that is not its keys'
            {"version": 1},  # another version (0.1.0 is unreleased: no older format is read)
        ],
        ids=[
            "ranges",
            "keys",
            "labels",
            "outside",
            "wraps",
            "floats",
            "booleans",
            "exts",
            "whitespace",
            "count",
            "version",
        ],
    )
    def test_a_damaged_one_is_ignored_with_a_warning(self, served_copy, monkeypatch, tmp_path, caplog, damage):
        srv, local = served_copy
        assert main(["index", local[0], "--beside", "--workers", "0"]) == 0
        doc = _read_json(local[0] + ".gpupipe.json")
        doc.update(damage)
        with open(local[0] + ".gpupipe.json", "w") as f:
            json.dump(doc, f)
        index = gp.WebDataset(f"{srv.url}/{names(local)[0]}", cache_dir=new_node(monkeypatch, tmp_path, "n")).index()
        assert "cannot use the index file" in caplog.text and len(index) == MANY[0]
        assert shard_gets(srv) == {names(local)[0]: 1}  # scanned instead
        index.close()

    @pytest.mark.parametrize("doc", ["[]", "null", "{"])
    def test_one_that_is_not_an_object_is_ignored(self, served_copy, monkeypatch, tmp_path, caplog, doc):
        srv, local = served_copy
        with open(local[0] + ".gpupipe.json", "w") as f:
            f.write(doc)
        index = gp.WebDataset(f"{srv.url}/{names(local)[0]}", cache_dir=new_node(monkeypatch, tmp_path, "n")).index()
        assert "cannot use the index file" in caplog.text and len(index) == MANY[0]
        index.close()

    def test_writing_them_again_scans_the_shards(self, shards, cache, monkeypatch, tmp_path):
        """A stale index file (its shard rewritten at the same size) is replaced by what the shard
        holds, not copied from itself."""
        fsspec = pytest.importorskip("fsspec")
        fs = fsspec.filesystem("memory")
        with open(shards[0], "rb") as f:
            fs.pipe("/stale/a.tar", f.read())
        stale = samples_of(shards[0])._replace(labels=np.full(SHARD_SIZES[0], 99, np.int64))
        storage = RemoteStorage("memory", cache_dir=cache)
        write_index_file(storage, "memory://stale/a.tar", size=os.path.getsize(shards[0]), detail=stale,
                      image_exts=("jpg",), label_ext="cls", problems=())  # fmt: skip
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "node"))
        assert main(["index", "memory://stale/a.tar", "--image", "jpg", "--beside", "--workers", "0"]) == 0
        truth = samples_of(shards[0]).labels
        assert truth is not None and json.loads(fs.cat("/stale/a.tar.gpupipe.json"))["labels"] == truth.tolist()
        storage.close()

    def test_one_for_another_version_of_the_shard_is_ignored(self, served_copy, monkeypatch, tmp_path):
        srv, local = served_copy
        write_index_file(LocalStorage(), local[0], size=1, detail=samples_of(local[1]), image_exts=("jpg",),
                      label_ext="cls", problems=())  # fmt: skip
        urls = [f"{srv.url}/{n}" for n in names(local)]
        index = gp.WebDataset(urls, image="jpg", cache_dir=new_node(monkeypatch, tmp_path, "node")).index()
        assert len(index) == sum(MANY) and shard_gets(srv) == dict.fromkeys(names(local), 1)

    def test_written_beside_remote_shards_too(self, shards, cache):
        fsspec = pytest.importorskip("fsspec")
        fs = fsspec.filesystem("memory")
        with open(shards[0], "rb") as f:
            fs.pipe("/beside/a.tar", f.read())
        storage = RemoteStorage("memory", cache_dir=cache)
        where = write_index_file(storage, "memory://beside/a.tar", size=10, detail=samples_of(shards[0]),
                              image_exts=("jpg",), label_ext="cls", problems=())  # fmt: skip
        written = json.loads(fs.cat("/beside/a.tar.gpupipe.json"))
        assert where == "memory://beside/a.tar.gpupipe.json" and written["samples"] == SHARD_SIZES[0]


def samples_of(path: str) -> Samples:
    samples = shard_samples(LocalStorage(), path, ("jpg",), "cls")[1]
    assert samples is not None
    return samples


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _split(loader_of, world: int) -> list[list[str]]:
    """The valid keys each of ``world`` ranks yields in one epoch (``loader_of(rank)``)."""
    out = []
    for rank in range(world):
        with loader_of(rank) as loader:
            out.append([k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v])
    return out


class TestParts:
    """A shard split between ranks: each downloads only its byte range of it."""

    WORLD = 5  # 48 samples of 4 per shard: ranks of 10, 10, 10, 9, 9 split 4 shards

    @pytest.fixture
    def indexed(self, served_copy) -> tuple[HttpServer, list[str], list[str]]:
        srv, local = served_copy
        assert main(["index", *local, "--beside", "--workers", "0"]) == 0
        return srv, local, [f"{srv.url}/{n}" for n in names(local)]

    def test_each_rank_downloads_only_its_part(self, backend, indexed, monkeypatch, tmp_path):
        srv, local, urls = indexed
        got = _split(
            lambda r: backend.loader(
                val(gp.WebDataset(urls, cache_dir=new_node(monkeypatch, tmp_path, f"node{r}"))),
                4, rank=r, world_size=self.WORLD, num_workers=0,
            ),
            self.WORLD,
        )  # fmt: skip
        assert got == _split(lambda r: backend.loader(val(gp.WebDataset(local)), 4, rank=r, world_size=self.WORLD,
                                                      num_workers=0), self.WORLD)  # fmt: skip
        size = {n: os.path.getsize(p) for n, p in zip(names(local), local, strict=True)}
        sent = {n: srv.sent.get(n, 0) for n in names(local)}
        # Each rank is its own node. The ranks' parts start at samples 10, 20, 30 and 39: shards 2
        # and 7 are split 2 + 2 samples, shard 9 3 + 1 (each rank downloads the byte range of its
        # samples: less than the shard together, its tar headers left out); shard 5 is not split.
        split = [names(local)[i] for i in (2, 7, 9)]
        assert all(sent[n] < size[n] for n in split)
        assert all(sent[n] == size[n] for n in names(local) if n not in split)
        parts = [e for r in range(self.WORLD) for e in cached(str(tmp_path / f"node{r}" / "shards")) if "+" in e]
        assert len(parts) == 6

    @pytest.mark.parametrize("says_so", [False, True], ids=["ignores-ranges", "accept-ranges-none"])
    def test_a_server_without_ranges_sends_the_whole_shard(self, indexed, monkeypatch, tmp_path, caplog, says_so):
        srv, local, urls = indexed
        srv.ranges, srv.says_no_ranges = False, says_so
        caplog.set_level(logging.INFO, logger="gpupipe")
        got = _split(lambda r: gp.Loader(val(gp.WebDataset(urls, cache_dir=new_node(monkeypatch, tmp_path, "n"))), 4,
                                         backend="torch", device="cpu", rank=r, world_size=self.WORLD,
                                         num_workers=0), 2)  # fmt: skip
        expected = _split(lambda r: gp.Loader(val(gp.WebDataset(local)), 4, backend="torch", device="cpu", rank=r,
                                              world_size=self.WORLD, num_workers=0), 2)  # fmt: skip
        assert got == expected and "ignores range requests" in caplog.text

    def test_worker_processes_download_the_part_their_loader_announced(self, indexed, monkeypatch, tmp_path):
        srv, local, urls = indexed
        loader = gp.Loader(val(gp.WebDataset(urls, cache_dir=new_node(monkeypatch, tmp_path, "node"))), 4,
                           backend="torch", device="cpu", rank=1, world_size=self.WORLD, num_workers=2)  # fmt: skip
        with loader:
            keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
        assert len(keys) == 10 and srv.sent[names(local)[2]] < os.path.getsize(local[2]) / 2

    def test_parts_of_empty_members_are_not_fetched(self):
        none = np.zeros((2, 2), np.int64)
        image = np.array([[512, 0], [1536, 0]], np.int64)  # two 0-byte images
        shard = ShardIndex("http://h/a.tar", ["a", "b"], {"image_range": image, "label_range": none - 1})
        shard.nbytes = 4096
        index = Index([shard], reader=None, sequential=True, labeled=False)  # type: ignore[arg-type]
        assert parts(index, np.array([1]), np.array([0]), np.array([0])) == {}

    def test_worker_processes_find_the_part_in_the_cache(self, indexed, monkeypatch, tmp_path):
        srv, local, urls = indexed
        cache = new_node(monkeypatch, tmp_path, "node")
        storage = RemoteStorage("http", cache_dir=cache)
        index = gp.WebDataset(urls, cache_dir=cache).index()
        rank_1 = np.arange(10, 20)  # rank 1's samples; shard 2 holds 8..11
        part = parts(index, rank_1, np.searchsorted(index.offsets, rank_1, side="right") - 1, np.array([2]))
        storage.expect_parts(part)  # another process of the node (the loader's) has it downloaded
        storage.prefetch([urls[2]])
        deadline = time.monotonic() + 10
        while not any("+" in e for e in cached(cache)) and time.monotonic() < deadline:
            time.sleep(0.05)
        loader = gp.Loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, backend="torch", device="cpu", rank=1,
                           world_size=self.WORLD, num_workers=2)  # fmt: skip
        with loader:
            keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
        assert keys[:1] == [index.key(10)]
        assert srv.sent[names(local)[2]] == part[urls[2]][1] - part[urls[2]][0]  # that part, once
        storage.close()
        index.close()

    def test_a_read_outside_the_part_fetches_the_whole_shard(self, indexed, monkeypatch, tmp_path):
        srv, local, urls = indexed
        storage = RemoteStorage("http", cache_dir=new_node(monkeypatch, tmp_path, "node"))
        index = gp.WebDataset(local).index()
        first, last = index.shards[0].column("image_range")[[0, 3]]
        storage.expect_parts({urls[0]: (int(last[0]), int(last.sum()))})
        with open(local[0], "rb") as f:
            data = f.read()
        assert storage.read(urls[0], int(last[0]), int(last[1])) == data[last[0] : last.sum()]
        assert storage.map(urls[0]) is None  # a part is read, never mapped
        assert srv.sent[names(local)[0]] == last[1]
        assert storage.read(urls[0], int(first[0]), int(first[1])) == data[first[0] : first.sum()]
        assert srv.sent[names(local)[0]] == last[1] + len(data)
        storage.close()


class TestCacheFiles:
    def test_lock_files_go_with_their_entries(self, many_shards, many_server, cache):
        storage = RemoteStorage("http", cache_dir=cache, cache_size=1)
        storage.keep = 1
        for n in names(many_shards):
            storage.read(f"{many_server.url}/{n}", 0, 10)
        storage.close()
        ShardCache(cache, 1).evict()
        assert os.listdir(os.path.join(cache, ".locks")) == [] and not cached(cache)

    def test_stale_lock_files_are_removed_unless_held(self, cache):
        import fcntl

        shard_cache = ShardCache(cache)
        held = shard_cache._lock(os.path.join(shard_cache.root, "x-a.tar"), "pin", fcntl.LOCK_SH)
        os.makedirs(os.path.join(cache, ".locks"), exist_ok=True)
        for name in ("y-b.tar.pin", "y-b.tar.dl"):
            open(os.path.join(cache, ".locks", name), "w").close()
        shard_cache.evict()
        assert os.listdir(os.path.join(cache, ".locks")) == ["x-a.tar.pin"]
        from gpupipe.storage import _cache

        _cache._close(held)

    def test_a_part_serves_reads_inside_it(self, cache):
        shard_cache = ShardCache(cache)
        stat = Stat(100, "v1")
        calls = []

        def download(f, span):
            calls.append(span)
            f.write(bytes(range(100))[span[0] : span[1]] if span else bytes(range(100)))

        part = shard_cache.fetch("http://h/a.tar", stat, download, need=(10, 20), span=(5, 50))
        again = shard_cache.fetch("http://h/a.tar", stat, download, need=(30, 40))
        assert (part.span, again.span, again.path, calls) == ((5, 50), (5, 50), part.path, [(5, 50)])
        whole = shard_cache.fetch("http://h/a.tar", stat, download, need=(60, 70))
        assert whole.span is None and calls == [(5, 50), None]
        assert shard_cache.fetch("http://h/a.tar", stat, download, need=(10, 20), span=(5, 50)).span is None
        for entry in (part, again, whole):
            ShardCache.release(entry)


@pytest.fixture
def gz_shards(shards, tmp_path) -> list[str]:
    """``shards`` gzip-compressed, as ``.tar.gz`` and ``.tgz``."""
    out = []
    for i, path in enumerate(shards):
        target = tmp_path / "gz" / (names(shards)[i].removesuffix(".tar") + (".tgz" if i == 1 else ".tar.gz"))
        target.parent.mkdir(exist_ok=True)
        with open(path, "rb") as f:
            target.write_bytes(gzip.compress(f.read()))
        out.append(str(target))
    return out


class TestCompressedShards:
    def test_local_tar_gz_on_every_backend(self, backend, shards, gz_shards, cache):
        with backend.loader(val(gp.WebDataset(gz_shards, cache_dir=cache)), 4, num_workers=1) as loader:
            got = epoch(loader)
        with backend.loader(val(shards), 4, num_workers=1) as loader:
            same_epochs(got, epoch(loader))
        entries = [f for f in os.listdir(cache) if not f.startswith(".")]
        assert len(entries) == 3  # each decompressed once
        for entry in entries:
            with open(os.path.join(cache, entry), "rb") as f:
                assert f.read(512)[257:262] == b"ustar"  # a tar, stored decompressed

    def test_over_http(self, shards, gz_shards, cache, http_server):
        srv = http_server(os.path.dirname(gz_shards[0]))
        urls = [f"{srv.url}/{os.path.basename(p)}" for p in gz_shards]
        with gp.Loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, backend="torch", device="cpu") as loader:
            got = epoch(loader)
        with gp.Loader(val(shards), 4, backend="torch", device="cpu") as loader:
            same_epochs(got, epoch(loader))

    def test_a_corrupt_gzip_is_named_at_once(self, gz_shards, cache):
        with open(gz_shards[0], "r+b") as f:
            f.seek(40)
            f.write(b"\x00" * 64)  # inside the deflate stream
        started = time.monotonic()
        with pytest.raises(gp.ShardError, match=r"train-000000\.tar\.gz' cannot be read") as info:
            gp.WebDataset(gz_shards, cache_dir=cache).index()
        assert info.value.kind is gp.Damage.UNREADABLE_SHARD and time.monotonic() - started < 5  # not retried


class TestMemory:
    def test_fsspec_memory_filesystem(self, backend, shards, cache):
        if backend.backend == "ray":
            pytest.skip("Ray's workers are processes of their own, not forks: this process's memory:// is not theirs")
        fsspec = pytest.importorskip("fsspec")
        fs = fsspec.filesystem("memory")
        for path in shards:
            with open(path, "rb") as f:
                fs.pipe(f"/gpupipe-test/{os.path.basename(path)}", f.read())
        pattern = "memory://gpupipe-test/train-{000000..000002}.tar"
        with backend.loader(val(gp.WebDataset(pattern, cache_dir=cache)), 4) as loader:
            got = epoch(loader)
        with backend.loader(val(shards), 4) as loader:
            same_epochs(got, epoch(loader))


class TestSecrets:
    def test_credentials_and_signatures_never_appear_in_errors(self, shards, server, cache):
        host = server.url.removeprefix("http://")
        url = f"http://alice:hunter2@{host}/gone.tar?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA"
        with pytest.raises(gp.ShardError) as info:
            gp.WebDataset(url, cache_dir=cache).index()
        for text in (str(info.value), str(info.value.shard)):
            assert "hunter2" not in text and "deadbeef" not in text and "AKIA" not in text
            assert "gone.tar" in text

    def test_files_beside_a_shard_keep_its_query(self):
        from gpupipe.shards._indexfile import index_file_url
        from gpupipe.shards._mask import mask_url

        assert index_file_url("https://h/a.tar?sig=1") == "https://h/a.tar.gpupipe.json?sig=1"
        assert mask_url("https://h/a.tar?sig=1") == "https://h/a.tar.bad.json?sig=1"
        assert index_file_url("/data/a?.tar") == "/data/a?.tar.gpupipe.json"

    def test_a_refusal_is_not_asked_again(self, shards, server, cache):
        name = names(shards)[0]
        server.status[name] = 403
        started = time.monotonic()
        with pytest.raises(OSError, match=r"refused \(HTTP 403\)"):
            RemoteStorage("http", cache_dir=cache).local_path(f"{server.url}/{name}")
        assert time.monotonic() - started < 2  # no backoff rounds

    def test_nor_in_gpupipe_checks_report(self, shards, server, cache):
        host = server.url.removeprefix("http://")
        url = f"http://alice:hunter2@{host}/gone.tar?sig=deadbeef"
        report = gp.check(gp.WebDataset(url, cache_dir=cache), workers=0, write=False, progress=False)
        text = report.summary() + repr(report.as_dict())
        assert not report.ok and "gone.tar" in text and "hunter2" not in text and "deadbeef" not in text

    def test_the_cache_key_ignores_credentials_and_signatures(self, tmp_path):
        a = canonical_url("https://u:p@Host/b/train-1.tar?X-Amz-Signature=1&X-Amz-Expires=60")
        b = canonical_url("https://Host/b/train-1.tar?X-Amz-Signature=2")
        assert a == b == "https://Host/b/train-1.tar"
        cache = ShardCache(str(tmp_path))
        for url in ("https://h/../../etc/passwd", "https://h/a/..", "s3://b/x\x00y.tar", "https://h/"):
            path = cache.path(canonical_url(url), Stat(1, "v"))
            assert os.path.dirname(path) == cache.root and ".." not in os.path.basename(path).split("-", 1)[0]

    def test_pipe_urls_stay_refused(self):
        with pytest.raises(gp.ConfigError, match="never runs a shell"):
            gp.WebDataset("pipe:curl -s https://host/a.tar")

    def test_storage_options_are_for_remote_urls(self, shards):
        with pytest.raises(gp.ConfigError, match="storage_options apply to remote URLs"):
            gp.WebDataset(shards, storage_options={"anon": True}).index()


class TestCacheCounts:
    """The node cache's hits and misses, counted per thread where the reads happen (the torch
    workers, DALI's reader threads) and reported per batch in ``loader.stats()["times"]``."""

    def test_a_read_that_waits_for_its_download_is_a_miss_the_next_a_hit(self, shards, server, cache):
        from gpupipe.storage._counts import snapshot

        url = f"{server.url}/{names(shards)[0]}"
        storage = RemoteStorage("http", cache_dir=cache)
        before = snapshot()
        storage.read(url, 0, 512)
        first = snapshot()
        storage.read(url, 512, 512)
        got = first.since(before), snapshot().since(first)
        storage.close()
        assert got[0]["cache_misses"] == 1 and got[0]["cache_hits"] == 0 and got[0]["wait_download"] > 0
        assert got[1] == {"cache_hits": 1, "cache_misses": 0, "wait_download": 0.0}
        other = RemoteStorage("http", cache_dir=cache)  # another process of the node: the cache has it
        before = snapshot()
        other.read(url, 0, 512)
        assert snapshot().since(before)["cache_hits"] == 1
        other.close()

    def test_a_read_that_waits_for_another_process_download_is_a_miss(self, shards, server, cache, monkeypatch):
        """Two storages of the node (as two processes): one downloads the shard, slowly; the
        other's read waits for that download on the cache's lock, and counts a miss with its wait."""
        from gpupipe.storage._counts import snapshot

        url = f"{server.url}/{names(shards)[0]}"
        started = threading.Event()
        real = RemoteStorage._download

        def slow(self, *args, **kwargs):
            started.set()
            time.sleep(0.3)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(RemoteStorage, "_download", slow)
        first, second = RemoteStorage("http", cache_dir=cache), RemoteStorage("http", cache_dir=cache)
        downloader = threading.Thread(target=first.read, args=(url, 0, 512))
        downloader.start()
        assert started.wait(10)
        before = snapshot()
        second.read(url, 0, 512)
        got = snapshot().since(before)
        downloader.join()
        first.close()
        second.close()
        assert got["cache_misses"] == 1 and got["cache_hits"] == 0 and got["wait_download"] > 0.1

    def test_local_reads_count_nothing(self, shards):
        from gpupipe.storage._counts import snapshot

        before = snapshot()
        LocalStorage().read(shards[0], 0, 512)
        assert snapshot().since(before) == {}

    def test_the_loader_reports_them_per_batch(self, backend, served_copy, monkeypatch, tmp_path):
        """No shard downloaded ahead (the prefetch left out): each batch's first read of a new
        shard waits for it; the next epoch's reads are the cache's."""
        from gpupipe.loader import _loader

        srv, local = served_copy
        assert main(["index", *local, "--beside", "--workers", "0"]) == 0
        urls = [f"{srv.url}/{n}" for n in names(local)]
        cache = new_node(monkeypatch, tmp_path, "node")
        monkeypatch.setattr(_loader, "prefetcher", lambda *args: None)
        with backend.loader(val(gp.WebDataset(urls, cache_dir=cache)), 4, num_workers=1, shuffle=False) as loader:
            epochs = []
            for e in range(2):
                loader.set_epoch(e)
                for _ in loader:
                    pass
                epochs.append(loader.stats())
        first, second = (s["times"] for s in epochs)
        assert first["cache_misses"] >= 1 and first["wait_download_s"] > 0  # each batch a new shard
        assert second["cache_misses"] == 0 and second["cache_hits"] >= 1 and second["wait_download_s"] == 0
