"""``gpupipe tune`` / ``gp.tune``: the loader's threads, prefetch and (on a GPU) hardware-decoder
share chosen by measurement, recorded per machine, pipeline, batch size, backend and device, and
taken by the loaders that leave them unset — never by one that sets them. Timings are not
asserted: the choice among measured trials is, with made-up measurements."""

from __future__ import annotations

import json
import os

import pytest
import torch

import gpupipe as gp
from gpupipe.cli._main import main
from gpupipe.core._config import LoaderConfig
from gpupipe.loader import _records, _tune

from .support.checkers import val

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_rates(monkeypatch):
    """Trials measure a made-up images/s: ``rates(workers, prefetch)``; every trial is recorded."""
    seen = []

    def install(rate):
        def measure(loader, seconds, *, warmup):
            seen.append((loader.num_workers, loader.prefetch))
            return rate(loader.num_workers, loader.prefetch)

        monkeypatch.setattr(_tune, "_measure", measure)
        return seen

    return install


def test_tune_records_and_loaders_take_it(backend, shards, cache, fake_rates, monkeypatch):
    monkeypatch.setattr("gpupipe.runtime._dist.cpu_cores", lambda: 2)
    seen = fake_rates(lambda w, p: 100.0 + (30.0 if p == 3 else 0.0))  # one worker saturates
    pipe = val(shards)
    tuned = gp.tune(pipe, 4, seconds=0.1, backend=backend.backend, device=backend.device)
    assert (tuned.num_workers, tuned.prefetch) == (1, 3)  # the cheapest within 3% of the best, then prefetch 3
    assert tuned.default_images_per_s == 100.0 and tuned.images_per_s == 130.0
    gpu_decoder = (backend.backend, backend.device) == ("dali", "cuda")  # the hardware decoder's share is tried too
    default, _ = _records.default_share(_records.gpu_capability(torch.device(backend.device)))
    assert tuned.hw_decoder_load == (default if gpu_decoder else None)  # all as fast: the GPU's default
    shares = [(1, 3)] * 4 if gpu_decoder else []  # four of 0.0, 0.5, 0.65, 0.8 and 1.0 besides the default
    assert sorted(seen) == sorted([(1, 1), (1, 2), (1, 3), (1, 4), (2, 2), *shares])  # each trial once
    record = json.loads((cache / "tune.json").read_text())
    (entry,) = record.values()
    assert entry["batch_size"] == 4 and entry["backend"] == backend.backend and len(entry["trials"]) == len(seen)
    tuned_used = tuned.__class__(**{k: getattr(tuned, k) for k in (
        "num_workers", "prefetch", "hw_decoder_load", "images_per_s", "default_images_per_s", "date")})  # fmt: skip
    with backend.loader(pipe, 4) as loader:  # options unset: the record's
        assert (loader.num_workers, loader.prefetch) == (1, 3) and loader.tuned == tuned_used
        assert f"tuned='{tuned.date}'" in repr(loader)
        assert len(list(loader)) == len(loader)
    with backend.loader(pipe, 4, num_workers=1, prefetch=2) as loader:  # set: never overridden
        assert (loader.num_workers, loader.prefetch) == (1, 2)
        # DALI on a GPU: the hardware decoder's share is still unset, so the record's is used
        assert loader.tuned == (tuned_used if gpu_decoder else None)
    with backend.loader(pipe, 8) as loader:  # another batch size: no record, the defaults
        assert (loader.num_workers, loader.prefetch, loader.tuned) == (2, 2, None)


def test_the_record_belongs_to_its_pipeline_and_backend(shards, cache, fake_rates):
    fake_rates(lambda w, p: 100.0 * w)
    gp.tune(val(shards), 4, seconds=0.1, backend="torch", device="cpu")
    other = gp.Pipeline(shards, [gp.transforms.CenterCrop(24), gp.transforms.RandomHorizontalFlip()])
    with gp.Loader(other, 4, backend="torch", device="cpu") as loader:
        assert loader.tuned is None
    with gp.Loader(val(shards), 4, backend="dali", device="cpu") as loader:
        assert loader.tuned is None


