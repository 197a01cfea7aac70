"""``loader.stats()["bound"]``: what limits a loader, and the change that would help. The rule on
made-up figures, then four bottlenecks planted in a real loader on the torch backend (a slow
training step, slow storage, large JPEGs decoded by one worker, a heavy CPU transform)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.loader._verdict import BOUNDS, STALL_OK, StageTimes, verdict

from .support.data import write_webdataset_shards


def stall(share: float, batches: int = 10, period: float = 0.1) -> dict:
    wait = share * period * batches
    return {"batches": batches, "wait_s": wait, "step_s": period * batches - wait, "stall": share}


def times(read=0.0, decode=0.0, transform=0.0, collate=0.0, stage=None, batches=10) -> dict:
    return {"batches": batches, "read_s": read, "decode_s": decode, "transform_s": transform, "collate_s": collate,
            "stage_s": stage}  # fmt: skip


class TestTheRule:
    def test_nothing_measured_yet(self):
        assert verdict({"stall": None, "batches": 0}, times(), workers=2)["bound"] is None

    def test_no_stall_is_the_model(self):
        got = verdict(stall(STALL_OK), times(decode=1.0), workers=2)
        assert got["bound"] == "model" and "a faster loader would not train faster" in got["remedy"]

    @pytest.mark.parametrize("stage, name, remedy", [
        ("read", "storage", "node cache"), ("decode", "decode", "device='cuda'"),
        ("transform", "transforms", "device stage"), ("collate", "collate", "num_workers"),
    ])  # fmt: skip
    def test_the_slowest_stage_of_the_workers(self, stage, name, remedy):
        spent = {"read": 0.01, "decode": 0.01, "transform": 0.01, "collate": 0.01, stage: 0.15}
        got = verdict(stall(0.6), times(**spent), workers=2)
        assert got["bound"] == name and remedy in got["remedy"] and "waited 60% of its time" in got["why"]
        assert f"{0.15 / 0.18:.0%}" in got["why"] and got["stall"] == 0.6

    def test_the_device_stage(self):
        got = verdict(stall(0.5), times(decode=0.05, stage=0.03), workers=2)  # wait 50 ms, stage 30
        assert got["bound"] == "stage" and "stage=False" in got["remedy"]

    def test_workers_with_time_to_spare_point_at_the_training_thread(self):
        got = verdict(stall(0.5), times(decode=0.01), workers=4)  # 400 batches/s against 10/s
        assert got["bound"] == "main" and "prefetch" in got["remedy"]

    def test_without_workers_the_stages_are_the_training_threads_wait(self):
        """num_workers=0: the training thread makes each batch while the loop waits, so a long step
        does not make a slow stage the training thread's share (no prefetch without workers)."""
        got = verdict(stall(0.5, period=0.16), times(decode=0.07, transform=0.01), workers=0)  # wait 80 ms
        assert got["bound"] == "decode" and "num_workers=0" in got["why"] and "num_workers" in got["remedy"]
        got = verdict(stall(0.5, period=0.16), times(decode=0.01), workers=0)  # 10 of the 80 ms
        assert got["bound"] == "main" and "prefetch" not in got["remedy"]

    @pytest.mark.parametrize("read, graph, bound", [(0.04, 0.01, "storage"), (0.01, 0.04, "graph"),
                                                    (0.005, 0.005, "main")])  # fmt: skip
    def test_the_dali_backends_waits(self, read, graph, bound):
        """DALI: the training thread's waits for the reader threads' batches and for the graph
        (the loop waits 50 ms per batch)."""
        got = verdict(stall(0.5), {"batches": 10, "wait_read_s": read, "wait_graph_s": graph, "stage_s": None},
                      workers=4)  # fmt: skip
        assert got["bound"] == bound

    def test_the_batch_transform_alone_on_the_training_thread(self):
        got = verdict(stall(0.5), {**times(decode=0.05), "mix_s": 0.03}, workers=2)  # wait 50 ms, mix 30
        assert got["bound"] == "main" and "MixUp/CutMix take 30.0 ms per batch" in got["why"]
        assert "stage=False" not in got["remedy"] and "workers" in got["remedy"]

    def test_reads_that_waited_for_downloads(self):
        """Remote shards: the node cache's misses named, with their wait, on either backend."""
        counted = {"read_bytes": 4e6, "cache_hits": 60.0, "cache_misses": 4.0, "wait_download_s": 0.12}
        got = verdict(stall(0.6), {**times(read=0.15, decode=0.01), **counted}, workers=2)
        assert got["bound"] == "storage"
        assert "4.0 of the 64.0 reads of remote shards per batch waited for a shard's download (120.0 ms)" in got["why"]
        assert "shards_ahead" in got["why"]
        dali = {"batches": 10, "wait_read_s": 0.04, "wait_graph_s": 0.01, "stage_s": None, **counted}
        got = verdict(stall(0.5), dali, workers=4)
        assert got["bound"] == "storage" and "waited for a shard's download" in got["why"]
        local = verdict(stall(0.6), {**times(read=0.15, decode=0.01), "read_bytes": 4e6}, workers=2)
        assert "download" not in local["why"]

    def test_a_full_queue_is_said_where_the_training_thread_is_the_limit(self):
        queued = {"queue_ready": 3.5, "queue_depth": 4.0}
        got = verdict(stall(0.5), {**times(decode=0.01), **queued}, workers=4)
        assert got["bound"] == "main" and "its queue held 3.5 of 4 batches ready when the loop asked" in got["why"]
        dali = {"batches": 10, "wait_read_s": 0.005, "wait_graph_s": 0.005, "stage_s": None, **queued}
        assert "3.5 of 4 batches ready" in verdict(stall(0.5), dali, workers=4)["why"]

    def test_the_remedies_name_real_options(self):
        """Every ``name=``-style option a remedy names is a Loader option (or DaliOptions'): a
        reader who follows it must find it."""
        import dataclasses
        import re

        from gpupipe.loader._verdict import _REMEDY

        options = {f.name for c in (gp.LoaderConfig, gp.DaliOptions) for f in dataclasses.fields(c)}
        named = {name for remedy in _REMEDY.values() for name in re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", remedy)}
        assert named and named <= options, named - options
        got = verdict(stall(0.6), times(read=0.01, decode=0.15), workers=2)
        assert got["bound"] == "decode" and "max_image_pixels" in got["remedy"]

    def test_a_backend_without_stage_times(self):
        got = verdict(stall(0.5), {"batches": 0, "stage_s": None}, workers=8)
        assert got["bound"] == "loader" and "gpupipe tune" in got["remedy"]


class TestStageTimes:
    def test_the_first_batch_is_left_out_and_the_rest_averaged(self):
        t = StageTimes()
        t.add({"read": 9.0, "decode": 9.0, "transform": 9.0, "collate": 9.0}, 9.0)
        t.add({"read": 1.0, "decode": 2.0, "transform": 3.0, "collate": 4.0}, None)
        t.add({"read": 3.0, "decode": 2.0, "transform": 1.0, "collate": 0.0}, None)
        assert t.stats() == {"batches": 2, "read_s": 2.0, "decode_s": 2.0, "transform_s": 2.0, "collate_s": 2.0,
                             "wait_read_s": None, "wait_graph_s": None, "h2d_s": None, "stage_s": None, "mix_s": None,
                             "read_bytes": None, "cache_hits": None, "cache_misses": None,
                             "wait_download_s": None, "queue_ready": None, "queue_depth": None}  # fmt: skip
        t.begin()
        assert t.stats()["batches"] == 0 and t.stats()["read_s"] is None

    def test_each_batch_kept_for_a_profile(self):
        t = StageTimes(keep=True)
        t.add({"read": 9.0, "decode": 8.0}, 7.0)
        t.add({"read": 1.0, "decode": 2.0, "other": 5.0}, None)
        assert t.history == [{"read": 9.0, "decode": 8.0, "stage": 7.0}, {"read": 1.0, "decode": 2.0}]
        t.begin()
        assert t.history == [] and StageTimes().keep is False


class TestCopyClock:
    """The torch backend's host-to-device copies on a GPU, timed by CUDA events read once the
    device has passed them, never waited on (here with stand-in events: the order, not a GPU)."""

    @pytest.fixture
    def events(self, monkeypatch):
        """Stand-in CUDA events: each recorded at the next tick; ``done`` events report as done."""
        from gpupipe.backends import _copies

        clock = {"now": 0.0, "done": 0}
        made: list = []

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at, self.index = 0.0, len(made)
                made.append(self)

            def record(self, stream) -> None:
                clock["now"] += 1.5
                self.at = clock["now"]

            def query(self) -> bool:
                return self.index < clock["done"]

            def elapsed_time(self, end) -> float:  # milliseconds, as CUDA's
                return end.at - self.at

        monkeypatch.setattr(_copies.torch.cuda, "Event", Event)
        monkeypatch.setattr(_copies.torch.cuda, "current_stream", lambda device=None: None)
        return clock

    def test_a_batch_reports_the_latest_copies_done_and_never_waits(self, events):
        from gpupipe.backends._copies import CopyClock

        clock = CopyClock(torch.device("cuda"))
        assert clock.stop(clock.start()) is None  # its events not passed yet: nothing
        events["done"] = 2  # the first batch's two events passed
        assert clock.stop(clock.start()) == pytest.approx(1.5e-3)
        events["done"] = 6
        assert clock.stop(clock.start()) == pytest.approx(1.5e-3)  # the latest of those done
        assert len(clock._pending) == 0

    def test_what_is_kept_is_bounded(self, events):
        from gpupipe.backends._copies import _PENDING, CopyClock

        clock = CopyClock(torch.device("cuda"))
        for _ in range(_PENDING * 2):
            clock.stop(clock.start())
        assert len(clock._pending) == _PENDING

    @pytest.mark.gpu
    @pytest.mark.parametrize("backend", ["torch", "ray"])
    def test_on_a_gpu_the_backend_times_its_copies(self, shards, backend, request):
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        if backend == "ray":
            pytest.importorskip("ray")
            request.getfixturevalue("ray_session")
        with gp.Loader(gp.Pipeline(shards, [T.CenterCrop(16)]), 4, backend=backend, device="cuda",
                       num_workers=1) as loader:  # fmt: skip
            for epoch in range(2):
                loader.set_epoch(epoch)
                for _ in loader:
                    torch.cuda.synchronize()
            assert loader.stats()["times"]["h2d_s"] > 0


def epoch_verdict(pipeline: gp.Pipeline, *, step: float = 0.0, epochs: int = 1, batch_size: int = 4,
                  backend: str = "torch", **options) -> dict:  # fmt: skip
    """The stats after the last of ``epochs`` epochs, the loop sleeping ``step`` per batch."""
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    with gp.Loader(pipeline, batch_size, backend=backend, device="cpu", **options) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for _ in loader:
                if step:
                    time.sleep(step)
        return loader.stats()


class TestPlanted:
    """Each bottleneck planted in a loader on the 2-core machine, and the verdict that names it.
    The loop does nothing but iterate (a loader-bound run) except where the step is the plant."""

    def test_a_slow_training_step(self, shards):
        got = epoch_verdict(gp.Pipeline(shards, [T.CenterCrop(16)]), step=0.1, epochs=2, batch_size=2, num_workers=1)
        assert got["bound"]["bound"] == "model", got  # (the second epoch: its worker warm, 7 batches measured)
        assert got["times"]["queue_depth"] == 2 and got["times"]["queue_ready"] >= 1  # the queue ran full

    def test_slow_storage(self, shards, monkeypatch):
        from gpupipe.storage import LocalStorage

        real = LocalStorage.read

        def slow(self, *args, **kwargs):
            time.sleep(0.02)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(LocalStorage, "read", slow)  # (forked workers inherit it)
        got = epoch_verdict(gp.Pipeline(shards, [T.CenterCrop(16)]), num_workers=1)
        assert got["bound"]["bound"] == "storage", got
        assert got["times"]["queue_ready"] < 0.5  # and empty: the loop took each batch as it came
        assert got["times"]["read_s"] >= 4 * 0.02  # four samples a batch
        assert got["times"]["read_bytes"] > 4 * 500 and "MB per batch at" in got["bound"]["why"]  # (JPEG bytes)

    def test_large_jpegs_and_one_worker(self, tmp_path):
        rng = np.random.default_rng(0)
        large = write_webdataset_shards(str(tmp_path), (12,), image=lambda n: rng.integers(0, 255, (1200, 1600, 3),
                                                                                         dtype=np.uint8))  # fmt: skip
        got = epoch_verdict(gp.Pipeline(large, [T.CenterCrop(16)]), num_workers=1)
        assert got["bound"]["bound"] == "decode", got

    def test_a_heavy_cpu_transform(self, shards):
        heavy = [T.Resize((384, 384)), T.GaussianBlur(41, sigma=5.0), T.CenterCrop(16)]
        got = epoch_verdict(gp.Pipeline(shards, heavy), num_workers=1)
        assert got["bound"]["bound"] == "transforms", got
        assert got["times"]["transform_s"] > got["times"]["decode_s"] and got["times"]["stage_s"] is None

    def test_a_stage_of_the_batch_transform_alone_is_timed_as_the_mix(self, shards):
        """DALI on the CPU (no tail staged) with MixUp: the training thread's mix, not a device
        stage that ``stage=False`` would move."""
        pytest.importorskip("nvidia.dali")
        pipe = gp.Pipeline(shards, [T.CenterCrop(16), T.ToDtype(torch.float32, scale=True)],
                           batch_transform=T.MixUp(num_classes=10))  # fmt: skip
        got = epoch_verdict(pipe, backend="dali", num_workers=1)
        assert got["times"]["stage_s"] is None and got["times"]["mix_s"] > 0

    def test_the_stage_is_timed_where_it_runs(self, shards, monkeypatch):
        """In the training thread (a backend that hands it the batches: the inline test backend),
        the stage's own clock; in the torch backend's workers on the CPU, with the transforms
        (run batched there), apart from the stacking."""
        from gpupipe import backends
        from gpupipe.backends._stage import _delivered

        monkeypatch.setitem(backends.TABLE, "inline", "tests.support.inline_backend")
        steps = [T.CenterCrop(16), T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True)]
        got = epoch_verdict(gp.Pipeline(shards, steps), backend="inline", num_workers=0, stage=True)
        assert got["times"]["stage_s"] is not None and got["times"]["stage_s"] > 0
        real = _delivered.Stage.finish

        def slow(*args, **kwargs):
            time.sleep(0.05)
            return real(*args, **kwargs)

        monkeypatch.setattr(_delivered.Stage, "finish", slow)
        got = epoch_verdict(gp.Pipeline(shards, steps), num_workers=1, stage=True)
        assert got["times"]["stage_s"] is None
        assert got["times"]["transform_s"] >= 0.05 > got["times"]["collate_s"]


