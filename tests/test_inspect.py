"""python -m gpupipe inspect: the grid shows the pipeline's outputs, and backends side by side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe as gp
from gpupipe import backends
from gpupipe.cli._inspect import HEADER, LABEL_WIDTH, MARGIN, to_uint8
from gpupipe.cli._main import main

PIPELINE = "pipelines/imagenet.py:train"


def read_png(path) -> Image.Image:
    with Image.open(path) as png:
        return png.convert("RGB")


def cell(png: Image.Image, row: int, column: int, size: int) -> np.ndarray:
    x = LABEL_WIDTH + MARGIN + column * (size + MARGIN)
    y = HEADER + MARGIN + row * (size + MARGIN)
    return np.asarray(png)[y : y + size, x : x + size]


class TestInspect:
    def test_the_grid_shows_each_draw_of_each_sample(self, shards, tmp_path, capsys):
        out = tmp_path / "grid.png"
        code = main(["inspect", PIPELINE, shards[0], "--samples", "3", "--draws", "2", "--backend", "torch",
                     "--out", str(out)])  # fmt: skip
        assert code == 0 and "3 samples x 2 draws, output [3, 224, 224]" in capsys.readouterr().out
        png = read_png(out)
        assert png.size == (LABEL_WIDTH + 2 * (224 + MARGIN) + MARGIN, HEADER + 3 * (224 + MARGIN) + MARGIN)
        pipeline = gp.load_pipeline(PIPELINE)(shards[0])
        with gp.Loader(pipeline, 3, backend="torch", device="cpu", num_workers=0, seed=0) as loader:
            for draw in range(2):
                loader.set_epoch(draw)
                images = to_uint8(next(iter(loader)).images, pipeline)
                for row in range(3):
                    np.testing.assert_array_equal(cell(png, row, draw, 224), images[row])
        assert not np.array_equal(cell(png, 0, 0, 224), cell(png, 0, 1, 224))  # two different draws

    def test_an_image_folder_scaled_cells(self, image_folder, tmp_path):
        out = tmp_path / "grid.png"
        assert main(["inspect", PIPELINE, image_folder, "--samples", "2", "--draws", "1", "--backend", "torch",
                     "--cell", "64", "--out", str(out)]) == 0  # fmt: skip
        assert read_png(out).size == (LABEL_WIDTH + 64 + 2 * MARGIN, HEADER + 2 * (64 + MARGIN) + MARGIN)

    def test_compare_puts_the_backends_side_by_side(self, shards, tmp_path, capsys):
        if not backends.get("dali").available():
            pytest.skip("needs DALI")
        out = tmp_path / "grid.png"
        assert main(["inspect", PIPELINE, shards[0], "--samples", "2", "--draws", "2", "--compare",
                     "--out", str(out)]) == 0  # fmt: skip
        report = capsys.readouterr().out
        assert "backends: dali, torch" in report and "torch vs dali: largest difference" in report
        largest = float(report.split("largest difference ")[1].split(",")[0])
        assert largest < 0.5  # normalized units: the same crops, resampled slightly differently
        png = read_png(out)
        assert png.size[0] == LABEL_WIDTH + 4 * (224 + MARGIN) + MARGIN
        dali, torch_ = cell(png, 0, 0, 224).astype(int), cell(png, 0, 1, 224).astype(int)
        assert np.abs(dali - torch_).mean() < 3  # side by side, the same draw

    def test_the_v2_recipe_with_its_soft_labels(self, shards, tmp_path, capsys):
        """TrivialAugmentWide, RandomErasing and MixUp/CutMix drawn, on every backend side by side;
        a soft label shows its two heaviest classes."""
        from gpupipe.cli._inspect import label_text

        out = tmp_path / "grid.png"
        assert main(["inspect", "pipelines/imagenet.py:train_v2", shards[0], "--samples", "2", "--draws", "2",
                     "--compare", "--cell", "64", "--out", str(out)]) == 0  # fmt: skip
        report = capsys.readouterr().out
        assert "output [3, 176, 176]" in report and out.exists()
        assert label_text([0.0, 0.13, 0.0, 0.87]) == "3: 0.87, 1: 0.13" and label_text(4) == "4"

    def test_a_wrong_pipeline_is_one_line(self, shards, capsys):
        assert main(["inspect", "pipelines/imagenet.py:nope", shards[0]]) == 2
        assert "has no function 'nope'" in capsys.readouterr().err


class TestDisplay:
    """What the grid shows of outputs that are not the ImageNet recipe's."""

    def test_a_normalize_followed_by_a_flip_is_undone(self, shards):
        import torch

        from gpupipe import transforms as T

        steps = [T.CenterCrop(16), T.ToDtype(torch.float32, scale=True), T.Normalize([0.5] * 3, [0.25] * 3)]
        plain = gp.Pipeline(shards[0], steps[:2])
        flipped = gp.Pipeline(shards[0], [*steps, T.RandomHorizontalFlip(p=1.0)])
        with gp.Loader(plain, 2, backend="torch", device="cpu", num_workers=0) as a:
            want = to_uint8(next(iter(a)).images, plain)
        with gp.Loader(flipped, 2, backend="torch", device="cpu", num_workers=0) as b:
            got = to_uint8(next(iter(b)).images, flipped)
        assert np.abs(got[:, :, ::-1].astype(int) - want.astype(int)).max() <= 1

    def test_floats_without_scale_are_not_multiplied(self, shards):
        import torch

        from gpupipe import transforms as T

        pipe = gp.Pipeline(shards[0], [T.CenterCrop(16), T.ToDtype(torch.float32)])  # values 0..255
        with gp.Loader(pipe, 2, backend="torch", device="cpu", num_workers=0) as loader:
            images = next(iter(loader)).images
        np.testing.assert_array_equal(to_uint8(images, pipe), images.permute(0, 2, 3, 1).to(torch.uint8).numpy())


