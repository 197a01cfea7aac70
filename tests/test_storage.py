"""The storage seam: LocalStorage's contract, the scheme table, and a new scheme plugged in as one
class plus one table entry, read by every backend."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, ClassVar

import pytest
import torch

import gpupipe as gp
from gpupipe import sources
from gpupipe import transforms as T
from gpupipe.storage import _schemes
from gpupipe.storage._mapped import MappedFile


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def blob(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


class TestLocalStorage:
    def test_stat_read_open(self, blob):
        with sources.LocalStorage() as st:
            stat = st.stat(blob)
            assert stat.size == 1024 and stat.version == "{0.st_mtime_ns}-{0.st_ino}-{0.st_ctime_ns}".format(
                os.stat(blob)
            )
            assert st.read(blob, 250, 10) == bytes([250, 251, 252, 253, 254, 255, 0, 1, 2, 3])
            assert st.read(blob, 1020, 10) == bytes([252, 253, 254, 255])  # short at the end, as pread
            with st.open(blob) as f:
                f.seek(256)
                assert f.read(2) == b"\x00\x01"
            assert st.canonical("file://" + blob) == os.path.abspath(blob) == st.canonical(blob)

    def test_missing_file_is_an_oserror(self, tmp_path):
        st = sources.LocalStorage()
        for call in (lambda: st.stat(str(tmp_path / "x")), lambda: st.read(str(tmp_path / "x"), 0, 1)):
            with pytest.raises(FileNotFoundError):
                call()

    def test_threads_and_close(self, blob):
        st = sources.LocalStorage()
        before = open_fds()
        errors = []
        reading, release = threading.Barrier(5), threading.Event()

        def work(k):
            for i in range(200):
                off = (k * 37 + i) % 1000
                if st.read(blob, off, 3) != bytes([off % 256, (off + 1) % 256, (off + 2) % 256]):
                    errors.append(off)
            reading.wait()
            release.wait()

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        reading.wait()
        assert not errors
        assert open_fds() == before + 4 == before + st.open_descriptors()  # one per live thread, kept open
        st.close()  # closes every thread's descriptors, from this thread
        assert open_fds() == before and st.open_descriptors() == 0
        release.set()
        for t in threads:
            t.join()
        assert st.read(blob, 0, 1) == b"\x00"  # reopens on demand
        st.close()

    def test_a_finished_thread_leaves_no_descriptor_open(self, blob):
        """Reader threads come and go (one pool per epoch): their descriptors go with them."""
        st = sources.LocalStorage()
        before = open_fds()
        for _ in range(5):
            t = threading.Thread(target=st.read, args=(blob, 0, 1))
            t.start()
            t.join()
        assert open_fds() == before and st.open_descriptors() == 0

    def test_forked_child_opens_its_own_descriptors(self, blob):
        st = sources.LocalStorage()
        st.read(blob, 0, 1)
        parent_fd = next(iter(st._local.files.fds.values()))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            ok = st.read(blob, 5, 1) == b"\x05" and st._pid == os.getpid()  # its own state, its own files
            st.close()
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 1) == b"1"
        os.close(r)
        os.close(w)
        assert st.read(blob, 7, 1) == b"\x07" and next(iter(st._local.files.fds.values())) == parent_fd
        os.fstat(parent_fd)  # still open here: the child's close() did not touch it
        st.close()


class TestOnlyRegularFiles:
    """A FIFO, a device or a folder under a file's name: refused without blocking, before a byte
    is read, by every way LocalStorage reads (``_files.open_regular``)."""

    @pytest.fixture
    def odd(self, tmp_path) -> dict[str, str]:
        os.mkfifo(tmp_path / "fifo.tar")  # no writer: a plain open() would block forever
        os.symlink("/dev/zero", tmp_path / "zero.tar")  # a read would never end
        (tmp_path / "dir.tar").mkdir()
        return {"a FIFO": str(tmp_path / "fifo.tar"), "a character device": str(tmp_path / "zero.tar"),
                "a directory": str(tmp_path / "dir.tar")}  # fmt: skip

    def test_each_read_refuses_them(self, odd):
        from gpupipe.storage._base import LocalStorage
        from gpupipe.storage._files import NotRegularFile

        storage = LocalStorage()
        for kind, path in odd.items():
            message = f"not a regular file \\({kind}\\)"
            with pytest.raises(NotRegularFile, match=message):
                storage.open(path)
            with pytest.raises(NotRegularFile, match=message):
                storage.read(path, 0, 10)
            assert isinstance(storage.sizes([path])[0], NotRegularFile)
            got = storage.read_files_into([path], memoryview(bytearray(8)), [0], [8])
            assert isinstance(got[0], NotRegularFile)
            try:  # (None where no lease can be had at all: then pread reads, refusing it above)
                mapped = MappedFile.open(path)
            except NotRegularFile:
                mapped = None
            assert mapped is None
        storage.close()

    def test_a_file_under_another_processs_write_lease_is_read_once_it_is_broken(self, tmp_path):
        """A write lease (Samba's oplocks, an NFS delegation) makes an open without blocking fail
        at once (EAGAIN), where a plain open waits for the holder to let go: such a file is read,
        not refused."""
        from gpupipe.storage._base import LocalStorage

        path = str(tmp_path / "leased.jpg")
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, signal, sys, time
fd = os.open({path!r}, os.O_RDWR)
signal.signal(signal.SIGIO, lambda *a: (time.sleep(0.3), fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)))
try:
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
except OSError as e:
    print("no lease", e, flush=True)
    sys.exit(0)
print("held", flush=True)
time.sleep(20)
"""], stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            said = holder.stdout.readline() if holder.stdout is not None else ""
            if not said.startswith("held"):
                pytest.skip(f"no write lease here: {said.strip()}")
            storage = LocalStorage()
            started = time.monotonic()
            assert storage.read(path, 0, 10) == b"x" * 10
            assert time.monotonic() - started < 15
            storage.close()
        finally:
            holder.kill()
            holder.communicate()

    def test_a_fifo_shard_is_a_shard_error(self, odd):
        with pytest.raises(gp.ShardError, match=r"not a regular file \(a FIFO\)"):
            gp.WebDataset(odd["a FIFO"]).index()


