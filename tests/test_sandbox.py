"""Decoding suspects in a child process (``gpupipe._sandbox``, ``gpupipe._decode.verdicts``): a
decoder that kills its process on a file (SIGSEGV) or hangs makes that file a verdict, and the
process that asked goes on — the DALI backend naming a sample DALI failed on, and ``gpupipe
check``, never die with a decoder. The crash is made on purpose: the decoder is replaced, before
the fork, by one that kills its process on a marked file."""

from __future__ import annotations

import os
import signal
import time

import pytest

import gpupipe as gp
from gpupipe import _decode
from gpupipe._sandbox import guarded_map
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
    """DALI fails on a batch; gpupipe decodes the batch's samples to find the bad one, and one of
    them kills its decoder: that one is skipped (or named), this process lives."""
    pytest.importorskip("nvidia.dali")
    bad = truncated_jpeg(1)  # DALI fails on it: the batch is searched
    urls = write_webdataset_shards(str(tmp_path), (8,), prefix="d", patch={1: {"jpg": bad}, 2: {"jpg": crasher()}})
    pipe = gp.Pipeline(urls, [gp.transforms.Resize((16, 16))])
    with gp.Loader(pipe, 4, backend="dali", device="cpu", on_error="skip", max_skipped=None) as loader:
        valid = [v for b in loader for v in b.valid.tolist()]
        skipped = {s.key: str(s.kind) for s in loader.skipped}
    assert skipped == {"img/00/000001": "undecodable", "img/00/000002": "undecodable"} and valid.count(True) == 6
