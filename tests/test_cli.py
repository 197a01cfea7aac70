"""python -m gpupipe make-shards / bench."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import gpupipe as gp
from gpupipe.cli._main import main
from gpupipe.testing import synthetic_image

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_make_shards_synthetic(tmp_path, capsys):
    assert (
        main(
            ["make-shards", str(tmp_path), "--synthetic", "10", "--shard-size", "4", "--classes", "3", "--workers", "1"]
        )
        == 0
    )
    assert "train-{000000..000002}.tar" in capsys.readouterr().out
    index = gp.WebDataset(str(tmp_path / "train-{000000..000002}.tar")).index()
    assert list(index.shard_sizes) == [4, 4, 2]
    assert [index.read(i).label for i in range(10)] == [i % 3 for i in range(10)]
    sample = index.read(0)
    assert sample.data[:2] == b"\xff\xd8" and len(sample.data) > 10_000  # a real, photo-sized JPEG
    from gpupipe.runtime._decode import decode_rgb

    assert 300 <= min(decode_rgb(sample.data, shard="s", key="k").shape[1:]) <= 500


def test_make_shards_with_fields_for_the_recipes(tmp_path, capsys):
    """``--fields text,meta,mask,boxes``: what the CLIP, segmentation and detection recipes read,
    the boxes enclosing the rectangles painted on the image."""
    assert main(["make-shards", str(tmp_path), "--synthetic", "6", "--fields", "text,meta,mask,boxes", "--workers",
                 "1", "--quiet"]) == 0  # fmt: skip
    shards = str(tmp_path / "train-000000.tar")
    clip = gp.load_pipeline("pipelines/clip.py:train")(shards, size=64)
    seg = gp.load_pipeline("pipelines/segmentation.py:train")(shards, base_size=64, crop_size=48)
    det = gp.load_pipeline("pipelines/detection.py:train")(shards, min_size=(48, 64), max_size=96)
    with gp.Loader(clip, 6, num_workers=0, backend="torch") as loader:
        batch = next(iter(loader))
        assert batch["text"][0].startswith("a synthetic photo of class")
    with gp.Loader(seg, 6, num_workers=0, backend="torch") as loader:
        assert set(torch.unique(next(iter(loader))["mask"]).tolist()) <= {0, 1, 2, 3, 255}
    with gp.Loader(det, 6, num_workers=0, backend="torch") as loader:
        assert int(next(iter(loader))["boxes"].lengths[:, 0].sum()) >= 6
    meta = gp.WebDataset(shards, fields={"image": "jpg", "meta": "json", "boxes": "boxes.npy"})
    with gp.Loader(gp.Pipeline(meta, [gp.transforms.CenterCrop(64)]), 6, num_workers=0, backend="torch") as loader:
        batch = next(iter(loader))
    for m, boxes in zip(batch["meta"], batch["boxes"], strict=True):
        assert min(m["height"], m["width"]) >= 300 and 1 <= len(boxes) <= 3
        assert bool((boxes[:, 2] <= m["width"]).all()) and bool((boxes[:, 3] <= m["height"]).all())
    capsys.readouterr()
    assert main(["make-shards", str(tmp_path / "x"), "--synthetic", "1", "--fields", "captions"]) != 0
    assert "captions unknown: choose from text, meta, mask, boxes" in capsys.readouterr().err


def test_synthetic_is_deterministic():
    import numpy as np

    np.testing.assert_array_equal(synthetic_image(3, label=1), synthetic_image(3, label=1))


class TestMakeShardsFromImageFolder:
    """Issue 54: an ImageFolder is sorted by class; its shards are written shuffled (seeded), each
    sample keyed by its number in the tree, unless ``--keep-order``."""

    def shards(self, out, image_folder, *options: str):
        assert main(["make-shards", str(out), "--from-imagefolder", image_folder, "--shard-size", "100",
                     *options]) == 0  # fmt: skip
        return gp.WebDataset(str(out / "train-000000.tar"), image="jpg;png").index()

    def test_every_sample_once_shuffled(self, tmp_path, image_folder):
        index, folder = self.shards(tmp_path, image_folder), gp.ImageFolder(image_folder).index()
        assert len(index) == len(folder)
        numbers = [int(index.key(i)) for i in range(len(index))]
        assert sorted(numbers) == list(range(len(folder))) and numbers != sorted(numbers)
        for i, n in enumerate(numbers):
            raw, source = index.read(i), folder.read(n)
            assert raw.label == source.label and raw.data == source.data  # JPEGs are copied, not re-encoded
        again = self.shards(tmp_path / "again", image_folder)
        assert [again.key(i) for i in range(len(again))] == [index.key(i) for i in range(len(index))]  # seeded
        other = self.shards(tmp_path / "other", image_folder, "--seed", "1")
        assert [other.key(i) for i in range(len(other))] != [index.key(i) for i in range(len(index))]

    def test_keep_order(self, tmp_path, image_folder):
        index, folder = self.shards(tmp_path, image_folder, "--keep-order"), gp.ImageFolder(image_folder).index()
        assert [index.key(i) for i in range(len(index))] == [f"{n:08d}" for n in range(len(folder))]
        assert [index.read(i).label for i in range(len(index))] == [folder.read(i).label for i in range(len(folder))]

    def test_a_file_that_cannot_be_reencoded_is_one_line_and_no_shards_stay(self, tmp_path, capsys):
        """A corrupt BMP (re-encoded as JPEG, unlike JPEG and PNG) was a Pillow traceback, and the
        shards written before it stayed: a run that fails leaves no part of a dataset behind."""
        from PIL import Image

        for cls in ("a", "b"):
            os.makedirs(tmp_path / "tree" / cls)
            for i in range(3):
                Image.fromarray(synthetic_image(i, size=(16, 16))).save(tmp_path / "tree" / cls / f"{i}.png")
        (tmp_path / "tree" / "b" / "9.bmp").write_bytes(b"BM not a bitmap")
        out = tmp_path / "out"
        argv = ["make-shards", str(out), "--from-imagefolder", str(tmp_path / "tree"), "--shard-size", "1",
                "--keep-order", "--quiet"]  # fmt: skip
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "error: sample 'b/9.bmp' in shard " in line and "cannot be re-encoded as JPEG" in line
        assert not out.exists() or os.listdir(out) == []

    def test_an_empty_class_folder_refused_unless_allowed(self, tmp_path, capsys):
        from gpupipe.testing import encode_jpeg, synthetic_image

        root = tmp_path / "tree"
        for cls in ("a", "b", "c"):
            (root / cls).mkdir(parents=True)
        for cls in ("a", "c"):
            (root / cls / "0.jpg").write_bytes(encode_jpeg(synthetic_image(0, size=(16, 16))))
        argv = ["make-shards", str(tmp_path / "out"), "--from-imagefolder", str(root), "--quiet"]
        assert main(argv) == 2
        assert "class folder 'b'" in capsys.readouterr().err
        assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
        assert main([*argv, "--allow-empty"]) == 0
        assert "wrote 2 samples" in capsys.readouterr().out


def test_make_shards_interrupted_leaves_no_shards(tmp_path, capsys, monkeypatch):
    """Ctrl-C after two of three shards: 130, and the two written are removed (they were left, a
    complete-looking dataset short of its samples)."""
    from gpupipe.cli import _commands

    counted = _commands._counted

    def interrupted(items, bar):
        for n, item in enumerate(counted(items, bar)):
            if n == 9:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(_commands, "_counted", interrupted)
    out = tmp_path / "out"
    argv = ["make-shards", str(out), "--synthetic", "12", "--shard-size", "4", "--workers", "1", "--quiet"]
    assert main(argv) == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(out) == []


def test_bench_runs_the_imagenet_pipeline(tmp_path):
    main(["make-shards", str(tmp_path), "--synthetic", "12", "--shard-size", "6", "--workers", "1"])
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpupipe",
            "bench",
            "pipelines/imagenet.py:train",
            str(tmp_path / "train-{000000..000001}.tar"),
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--workers",
            "1",
            "--rounds",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "images/s" in proc.stdout and "round 2 of 2" in proc.stdout
    result = json.loads(out.read_text())
    assert result["epochs"][0]["images"] == 12 and result["epochs"][0]["images_per_s"] > 0
    assert result["rounds"] == 2 and [r["round"] for r in result["runs"]] == [0, 1]
    (entry,) = result["summary"]
    assert entry["rounds"] == 2 and entry["images_per_s"]["min"] <= entry["images_per_s"]["median"] > 0


class TestBenchRounds:
    """``--rounds``: ratios within a round, medians and ranges over the rounds."""

    @staticmethod
    def run(backend, rate, number, workers=2):
        from gpupipe.cli._bench import Run

        return Run(backend, "cpu", 64, workers, [{"epoch": 0, "images_per_s": 1.0}, {"epoch": 1, "images_per_s": rate}],
                   round=number)  # fmt: skip

    def test_ratios_are_paired_within_a_round(self):
        from gpupipe.cli._bench import summary

        runs = [self.run("dali", 110, 0), self.run("dataloader", 100, 0),
                self.run("dataloader", 50, 1), self.run("dali", 60, 1),
                self.run("dali", 90, 2), self.run("dataloader", 100, 2)]  # fmt: skip
        dali, base = summary(runs)
        assert dali["images_per_s"] == {"median": 90, "min": 60, "max": 110} and dali["rounds"] == 3
        # 1.1, 1.2, 0.9: the median of the ratios, not the ratio of the medians (90 / 100)
        assert dali["vs"] == {"dataloader": {"median": 1.1, "min": 0.9, "max": 1.2}}
        assert base["vs"] == {} and base["images_per_s"]["median"] == 100

    def test_a_ratio_needs_the_same_batch_workers_and_round(self):
        from gpupipe.cli._bench import summary

        runs = [self.run("dali", 100, 0), self.run("dataloader", 100, 0, workers=1), self.run("dataloader", 80, 1)]
        assert summary(runs)[0]["vs"] == {}

    def test_table_of_one_round_and_of_several(self):
        from gpupipe.cli._bench import table

        one = table([self.run("torch", 120, 0), self.run("dataloader-torchvision", 100, 0)])
        assert one.splitlines()[1].split()[-2:] == ["120", "1.20x"]
        several = table([self.run("torch", 120, 0), self.run("dataloader-torchvision", 100, 0),
                         self.run("dataloader-torchvision", 100, 1), self.run("torch", 90, 1)])  # fmt: skip
        header, torch_row, base_row = several.splitlines()
        assert "vs dataloader-torchvision" in header
        assert torch_row.split()[-4:] == ["105", "(90-120)", "1.05x", "(0.90-1.20)"]
        assert base_row.split()[-2:] == ["100", "(100-100)"]

    def test_rounds_must_be_positive(self, capsys):
        assert main(["bench", "pipelines/imagenet.py:train", "x-{0..1}.tar", "--rounds", "0"]) != 0
        assert "--rounds must be 1 or more" in capsys.readouterr().err


def test_index_builds_the_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["make-shards", str(tmp_path), "--synthetic", "6", "--shard-size", "4", "--workers", "1"]) == 0
    pattern = str(tmp_path / "train-{000000..000001}.tar")
    assert main(["index", pattern, "--workers", "1", "--label", ".CLS"]) == 0  # the same cache as label="cls"
    assert "6 samples in 2 shards" in capsys.readouterr().out
    index = gp.WebDataset(pattern).index()
    assert all(not s.loaded for s in index.shards)  # served from the cache: sizes only, details lazily
    assert index.key(5) == "00000005"


def test_index_of_shards_that_are_not_there(tmp_path, capsys, monkeypatch):
    """A mistyped pattern was '0 samples in 2 shards, indexed', exit 0: not one shard is an error
    (as the loaders'), and missing or damaged shards among good ones are named."""
    monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["index", str(tmp_path / "typo-{000000..000001}.tar"), "--workers", "0", "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "gpupipe index: error: not one of the 2 shards could be indexed" in line
    assert "typo-000000.tar' does not exist" in line
    assert main(["make-shards", str(tmp_path), "--synthetic", "4", "--shard-size", "4", "--workers", "1",
                 "--quiet"]) == 0  # fmt: skip
    (tmp_path / "train-000001.tar").write_bytes(b"not a tar")
    assert main(["index", str(tmp_path / "train-{000000..000002}.tar"), "--workers", "0", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("4 samples in 3 shards") and "2 shards missing or damaged (first: shard '" in out
    assert "gpupipe check" in out


def test_index_sizes_spares_the_first_epoch_every_header(tmp_path, capsys, monkeypatch):
    """``index --sizes`` records each image's size as the DALI runner checks it: a DALI loader's
    first epoch then reads no header (issue 53)."""
    pytest.importorskip("nvidia.dali")
    from gpupipe import transforms as T

    from .support.headers import header_reads

    monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["make-shards", str(tmp_path), "--synthetic", "6", "--shard-size", "4", "--workers", "1"]) == 0
    pattern = str(tmp_path / "train-{000000..000001}.tar")
    assert main(["index", pattern, "--workers", "0", "--sizes"]) == 0
    assert "6 image sizes recorded" in capsys.readouterr().out
    read = header_reads(monkeypatch)
    pipe = gp.Pipeline(gp.WebDataset(pattern), [T.RandomResizedCrop(16)])
    with gp.Loader(pipe, 3, backend="dali", device="cpu", seed=0) as loader:
        assert sum(len(b.images) for b in loader) == 6
    assert read == []


COMMANDS = ("make-shards", "index", "check", "bench", "tune", "inspect", "doctor")


class TestHelp:
    @pytest.mark.parametrize("command", (None, *COMMANDS))
    def test_plain_text_with_an_example(self, command, capsys):
        with pytest.raises(SystemExit) as done:
            main(["--help"] if command is None else [command, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "example:\n  python -m gpupipe " in text
        for markup in ("``", ":class:", ":func:", ":meth:", ".. "):  # no reStructuredText
            assert markup not in text, (command, markup)

    def test_every_command_is_listed(self, capsys):
        with pytest.raises(SystemExit):
            main(["--help"])
        description = capsys.readouterr().out.split("positional arguments")[0]
        assert all(f"{c} (" in description for c in COMMANDS)


class TestPipelineAndData:
    """What a user gives the commands that run a pipeline: a directory of shards is taken, and a
    pipeline file's own mistakes are one line naming the file and line."""

    @pytest.fixture
    def bad(self, tmp_path):
        (tmp_path / "bad.py").write_text(
            "import gpupipe as gp\nfrom gpupipe import transforms as T\n\n\ndef typo(source):\n"
            "    return gp.Pipeline(source, [T.RandomResizedCrop(sizee=224)])\n\n\ndef unknown(source):\n"
            "    return gp.Pipeline(source, [T.Normalize(mean=[0.5], std=[0.5], foo=1)])\n"
        )
        (tmp_path / "broken.py").write_text("def train(s:\n")
        return tmp_path

    def test_a_directory_of_shards(self, shards, capsys, tmp_path):
        folder = tmp_path / "shards"
        folder.mkdir()
        for s in shards:
            os.symlink(s, folder / os.path.basename(s))
        (folder / "._train-000000.tar").write_bytes(b"")  # macOS's AppleDouble files are not shards
        folder = str(folder)
        argv = ["bench", "pipelines/imagenet.py:val", folder, "--backend", "torch", "--workers", "0", "--epochs", "1",
                "--batch-size", "4", "--quiet"]  # fmt: skip
        assert main(argv) == 0
        assert f"{len(gp.WebDataset(shards).index())} images" in capsys.readouterr().out

    @pytest.mark.parametrize(
        "spec, message",
        [
            ("bad.py:typo", r"pipeline .*bad\.py:typo: TypeError: RandomResizedCrop\.__init__\(\) got an unexpected "
             r"keyword argument 'sizee'.* \(.*bad\.py:6\)(; did you mean size=\?)?$"),
            ("bad.py:unknown", r"TypeError: .*'foo' \(.*bad\.py:10\); Normalize takes mean, std, inplace$"),
            ("broken.py:train", r"pipeline file '.*broken\.py' failed to import: SyntaxError: .* \(.*broken\.py:1\)$"),
        ],
    )  # fmt: skip
    def test_a_mistake_in_the_pipeline_file_is_one_line(self, bad, shards, capsys, spec, message):
        assert main(["bench", str(bad / spec), shards[0], "--quiet"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert re.search(message, line), line

    def test_a_directory_gets_its_pattern(self, shards, tmp_path):
        folder = os.path.dirname(shards[0])
        with pytest.raises(gp.ConfigError, match=r"is a directory; it holds \d+ tar shards: give them as a pattern, "
                           r"'.*\{0+\.\.0+\d\}\.tar'"):  # fmt: skip
            gp.Pipeline(folder, [])
        with pytest.raises(gp.ConfigError, match=r"use gp\.ImageFolder"):
            gp.Pipeline(str(tmp_path), [])
        with pytest.raises(gp.ConfigError, match="pipeline module 'no_such_module' failed to import: ModuleNotFound"):
            gp.load_pipeline("no_such_module:train")


class TestProgress:
    """Long commands show a tqdm bar on stderr; --quiet turns it off."""

    def test_make_shards_and_index(self, tmp_path, capsys, monkeypatch):
        monkeypatch.setenv("GPUPIPE_CACHE_DIR", str(tmp_path / "cache"))
        assert main(["make-shards", str(tmp_path), "--synthetic", "6", "--shard-size", "4", "--workers", "1"]) == 0
        assert "gpupipe make-shards: 100%" in capsys.readouterr().err
        shards = str(tmp_path / "train-{000000..000001}.tar")
        assert main(["index", shards, "--workers", "0"]) == 0
        err = capsys.readouterr().err
        assert "gpupipe index: 100%" in err and "2/2" in err
        assert main(["index", shards, "--workers", "0", "--quiet"]) == 0
        assert capsys.readouterr().err == ""


class TestBenchGrid:
    def test_backends_batch_sizes_and_the_baseline_plotted(self, tmp_path, capsys):
        pytest.importorskip("matplotlib")
        pytest.importorskip("webdataset")
        main(["make-shards", str(tmp_path), "--synthetic", "16", "--shard-size", "8", "--workers", "1", "--quiet"])
        out, png = tmp_path / "bench.json", tmp_path / "bench.png"
        argv = ["bench", "pipelines/imagenet.py:train", str(tmp_path / "train-{000000..000001}.tar"), "--backend",
                "torch", "--batch-size", "4,8", "--workers", "1", "--epochs", "2", "--baseline", "--plot", str(png),
                "--json", str(out), "--quiet", "--baseline-decoder", "pillow,torchvision"]  # fmt: skip
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "vs dataloader  vs dataloader-torchvision" in text and f"plot: {png}" in text
        torch_row = next(line for line in text.splitlines() if line.startswith("torch "))
        assert torch_row.count("x") == 2  # a ratio to each baseline
        runs = json.loads(out.read_text())["runs"]
        assert [(r["backend"], r["batch_size"]) for r in runs] == [
            ("torch", 4), ("torch", 8), ("dataloader", 4), ("dataloader-torchvision", 4), ("dataloader", 8),
            ("dataloader-torchvision", 8),
        ]  # fmt: skip
        assert all(r["images_per_s"] > 0 and [e["images"] for e in r["epochs"]] == [16, 16] for r in runs)
        from PIL import Image

        with Image.open(png) as image:
            assert image.size == (1300, 400)

    def test_a_profile_says_where_the_time_went_and_plots_it(self, tmp_path, capsys):
        """Issue 54: ``--profile PNG``: each configuration's time per stage per batch in its last
        epoch, the verdict and its remedy, in the output, the JSON and a plot."""
        pytest.importorskip("matplotlib")
        main(["make-shards", str(tmp_path), "--synthetic", "24", "--shard-size", "12", "--workers", "1", "--quiet"])
        out, png = tmp_path / "bench.json", tmp_path / "profile.png"
        backends = "torch,dali" if importlib.util.find_spec("nvidia.dali") else "torch"
        argv = ["bench", "pipelines/imagenet.py:train", str(tmp_path / "train-{000000..000001}.tar"), "--backend",
                backends, "--batch-size", "4", "--workers", "1", "--epochs", "2", "--profile", str(png),
                "--json", str(out), "--quiet"]  # fmt: skip
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "profile, epoch 1, median ms per batch (read..collate: one worker's, 1 workers): read " in text
        assert "| decode " in text and "| loop's wait in next() " in text and f"profile plot: {png}" in text
        assert "| MB read " in text and "| queue ready " in text
        assert text.count("\nbound: ") == len(backends.split(",")) and "\nremedy: " in text
        runs = json.loads(out.read_text())["runs"]
        for r in runs:
            profile = r["profile"]
            assert profile["epoch"] == 1 and len(profile["batches"]) == 6 and profile["bound"]["bound"] is not None
            assert all(b["wait"] >= 0 for b in profile["batches"])
        queue = {"queue_ready", "queue_depth"}  # how full the runner's queue ran
        assert set(runs[0]["profile"]["batches"][1]) == {"wait", "read", "decode", "transform", "collate",
                                                         "read_bytes", *queue}  # fmt: skip
        assert runs[0]["profile"]["batches"][1]["queue_depth"] == 2  # one worker, prefetch 2
        if len(runs) > 1:
            assert "wait: DALI graph" in text and set(runs[1]["profile"]["batches"][1]) == {
                "wait", "wait_read", "wait_graph", "read_bytes", *queue}  # fmt: skip
        from PIL import Image

        with Image.open(png) as image:
            assert image.size == (1000, 280 * len(runs))

    def test_without_profile_no_stage_history_is_kept(self, tmp_path, capsys):
        main(["make-shards", str(tmp_path), "--synthetic", "8", "--shard-size", "8", "--workers", "1", "--quiet"])
        out = tmp_path / "bench.json"
        argv = ["bench", "pipelines/imagenet.py:train", str(tmp_path / "train-000000.tar"), "--backend", "torch",
                "--batch-size", "4", "--workers", "0", "--epochs", "1", "--json", str(out), "--quiet"]  # fmt: skip
        assert main(argv) == 0
        assert (
            "profile, epoch" not in capsys.readouterr().out
            and json.loads(out.read_text())["runs"][0]["profile"] is None
        )

    def test_a_dali_run_says_its_graphs_operators(self, tmp_path, capsys):
        """Issue 37: the operator count in the bench's output (the V2 recipe's, here)."""
        pytest.importorskip("nvidia.dali")
        main(["make-shards", str(tmp_path), "--synthetic", "8", "--shard-size", "8", "--workers", "1", "--quiet"])
        argv = ["bench", "pipelines/imagenet.py:train_v2", str(tmp_path / "train-000000.tar"), "--backend", "dali",
                "--batch-size", "4", "--workers", "1", "--epochs", "1", "--quiet"]  # fmt: skip
        assert main(argv) == 0
        line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("backend=dali"))
        # DALI-CPU hands V2's tail to the stage by default (2026-11-29): its graph ends after decode and
        # geometry, 7 operators (87 with TrivialAugmentWide's branches in it)
        assert 0 < int(line.split("operators=")[1].split()[0]) <= 10

    def test_the_baseline_uses_torchvisions_transforms_of_the_same_names(self):
        from torchvision.transforms import v2

        from gpupipe import transforms as T
        from gpupipe.cli._bench import torchvision_equivalent

        steps = torchvision_equivalent([T.RandomResizedCrop(32, scale=(0.5, 1.0), interpolation="bicubic"),
                                        T.Normalize(mean=[0.5] * 3, std=[0.2] * 3)]).transforms  # fmt: skip
        assert isinstance(steps[0], v2.RandomResizedCrop) and steps[0].scale == (0.5, 1.0)
        assert steps[0].interpolation == v2.InterpolationMode.BICUBIC and isinstance(steps[1], v2.Normalize)
        inner = [T.GaussianBlur(3), T.RandomSolarize(128, p=1.0)]
        (apply,) = torchvision_equivalent([T.RandomApply(inner, 0.8)]).transforms  # the inner ones mapped too
        assert isinstance(apply, v2.RandomApply) and apply.p == 0.8 and isinstance(apply.transforms[0], v2.GaussianBlur)
        assert isinstance(apply.transforms[1], v2.RandomSolarize) and apply.transforms[1].threshold == 128

    def test_the_baseline_takes_the_policies_and_the_batch_transforms(self):
        from torchvision.transforms import v2

        from gpupipe import transforms as T
        from gpupipe.cli._bench import batch_equivalent, torchvision_equivalent

        steps = torchvision_equivalent([T.AutoAugment("svhn", interpolation="bilinear"), T.AugMix(severity=2),
                                        T.TrivialAugmentWide(num_magnitude_bins=11)]).transforms  # fmt: skip
        assert steps[0].policy == v2.AutoAugmentPolicy.SVHN and steps[1].chain_depth == -1
        assert steps[1].severity == 2 and steps[2].num_magnitude_bins == 11
        mix = batch_equivalent(T.RandomChoice([T.MixUp(alpha=0.2, num_classes=5), T.CutMix(num_classes=5)]))
        assert isinstance(mix, v2.RandomChoice) and [type(t) for t in mix.transforms] == [v2.MixUp, v2.CutMix]
        assert mix.transforms[0].alpha == 0.2 and mix.transforms[1].num_classes == 5
        with pytest.raises(gp.ConfigError, match="label smoothing"):
            batch_equivalent(T.MixUp(num_classes=5, label_smoothing=0.1))

    def test_a_bad_list_is_one_line(self, capsys, shards):
        assert main(["bench", "pipelines/imagenet.py:train", shards[0], "--batch-size", "4,x"]) == 2
        assert "--batch-size must be a value or values separated by commas" in capsys.readouterr().err


def test_the_data_stall_benchmark_runs(tmp_path):
    """bench/data_stall.py, tiny: every feeder present gets a row (performance is never asserted)."""
    argv = [sys.executable, os.path.join(ROOT, "bench", "data_stall.py"), "--data", str(tmp_path / "data"),
            "--images", "32", "--steps", "2", "--warmup", "1", "--batch-size", "8", "--image-size", "32",
            "--workers", "1", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = next(tmp_path.glob("*-data-stall-*.md")).read_text()
    assert "| synthetic (on the device) |" in report and "| gpupipe torch" in report and "| dataloader" in report
    torch_row = next(line for line in report.splitlines() if line.startswith("| gpupipe torch"))
    assert float(torch_row.split("|")[4]) >= 0  # the loader's meter over the same steps (issue 54)
    assert report.splitlines()[-1].split("|")[4].strip() == "—"  # (the dataloader has none)


def test_make_shards_into_a_folder_with_a_percent(tmp_path, capsys):
    out = tmp_path / "50%-subset"
    assert main(["make-shards", str(out), "--synthetic", "3", "--shard-size", "2", "--prefix", "a%d", "--workers", "1",
                 "--quiet"]) == 0  # fmt: skip
    assert sorted(os.listdir(out)) == ["a%d-000000.tar", "a%d-000001.tar"]


class TestUsageErrors:
    """A number out of range is a usage error (exit 2, one line naming the option), refused before
    any work: not a traceback, a silent no-op or a misleading result."""

    @pytest.mark.parametrize(
        "argv, option",
        [
            (["make-shards", "OUT", "--synthetic", "4", "--classes", "0"], "--classes"),
            (["make-shards", "OUT", "--synthetic", "4", "--shard-size", "0"], "--shard-size"),
            (["make-shards", "OUT", "--synthetic", "4", "--quality", "500"], "--quality"),
            (["make-shards", "OUT", "--synthetic", "4", "--workers", "-2"], "--workers"),
            (["make-shards", "OUT", "--synthetic", "4", "--seed", "-1"], "--seed"),
            (["index", "SHARD", "--workers", "-1"], "--workers"),
            (["check", "SHARD", "--workers", "-1"], "--workers"),
            (["check", "SHARD", "--max-image-pixels", "-5"], "--max-image-pixels"),
            (["bench", "P.py:f", "SHARD", "--epochs", "0"], "--epochs"),
            (["inspect", "P.py:f", "SHARD", "--cell", "0"], "--cell"),
            (["inspect", "P.py:f", "SHARD", "--samples", "0"], "--samples"),
            (["doctor", "--run", "--images", "0"], "--images"),
        ],
    )
    def test_a_number_out_of_range(self, argv, option, tmp_path, capsys):
        argv = [str(tmp_path / a) if a in ("OUT", "SHARD") else a for a in argv]
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument {option}: must be" in err and "Traceback" not in err
        assert os.listdir(tmp_path) == []  # nothing written


def test_a_reader_that_goes_away_is_no_traceback(tmp_path):
    """``gpupipe check ... --json | head``: the pipe closes while the report is written; the
    command ends as a process killed by SIGPIPE would (141), saying nothing."""
    pattern = str(tmp_path / "gone-{000000..002999}.tar")  # 3000 missing shards: a long report
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT), GPUPIPE_CACHE_DIR=str(tmp_path / "cache"))
    argv = [sys.executable, "-m", "gpupipe", "check", pattern, "--workers", "0", "--no-write", "--quiet", "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10)
    proc.stdout.close()  # as `| head -c 10` does
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


class TestOutputs:
    """A file a command writes at its end that it could not write is a one-line error (exit 2)
    before the work, not a traceback after it."""

    @pytest.mark.parametrize(
        "option, name, message",
        [
            ("--json", "no-such-folder/bench.json", "--json .*: the folder .* does not exist"),
            ("--json", "", "--json .* is a folder"),
            ("--plot", "bench.txt", r"--plot .*: matplotlib writes no '\.txt' files"),
            ("--profile", "profile.txt", r"--profile .*: matplotlib writes no '\.txt' files"),
        ],
    )
    def test_bench(self, option, name, message, shards, tmp_path, capsys):
        pytest.importorskip("matplotlib")
        argv = ["bench", "pipelines/imagenet.py:val", shards[0], "--backend", "torch", "--workers", "0",
                "--epochs", "1", "--batch-size", "4", "--quiet", option, str(tmp_path / name)]  # fmt: skip
        assert main(argv) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.strip().splitlines()
        assert re.search(f"gpupipe bench: error: {message}", line), line
        assert "images/s" not in captured.out  # nothing ran

    @pytest.mark.parametrize("option, values", [("--batch-size", "4,0"), ("--workers", "0,-1")])
    def test_bench_lists_out_of_range(self, option, values, shards, capsys):
        """A list's value out of range is refused before the work: the configurations before it
        were benchmarked first (every epoch of them), then the command failed on it."""
        argv = ["bench", "pipelines/imagenet.py:val", shards[0], "--backend", "torch", "--workers", "0",
                "--epochs", "1", "--batch-size", "4", "--quiet", option, values]  # fmt: skip
        assert main(argv) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.strip().splitlines()
        assert re.search(f"gpupipe bench: error: {option} values must be", line), line
        assert "images/s" not in captured.out  # nothing ran

    @pytest.mark.parametrize(
        "name, message",
        [
            ("", "--out .* is a folder"),
            ("grid.txt", r"--out .*: Pillow writes no '\.txt' files"),
            ("grid.psd", r"--out .*: Pillow writes no '\.psd' files"),  # (it reads them: was a KeyError at the end)
        ],
    )
    def test_inspect(self, name, message, shards, tmp_path, capsys):
        argv = ["inspect", "pipelines/imagenet.py:val", shards[0], "--backend", "torch", "--samples", "1",
                "--draws", "1", "--out", str(tmp_path / name)]  # fmt: skip
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert re.search(f"gpupipe inspect: error: {message}", line), line


class TestMakeShardsOverExistingShards:
    """make-shards into a folder holding shards of the same prefix: refused unless --overwrite,
    which removes them first (a pattern or the folder would otherwise read old shards beside the
    new ones: 30 samples written, then 10, and a glob read 30)."""

    def make(self, out, n, *more):
        return main(["make-shards", str(out), "--synthetic", str(n), "--shard-size", "4", "--workers", "1", "--quiet",
                     *more])  # fmt: skip

    def test_refused_without_overwrite(self, tmp_path, capsys):
        assert self.make(tmp_path, 10) == 0
        before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
        capsys.readouterr()
        assert self.make(tmp_path, 4) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "already holds 3 shards named train-NNNNNN.tar" in line and "--overwrite" in line
        assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before  # untouched
        assert self.make(tmp_path, 4, "--prefix", "val") == 0  # another prefix is another dataset
        assert self.make(tmp_path / "new", 4) == 0

    def test_overwrite_removes_the_old_shards_and_their_lists(self, tmp_path, capsys):
        assert self.make(tmp_path, 12) == 0
        (tmp_path / "train-000002.tar.bad.json").write_text("{}")
        (tmp_path / "train-000001.tar.gpupipe.json").write_text("{}")
        (tmp_path / "notes.txt").write_text("mine")
        assert self.make(tmp_path, 4, "--overwrite") == 0
        assert sorted(os.listdir(tmp_path)) == ["notes.txt", "train-000000.tar"]
        assert "removed 3 shards" in capsys.readouterr().out
        assert len(gp.WebDataset(sorted(str(p) for p in tmp_path.glob("*.tar"))).index()) == 4

    def test_a_prefix_naming_a_sub_folder(self, tmp_path, capsys):
        """``--prefix sub/train`` writes into ``OUT/sub``: the shards there are the old ones (they
        were looked for in ``OUT``, and 2 of 3 old shards stayed beside 1 new one)."""
        assert self.make(tmp_path, 10, "--prefix", "sub/train") == 0
        assert self.make(tmp_path, 4, "--prefix", "sub/train") == 2
        assert "already holds 3 shards named sub/train-NNNNNN.tar" in capsys.readouterr().err
        assert self.make(tmp_path, 4, "--prefix", "sub/train", "--overwrite") == 0
        assert sorted(os.listdir(tmp_path / "sub")) == ["train-000000.tar"]
