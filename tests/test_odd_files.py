"""One verdict per file (issues 24 and 36): the generated corpus of odd files
(``tests/support/corpus.py``: other formats named ``.jpg``, animations, damaged PNGs that crash
torchvision's decoder, lossless and 12-bit JPEGs, decompression bombs, files DALI's decoders refuse
and gpupipe's reads, several bad files in one batch and in the short last one) through every
backend at batch sizes 1, 16 and 64, under ``skip`` and ``raise``, each run in a child process so
that a crash fails a test instead of ending the test run: every good file delivered, exactly the
bad ones skipped with the same kinds on every backend, batch size and DALI decode, ``raise``
naming the first bad file, and ``gpupipe check`` listing exactly the set the loaders skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpupipe import backends

from .support.corpus import RUN, write_shard

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> tuple[str, dict[str, str | None]]:
    path = str(tmp_path_factory.mktemp("corpus") / "corpus-000000.tar")
    return path, write_shard(path)


def run(args: list[str], timeout: float = 300) -> dict:
    """A corpus run in a child process; its result (a crash fails the test, naming the signal)."""
    out = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, f"the loader's process died ({out.returncode}): {out.stderr[-2000:]}"
    return json.loads(line.removeprefix("RESULT "))


BACKENDS = [name for name in ("torch", "dali") if backends.get(name).available()]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_leaves_out_exactly_the_bad_files(shard, backend, batch, workers):
    if backend == "dali" and workers == 0:
        pytest.skip("DALI has no in-process mode: its threads are the workers")
    path, verdicts = shard
    result = run([path, backend, str(batch), "skip", str(workers)])
    bad = {key: verdict for key, verdict in verdicts.items() if verdict}
    assert result["skipped"] == bad
    assert sorted(result["delivered"]) == sorted(k for k, v in verdicts.items() if v is None)


@pytest.mark.skipif("dali" not in BACKENDS, reason="needs DALI")
@pytest.mark.parametrize(("decode", "batch"), [("center", 16), ("center", 64), ("resize", 1), ("resize", 64)])
def test_dali_skips_the_same_whatever_it_decodes(shard, decode, batch):
    """Resize + CenterCrop and Resize((h, w)) decode whole images (not a region): the same verdicts."""
    path, verdicts = shard
    result = run([path, "dali", str(batch), "skip", "1", "cpu", decode])
    assert result["skipped"] == {key: verdict for key, verdict in verdicts.items() if verdict}
    assert sorted(result["delivered"]) == sorted(k for k, v in verdicts.items() if v is None)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_the_gpu_reaches_the_same_verdicts(shard, batch, on_error):
    """DALI on the GPU (nvJPEG, the mixed decoders): the same files skipped, the same first raised."""
    path, verdicts = shard
    result = run([path, "dali", str(batch), on_error, "2", "cuda"])
    bad = {key: verdict for key, verdict in verdicts.items() if verdict}
    if on_error == "skip":
        assert result["skipped"] == bad
    else:
        first = next(iter(bad))
        assert result["raised"]["key"] == first and result["raised"]["kind"] == bad[first]


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_raise_names_the_first_bad_file(shard, backend, batch):
    path, verdicts = shard
    result = run([path, backend, str(batch), "raise", "1"])
    first = next(key for key, verdict in verdicts.items() if verdict)
    assert result["raised"]["key"] == first and result["raised"]["kind"] == verdicts[first]
    if batch == 1:  # every file before it delivered: those DALI's decoders refuse too
        assert result["delivered"] == list(verdicts)[: list(verdicts).index(first)]


def test_check_lists_the_set_the_loaders_skip(shard):
    path, verdicts = shard
    argv = [sys.executable, "-m", "gpupipe", "check", path, "--json", "--no-write", "--workers", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert {f["key"]: f["kind"] for f in report["findings"]} == {k: v for k, v in verdicts.items() if v}