VIEWS = """
import torch
import gpupipe as gp
from gpupipe import transforms as T


def two(source):
    return gp.Pipeline(source, views=[[T.RandomResizedCrop(32), T.ToDtype(torch.float32, scale=True)],
                                      [T.RandomResizedCrop(16), T.RandomGrayscale(p=1.0)]])
"""


class TestInspectViews:
    def test_every_view_of_each_draw_is_shown_at_its_size(self, shards, tmp_path, capsys):
        (tmp_path / "views.py").write_text(VIEWS)
        spec, out = f"{tmp_path / 'views.py'}:two", tmp_path / "grid.png"
        assert main(["inspect", spec, shards[0], "--samples", "2", "--draws", "2", "--backend", "torch",
                     "--out", str(out)]) == 0  # fmt: skip
        assert "2 samples x 2 draws, outputs [3, 32, 32], [3, 16, 16]" in capsys.readouterr().out
        png = np.asarray(read_png(out))
        assert png.shape[1] == LABEL_WIDTH + 2 * (32 + MARGIN + 16 + MARGIN) + MARGIN
        assert png.shape[0] == 2 * HEADER + 2 * (32 + MARGIN) + MARGIN
        pipeline = gp.load_pipeline(spec)(shards[0])
        with gp.Loader(pipeline, 2, backend="torch", device="cpu", num_workers=0, seed=0) as loader:
            loader.set_epoch(1)
            views = next(iter(loader)).views
        x = LABEL_WIDTH + MARGIN + (32 + MARGIN + 16 + MARGIN)  # draw 1, view 0
        for row in range(2):
            y = 2 * HEADER + MARGIN + row * (32 + MARGIN)  # two title rows: draw, view
            np.testing.assert_array_equal(png[y : y + 32, x : x + 32], to_uint8(views[0], pipeline, 0)[row])
            small = png[y : y + 16, x + 32 + MARGIN : x + 32 + MARGIN + 16]
            np.testing.assert_array_equal(small, to_uint8(views[1], pipeline, 1)[row])
            assert (small[..., 0] == small[..., 1]).all()  # view 1 is grey


class TestMasksAndBoxes:
    """A pipeline's masks and boxes drawn over its images (``overlay``)."""

    def test_overlay_colours_labels_fill_and_outlines(self):
        from gpupipe.cli._inspect import _BOX, _PALETTE, overlay

        images = np.zeros((1, 10, 12, 3), np.uint8)
        mask = np.full((1, 10, 12), 255, np.uint8)
        mask[0, :5] = 3
        boxes = gp.fields.Padded(torch.tensor([[[2.0, 3.0, 8.0, 7.0], [0, 0, 0, 0]]]), torch.tensor([[1, 2]]))
        fields = {"mask": gp.fields.Mask("seg.png"), "boxes": gp.fields.Boxes("boxes.npy")}
        out = overlay(images, {"mask": torch.from_numpy(mask), "boxes": boxes}, fields)
        np.testing.assert_array_equal(out[0, 0, 0], np.round(0.45 * _PALETTE[3]).astype(np.uint8))  # label 3
        np.testing.assert_array_equal(out[0, 9, 11], [128, 128, 128])  # the fill: white, half
        assert (out[0, 3, 2:8] == _BOX).all() and (out[0, 6, 2:8] == _BOX).all()  # rows 3 and 6
        assert (out[0, 3:7, 2] == _BOX).all() and (out[0, 3:7, 7] == _BOX).all()  # columns 2 and 7
        assert not (out[0, 4, 3:7] == _BOX).all(axis=-1).any()  # inside: not drawn
        thick = overlay(images, {"boxes": boxes}, fields, width=2)  # (scaled down to a cell: wider, inside the box)
        assert (thick[0, 3:5, 2:8] == _BOX).all() and (thick[0, 3:7, 6:8] == _BOX).all()
        assert not (thick[0, 2, 2:8] == _BOX).all(axis=-1).any()  # not outside the box

    def test_inspect_draws_them_on_every_backend(self, tmp_path, capsys):
        from gpupipe.testing import encode_jpeg, encode_png, synthetic_image

        with gp.ShardWriter(str(tmp_path / "s-%06d.tar")) as w:
            for i in range(2):
                labels = (np.arange(48 * 64).reshape(48, 64) // 300 % 5).astype(np.uint8)
                w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=(48, 64))), "seg.png": encode_png(labels),
                                  "boxes.npy": np.array([[4, 4, 40, 30]], np.float32)})  # fmt: skip
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png"),
                                                 "boxes": gp.fields.Boxes("boxes.npy")})  # fmt: skip
        pipeline = gp.Pipeline(source, [gp.transforms.RandomResizedCrop(32, scale=(0.5, 1.0)),
                                        gp.transforms.RandomHorizontalFlip()])  # fmt: skip
        from gpupipe.cli._inspect import _BOX, inspect

        names = ("torch", "dali") if backends.get("dali").available() else ("torch",)
        out = str(tmp_path / "grid.png")
        lines = inspect(pipeline, out, samples=2, draws=2, backends=names)
        assert lines[0].startswith(f"wrote {out}: 2 samples x 2 draws")
        png = np.asarray(read_png(out))
        assert (png == _BOX).all(axis=-1).sum() > 40  # the boxes' outlines
