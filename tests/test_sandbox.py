"""Decoding suspects in a child process (``gpupipe.runtime._sandbox``, ``gpupipe.runtime._decode.verdicts``): a
decoder that kills its process on a file (SIGSEGV) or hangs makes that file a verdict, and the
process that asked goes on — the DALI backend naming a sample DALI failed on, and ``gpupipe
check``, never die with a decoder. The crash is made on purpose: the decoder is replaced, before
the fork, by one that kills its process on a marked file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import gpupipe as gp
from gpupipe.runtime import _decode, _sandbox
from gpupipe.runtime._children import fork_can_freeze, frozen_fork_cause
from gpupipe.runtime._sandbox import guarded_map
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import crasher, make_decoders_crash
from .support.data import truncated_jpeg, write_webdataset_shards


def _crash_or_hang(item):
    if item == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if item == "hang":
        time.sleep(3600)
    return item * 2


def test_each_item_gets_an_outcome_and_the_map_goes_on():
    outcomes = guarded_map(_crash_or_hang, ["a", "crash", "b", "hang", "c"], timeout=2.0)
    assert [o.value for o in outcomes] == ["aa", None, "bb", None, "cc"]
    assert outcomes[1].crashed == -signal.SIGSEGV and "killed by SIGSEGV" in outcomes[1].reason()
    assert outcomes[3].hung == 2.0 and "did not finish in 2 s" in outcomes[3].reason()
    assert guarded_map(_crash_or_hang, []) == []


class TestAChildThatNeverStarts:
    """A sandbox child that freezes inside ``fork`` (CPython gh-112275 before 3.11.10) or dies at
    birth has run no item: it blames none, and another child takes its place."""

    @staticmethod
    def _first_child(monkeypatch, tmp_path, fate, *, every: bool = False):
        """The first sandbox child (every one, with ``every``) meets ``fate`` before its first item."""
        marker = tmp_path / "first"

        def birth(*_):
            if every or not marker.exists():
                marker.touch()
                fate()

        monkeypatch.setattr(_sandbox, "exit_with_parent", birth)
        monkeypatch.setattr(_sandbox, "START_TIMEOUT", 1.0)

    def test_a_child_frozen_at_birth_blames_no_item(self, monkeypatch, tmp_path, caplog):
        self._first_child(monkeypatch, tmp_path, lambda: time.sleep(3600))
        outcomes = guarded_map(_crash_or_hang, ["a", "b"], timeout=30.0)
        assert [o.value for o in outcomes] == ["aa", "bb"] and all(o.ok for o in outcomes)
        (record,) = [r for r in caplog.records if "sandbox" in r.getMessage()]
        assert "gave no sign within 1 s before it started its first item (1 of 3 in a row)" in record.getMessage()
        assert "starting another" in record.getMessage()

    def test_a_child_dead_at_birth_blames_no_item(self, monkeypatch, tmp_path, caplog):
        self._first_child(monkeypatch, tmp_path, lambda: os._exit(3))
        outcomes = guarded_map(_crash_or_hang, ["a", "crash", "b"], timeout=30.0)
        assert [o.value for o in outcomes] == ["aa", None, "bb"] and outcomes[1].crashed == -signal.SIGSEGV
        assert any("ended (exit code 3) before it started" in r.getMessage() for r in caplog.records)

    def test_children_that_never_start_raise_a_worker_error(self, monkeypatch, tmp_path):
        self._first_child(monkeypatch, tmp_path, lambda: os._exit(3), every=True)
        with pytest.raises(gp.WorkerError, match=r"\(3 of 3 in a row\).*giving up") as raised:
            guarded_map(_crash_or_hang, ["a"], timeout=30.0)
        assert raised.value.exitcode == 3

    @pytest.mark.parametrize(("version", "fixed"), [
        ((3, 11, 7), (3, 11, 10)), ((3, 10, 14), (3, 10, 15)), ((3, 11, 10), None), ((3, 12, 0), None),
    ])  # fmt: skip
    def test_the_pythons_whose_fork_can_freeze(self, version, fixed):
        assert fork_can_freeze(version) == fixed
        cause = frozen_fork_cause(version)
        assert "gh-112275" in cause and (
            f"fixed in {'.'.join(map(str, fixed))}" in cause if fixed else "has the fix" in cause
        )


class TestForksFromSeveralThreads:
    """The DALI backend's reader threads may judge suspects at once: their sandbox forks are one
    at a time, and a fork refused anyway is tried again (seen on an H100 with filelock 4 on
    Python 3.12: ``RuntimeError: os.fork is unsafe while filelock is changing descriptor
    ownership``, whose audit hook refuses a fork while another thread is inside one)."""

    def test_with_filelocks_guard_every_map_gets_its_outcomes(self):
        fork = pytest.importorskip("filelock._core._fork")  # filelock >= 4
        script = (
            f"import sys, threading, {fork.__name__}\n"
            f"sys.addaudithook({fork.__name__}._audit_fork_safety)  # as filelock adds it on 3.12\n"
            "from gpupipe.runtime._sandbox import guarded_map\n"
            "errors = []\n"
            "def work():\n"
            "    for _ in range(25):\n"
            "        try:\n"
            "            assert [o.value for o in guarded_map(abs, [-1, -2])] == [1, 2]\n"
            "        except Exception as e:\n"
            "            errors.append(repr(e))\n"
            "threads = [threading.Thread(target=work) for _ in range(4)]\n"
            "[t.start() for t in threads]\n"
            "[t.join() for t in threads]\n"
            "print(errors)\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[]"

    def test_a_refused_fork_is_tried_again(self, monkeypatch, caplog):
        refusals = iter([True])
        start = _sandbox.multiprocessing.process.BaseProcess.start

        def refused_once(process):
            if next(refusals, False):
                raise RuntimeError("os.fork is unsafe while filelock is changing descriptor ownership")
            start(process)

        monkeypatch.setattr(_sandbox.multiprocessing.process.BaseProcess, "start", refused_once)
        assert [o.value for o in guarded_map(_crash_or_hang, ["a", "b"])] == ["aa", "bb"]
        (record,) = [r for r in caplog.records if "sandbox" in r.getMessage()]
        assert "a gpupipe sandbox process could not be forked (os.fork is unsafe" in record.getMessage()


@pytest.fixture
def crashing_decoder(monkeypatch):
    make_decoders_crash(monkeypatch, _decode)


def test_a_crash_is_a_verdict_naming_the_sample(crashing_decoder):
    good = encode_jpeg(synthetic_image(1, size=(24, 32)))
    found = _decode.verdicts([(good, "s.tar", "good"), (crasher(), "s.tar", "bad"), (b"", "s.tar", "empty")])
    assert found[0] is None and found[2] is not None and found[2].kind is gp.Damage.EMPTY_IMAGE
    assert found[1] is not None and found[1].kind is gp.Damage.UNDECODABLE and found[1].key == "bad"
    assert "'bad' in shard 's.tar' cannot be decoded: it killed the process decoding it" in str(found[1])


def test_check_reports_a_file_that_crashes_the_decoder(crashing_decoder, tmp_path):
    urls = write_webdataset_shards(str(tmp_path), (4,), prefix="c", patch={2: {"jpg": crasher()}})
    report = gp.check(urls, workers=0, write=False)
    (finding,) = report.findings
    assert finding.sample == 2 and finding.kind is gp.Damage.UNDECODABLE and "killed the process" in finding.message


def test_dali_names_a_sample_that_crashes_gpupipes_decoder(crashing_decoder, tmp_path):
    """DALI fails on a batch; gpupipe decodes the samples it fails on to judge them, and one of them
    kills its decoder: that one is skipped (or named), this process lives."""
    pytest.importorskip("nvidia.dali")
    bad = truncated_jpeg(1)  # DALI fails on it, and on the (cut) crasher: the batch is searched
    cut = crasher()[: len(crasher()) // 2]
    urls = write_webdataset_shards(str(tmp_path), (8,), prefix="d", patch={1: {"jpg": bad}, 2: {"jpg": cut}})
    pipe = gp.Pipeline(urls, [gp.transforms.Resize((16, 16))])
    with gp.Loader(pipe, 4, backend="dali", device="cpu", on_error="skip", max_skipped=None) as loader:
        valid = [v for b in loader for v in b.valid.tolist()]
        skipped = {s.key: str(s.kind) for s in loader.skipped}
    assert skipped == {"img/00/000001": "undecodable", "img/00/000002": "undecodable"} and valid.count(True) == 6
