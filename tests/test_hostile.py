"""Hostile data cannot stop, starve or bloat a run (issue 51): every limit is checked before the
bytes are read, from the tar header or the first bytes, and a shard or sample over one is named
and refused, never an exception out of ``Loader(...)`` or ``check``."""

from __future__ import annotations

import tarfile

import pytest

import gpupipe as gp
from gpupipe.core._errors import Damage
from gpupipe.shards import _tar

from .support.hostile import good_jpeg, good_sample, member, tar_of

HUGE = 1 << 62  # a claimed size no process can allocate


def write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def problems(path: str) -> list[gp.DataError]:
    return gp.WebDataset(path).index(on_error="skip").problems


def keys(urls, *, backend: str = "torch", **options) -> list[str]:
    """The keys a loader delivers under ``skip`` (DALI: its CPU operators)."""
    pipe = gp.Pipeline(urls, [gp.transforms.CenterCrop(16)])
    if backend == "dali":
        options.setdefault("device", "cpu")
    with gp.Loader(pipe, 2, backend=backend, on_error="skip", max_skipped=None, **options) as loader:
        return sorted(k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v)


class TestTarHeaderRecords:
    """A pax or GNU long-name header claims the size of the record after it; :mod:`tarfile` reads
    that many bytes at once. Over ``HEADER_LIMIT`` the shard is damaged from there."""

    @pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                                      tarfile.GNUTYPE_LONGLINK])  # fmt: skip
    @pytest.mark.parametrize("claim", [HUGE, 100 << 20])
    def test_a_huge_record_after_a_sample_truncates_the_shard_there(self, tmp_path, kind, claim):
        data = tar_of(good_sample("a"), member("././@LongLink", b"x" * 100, type=kind, size=claim), b"\0" * 15_000)
        path = write(tmp_path / "s.tar", data)
        (problem,) = problems(path)
        assert problem.kind is Damage.TRUNCATED_SHARD and problem.shard == path
        assert f"a header record of {claim} bytes" in str(problem) and "1 complete samples" in str(problem)
        assert keys(path) == ["a"]

    @pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
    def test_a_huge_first_record_makes_the_shard_unreadable_not_the_loader(self, tmp_path, kind):
        bad = write(tmp_path / "bad.tar", tar_of(member("x", b"y", type=kind, size=HUGE), b"\0" * 15_000))
        good = write(tmp_path / "good.tar", tar_of(good_sample("g")))
        (problem,) = problems(bad)
        assert problem.kind is Damage.UNREADABLE_SHARD and f"a header record of {HUGE} bytes" in str(problem)
        assert keys([bad, good]) == ["g"]
        with pytest.raises(gp.ShardError, match="header record") as e:
            gp.Pipeline([bad, good], [gp.transforms.CenterCrop(16)]).source.index()
        assert e.value.shard == bad
        report = gp.check([bad, good], workers=0, write=False)
        assert [(f.shard, f.kind) for f in report.findings] == [(bad, Damage.UNREADABLE_SHARD)]

    def test_records_under_the_limit_are_read(self, tmp_path):
        long = "d/" + "n" * 300  # a GNU long name, as tarfile writes one
        data = tar_of(member(f"{long}.jpg", good_jpeg()), member(f"{long}.cls", b"3"))
        path = write(tmp_path / "s.tar", data)
        assert problems(path) == [] and keys(path) == [long]

    def test_the_scan_never_reads_more_than_the_limit_at_once(self, tmp_path, monkeypatch):
        asked: list[int] = []
        opened = gp.sources.LocalStorage.open_shard

        class Recording:
            def __init__(self, f):
                self.f = f

            def read(self, n=-1):
                asked.append(n)
                return self.f.read(n)

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        monkeypatch.setattr(gp.sources.LocalStorage, "open_shard", lambda self, url: Recording(opened(self, url)))
        data = tar_of(good_sample("a"), member("p", b"x", type=tarfile.XHDTYPE, size=HUGE), b"\0" * 15_000)
        assert [p.kind for p in problems(write(tmp_path / "s.tar", data))] == [Damage.TRUNCATED_SHARD]
        assert asked and max(asked) <= _tar.HEADER_LIMIT and min(asked) >= 0


class TestLabelMembers:
    """A ``.cls`` member is an int64 in ASCII: one over ``LABEL_LIMIT`` bytes is a bad label,
    never read (a 2 GB ``.cls`` is not read whole to find that out)."""

    def test_a_huge_label_member_is_a_bad_label_unread(self, tmp_path, monkeypatch):
        big = _tar.LABEL_LIMIT + 1
        data = tar_of(good_sample("a"), member("b.jpg", good_jpeg()), member("b.cls", b"7" + b" " * (big - 1)))
        path = write(tmp_path / "s.tar", data)
        reads: list[int] = []
        storage_read = gp.sources.LocalStorage.read

        def read(self, url, offset, size):
            reads.append(size)
            return storage_read(self, url, offset, size)

        monkeypatch.setattr(gp.sources.LocalStorage, "read", read)
        with pytest.raises(gp.SampleError, match=f"is {big} bytes") as e:
            list(gp.Loader(gp.Pipeline(path, [gp.transforms.CenterCrop(16)]), 2, backend="torch"))
        assert (e.value.kind, e.value.key, e.value.shard) == (Damage.BAD_LABEL, "b", path)
        assert big not in reads
        assert keys(path) == ["a"]