def test_auto_tunes_the_backend_the_loader_picks(shards, cache, fake_rates):
    """``backend="auto"`` is resolved for the pipeline (DALI passed over for TrivialAugmentWide on
    the CPU): the record is the one an ``auto`` loader of that pipeline finds."""
    fake_rates(lambda w, p: 100.0 * w)
    pipe = gp.Pipeline(shards, [gp.transforms.CenterCrop(24), gp.transforms.TrivialAugmentWide()])
    gp.tune(pipe, 4, seconds=0.1, device="cpu")
    (entry,) = json.loads((cache / "tune.json").read_text()).values()
    with gp.Loader(pipe, 4, device="cpu") as loader:
        assert entry["backend"] == loader.backend == "torch" and loader.tuned is not None


def test_hw_decoder_load_is_tuned_on_a_gpu_only(shards, cache, fake_rates, monkeypatch):
    """The hardware decoder's share is a trial only where DALI decodes on a GPU; the cheapest share
    is the one nearest DALI's 0.65 within 3% of the best."""
    chosen = _tune._best(
        [{"hw_decoder_load": s, "images_per_s": r} for s, r in [(0.0, 80.0), (0.5, 99.0), (0.65, 97.0), (1.0, 100.0)]],
        lambda t: abs(t["hw_decoder_load"] - 0.65),
    )
    assert chosen["hw_decoder_load"] == 0.65
    fake_rates(lambda w, p: 50.0)
    assert gp.tune(val(shards), 4, seconds=0.1, backend="dali", device="cpu", record=False).hw_decoder_load is None


def test_a_tune_for_several_ranks_per_node_serves_ranks_of_that_share(shards, cache, fake_rates, clean_env):
    """Ranks that share a node share its cores: tuned for 4 ranks on 8 cores, the trials have 2
    cores, and the record serves loaders of 4 ranks a node, not a single process's."""
    clean_env.setattr("gpupipe.runtime._dist.cpu_cores", lambda: 8)
    seen = fake_rates(lambda w, p: 100.0 * w)
    tuned = gp.tune(val(shards), 4, seconds=0.1, backend="torch", device="cpu", ranks_per_node=4)
    assert tuned.num_workers == 2 and max(w for w, _ in seen) == 2
    assert "2 cores" in next(iter(json.loads((cache / "tune.json").read_text()).values()))["machine"]
    with gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=1) as alone:  # 8 cores: no record
        assert alone.tuned is None and alone.prefetch == 2
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    with gp.Loader(val(shards), 4, backend="torch", device="cpu") as rank:
        assert rank.tuned is not None and rank.num_workers == 2


def test_options_that_tune_chooses_are_refused(shards):
    with pytest.raises(gp.ConfigError, match="num_workers is what tune chooses"):
        gp.tune(val(shards), 4, num_workers=2)
    with pytest.raises(gp.ConfigError, match="seconds must be positive"):
        gp.tune(val(shards), 4, seconds=0)
    with pytest.raises(gp.ConfigError, match="ranks_per_node"):
        gp.tune(val(shards), 4, ranks_per_node=0)


def test_a_damaged_record_file_is_ignored_with_a_warning(shards, cache):
    cache.mkdir(parents=True)
    (cache / "tune.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the tuning records"):
        loader = gp.Loader(val(shards), 4, backend="torch", device="cpu", num_workers=0)
    assert loader.tuned is None and loader.prefetch == 2
    loader.close()


