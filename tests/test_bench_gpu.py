"""``make bench-gpu`` (bench/gpu.py): its quick form runs anywhere, here on DALI's CPU operators,
so that the GPU benchmark keeps working between the sessions that have a GPU. Performance is
never asserted: only that every row, the probe of where JPEGs were decoded and the report come out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .support.bench import run_bench

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))

pytest.importorskip("nvidia.dali")


def test_the_quick_run_writes_every_row(tmp_path):
    proc = run_bench("gpu.py", "--quick", "--cpu", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "out"),
                     timeout=600)  # fmt: skip
    (report,) = (tmp_path / "out").glob("*-quick.md")
    (data,) = (tmp_path / "out").glob("*-quick.json")
    assert report.with_suffix(".png").exists()
    text, result = report.read_text(), json.loads(data.read_text())
    recipes = {(r["set"], r["recipe"]) for r in result["rows"]}
    assert {("imagenet-like", r) for r in ("by hand", "by hand, fancy", "gpupipe train", "by hand val", "gpupipe val",
                                           "gpupipe dino", "gpupipe train v2",
                                           "gpupipe train timm", "gpupipe train v2 augmix")} <= recipes  # fmt: skip
    assert {("targets", r) for r in ("gpupipe segmentation", "gpupipe segmentation, image only", "gpupipe ssd",
                                     "gpupipe ssd, image only")} <= recipes  # fmt: skip
    probed = [r for r in result["rows"] if r.get("decoded")]
    assert probed and all(r["decoded"] == "hw 0% / cuda 0% / cpu 100%" for r in probed), probed  # DALI's CPU decoder
    assert all(r["images_per_s"] > 0 and r["cpu_s_per_1000"] > 0 for r in result["rows"])
    assert {"train_vs_hand_fancy", "train_vs_val", "stall", "tuned_train", "v2_vs_train"} <= set(result["headline"])
    (tuned,) = [r for r in result["rows"] if r["recipe"] == "gpupipe train, tuned"]
    assert "num_workers=" in tuned["tuned"] and "gpupipe train, tuned (num_workers=" in text
    assert "A smoke run" in text and "operators=7" in result["data_stall"]["loader"]
    assert "MET " in proc.stdout or "MISS" in proc.stdout
    assert not list((tmp_path / "out").glob("*.partial.jsonl"))  # the rows as they came: removed once all is written
    assert f"wrote {report}, {data}, {report.with_suffix('.png')}" in proc.stdout


class TestCutShort:
    """A lent machine's command has a time limit: a run that ends early still leaves its report."""

    def test_past_the_budget_no_row_starts_and_the_report_says_not_measured(self, tmp_path):
        proc = run_bench("gpu.py", "--quick", "--cpu", "--budget", "0", "--data", str(tmp_path / "d"), "--out",
                  str(tmp_path / "out"), timeout=600)  # fmt: skip
        (data,) = (tmp_path / "out").glob("*-quick.json")
        result = json.loads(data.read_text())
        assert result["rows"] == [] and result["data_stall"] is None and result["headline"]["train"] is None
        assert "---- train ≥ 10,000 images/s" in proc.stdout and "no row was measured" in proc.stdout
        assert "| train ≥ 0.8× val | not measured |" in data.with_suffix(".md").read_text()

    def test_recipes_picks_the_rows_and_names_an_unknown_one(self, tmp_path):
        """``--recipes``: a lent machine's short run measures the rows it needs (train beside V2).
        Names hold commas, so ';' separates them."""
        argv = [sys.executable, os.path.join(ROOT, "bench", "gpu.py"), "--quick", "--cpu", "--sets", "imagenet-like",
                "--data", str(tmp_path / "d"), "--out", str(tmp_path / "out")]  # fmt: skip
        proc = subprocess.run([*argv, "--recipes", "gpupipe train;gpupipe trian"], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 2 and "--recipes: unknown 'gpupipe trian'; the rows are by hand; by hand, fancy;" \
            in proc.stderr  # fmt: skip
        assert not (tmp_path / "out").exists()  # refused before anything is made
        chosen = "gpupipe train, tuned; gpupipe train v2;by hand, fancy"
        proc = subprocess.run([*argv, "--recipes", chosen], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (data,) = (tmp_path / "out").glob("*-quick.json")
        result = json.loads(data.read_text())
        rows = [r["recipe"] for r in result["rows"]]
        assert rows == ["by hand, fancy", "gpupipe train v2", "gpupipe train, tuned"]  # in ROWS' order
        assert result["meta"]["recipes"] == ["gpupipe train, tuned", "gpupipe train v2", "by hand, fancy"]
        assert result["data_stall"] is None
        report = data.with_suffix(".md").read_text()
        assert "not measured (the run was cut short, or --recipes did not name it)" in report

    def test_the_report_of_a_partial_file(self, tmp_path):
        from gpu import RECIPES, report_of_partial

        meta = {"date": "2026-11-26", "device": "NVIDIA X", "default_threads": 8, "quick": False}
        rows = [{"set": "imagenet-like", "recipe": r, "threads": t, "images_per_s": 1000.0 * (i + 1),
                 "cpu_s_per_1000": 0.4, "image": "500x375, 99 KB"}
                for i, r in enumerate(RECIPES) for t in (4, 8)]  # fmt: skip
        partial = tmp_path / "2026-11-26-nvidia-x-gpu.partial.jsonl"
        partial.write_text("\n".join(json.dumps(x) for x in [{"meta": meta}, *rows]) + "\n")
        report_of_partial(str(partial), str(tmp_path / "out"))
        result = json.loads((tmp_path / "out" / "2026-11-26-nvidia-x-gpu.json").read_text())
        head = result["headline"]
        assert head["threads"] == 8 and head["train"] == 3000.0 and head["train_vs_hand_fancy"] == 1.5
        rate = {r: 1000.0 * (i + 1) for i, r in enumerate(RECIPES)}
        want = round(rate["gpupipe train v2"] / rate["gpupipe train"], 3)
        assert head["v2_vs_train"] == want and head["stall"] is None and head["tuned_train"] is None
        assert len(result["rows"]) == 2 * len(RECIPES) and "cut short" in result["meta"]

    def test_the_hardware_decoders_rows_in_the_report(self, tmp_path):
        """On a GPU: the train recipe with every JPEG to the hardware decoder and with DALI's share,
        and the data stall."""
        from gpu import DALI_SHARE, HW_ONLY, report_of_partial

        meta = {"date": "2026-11-26", "device": "NVIDIA X", "default_threads": 8, "quick": False}
        measured = [("gpupipe train", 1000.0, 0.5), (HW_ONLY, 1500.0, 0.1), (DALI_SHARE, 900.0, 0.6)]
        rows = [{"set": "imagenet-like", "recipe": r, "threads": 8, "images_per_s": v, "cpu_s_per_1000": c,
                 "image": "500x375, 99 KB"} for r, v, c in measured]  # fmt: skip
        stall = {"arch": "resnet50", "batch_size": 256, "ceiling": 100.0, "fed": 90.0, "wait_percent": 9.0,
                 "stall_percent": 10.0, "loader": "L",
                 "hw_decoder_load=1.0": {"ceiling": 100.0, "fed": 98.0, "stall_percent": 2.0}}  # fmt: skip
        partial = tmp_path / "2026-11-26-nvidia-x-gpu.partial.jsonl"
        partial.write_text("\n".join(json.dumps(x) for x in [{"meta": meta}, *rows, {"data_stall": stall}]) + "\n")
        report_of_partial(str(partial), str(tmp_path / "out"))
        result = json.loads((tmp_path / "out" / "2026-11-26-nvidia-x-gpu.json").read_text())
        head = result["headline"]
        assert (head["train_hw_only"], head["train_hw_only_cpu"], head["stall_hw_only"]) == (1500.0, 0.1, 2.0)
        assert head["train_dali_share"] == 900.0
        text = (tmp_path / "out" / "2026-11-26-nvidia-x-gpu.md").read_text()
        assert "hardware decoder (hw_decoder_load=1.0): fed 98 images/s, stall 2.0%" in text


def test_decode_shares_from_the_log():
    """On a GPU the hardware decoder's batches are not logged: its share is the rest."""
    from gpu import decode_shares

    log = "\n".join(
        ["[nvjpeg-ext] nvJPEG version: 13.3.2 (CUDA version is 13.0)"]
        + [f"123: nvjpeg_cuda_decoder process #{i}" for i in range(16)]
        + [f"124: libjpeg_turbo_decoder process #{i}" for i in range(8)]
    )
    got = decode_shares(log, 64, gpu=True)
    assert got["decoded"] == "hw 62% / cuda 25% / cpu 12%" and got["nvjpeg"] == "13.3.2" and got["cpu_share"] == 0.125
    assert decode_shares("", 64, gpu=False)["decoded"] == "hw 0% / cuda 0% / cpu 0%"
    assert decode_shares(log, 64, gpu=True, hw=False)["decoded"] == "unlogged 62% / cuda 25% / cpu 12%"


class TestOnALentMachine:
    """What a lent GPU machine may lack or do: no matplotlib, a probe that hangs or exits badly."""

    def test_no_matplotlib_no_plot_and_said_so(self, tmp_path, monkeypatch, capsys):
        from gpu import plot

        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
        rows = [{"set": "imagenet-like", "recipe": "by hand", "threads": 4, "images_per_s": 1.0}]
        plot(rows, str(tmp_path / "x.png"), title="t")
        assert not (tmp_path / "x.png").exists() and "matplotlib is not installed" in capsys.readouterr().out

    def test_a_probe_that_hangs_is_a_row_note(self, monkeypatch):
        import gpu

        def hang(argv, **kwargs):
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

        monkeypatch.setattr(gpu.subprocess, "run", hang)
        found = gpu.probe("gpupipe train", [], "", gpu=False, batch=4, threads=1)
        assert found == {"decoded": f"probe gave no answer in {gpu.PROBE_TIMEOUT} s"}

    def test_a_probe_that_exits_badly_after_decoding_still_counts(self, monkeypatch):
        import gpu

        log = "\n".join(f"1: libjpeg_turbo_decoder process #{i}" for i in range(8))
        done = subprocess.CompletedProcess([], -11, stdout="PROBED 8\n", stderr=log)  # a crash at teardown
        monkeypatch.setattr(gpu.subprocess, "run", lambda argv, **kwargs: done)
        assert gpu.probe("gpupipe train", [], "", gpu=False, batch=4, threads=1)["cpu_share"] == 1.0
        failed = subprocess.CompletedProcess([], 1, stdout="", stderr="boom")
        monkeypatch.setattr(gpu.subprocess, "run", lambda argv, **kwargs: failed)
        assert gpu.probe("gpupipe train", [], "", gpu=False, batch=4, threads=1)["decoded"] == "probe failed (1): boom"