class TestPlantedOnDali:
    """The DALI backend (its CPU operators) times the training thread's waits for the reader
    threads and for its graph: the same plants, told apart by them."""

    def test_a_slow_training_step(self, shards):
        got = epoch_verdict(gp.Pipeline(shards, [T.CenterCrop(16)]), step=0.1, epochs=2, batch_size=2,
                            backend="dali", num_workers=1)  # fmt: skip
        assert got["bound"]["bound"] == "model", got
        assert got["times"]["queue_ready"] >= 1  # the reader threads' queue ran full

    def test_slow_reads(self, shards, monkeypatch):
        """A CPU pipeline reads views of mapped shards: the plant is a reader thread that takes
        150 ms per batch."""
        pytest.importorskip("nvidia.dali")
        from gpupipe.backends._dali._input import BatchReader

        real = BatchReader.read

        def slow(self, *args, **kwargs):
            time.sleep(0.15)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(BatchReader, "read", slow)
        got = epoch_verdict(gp.Pipeline(shards, [T.CenterCrop(16)]), backend="dali", num_workers=1)
        assert got["bound"]["bound"] == "storage", got
        assert got["times"]["read_bytes"] > 4 * 500 and " MB) kept the loop waiting" in got["bound"]["why"]
        assert got["times"]["queue_ready"] < 0.5

    def test_large_jpegs_on_one_thread(self, tmp_path):
        rng = np.random.default_rng(0)
        large = write_webdataset_shards(str(tmp_path), (12,), image=lambda n: rng.integers(0, 255, (1200, 1600, 3),
                                                                                         dtype=np.uint8))  # fmt: skip
        got = epoch_verdict(gp.Pipeline(large, [T.Resize((512, 512)), T.CenterCrop(16)]), backend="dali",
                            num_workers=1)  # fmt: skip
        assert got["bound"]["bound"] == "graph", got