def test_the_command(shards, cache, capsys):
    """Real measurements, briefly: the command prints every trial and records the choice."""
    pattern = shards[0].replace("000000", "{000000..000001}")
    argv = ["tune", os.path.join(ROOT, "pipelines", "imagenet.py:val"), pattern, "--batch-size", "4", "--backend",
            "torch", "--device", "cpu", "--seconds", "0.05", "--ranks-per-node", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "num_workers=1 prefetch=2:" in out and "chosen: num_workers=" in out and "recorded in" in out
    (entry,) = json.loads((cache / "tune.json").read_text()).values()
    assert entry["machine"].startswith(f"{max(1, len(os.sched_getaffinity(0)) // 2)} cores, ")


class TestTheHardwareDecodersDefaultShare:
    """``DaliOptions.hw_decoder_load`` left unset and not tuned: 1.0 on Hopper GPUs (measured on
    an H200 and an H100), DALI's 0.65 on the others; set or tuned, as it says."""

    @pytest.mark.parametrize("capability, share", [((9, 0), 1.0), ((8, 0), 0.65), ((10, 0), 0.65), (None, 0.65)])
    def test_by_compute_capability(self, capability, share):
        assert _records.default_share(capability)[0] == share

    def test_a_cpu_has_no_capability(self):
        assert _records.gpu_capability(torch.device("cpu")) is None

    def test_unset_set_and_tuned(self, cache):
        def share(config, key="no record"):
            return _records.resolve(config, key, hw_default=1.0)[0].dali.hw_decoder_load

        assert share(LoaderConfig(batch_size=4)) == 1.0
        assert share(LoaderConfig(batch_size=4, dali=gp.DaliOptions(hw_decoder_load=0.5))) == 0.5
        _records.record("k", _records.Tuned(2, 2, 0.8, 10.0, 9.0, "2026-11-28"), {})
        assert share(LoaderConfig(batch_size=4), "k") == 0.8

    def test_the_loader_asks_its_device(self, shards, cache, monkeypatch):
        monkeypatch.setattr("gpupipe.loader._loader.gpu_capability", lambda device: (9, 0))
        with gp.Loader(val(shards), 4, backend="dali", device="cpu") as loader:
            assert loader._run_config.dali.hw_decoder_load == 1.0

    @pytest.mark.parametrize(
        "chosen, verdict", [(1.0, "the default on this GPU"), (0.8, "not the default, 1.0 on this GPU")]
    )
    def test_the_command_reports_the_share_against_the_default(self, shards, cache, monkeypatch, capsys, chosen,
                                                               verdict):  # fmt: skip
        """``gpupipe tune`` on a GPU says whether the share it chose is the GPU's default, and why
        that default (here a Hopper GPU, faked)."""
        monkeypatch.setattr("gpupipe.loader._records.gpu_capability", lambda device: (9, 0))
        monkeypatch.setattr("gpupipe.loader._tune.tune",
                            lambda *a, **k: _records.Tuned(2, 2, chosen, 10.0, 9.0, "2026-11-28"))  # fmt: skip
        pattern = os.path.join(os.path.dirname(shards[0]), "*.tar")
        argv = ["tune", os.path.join(ROOT, "pipelines", "imagenet.py:val"), pattern, "--batch-size", "4", "--no-record"]
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f"hw_decoder_load={chosen}: {verdict} (every JPEG to the hardware decoder on a Hopper GPU" in out


class TestARecordMadeUnderAnotherDefault:
    """A record's share is chosen again among its trials for today's default: records made when
    0.65 was the default everywhere follow 1.0 on Hopper where their trials found it as fast."""

    def record(self, rates: dict[float, float]) -> _records.Tuned:
        trials = [{"num_workers": 2, "prefetch": 2, "hw_decoder_load": s, "images_per_s": r} for s, r in rates.items()]
        trials.append({"num_workers": 4, "prefetch": 2, "hw_decoder_load": 1.0, "images_per_s": 999.0})  # other threads
        return _records.Tuned(2, 2, 0.65, 100.0, 90.0, "2026-11-27", tuple(trials))

    def test_as_fast_follows_the_default(self):
        tuned = self.record({0.0: 50.0, 0.65: 100.0, 1.0: 98.0})
        assert _records.recorded_share(tuned, 1.0) == 1.0 and _records.recorded_share(tuned, 0.65) == 0.65

    def test_slower_keeps_the_record(self):
        tuned = self.record({0.65: 100.0, 1.0: 80.0})
        assert _records.recorded_share(tuned, 1.0) == 0.65

    def test_through_the_loader_config(self, cache):
        _records.record("k", self.record({0.65: 100.0, 1.0: 99.0}), {})
        found = _records.lookup("k")
        assert found is not None and found.trials  # the trials come back with the record
        config, _, used = _records.resolve(LoaderConfig(batch_size=4), "k", hw_default=1.0)
        assert config.dali.hw_decoder_load == 1.0 and used is not None