class TestSchemes:
    def test_scheme_of(self):
        assert _schemes.scheme_of("s3://bucket/a.tar") == "s3"
        assert _schemes.scheme_of("HTTPS://x/a.tar") == "https"
        assert _schemes.scheme_of("/data/a.tar") == "" == _schemes.scheme_of("a:b.tar")

    @pytest.mark.parametrize("url", ["nosuch://bucket/a.tar", "other://host/a-{0..1}.tar"])
    def test_unserved_schemes_are_refused_when_the_source_is_made(self, url):
        with pytest.raises(gp.ConfigError, match=r"WebDataset: no storage serves [\w-]+:// URLs.*local paths.*fsspec"):
            gp.WebDataset(url)

    def test_a_missing_fsspec_driver_is_named_when_the_source_is_made(self, monkeypatch):
        import fsspec

        def missing(protocol):
            raise ImportError("Install s3fs to access S3")

        monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
        with pytest.raises(gp.ConfigError, match=r"s3:// URLs need a package fsspec uses for them: Install s3fs"):
            gp.WebDataset("s3://bucket/a-{0..1}.tar")

    def test_one_source_one_scheme(self, monkeypatch):
        monkeypatch.setitem(_schemes._SCHEMES, "mem", MemoryStorage)
        with pytest.raises(gp.ConfigError, match="cannot mix URL schemes"):
            sources.storage_for(["mem://a.tar", "/data/b.tar"])

    def test_every_option_of_remote_storage_survives_pickling(self, tmp_path):
        """Ray workers and spawned processes get the storage pickled: every option must travel
        (``max_inflation`` once did not, and Ray's downloads failed on the missing attribute)."""
        import inspect
        import pickle

        from gpupipe.storage._remote import RemoteStorage

        options: dict[str, Any] = {"storage_options": {"timeout": 3}, "cache_dir": str(tmp_path), "cache_size": 1 << 20,
                   "max_inflation": 7.0, "retries": 2, "backoff": 0.25}  # fmt: skip
        params = set(inspect.signature(RemoteStorage.__init__).parameters) - {"self", "protocol"}
        assert params == set(options), "a new RemoteStorage option: give it a value here"
        storage = RemoteStorage("http", **options)
        copy = pickle.loads(pickle.dumps(storage))
        try:
            assert copy.protocol == "http"
            for name, value in options.items():
                if name.startswith("cache"):
                    assert (copy.cache.root, copy.cache.max_bytes) == (str(tmp_path), 1 << 20)
                else:
                    assert getattr(copy, name) == value, name
        finally:
            copy.close()
            storage.close()

    def test_register_refuses_to_replace_silently(self):
        with pytest.raises(gp.ConfigError, match="already served"):
            sources.register_storage("file", sources.LocalStorage)


