"""Processes: no worker gpupipe starts can hang the run or outlive it. A worker that dies is
raised with its exit code; Ctrl-C stops an epoch (or ``gpupipe check``) within seconds and leaves
no process behind; a parent killed outright (``kill -9``, the out-of-memory killer) leaves no
orphan. The signal tests run the loader in a subprocess of its own session and look for every
process of that session afterwards."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.runtime._children import POLL_S, exit_status, process_pool
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import crasher, make_decoders_crash

ROOT = os.path.join(os.path.dirname(__file__), "..")
PROMPT_S = 10.0  # "within a few seconds", with room for a loaded CI machine


@dataclasses.dataclass(frozen=True)
class _KillWorker(T.ArrayFunction):
    """Kills the process it runs in (SIGKILL, as the out-of-memory killer does) unless that is
    ``parent``: every torch-backend worker dies on its first sample."""

    parent: int = 0

    def apply(self, x, xp):
        if os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


@dataclasses.dataclass(frozen=True)
class _CrashOnce(T.ArrayFunction):
    """Crashes (SIGSEGV) the worker that first meets a sample whose image starts with ``value`` at
    pixel (0, 0): a fault from outside the data (the flag file makes it happen once)."""

    flag: str = ""

    def apply(self, x, xp):
        if not os.path.exists(self.flag) and int(x[0, 0, 0]) == 255:
            open(self.flag, "w").close()
            os.kill(os.getpid(), signal.SIGSEGV)
        return x


@dataclasses.dataclass(frozen=True)
class _CrashLater(T.ArrayFunction):
    """Crashes (SIGSEGV) its worker a second after meeting a white sample, every time: while the
    loop's step runs, not while it waits in ``next()``."""

    def apply(self, x, xp):
        if int(x[0, 0, 0]) == 255:
            import time

            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGSEGV)
        return x


@pytest.fixture
def crashing_decoder(monkeypatch):
    from gpupipe.backends._torch import _persample

    make_decoders_crash(monkeypatch, _persample)


class TestCrashedWorkers:
    """A torch-backend worker that crashes (SIGSEGV) mid-epoch is replaced and the epoch goes on:
    the sample that crashed it, found by running the samples in flight again in a sandbox, is
    left out under ``skip`` (raised under ``raise``), and a crash no sample repeats is taken as
    transient."""

    def test_the_sample_that_crashes_a_worker_is_skipped(self, crashing_decoder, tmp_path):
        from .support.data import write_webdataset_shards

        urls = write_webdataset_shards(str(tmp_path), (16,), prefix="crash", patch={5: {"jpg": crasher()}})
        pipe = gp.Pipeline(urls, [T.Resize((16, 16)), T.ToDtype(__import__("torch").float32)])
        options = dict(backend="torch", device="cpu", num_workers=2, on_error="skip", max_skipped=None)
        with gp.Loader(pipe, 4, **options) as loader:
            for epoch in range(2):  # the second epoch knows it: no crash
                loader.set_epoch(epoch)
                keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
                assert sorted(keys) == sorted(f"img/00/{n:06d}" for n in range(16) if n != 5)
            (skipped,) = loader.skipped
        assert skipped.key == "img/00/000005" and skipped.kind == "undecodable"
        assert "cannot be decoded: it killed the process decoding it" in skipped.reason and "SIGSEGV" in skipped.reason
        with (
            gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2) as loader,
            pytest.raises(gp.SampleError, match=r"img/00/000005.*killed the process decoding it") as info,
        ):
            list(loader)
        assert info.value.key == "img/00/000005"

    def test_a_crash_no_sample_repeats_is_transient(self, shards, tmp_path):
        white = np.full((24, 32, 3), 255, np.uint8)
        from .support.data import write_webdataset_shards

        urls = write_webdataset_shards(str(tmp_path), (12,), prefix="once", patch={7: {"jpg": encode_jpeg(white)}})
        pipe = gp.Pipeline(urls, [T.Resize((16, 16)), _CrashOnce(flag=str(tmp_path / "crashed"))])
        with gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2, on_error="skip") as loader:
            keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
            assert sorted(keys) == [f"img/00/{n:06d}" for n in range(12)] and not loader.skipped
        assert os.path.exists(tmp_path / "crashed")  # it did crash a worker


