"""The examples, run as users run them: ``examples/train_imagenet.py`` under torchrun with 2
processes (gloo, CPU) for both loaders, and ``examples/train.py``."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from gpupipe.testing import encode_jpeg, synthetic_image

from .support.data import label_of, write_webdataset_shards
from .support.targets import DIST_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = 5  # label_of(n) = 7n mod 5; the image's hue follows its label: a signal a small model learns


def _val_image(n: int):
    return synthetic_image(10_000 + n, label=label_of(n), size=(64, 80))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("imagenet")
    for name in ("train", "val"):
        os.makedirs(root / name)
    train = write_webdataset_shards(str(root / "train"), (64,) * 4, prefix="train")
    val = write_webdataset_shards(str(root / "val"), (31, 30), prefix="val", image=_val_image)
    folder = root / "val-folder"  # the same 61 validation images as an ImageFolder tree
    for n in range(61):
        os.makedirs(folder / f"class{label_of(n)}", exist_ok=True)
        (folder / f"class{label_of(n)}" / f"{n:04d}.jpg").write_bytes(encode_jpeg(_val_image(n)))
    train_folder = root / "train-folder"
    for n in range(128):
        os.makedirs(train_folder / f"class{label_of(n)}", exist_ok=True)
        image = synthetic_image(n, label=label_of(n), size=(64, 80))
        (train_folder / f"class{label_of(n)}" / f"{n:04d}.jpg").write_bytes(encode_jpeg(image))
    return {
        "train": os.path.join(os.path.dirname(train[0]), "train-{000000..000003}.tar"),
        "val": os.path.join(os.path.dirname(val[0]), "val-{000000..000001}.tar"),
        "train_folder": str(train_folder),
        "val_folder": str(folder),
    }


def train_imagenet(tmp_path, *args: str, processes: int = 2) -> dict:
    """Runs examples/train_imagenet.py under torchrun; returns rank 0's JSON log."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1")
    log = str(tmp_path / "log.json")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            os.path.join(ROOT, "examples", "train_imagenet.py"), "--arch", "tiny", "--image-size", "32",
            "--num-classes", str(CLASSES), "--batch-size", "16", "--lr", "0.2", "--workers", "1",
            "--log-json", log, *args]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if not os.path.exists(log):
        return {"stderr": proc.stderr}
    with open(log) as f:
        result = json.load(f)
    result["stderr"] = proc.stderr
    return result


class TestTrainImagenet:
    def test_gpupipe_two_ranks_learn_and_count_each_sample_once(self, data, tmp_path):
        log = train_imagenet(tmp_path, "--train", data["train"], "--val", data["val"], "--epochs", "3")
        epochs = log["epochs"]
        assert log["world_size"] == 2 and len(epochs) == 3
        assert epochs[-1]["loss"] < epochs[0]["loss"]  # it learns
        assert all(e["val_counted"] == e["val_size"] == 61 for e in epochs)  # 61 over 2 ranks: each once
        assert all(e["train_samples"] == 256 for e in epochs)  # 8 steps x 16 x 2 ranks
        assert all(0 <= e["data_wait_pct"] <= 100 and e["images_per_s"] > 0 for e in epochs)
        assert "(each once)" in log["stderr"]

    def test_dataloader_over_shards(self, data, tmp_path):
        log = train_imagenet(tmp_path, "--train", data["train"], "--val", data["val"], "--epochs", "3",
                             "--loader", "dataloader")  # fmt: skip
        epochs = log["epochs"]
        assert epochs[-1]["loss"] < epochs[0]["loss"]
        assert all(e["train_samples"] == 256 for e in epochs)  # equal steps on both ranks

    def test_dataloader_over_an_image_folder_reports_its_padding(self, data, tmp_path):
        log = train_imagenet(tmp_path, "--train", data["train_folder"], "--val", data["val_folder"], "--epochs",
                             "2", "--loader", "dataloader")  # fmt: skip
        # DistributedSampler pads 61 samples to 2 x 31: one sample counted twice, and said so
        assert all(e["val_counted"] == 62 and e["val_size"] == 61 for e in log["epochs"])
        assert "+1 against the 61 of the set" in log["stderr"]

    @pytest.mark.parametrize("loader", ["gpupipe", "dataloader"])
    def test_the_v2_recipe_trains(self, data, tmp_path, loader):
        """torchvision's IMAGENET1K_V2 flags: TrivialAugmentWide, RandomErasing, MixUp or CutMix per
        batch (soft targets into the loss), and with gpupipe repeated augmentation."""
        flags = ["--auto-augment", "ta_wide", "--random-erase", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha",
                 "1.0", "--val-resize", "40", "--val-size", "36"]  # fmt: skip
        if loader == "gpupipe":
            flags += ["--ra-reps", "2"]
        log = train_imagenet(tmp_path, "--train", data["train"], "--val", data["val"], "--epochs", "2",
                             "--loader", loader, *flags)  # fmt: skip
        epochs = log["epochs"]
        assert len(epochs) == 2 and all(math.isfinite(e["loss"]) and e["loss"] > 0 for e in epochs)
        assert all(e["train_samples"] == 256 for e in epochs)  # the epoch keeps its length with repeats
        assert all(e["val_counted"] >= 61 for e in epochs)

    def test_progressive_resizing_changes_the_train_size_per_epoch(self, data, tmp_path):
        log = train_imagenet(tmp_path, "--train", data["train"], "--val", data["val"], "--epochs", "3",
                             "--min-res", "16", "--ramp", "0", "2", "--res-step", "8", processes=1)  # fmt: skip
        assert [e["train_size"] for e in log["epochs"]] == [16, 24, 32]
        assert all(e["train_samples"] == 256 and e["val_counted"] == 61 for e in log["epochs"])
        assert "epoch 2 (train at 32)" in log["stderr"]

    def test_gpupipe_resumes_mid_epoch_from_the_checkpoint(self, data, tmp_path):
        ckpt = str(tmp_path / "ckpt.pt")
        common = ("--train", data["train"], "--val", data["val"], "--epochs", "2", "--checkpoint", ckpt)
        stopped = train_imagenet(tmp_path, *common, "--stop-after", "3")
        assert "stopped after step 3 (epoch 0)" in stopped["stderr"] and os.path.exists(ckpt)
        log = train_imagenet(tmp_path, *common, "--resume")
        assert "resumed at epoch 0, step 3" in log["stderr"]
        first, second = log["epochs"]
        assert first["train_samples"] == (8 - 3) * 32  # the rest of epoch 0, each rank from its position
        assert second["train_samples"] == 256 and second["val_counted"] == 61


