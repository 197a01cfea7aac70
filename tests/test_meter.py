"""The data-stall meter (``loader.stats()["stall"]``): the training loop's waits in ``next()``
against its steps, per epoch from the second batch on, over a moving window, and the first
batch's wait."""

from __future__ import annotations

import json
import time

import pytest

import gpupipe as gp
from gpupipe.loader._meter import Meter

from .support.checkers import val


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loop(meter: Meter, clock: Clock, waits: list[float], steps: list[float], *, epoch: int = 0) -> None:
    """An epoch as a training loop sees it: batch ``i`` takes ``waits[i]`` to come, then the loop
    steps ``steps[i]``."""
    meter.begin(epoch, 8)
    for i, (wait, step) in enumerate(zip(waits, steps, strict=True)):
        if i:
            meter.resumed()
        clock.now += wait
        meter.ready()
        clock.now += step


class TestMeter:
    def test_the_stall_is_the_waits_share(self):
        clock = Clock()
        meter = Meter(clock=clock)
        loop(meter, clock, [2.0, 0.1, 0.1, 0.3], [0.9, 0.9, 0.9, 0.9])
        got = meter.stats()
        assert got["first_batch_s"] == pytest.approx(2.0)  # the start-up, apart
        assert got["batches"] == 3 and got["wait_s"] == pytest.approx(0.5) and got["step_s"] == pytest.approx(2.7)
        assert got["stall"] == pytest.approx(0.5 / 3.2) and got["images_per_s"] == pytest.approx(24 / 3.2)

    def test_a_model_bound_loop_has_no_stall_and_a_loader_bound_one_nearly_all(self):
        clock = Clock()
        meter = Meter(clock=clock)
        loop(meter, clock, [1.0] + [0.0] * 9, [0.1] * 10)
        assert meter.stats()["stall"] == 0.0
        loop(meter, clock, [1.0] + [0.5] * 9, [0.001] * 10, epoch=1)
        assert meter.stats()["stall"] > 0.99 and meter.stats()["epoch"] == 1

    def test_totals_run_across_epochs(self):
        clock = Clock()
        meter = Meter(clock=clock)
        loop(meter, clock, [1.0, 0.5, 0.5], [0.25] * 3)
        before = meter.totals()
        loop(meter, clock, [1.0, 0.5], [0.25] * 2, epoch=1)  # (every batch: each epoch's first too)
        assert before == (3, 2.0, 0.5) and meter.totals() == (5, 3.5, 1.0)  # the step between the epochs counts
        assert meter.stats()["batches"] == 1 and meter.stats()["wait_s"] == 0.5

    def test_the_window_is_the_last_batches_across_epochs(self):
        clock = Clock()
        meter = Meter(window=4, clock=clock)
        loop(meter, clock, [0.0] + [1.0] * 5, [1.0] * 6)  # stall 0.5
        loop(meter, clock, [0.0, 0.0, 0.0, 3.0], [1.0] * 4, epoch=1)  # three batches after the first
        got = meter.stats()
        assert got["batches"] == 3 and got["stall"] == pytest.approx(3.0 / 6.0)
        assert got["window"]["batches"] == 4
        assert got["window"]["stall"] == pytest.approx((1.0 + 0 + 0 + 3.0) / (4.0 + 4.0))

    def test_images_are_the_batches_valid_ones(self):
        """A partial last batch's padding (and skipped samples) are no images delivered."""
        clock = Clock()
        meter = Meter(clock=clock)
        meter.begin(0, 8)
        for i, valid in enumerate((8, 8, 2)):
            if i:
                meter.resumed()
            clock.now += 0.5
            meter.ready(valid)
            clock.now += 0.5
        got = meter.stats()
        assert got["images_per_s"] == pytest.approx(10 / 2.0) and got["window"]["images_per_s"] == pytest.approx(5.0)

    def test_nothing_measured_yet(self):
        got = Meter().stats()
        assert got["epoch"] is None and got["first_batch_s"] is None and got["stall"] is None
        assert got["window"] == {"batches": 0, "stall": None, "images_per_s": None}


class TestInTheLoader:
    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_a_slow_step_shows_in_step_s_and_a_fast_one_in_the_stall(self, shards, backend):
        """A loop that sleeps 50 ms per batch: every batch ready when asked (the step's time is
        at least the sleeps; the stall is what the loader's own next() costs). A loop that does
        nothing: all its time is waiting."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.Loader(val(shards), 4, backend=backend, device="cpu", num_workers=1) as loader:
            n = 0
            for _ in loader:
                time.sleep(0.05)
                n += 1
            slow = loader.stats()["stall"]
            loader.set_epoch(1)
            for _ in loader:
                pass
            fast = loader.stats()["stall"]
        assert slow["epoch"] == 0 and slow["batches"] == n - 1 and slow["first_batch_s"] > 0
        assert slow["step_s"] >= 0.05 * (n - 1) and slow["stall"] < fast["stall"]
        assert fast["epoch"] == 1 and fast["step_s"] < slow["step_s"] and fast["images_per_s"] > 0


class TestForLoggers:
    def test_the_flat_numbers_a_logger_takes(self):
        clock = Clock()
        meter = Meter(clock=clock)
        from gpupipe.loader._meter import metrics

        assert metrics(meter.stats()) == {}
        loop(meter, clock, [2.0, 0.5], [0.5, 0.5])
        got = metrics(meter.stats(), prefix="x/")
        assert got == {"x/stall": 0.5, "x/images_per_s": 8.0, "x/epoch_stall": 0.5, "x/epoch_images_per_s": 8.0,
                       "x/first_batch_s": 2.0}  # fmt: skip

    def test_the_loaders_own(self, shards):
        with gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=0) as loader:
            assert loader.stall_metrics() == {}
            for _ in loader:
                pass
            got = loader.stall_metrics()
        assert {"gpupipe/first_batch_s", "gpupipe/epoch_stall", "gpupipe/stall"} <= set(got)
        assert all(isinstance(v, float) for v in got.values())

    def test_the_lightning_callbacks_option(self):
        pytest.importorskip("lightning")
        from gpupipe.lightning import StallLogger

        assert StallLogger().every_n_steps == 50
        with pytest.raises(gp.ConfigError, match="every_n_steps must be an int >= 1, got 0"):
            StallLogger(every_n_steps=0)


def test_the_meter_overhead_benchmark_runs(tmp_path):
    """``bench/meter_overhead.py --quick``: the meter on against off, side by side (issue 54)."""
    from .support.bench import run_bench

    out = tmp_path / "results"
    proc = run_bench("meter_overhead.py", "--quick", "--backends", "torch", "--out", str(out), "--data",
                     str(tmp_path / "data"))  # fmt: skip
    assert "| torch | 2 |" in proc.stdout and "µs per batch" in proc.stdout
    (report,) = out.glob("*-meter-overhead.json")
    found = json.loads(report.read_text())
    assert found["meter_us_per_batch"] > 0 and found["results"][0]["on"] > 0 and found["results"][0]["off"] > 0