class TestCrashesAnywhere:
    """PyTorch's SIGCHLD check raised "DataLoader worker is killed by signal" wherever the main
    thread was: a crash while the training step ran (not inside ``next()``) ended the epoch, as
    did a persistent worker that died between epochs (found by a review, 2026-11-29). gpupipe's
    workers are off that check: a death is found where the loop waits, at each poll."""

    def test_a_crash_while_the_step_runs_is_recovered(self, tmp_path):
        import time

        from .support.data import write_webdataset_shards

        white = np.full((24, 32, 3), 255, np.uint8)
        urls = write_webdataset_shards(str(tmp_path), (16,), prefix="busy", patch={9: {"jpg": encode_jpeg(white)}})
        pipe = gp.Pipeline(urls, [T.Resize((16, 16)), _CrashLater()])
        with gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2, on_error="skip",
                       max_skipped=None) as loader:  # fmt: skip
            keys = []
            for i, batch in enumerate(loader):
                keys += [k for k, v in zip(batch.keys, batch.valid.tolist(), strict=True) if v]
                if i == 0:
                    time.sleep(3.0)  # the training step: the crash comes meanwhile
            assert len(keys) == 15 and [s.key for s in loader.skipped] == ["img/00/000009"]

    def test_a_worker_dead_between_epochs_is_replaced(self, shards, monkeypatch, caplog):
        from gpupipe.backends._torch import _runner

        monkeypatch.setattr(_runner, "START_TIMEOUT", 3.0)
        with gp.Loader(gp.Pipeline(shards, [T.Resize((16, 16))]), 4, backend="torch", device="cpu",
                       num_workers=2) as loader:  # fmt: skip
            assert len(list(loader)) == 4
            worker = loader._runner._loader._iterator._workers[0]  # type: ignore[attr-defined]
            os.kill(worker.pid, signal.SIGSEGV)
            worker.join(10)
            loader.set_epoch(1)
            assert len(list(loader)) == 4
        assert "between epochs" in caplog.text


def _local_error() -> type[Exception]:
    class Local(Exception):  # (made in a function: pickle cannot name it)
        pass

    return Local


_LOCAL = _local_error()


@dataclasses.dataclass(frozen=True)
class _RaiseLocal(T.ArrayFunction):
    def apply(self, x, xp):
        if int(x[0, 0, 0]) == 255:
            raise _LOCAL("boom")
        return x


def test_an_error_of_a_type_pickle_cannot_name_reaches_the_loop(tmp_path):
    """A worker's exception whose type cannot be pickled was dropped on its way: the loop waited
    worker_timeout, twice, then called the workers stuck (found by a review, 2026-11-29)."""
    import time

    from .support.data import write_webdataset_shards

    white = np.full((24, 32, 3), 255, np.uint8)
    urls = write_webdataset_shards(str(tmp_path), (8,), prefix="local", patch={5: {"jpg": encode_jpeg(white)}})
    started = time.monotonic()
    pipe = gp.Pipeline(urls, [T.Resize((16, 16)), _RaiseLocal()])
    loader = gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2, worker_timeout=60)
    with loader, pytest.raises(gp.GpupipeError, match=r"Local: boom .*cannot be sent"):
        list(loader)
    assert time.monotonic() - started < 30


class TestDeadWorkers:
    def test_a_torch_worker_is_reported_with_its_exit_code(self, shards):
        pipe = gp.Pipeline(shards, [T.Resize(24), T.CenterCrop(16), _KillWorker(parent=os.getpid())])
        loader = gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2)
        started = time.monotonic()
        with pytest.raises(gp.WorkerError, match=r"died with exit code -9 \(killed by SIGKILL\).*epoch 0, batch 0"):
            list(loader)
        assert time.monotonic() - started < PROMPT_S
        with pytest.raises(gp.WorkerError) as info:  # the next epoch starts new workers (which die too)
            list(loader)
        assert info.value.exitcode == -9 and info.value.pid is not None and isinstance(info.value, RuntimeError)
        loader.close()
        assert not multiprocessing.active_children()

    def test_a_pool_process_is_reported_with_its_exit_code(self):
        died = r"gpupipe test: a worker process \(pid \d+\) died with exit code 3"
        with pytest.raises(gp.WorkerError, match=died), process_pool(2, "gpupipe test") as pool:
            list(pool.map(os._exit, [3, 3]))
        assert not multiprocessing.active_children()

    def test_exit_status_in_words(self):
        assert exit_status(3) == "exit code 3"
        assert exit_status(-9) == "exit code -9 (killed by SIGKILL)"
        assert exit_status(None) == "an unknown status"


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded: already ended)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(pid))
    return found