def test_train_example_runs(shards, tmp_path):
    """examples/train.py: one process, one epoch."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    argv = [sys.executable, os.path.join(ROOT, "examples", "train.py"), shards[0], "--size", "32", "--batch-size",
            "4", "--classes", "5", "--backend", "torch"]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "each counted once" in proc.stderr


@pytest.mark.parametrize("pipeline", ["pipelines/ssl.py:simclr", "pipelines/ssl.py:dino"])
def test_ssl_example_runs(shards, tmp_path, pipeline):
    """examples/train_ssl.py: one process, one epoch of SimCLR's loss over a pipeline of views."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    argv = [sys.executable, os.path.join(ROOT, "examples", "train_ssl.py"), shards[0], "--pipeline", pipeline,
            "--size", "32", "--batch-size", "4", "--epochs", "2", "--backend", "torch"]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [
        float(line.split("mean loss ")[1].split(",")[0]) for line in proc.stderr.splitlines() if "mean loss" in line
    ]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


@pytest.mark.parametrize("layout", ["folder", "shards"])
def test_the_migrated_pytorch_examples_script(tmp_path, data, layout):
    """examples/imagenet_main.py — pytorch/examples' ImageNet script migrated — for one epoch under
    torchrun with 2 processes (gloo, CPU): it trains, and validation counts each sample once."""
    root = tmp_path / "imagenet"
    root.mkdir()
    if layout == "folder":
        os.symlink(data["train_folder"], root / "train")
        os.symlink(data["val_folder"], root / "val")
    else:
        import glob

        for name in ("train", "val"):
            for i, path in enumerate(sorted(glob.glob(os.path.join(os.path.dirname(data[name]), f"{name}-*.tar")))):
                os.symlink(path, root / f"{name}-{i:06d}.tar")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            os.path.join(ROOT, "examples", "imagenet_main.py"), str(root), "-a", "resnet18", "--epochs", "1",
            "-b", "32", "-j", "1", "--image-size", "32", "-p", "1", "--backend", "torch", "--seed", "0"]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Epoch: [0][" in proc.stdout and re.search(r"\* +Acc@1 [0-9.]+ Acc@5 [0-9.]+", proc.stdout)
    assert " * counted 61 validation samples" in proc.stdout  # 61 over 2 ranks, each once
    assert (tmp_path / "checkpoint.pth.tar").exists()


def test_growing_example_trains_on_more_each_epoch(tmp_path):
    """examples/growing.py: a producer process writes 4 shards of 8 in the background; the epochs
    never shrink, and the last (after the producer ended) reads all 32 samples."""
    argv = [sys.executable, os.path.join(ROOT, "examples", "growing.py"), str(tmp_path / "shards"), "--shards", "4",
            "--per-shard", "8", "--interval", "0.3", "--epochs", "3", "--backend", "torch"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = [tuple(map(int, m)) for m in re.findall(r"epoch \d+: (\d+) shards, (\d+) samples", proc.stdout)]
    assert len(epochs) == 3 and epochs == sorted(epochs), proc.stdout
    assert epochs[-1] == (4, 32) and all(n == 8 * s for s, n in epochs)


def test_segmentation_example_learns(tmp_path):
    """examples/train_segmentation.py: synthetic image + mask shards, a tiny network, CPU; the
    loss falls and the pixel accuracy rises over the epochs."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    argv = [sys.executable, os.path.join(ROOT, "examples", "train_segmentation.py"), "--make", str(tmp_path / "seg"),
            "64", "--epochs", "4", "--base-size", "64", "--crop-size", "48", "--batch-size", "8",
            "--workers", "0"]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = [line for line in proc.stderr.splitlines() if "mean loss" in line]
    losses = [float(line.split("mean loss ")[1].split(",")[0]) for line in epochs]
    accuracy = [float(line.split("pixel accuracy ")[1].split()[0]) for line in epochs]
    assert len(epochs) == 4 and losses[-1] < losses[0] and accuracy[-1] > accuracy[0]


def test_detection_example_learns(tmp_path):
    """examples/train_detection.py: synthetic image + boxes shards, torchvision's Faster R-CNN
    (MobileNetV3) on the SSDlite preset, CPU; the loss falls over the epochs."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    argv = [sys.executable, os.path.join(ROOT, "examples", "train_detection.py"), "--make", str(tmp_path / "det"),
            "32", "--epochs", "2", "--size", "96", "--batch-size", "8", "--workers", "0"]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split("mean loss ")[1].split()[0]) for line in proc.stderr.splitlines() if "mean loss" in line]
    assert len(losses) == 2 and losses[-1] < losses[0]
