"""Remote shards against hostile or broken servers (found by a review, 2026-11-29): an error page
answered for a range, a shard that grows between its size and its download, a server that
trickles, a stall while the size is asked, a full cache disk, credentials in a cause's text, a
wait for another process's download, and shards named by their query string."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import threading
import time

import numpy as np
import pytest

from gpupipe.core._errors import redact
from gpupipe.storage import _cache, _transfer
from gpupipe.storage._base import Stat
from gpupipe.storage._cache import ShardCache
from gpupipe.storage._fsspec import canonical_url
from gpupipe.storage._remote import RemoteStorage

from .support.data import write_webdataset_shards
from .support.http_server import HttpServer

pytest.importorskip("aiohttp")


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> str:
    return write_webdataset_shards(str(tmp_path_factory.mktemp("hostile")), (8,), prefix="hostile")[0]


@pytest.fixture
def served(shard, http_server, tmp_path) -> tuple[HttpServer, str, bytes]:
    """A server of a copy of the shard (tests may change it), its URL, and its bytes."""
    root = tmp_path / "served"
    root.mkdir()
    with open(shard, "rb") as f:
        data = f.read()
    (root / "s.tar").write_bytes(data)
    server = http_server(str(root), ranges=True)
    return server, f"{server.url}/s.tar", data


def storage(tmp_path, **options) -> RemoteStorage:
    options.setdefault("retries", 1)
    options.setdefault("backoff", 0.01)
    return RemoteStorage("http", cache_dir=str(tmp_path / "cache"), **options)


def fail(error: BaseException, times: int = 99):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "ok"

    return call, calls


def retried(call) -> object:
    return _transfer.retry("http://h/s.tar", "download", call, retries=2, backoff=0.001, stopping=threading.Event())


class TestRangeAnswers:
    def test_an_error_page_answered_for_a_range_is_not_cached(self, served, tmp_path):
        """A rate limiter's page with ``200`` for a range request: fsspec took a body no longer
        than the range for the range itself, and the page was cached as the shard's bytes. Now a
        ``200`` to a range means no ranges: the shard is downloaded whole, and checked."""
        server, url, data = served
        server.pages["s.tar"] = b"<html>rate limited</html>"
        remote = storage(tmp_path)
        remote.expect_parts({url: (1000, 1400)})
        assert remote.read(url, 1000, 60) == data[1000:1060]
        remote.close()

    def test_a_range_answered_with_more_is_not_read_whole(self, tmp_path):
        """A ``206`` whose body runs past the range is read a piece at a time and stopped one
        byte past it (fsspec read any ``206`` whole into memory first)."""
        import asyncio

        class Content:
            def __init__(self) -> None:
                self.asked: list[int] = []

            async def read(self, n: int) -> bytes:
                self.asked.append(n)
                return bytes(n)

        class Response:
            status, headers, content = 206, {"Content-Range": "bytes 100-199/1000"}, Content()

            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

            def raise_for_status(self) -> None:
                pass

        class Session:
            def get(self, url, headers, **kwargs):
                assert headers["Range"] == "bytes=100-199"
                return Response()

        class HTTPFileSystem:
            def __init__(self) -> None:
                self.kwargs: dict = {}

            def encode_url(self, url):
                return url

            async def set_session(self):
                return Session()

        out = io.BytesIO()
        with pytest.raises(_transfer.NoRanges):
            asyncio.run(_transfer._http_part(HTTPFileSystem(), "http://h/s.tar", out, (100, 200), threading.Event()))
        assert out.tell() == 0 and Response.content.asked == [101]  # (one byte past the range asked, none written)

    def test_a_shard_gone_since_its_size_was_asked_does_not_exist(self, served, tmp_path):
        """A ``404`` to a range request is "does not exist" at once, not six tries (found by a
        review of the range request, 2026-11-29)."""
        server, url, _ = served
        remote = storage(tmp_path, retries=5)
        remote.expect_parts({url: (1000, 1400)})
        remote.stat(url)
        server.status["s.tar"] = 404
        started = time.monotonic()
        with pytest.raises(OSError, match="does not exist"):
            remote.read(url, 1000, 60)
        assert time.monotonic() - started < 5
        remote.close()

    def test_a_short_answer_to_a_range_is_an_error(self, tmp_path):
        class Short:
            def open(self, url: str, mode: str, **kwargs: object) -> io.BytesIO:
                return io.BytesIO(b"<html>error</html>")

        with pytest.raises(OSError, match="were answered with"):
            _transfer.download(Short(), "memory://s.tar", io.BytesIO(), size=10_000, span=(0, 1000), stream=False,
                               stopping=threading.Event())  # fmt: skip


class TestSizeAndSpeed:
    def test_a_shard_that_grows_before_its_download_is_downloaded_at_its_new_size(self, served, tmp_path):
        server, url, data = served
        remote = storage(tmp_path)
        assert remote.stat(url).size == len(data)
        server.grows["s.tar"] = 512  # after the size was asked
        with open(remote.local_path(url), "rb") as f:
            assert f.read() == data + bytes(512)
        remote.close()

    def test_a_trickle_is_cut(self, served, tmp_path, monkeypatch):
        """A server that sends a byte every 50 ms never trips the read timeout; the minimum rate
        cuts it (here 1 MiB in 0.5 s)."""
        server, url, _ = served
        monkeypatch.setattr(_transfer, "RATE_WINDOW_S", 0.5)
        server.trickles["s.tar"] = 99
        started = time.monotonic()
        with pytest.raises(OSError, match="trickles"):
            storage(tmp_path, retries=0).local_path(url)
        assert time.monotonic() - started < 10

    def test_a_download_writes_at_most_one_byte_past_its_bound(self):
        out = io.BytesIO()
        _transfer._copy(io.BytesIO(bytes(3 * _transfer.CHUNK)), out, threading.Event(), 1000)
        assert out.tell() == 1001


class TestRetries:
    def test_a_failed_request_for_the_size_is_not_a_missing_shard(self):
        """fsspec's http filesystem raises FileNotFoundError for any failure of the requests that
        ask the size: a stall, a dropped connection or a redirect loop is tried again."""

        class ServerDisconnectedError(Exception):
            pass

        class TooManyRedirects(Exception):
            pass

        for cause in (TimeoutError(), ServerDisconnectedError(), TooManyRedirects()):
            missing = FileNotFoundError("http://h/s.tar")
            missing.__cause__ = cause
            call, calls = fail(missing, times=1)
            assert retried(call) == "ok" and len(calls) == 2, cause
        call, calls = fail(FileNotFoundError("http://h/s.tar"))
        with pytest.raises(FileNotFoundError, match="does not exist"):
            retried(call)
        assert len(calls) == 1

    def test_a_full_disk_is_not_tried_again(self):
        call, calls = fail(OSError(errno.ENOSPC, "No space left on device"))
        with pytest.raises(OSError, match="disk is full") as info:
            retried(call)
        assert len(calls) == 1 and info.value.errno is None

    def test_the_last_error_carries_no_secret_in_its_cause(self):
        call, _ = fail(ConnectionResetError("http://alice:S3CRET@h/s.tar?token=TOK reset"))
        with pytest.raises(OSError) as info:
            _transfer.retry("http://alice:S3CRET@h/s.tar?token=TOK", "download", call, retries=1, backoff=0.001,
                            stopping=threading.Event())  # fmt: skip
        assert info.value.__cause__ is None and info.value.__suppress_context__
        assert "S3CRET" not in str(info.value) and "TOK" not in str(info.value)

    def test_a_body_cut_short_is_not_called_an_http_status(self, served, tmp_path):
        """A body shorter than its Content-Length is the transfer's fault, not an answer: aiohttp's
        parser error carries a code of 400, which the error called the server's status."""
        server, url, _ = served
        server.drops["s.tar"] = 99
        with pytest.raises(OSError, match=r"failed after 2 tries") as info:
            storage(tmp_path).local_path(url)
        assert "(HTTP" not in str(info.value), info.value  # (the server answered 200)

    def test_the_last_error_names_why_the_size_could_not_be_asked(self, tmp_path):
        """fsspec's error for a failed request of the size says only the URL: the error names its
        cause (a refused connection, a timeout)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/s.tar"  # nothing listens there
        with pytest.raises(OSError) as info:
            storage(tmp_path).stat(url)
        assert "Cannot connect" in str(info.value), info.value

    def test_a_refusal_names_the_shard(self):
        call, _ = fail(PermissionError("Access Denied"))
        with pytest.raises(PermissionError, match=r"download http://h/s.tar was refused: Access Denied"):
            retried(call)


class TestCache:
    def test_room_is_made_before_a_download(self, tmp_path):
        cache = ShardCache(str(tmp_path / "c"), max_bytes=3000)
        for i, when in enumerate((100, 200)):
            path = cache.path(f"https://h/{i}.tar", Stat(1000, "v"))
            os.makedirs(cache.root, exist_ok=True)
            with open(path, "wb") as f:
                f.write(bytes(1000))
            os.utime(path, (when, when))
        assert cache.evict(room=1500) == 1 and cache.usage() == 1000  # the older one went

    def test_a_wait_for_another_download_ends_with_close(self, tmp_path):
        cache = ShardCache(str(tmp_path / "c"))
        stat = Stat(10, "v")
        held = cache._lock(cache.path("https://h/s.tar", stat), "dl", fcntl.LOCK_EX)  # another download
        stopping = threading.Event()
        threading.Timer(0.3, stopping.set).start()
        started = time.monotonic()
        with pytest.raises(OSError, match="closed while waiting"):
            cache.fetch("https://h/s.tar", stat, lambda f, span: None, stopping=stopping)
        assert time.monotonic() - started < 5
        _cache._close(held)

    def test_a_forked_child_closes_no_reused_descriptor_number(self, tmp_path):
        """A lock descriptor closed by a path other than the cache's own left its number in the
        list a forked child closes: the child then closed whatever held that number by then (a
        DataLoader worker's index queue: the worker read end of file and exited with code 1).
        Found when a test closed its lock with ``os.close``, 2026-11-29."""
        cache = ShardCache(str(tmp_path / "c"))
        stale = cache._lock(cache.path("https://h/s.tar", Stat(10, "v")), "dl", fcntl.LOCK_EX)
        os.close(stale)  # (not through the cache)
        r, w = os.pipe()
        try:
            if r != stale:  # the number is taken again by the next descriptor opened
                os.dup2(r, stale)
                os.close(r)
                r = stale
            os.write(w, b"x")
            pid = os.fork()
            if pid == 0:  # the child: the pipe, under the stale number, is still its own
                try:
                    os._exit(0 if os.read(r, 1) == b"x" else 3)
                except OSError:
                    os._exit(4)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            _cache._close(r)
            os.close(w)


class TestUrls:
    def test_shards_named_by_their_query_are_two_shards(self):
        assert canonical_url("https://h/get?shard=0") != canonical_url("https://h/get?shard=1")
        assert canonical_url("https://u:p@H/get?shard=1&X-Amz-Signature=2&sig=3&Token=9#f") == "https://H/get?shard=1"
        assert canonical_url("https://h/a.tar?sv=1&se=2&sp=r&sig=x") == "https://h/a.tar"

    def test_a_password_holding_an_at_sign_is_redacted_whole(self):
        assert redact("see https://user:p@ss@host/x.tar") == "see https://<redacted>@host/x.tar"

    def test_a_query_after_a_path_with_spaces_is_redacted(self):
        """Shards may be named with spaces (fsspec encodes them): the query of such a URL is a
        query still, whatever sits between it and the scheme."""
        for url in ("https://h/my data/s.tar?X-Amz-Signature=SECRET", "s3://b/my data/s.tar?token=SECRET"):
            assert "SECRET" not in redact(f"shard '{url}' is missing") and "SECRET" not in redact(f"see {url}")
        assert redact("is it cut at a member boundary? see https://h/a.tar") == (
            "is it cut at a member boundary? see https://h/a.tar"
        )

    def test_a_query_opening_on_a_flag_after_a_path_with_spaces_is_redacted(self):
        """A query whose first parameter has no value (``?download&sig=``) is a query too."""
        for url in ("https://h/my data/s.tar?download&sig=SECRET", "gs://b/my data/s.tar?a&b&token=SECRET"):
            assert "SECRET" not in redact(f"shard '{url}' is missing") and "SECRET" not in redact(f"see {url}")


class TestSideFiles:
    """Files beside shards that gpupipe did not write itself, or that went stale (found by a
    review, 2026-11-29): an index file whose ranges cannot be a tar's members, one written for
    another version of the shard, JSON nested past Python's recursion limit, ``Infinity`` in a
    bad-sample list, a damaged index cache. Each is ignored (the shard scanned), never used."""

    IMAGE, LABEL = ("jpg",), "cls"

    @pytest.fixture
    def described(self, shard, tmp_path):
        import shutil

        from gpupipe.shards._indexing import shard_samples
        from gpupipe.sources import LocalStorage

        url = str(tmp_path / "s.tar")
        shutil.copy(shard, url)
        storage = LocalStorage()
        _, samples = shard_samples(storage, url, self.IMAGE, self.LABEL)
        assert samples is not None
        return storage, url, samples

    def read(self, storage, url, doc, version=None):
        import json

        from gpupipe.shards._indexfile import index_file_url, read_index_file

        with open(index_file_url(url), "w") as f:
            f.write(doc if isinstance(doc, str) else json.dumps(doc))
        return read_index_file(storage, url, size=os.path.getsize(url), image_exts=self.IMAGE, label_ext=self.LABEL,
                               version=version)  # fmt: skip

    def doc(self, url, samples, **changes):
        import json

        from gpupipe.shards._indexfile import encode

        doc = json.loads(encode(os.path.getsize(url), samples, self.IMAGE, self.LABEL, (), version="v1"))
        doc.update(changes)
        return doc

    def test_ranges_that_cannot_be_members_are_refused(self, described, caplog):
        storage, url, samples = described
        assert self.read(storage, url, self.doc(url, samples), "v1") is not None
        n = len(samples.keys)
        image = samples.image.reshape(-1).tolist()
        header = [0, 512] * n  # a tar header served as each image
        repeated = image[:2] * n  # every sample the first one's bytes
        straddling = [v + 100 if i % 2 == 0 else v for i, v in enumerate(image)]
        for ranges in (header, repeated, straddling):
            assert self.read(storage, url, self.doc(url, samples, image_range=ranges), "v1") is None
        assert "cannot use the index file" in caplog.text

    def test_a_file_written_for_another_version_is_ignored(self, described):
        storage, url, samples = described
        assert self.read(storage, url, self.doc(url, samples), "v2") is None
        assert self.read(storage, url, self.doc(url, samples, shard_version=None), "v2") is not None  # (older files)

    def test_damaged_json_is_ignored(self, described, caplog):
        storage, url, samples = described
        assert self.read(storage, url, "[" * 100_000 + "]" * 100_000, "v1") is None
        assert "nested too deeply" in caplog.text or "not a JSON object" in caplog.text
        bad_key = self.doc(url, samples, problems=[{"kind": "undecodable", "key": ["k"], "detail": "x"}])
        missing = self.doc(url, samples, problems=[{"kind": "missing-shard", "key": None, "detail": "x"}])
        assert self.read(storage, url, bad_key, "v1") is None and self.read(storage, url, missing, "v1") is None

    def test_a_bad_sample_list_with_infinity_or_deep_nesting_is_ignored(self, described):
        import json

        from gpupipe.shards import _mask
        from gpupipe.shards._mask import mask_url, read_mask

        storage, url, samples = described
        n, size = len(samples.keys), os.path.getsize(url)
        bad = [{"sample": float("inf"), "kind": "undecodable", "key": "k", "detail": "d"}]  # (json writes Infinity)
        listed = {"format": _mask.FORMAT, "version": _mask.VERSION, "size": size, "samples": n, "image": "jpg",
                  "label": "cls", "bad": bad}  # fmt: skip
        for text in ("[" * 100_000 + "]" * 100_000, json.dumps(listed)):
            with open(mask_url(url), "w") as f:
                f.write(text)
            assert read_mask(storage, url, size=size, samples=n, image_exts=self.IMAGE, label_ext=self.LABEL) == ()

    def test_a_damaged_index_cache_is_scanned_again(self, tmp_path):
        from gpupipe.shards import _indexcache

        path = str(tmp_path / "x.idx")
        keys, image = ["a", "b"], np.array([[512, 10], [1536, 10]], np.int64)
        assert _indexcache.save(path, keys, ["jpg", "jpg"], image, None)
        assert _indexcache.load(path, False) is not None
        with open(path) as f:
            text = f.read()
        for bad in ("1536", "99999999999999999999999"):
            with open(path, "w") as f:
                f.write(text.replace("1536", "5x2" if bad == "1536" else bad))
            assert _indexcache.load(path, False) is None