def _signal_masks(pid: int) -> dict:
    """Whether SIGINT is blocked or ignored in process ``pid``, and the masks of it and of this
    process's threads (a blocked or ignored signal is inherited through fork and exec)."""

    def status(path: str) -> dict[str, int]:
        with open(path) as f:
            return {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigBlk", "SigIgn")}

    bit = 1 << (signal.SIGINT - 1)
    child = status(f"/proc/{pid}/status")
    ours = {tid: status(f"/proc/self/task/{tid}/status") for tid in os.listdir("/proc/self/task")}
    return {"blocked or ignored": bool((child["SigBlk"] | child["SigIgn"]) & bit), "child": child,
            "this process's main thread": ours.get(str(os.getpid())),
            "threads here with SIGINT blocked": sum(bool(m["SigBlk"] & bit) for m in ours.values())}  # fmt: skip


def _interrupt(argv: list[str], sig: signal.Signals, *, group: bool, ready) -> tuple[int, float, list[int]]:
    """Starts ``argv`` in a session of its own, waits until ``ready(proc)``, sends ``sig`` (to the
    whole process group, as a terminal's Ctrl-C does, or to the parent alone, as ``kill -9`` or
    the OOM killer does) and returns the exit status, the seconds until every process of the
    session was gone, and those still alive after ``PROMPT_S``."""
    stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in the finally below
    if argv[1:2] == ["-c"]:  # Python: on SIGABRT its stacks go to stderr (kept for a hang's report)
        argv = [argv[0], "-X", "faulthandler", *argv[1:]]
    # A test session started with Ctrl-C ignored (`make test &`, nohup) would pass that on through
    # exec: with a handler here instead, the child starts with Ctrl-C as a terminal gives it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        ready(proc)
        masks = _signal_masks(proc.pid)
        assert sig != signal.SIGINT or not masks["blocked or ignored"], f"SIGINT cannot reach the child: {masks}"
        sent = time.monotonic()
        (os.killpg if group else os.kill)(proc.pid, sig)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # hung: its stacks, then the failure
            os.kill(proc.pid, signal.SIGABRT)
            time.sleep(2)
            stderr.seek(0)
            raise AssertionError(f"no exit within 60 s of {sig.name}; its stacks:\n{stderr.read()[-6000:]}") from None
        left = _session(proc.pid)
        while left and time.monotonic() - sent < PROMPT_S:
            time.sleep(0.05)
            left = _session(proc.pid)
        return code, time.monotonic() - sent, left
    finally:
        for pid in [proc.pid, *_session(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()


EPOCHS = textwrap.dedent("""
    import sys, torch, gpupipe as gp
    from gpupipe import transforms as T
    backend, workers, shards = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    pipe = gp.Pipeline(shards, [T.RandomResizedCrop(32), T.ToDtype(torch.float32, scale=True)])
    loader = gp.Loader(pipe, 2, backend=backend, device="cpu", num_workers=workers, shuffle=True)
    for epoch in range(10**6):
        loader.set_epoch(epoch)
        for n, batch in enumerate(loader):
            if epoch == 1 and n == 0:
                print("running", flush=True)
""")


def _printed_running(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "running"


class TestSignals:
    @pytest.mark.parametrize(("backend", "workers"), [("torch", 2), ("dali", 2)])
    def test_ctrl_c_during_an_epoch_ends_everything_within_seconds(self, shards, backend, workers):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        argv = [sys.executable, "-c", EPOCHS, backend, str(workers), *shards]
        code, took, left = _interrupt(argv, signal.SIGINT, group=True, ready=_printed_running)
        assert code in (-signal.SIGINT, 1) and not left  # KeyboardInterrupt's traceback: status 1 or -2
        assert took < PROMPT_S

    def test_a_killed_parent_leaves_no_torch_worker(self, shards):
        argv = [sys.executable, "-c", EPOCHS, "torch", "2", *shards]
        code, took, left = _interrupt(argv, signal.SIGKILL, group=False, ready=_printed_running)
        assert code == -signal.SIGKILL and not left
        assert took < 2 + 4 * POLL_S  # gpupipe's watch; PyTorch's own notices only every 5 s


@pytest.fixture(scope="module")
def slow_shards(tmp_path_factory) -> list[str]:
    """4 shards of 60 copies of one 1600x1600 JPEG: ``gpupipe check`` takes seconds over them."""
    big = encode_jpeg(synthetic_image(0, size=(1600, 1600)), quality=90)
    with gp.ShardWriter(str(tmp_path_factory.mktemp("slow") / "slow-%d.tar"), max_count=60) as w:
        for n in range(240):
            w.write(f"s{n:04d}", {"jpg": big, "cls": n % 3})
    return w.shards


def _checking(proc: subprocess.Popen) -> None:
    """Returns once the check's 2 worker processes are busy."""
    deadline = time.monotonic() + 60
    while len(_session(proc.pid)) < 3:  # the CLI, its 2 workers (and spawn's resource tracker)
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)


class TestCheckSignals:
    def test_ctrl_c_ends_the_check_and_its_workers(self, slow_shards):
        argv = [sys.executable, "-m", "gpupipe", "check", "--no-write", "--quiet", "--workers", "2", *slow_shards]
        code, took, left = _interrupt(argv, signal.SIGINT, group=True, ready=_checking)
        assert code == 130 and not left and took < PROMPT_S

    def test_a_killed_check_leaves_no_worker(self, slow_shards):
        argv = [sys.executable, "-m", "gpupipe", "check", "--no-write", "--quiet", "--workers", "2", *slow_shards]
        code, took, left = _interrupt(argv, signal.SIGKILL, group=False, ready=_checking)
        assert code == -signal.SIGKILL and not left and took < PROMPT_S


def test_a_dead_worker_is_named_by_its_signal():
    """A worker killed by SIGSEGV crashed (a decoder on a damaged file, most often), one killed by
    SIGKILL most likely met the out-of-memory killer: the message says which, not one for both."""
    import signal

    from gpupipe.runtime._children import death_cause

    assert "crashed in native code" in death_cause(-signal.SIGSEGV) and "gpupipe check" in death_cause(-signal.SIGSEGV)
    assert "out-of-memory killer" in death_cause(-signal.SIGKILL)
    assert "out-of-memory" not in death_cause(-signal.SIGSEGV) and "num_workers=0" in death_cause(3)


@dataclasses.dataclass(frozen=True)
class _HangOn(T.ArrayFunction):
    """Never returns on a white image (a decoder stuck on a file); once only, with ``flag``."""

    flag: str = ""

    def apply(self, x, xp):
        if int(x[0, 0, 0]) == 255 and not (self.flag and os.path.exists(self.flag)):
            if self.flag:
                open(self.flag, "w").close()
            time.sleep(3600)
        return x


class TestStuckWorkers:
    """A torch-backend worker that delivers nothing within ``worker_timeout`` is taken as stuck:
    its Python stack is logged, the sample that hangs (run again alone in a sandbox, which times
    out too) is refused, and new workers finish the epoch; a stall no sample repeats is transient."""

    def _urls(self, tmp_path):
        from .support.data import write_webdataset_shards

        white = np.full((24, 32, 3), 255, np.uint8)
        return write_webdataset_shards(str(tmp_path), (12,), prefix="hang", patch={6: {"jpg": encode_jpeg(white)}})

    def test_the_sample_that_hangs_is_refused_and_the_epoch_finishes(self, tmp_path, caplog):
        pipe = gp.Pipeline(self._urls(tmp_path), [T.Resize((16, 16)), _HangOn()])
        options = dict(backend="torch", device="cpu", num_workers=2, on_error="skip", max_skipped=None)
        started = time.monotonic()
        with gp.Loader(pipe, 4, worker_timeout=2.0, **options) as loader:
            keys = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
            (skipped,) = loader.skipped
        assert sorted(keys) == [f"img/00/{n:06d}" for n in range(12) if n != 6]
        assert skipped.key == "img/00/000006" and "did not finish in 2 s" in skipped.reason
        assert "no batch from the workers in 2.0 s" in caplog.text and "in apply" in caplog.text  # the stack
        assert time.monotonic() - started < 60

    def test_a_stall_no_sample_repeats_is_transient(self, tmp_path):
        pipe = gp.Pipeline(self._urls(tmp_path), [T.Resize((16, 16)), _HangOn(flag=str(tmp_path / "hung"))])
        with gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2, worker_timeout=2.0) as loader:
            keys = [k for b in loader for k in b.keys]
        assert sorted(keys) == [f"img/00/{n:06d}" for n in range(12)] and os.path.exists(tmp_path / "hung")

    def test_the_option(self):
        assert gp.LoaderConfig(4).worker_timeout == 600.0 and gp.LoaderConfig(4, worker_timeout=None)
        with pytest.raises(gp.ConfigError, match="worker_timeout must be None or a number of seconds > 0"):
            gp.LoaderConfig(4, worker_timeout=0)


@dataclasses.dataclass(frozen=True)
class _SlowFirst(T.ArrayFunction):
    """Takes ``seconds`` on sample 0's white image: a slow first batch from workers that started."""

    seconds: float = 2.5

    def apply(self, x, xp):
        if int(x[0, 0, 0]) == 255:
            time.sleep(self.seconds)
        return x


class TestWorkersFrozenAtBirth:
    """A torch-backend worker frozen inside fork (CPython gh-112275 before 3.11.10) never runs
    its init: it is found within START_TIMEOUT, not worker_timeout, killed, and new workers run
    the epoch, with no sample blamed; a slow first batch from workers that started is waited for."""

    @staticmethod
    def _freeze(monkeypatch, tmp_path, *, every: bool = False):
        from gpupipe.backends._torch import _runner
        from gpupipe.runtime import _children

        marker = tmp_path / "frozen"

        def birth(*_):
            if every or not marker.exists():
                marker.touch()
                time.sleep(3600)  # as frozen in fork: the worker's own code never runs

        monkeypatch.setattr(_children, "exit_with_parent", birth)
        monkeypatch.setattr(_runner, "START_TIMEOUT", 1.0)

    def _urls(self, tmp_path):
        from .support.data import write_webdataset_shards

        white = np.full((24, 32, 3), 255, np.uint8)
        return write_webdataset_shards(str(tmp_path), (12,), prefix="birth", patch={0: {"jpg": encode_jpeg(white)}})

    def test_a_worker_frozen_at_birth_is_replaced_and_no_sample_blamed(self, monkeypatch, tmp_path, caplog):
        self._freeze(monkeypatch, tmp_path)
        pipe = gp.Pipeline(self._urls(tmp_path), [T.Resize((16, 16))])
        started = time.monotonic()
        with gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=2, worker_timeout=120.0) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                keys = [k for b in loader for k in b.keys]
                assert sorted(keys) == [f"img/00/{n:06d}" for n in range(12)] and not loader.skipped
        assert time.monotonic() - started < 60  # not worker_timeout's 120 s
        (record,) = [r for r in caplog.records if "never started" in r.getMessage()]
        assert "1 of 3 in a row" in record.getMessage() and "gh-112275" in record.getMessage()

    def test_workers_that_never_start_raise_a_worker_error(self, monkeypatch, tmp_path):
        self._freeze(monkeypatch, tmp_path, every=True)
        pipe = gp.Pipeline(self._urls(tmp_path), [T.Resize((16, 16))])
        with (
            gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=1) as loader,
            pytest.raises(gp.WorkerError, match=r"never started.*3 of 3 in a row.*Giving up"),
        ):
            list(loader)

    def test_a_slow_first_batch_is_waited_for(self, monkeypatch, tmp_path, caplog):
        from gpupipe.backends._torch import _runner

        monkeypatch.setattr(_runner, "START_TIMEOUT", 1.0)
        pipe = gp.Pipeline(self._urls(tmp_path), [T.Resize((16, 16)), _SlowFirst()])
        with gp.Loader(pipe, 4, backend="torch", device="cpu", num_workers=1, worker_timeout=60.0) as loader:
            keys = [k for b in loader for k in b.keys]
        assert sorted(keys) == [f"img/00/{n:06d}" for n in range(12)] and not loader.skipped
        assert "never started" not in caplog.text and "no batch from the workers" not in caplog.text