class MemoryStorage(sources.Storage):
    """A whole storage scheme in a dozen lines: objects in a dict, versioned by their hash."""

    objects: ClassVar[dict[str, bytes]] = {}
    reads: ClassVar[list[tuple[str, int, int]]] = []

    def canonical(self, url):
        return url

    def stat(self, url):
        if url not in self.objects:
            raise FileNotFoundError(url)
        return sources.Stat(len(self.objects[url]), f"v{hash(self.objects[url]) & 0xFFFF}")

    def read(self, url, offset, size):
        self.reads.append((url, offset, size))
        self.stat(url)
        return self.objects[url][offset : offset + size]

    def open(self, url):
        self.stat(url)
        return io.BytesIO(self.objects[url])


@pytest.fixture
def memory_shards(monkeypatch, shards):
    """The session's shards served as mem://train-00000{0,1,2}.tar."""
    monkeypatch.setitem(_schemes._SCHEMES, "mem", MemoryStorage)
    monkeypatch.setattr(MemoryStorage, "objects", {})
    monkeypatch.setattr(MemoryStorage, "reads", [])
    for path in shards:
        with open(path, "rb") as f:
            MemoryStorage.objects[f"mem://{os.path.basename(path)}"] = f.read()
    return "mem://train-{000000..000002}.tar"


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_a_new_scheme_is_one_class_and_one_table_entry(memory_shards, shards, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    pipe = [T.Resize(24), T.CenterCrop(16), T.ToDtype(torch.float32, scale=True)]
    remote = gp.Loader(gp.Pipeline(memory_shards, pipe), 4, backend=backend, device="cpu", num_workers=0)
    local = gp.Loader(gp.Pipeline(shards, pipe), 4, backend=backend, device="cpu", num_workers=0)
    got, expected = list(remote), list(local)
    assert [b.keys for b in got] == [b.keys for b in expected]
    for a, b in zip(got, expected, strict=True):
        assert a.labels is not None and b.labels is not None
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert {url for url, _, _ in MemoryStorage.reads} == set(MemoryStorage.objects)  # every byte through the seam
    assert remote.index.shards[0].dali_index is not None  # its index was cached like a local shard's


def _truncate_in_background(path: str, size: int) -> subprocess.Popen[bytes]:
    """Another process truncating ``path`` (it waits while a read lease stands)."""
    code = f"import os; os.truncate({path!r}, {size})"
    return subprocess.Popen([sys.executable, "-c", code])


def _leasable(path: str) -> MappedFile:
    mapped = MappedFile.open(path)
    if mapped is None:
        pytest.skip("no read leases here (Linux grants them on files one owns, on local file systems)")
    return mapped


class TestMappedFile:
    """Shards are mapped only under a read lease, so that a truncation can never raise SIGBUS."""

    def test_a_truncation_waits_until_the_last_use_is_given_back(self, blob):
        mapped = _leasable(blob)
        assert mapped.size == 1024 and bytes(mapped.array[:4]) == bytes(range(4))
        assert mapped.acquire()
        writer = _truncate_in_background(blob, 10)
        deadline = time.monotonic() + 10
        while mapped.acquire():  # the lease reads back as breaking once the writer waits
            mapped.give()
            assert time.monotonic() < deadline, "the truncation never broke the lease"
            time.sleep(0.02)
        time.sleep(0.3)
        assert writer.poll() is None, "the file was truncated while a use was held"
        assert int(mapped.array[1023]) == 255  # still readable: no SIGBUS
        mapped.give()  # the last use: the lease goes
        assert writer.wait(timeout=10) == 0 and os.path.getsize(blob) == 10
        assert not mapped.leased and not mapped.acquire()

    def test_retiring_an_unused_map_releases_it_at_once(self, blob):
        mapped = _leasable(blob)
        mapped.retire()
        assert not mapped.leased and not mapped.acquire()
        writer = _truncate_in_background(blob, 10)
        assert writer.wait(timeout=10) == 0

    def test_no_lease_while_a_writer_has_the_file_open(self, blob):
        _leasable(blob).retire()
        with open(blob, "r+b"):
            assert MappedFile.open(blob) is None  # read it with pread instead

    def test_no_lease_while_someone_handles_the_lease_signal(self, blob, monkeypatch):
        _leasable(blob).retire()
        monkeypatch.setattr(signal, "getsignal", lambda sig: (lambda *a: None) if sig == signal.SIGURG else None)
        assert MappedFile.open(blob) is None

    def test_an_empty_file_is_not_mapped(self, tmp_path):
        empty = tmp_path / "empty"
        empty.write_bytes(b"")
        assert MappedFile.open(str(empty)) is None

    def test_local_storage_maps_and_other_storages_do_not(self, blob):
        mapped = sources.LocalStorage().map(blob)
        assert mapped is None or mapped.size == 1024
        if mapped is not None:
            mapped.retire()
        assert MemoryStorage().map("mem://x") is None