class TestRaysTasks:
    def test_they_time_their_stages_and_the_verdict_reads_them(self, tmp_path, ray_session):
        """Ray's tasks return their seconds per stage as the torch workers do: large JPEGs make
        decoding the slowest."""
        pytest.importorskip("ray")
        rng = np.random.default_rng(0)
        large = write_webdataset_shards(str(tmp_path), (12,), image=lambda n: rng.integers(0, 255, (1200, 1600, 3),
                                                                                         dtype=np.uint8))  # fmt: skip
        got = epoch_verdict(gp.Pipeline(large, [T.CenterCrop(16)]), backend="ray", num_workers=1)
        times = got["times"]
        assert times["batches"] == 2 and all(times[f"{k}_s"] > 0 for k in ("read", "decode", "transform", "collate"))
        assert times["decode_s"] > times["read_s"] and got["bound"]["bound"] != "loader", got
        assert times["read_bytes"] > 4 * 100_000  # four 1600 x 1200 JPEGs of noise a batch


class TestTheLastVerdict:
    """The verdict a loader leaves for ``gpupipe doctor``: at each epoch's end and at close(), by
    the node's first rank, never an error."""

    def run(self, shards, **options) -> gp.Loader:
        options = {"shuffle": True, **options}
        loader = gp.Loader(gp.Pipeline(shards, [T.CenterCrop(16)]), 2, backend="torch", num_workers=0, **options)
        with loader:
            for _ in loader:
                pass
        return loader

    def test_an_epoch_leaves_its_verdict(self, shards, tmp_path, monkeypatch):
        from gpupipe.cli._doctor import verdict_lines
        from gpupipe.loader._observed import last_verdict, verdict_file

        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path))
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        assert last_verdict() is None and "no loader verdict recorded here yet" in verdict_lines(None)[0]
        self.run(shards)
        found = last_verdict()
        assert verdict_file() == str(tmp_path / "verdict.json")
        assert found is not None and found["bound"] in BOUNDS and found["backend"] == "torch"
        assert found["epoch"] == 0 and found["batches"] == 7 and found["transforms"] == ["CenterCrop"]
        lines = verdict_lines(found)
        assert lines[0].startswith("last run     ") and "backend='torch'" in lines[0]
        assert "epoch 0 (7 batches" in lines[0]
        assert lines[1].startswith(f"  bound      {found['bound']}: ") and found["remedy"] in lines[2]

    def test_a_validation_loader_leaves_none(self, shards, tmp_path, monkeypatch):
        """A loader without shuffle (validation, run between the training epochs) does not replace
        the training loader's verdict."""
        from gpupipe.loader._observed import last_verdict

        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path))
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        self.run(shards)
        trained = last_verdict()
        self.run(shards, shuffle=False)
        assert trained is not None and last_verdict() == trained

    def test_other_local_ranks_leave_none(self, shards, tmp_path, monkeypatch):
        from gpupipe.loader._observed import last_verdict

        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("LOCAL_RANK", "1")
        self.run(shards)
        assert last_verdict() is None

    def test_an_unwritable_cache_stops_nothing(self, shards, tmp_path, monkeypatch):
        from gpupipe.loader._observed import last_verdict

        (tmp_path / "verdict.json").mkdir()  # (a directory where the file goes: the write fails)
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path))
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        self.run(shards)  # (logged at info, the run goes on)
        assert last_verdict() is None and not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]

    def test_a_damaged_record_is_none(self, tmp_path, monkeypatch):
        from gpupipe.loader._observed import last_verdict

        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path))
        for text in ("{not json", "[1, 2]", '{"bound": 3}'):
            (tmp_path / "verdict.json").write_text(text)
            assert last_verdict() is None
