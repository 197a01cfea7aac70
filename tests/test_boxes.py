"""Bounding boxes (``gp.fields.Boxes``, issue 39 step 3): moved by every geometric transform with
the image's draws through torchvision v2's box kernels, clamped, and sanitized as torchvision's
``SanitizeBoundingBoxes`` does (with their labels); on the torch backend (and Ray, through it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, encode_png, synthetic_image

from .support.checkers import check_target_parity

SIZE = (60, 80)  # (height, width)


def _box(i: int) -> np.ndarray:
    """Sample ``i``'s box, XYXY in pixels, well inside the image."""
    x1, y1 = 8 + 3 * i, 6 + 2 * i
    return np.array([[x1, y1, x1 + 30 - i, y1 + 20 + i]], np.float32)


@pytest.fixture(scope="module")
def box_shards(tmp_path_factory) -> list[str]:
    """10 samples: a photo, its box (``boxes.npy``, XYXY), the box's labels (``labels.npy``), and a
    mask that is 1 exactly inside the box (``seg.png``), to check the box's geometry against."""
    root = tmp_path_factory.mktemp("boxes")
    with gp.ShardWriter(str(root / "b-%06d.tar"), max_count=10) as w:
        for i in range(10):
            box = _box(i)
            inside = np.zeros(SIZE, np.uint8)
            x1, y1, x2, y2 = box[0].astype(int)
            inside[y1:y2, x1:x2] = 1
            w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=SIZE)), "boxes.npy": box,
                              "labels.npy": np.array([i], np.int64), "seg.png": encode_png(inside)})  # fmt: skip
    return w.shards


def _source(urls, **box_options):
    return gp.WebDataset(urls, fields={
        "image": "jpg",
        "boxes": gp.fields.Boxes("boxes.npy", labels="classes", **box_options),
        "classes": gp.fields.Array("labels.npy"),
        "inside": gp.fields.Mask("seg.png", fill=0),
    })  # fmt: skip


def _batches(source, steps, batch_size=5, backend="torch"):
    with gp.Loader(gp.Pipeline(source, steps), batch_size, shuffle=True, seed=3, num_workers=0, backend=backend,
                   device="cpu") as loader:  # fmt: skip
        loader.set_epoch(1)
        return list(loader)


GEOMETRIES = {
    "flips": ([T.RandomHorizontalFlip(), T.RandomVerticalFlip(), T.CenterCrop(SIZE)], 0.0),
    "resized crop": ([T.RandomResizedCrop((48, 64), scale=(0.6, 1.0)), T.RandomHorizontalFlip()], 1.5),
    "resize and center crop": ([T.Resize(45), T.CenterCrop((40, 56))], 1.0),
    "random resize and padded crop": ([T.RandomResize(40, 80), T.RandomCrop(64, pad_if_needed=True)], 1.5),
    "rotation": ([T.RandomRotation(25), T.CenterCrop(SIZE)], 2.0),
    "affine": ([T.RandomAffine(15, translate=(0.1, 0.1), scale=(0.9, 1.1)), T.CenterCrop(SIZE)], 2.0),
}  # fmt: skip


class TestGeometry:
    @pytest.mark.parametrize("name", list(GEOMETRIES))
    def test_the_box_encloses_the_region_it_was_drawn_around(self, box_shards, name):
        """Each box, moved with the image, is the bounding box of the mask region that was
        exactly inside it (nearest: within the stated pixels; rotated: torchvision's enclosing box
        of the rotated corners, so the region lies inside it)."""
        steps, tolerance = GEOMETRIES[name]
        for batch in _batches(_source(box_shards), steps):
            boxes = batch["boxes"]
            assert isinstance(boxes, gp.fields.Padded) and boxes.data.dtype == torch.float32
            for j in range(len(batch.keys)):
                ys, xs = torch.nonzero(batch["inside"][j], as_tuple=True)
                if boxes.lengths[j, 0] == 0:  # dropped: its region is (nearly) gone too
                    assert len(xs) < 4
                    continue
                x1, y1, x2, y2 = boxes.data[j, 0].tolist()
                region = (xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1)
                if name in ("rotation", "affine"):  # the region inside its enclosing box
                    assert x1 - 1 <= region[0] and y1 - 1 <= region[1] and region[2] <= x2 + 1 and region[3] <= y2 + 1
                else:
                    got = (x1, y1, x2, y2)
                    assert max(abs(a - b) for a, b in zip(got, region, strict=True)) <= tolerance, (name, got, region)
                assert batch["classes"][j].tolist() == [int(batch.keys[j][1:])]  # its label kept with it

    def test_left_out_of_the_crop_dropped_with_their_labels(self, tmp_path):
        """Boxes that a crop leaves thinner than ``min_size`` go, their labels with them; the
        others are clamped to the image."""
        boxes = np.array([[0, 0, 10, 10], [70, 50, 80, 60], [30, 20, 79, 59]], np.float32)  # the last clamped
        with gp.ShardWriter(str(tmp_path / "c-%06d.tar")) as w:
            w.write("k0", {"jpg": encode_jpeg(synthetic_image(0, size=SIZE)), "boxes.json": json.dumps(boxes.tolist()),
                           "cls.json": ["a", "b", "c"]})  # fmt: skip
        source = gp.WebDataset(w.shards, fields={
            "image": "jpg", "boxes": gp.fields.Boxes("boxes.json", labels="names", min_size=2, pad=None),
            "names": gp.fields.Json("cls.json")})  # fmt: skip
        (batch,) = _batches(source, [T.CenterCrop((40, 60))], batch_size=1)  # window x 10..70, y 10..50
        assert batch["names"] == [["c"]]
        assert batch["boxes"][0].tolist() == [[20.0, 10.0, 60.0, 40.0]]

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_no_area_goes_whatever_min_size(self, tmp_path, backend):
        """``min_size=0`` kept boxes of no area (those ``RandomIoUCrop`` zeroes, and ones a crop
        leaves as a line); ``min_area`` (default 1.0, torchvision's) drops them, labels with them."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        boxes = np.array([[0, 0, 0, 0], [5, 5, 5, 30], [5, 5, 5.5, 30], [5, 5, 5.5, 6], [10, 10, 20, 20]], np.float32)
        with gp.ShardWriter(str(tmp_path / "a-%06d.tar")) as w:
            w.write("k0", {"jpg": encode_jpeg(synthetic_image(0, size=SIZE)), "boxes.npy": boxes,
                           "labels.npy": np.arange(5)})  # fmt: skip
        for min_area, kept in ((1.0, [2, 4]), (0.0, [0, 1, 2, 3, 4]), (12.5, [2, 4]), (12.6, [4])):
            boxes_field = gp.fields.Boxes("boxes.npy", labels="l", min_size=0, min_area=min_area, pad=None)
            fields = {"image": "jpg", "boxes": boxes_field, "l": gp.fields.Array("labels.npy")}
            source = gp.WebDataset(w.shards, fields=fields)
            (batch,) = _batches(source, [T.CenterCrop(SIZE)], batch_size=1, backend=backend)
            assert batch["l"][0].tolist() == kept, min_area
            assert batch["boxes"][0].tolist() == boxes[kept].tolist()

    def test_formats_are_kept(self, box_shards):
        """The same four numbers read as XYWH: flipped as XYWH boxes (x' = W - x - w), and given
        back as XYWH."""
        (batch,) = _batches(_source(box_shards, format="XYWH"), [T.RandomHorizontalFlip(1.0), T.CenterCrop(SIZE)],
                            batch_size=10)  # fmt: skip
        raw = torch.stack([torch.from_numpy(_box(int(k[1:]))[0]) for k in batch.keys])
        x, y, w, h = raw.unbind(1)
        left, right = (SIZE[1] - x - w).clamp(0, SIZE[1]), (SIZE[1] - x).clamp(0, SIZE[1])  # clamped to the image
        bottom = (y + h).clamp(0, SIZE[0])
        expected = torch.stack([left, y, right - left, bottom - y], 1)
        assert torch.equal(batch["boxes"].data[:, 0], expected)


class TestDali:
    """The DALI backend moves boxes in its reader threads, from each image's size in its header,
    with the torch backend's code: the same boxes and labels, exactly."""

    @pytest.mark.parametrize("name", list(GEOMETRIES))
    def test_the_same_boxes_as_torch(self, box_shards, name):
        check_target_parity(_source(box_shards), GEOMETRIES[name][0], batch_size=5)

    def test_unpadded_and_a_crop_too_large_for_some(self, box_shards):
        """``pad=None`` (not padded), and a RandomCrop a sample cannot take: skipped alike on both."""
        out = check_target_parity(_source(box_shards, pad=None), [T.RandomResize(30, 90), T.RandomCrop(56)],
                                  batch_size=5, on_error="skip", max_skipped=None)  # fmt: skip
        assert any(not bool(b.valid.all()) for b in out["dali"])
        assert not isinstance(out["dali"][0]["boxes"], gp.fields.Padded)


class TestBadBoxes:
    @pytest.mark.parametrize(("member", "match"), [
        (np.zeros((2, 3), np.float32), r"shape \(2, 3\), not \[K, 4\]"),
        (np.array([[0, 0, np.inf, 4]], np.float32), "not finite"),
        (np.array([[0, np.nan, 3, 4]], np.float32), "not finite"),
        (b"not json", "neither .npy nor a JSON list"),
    ], ids=["shape", "inf", "nan", "not json"])  # fmt: skip
    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_named(self, tmp_path, member, match, backend):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.ShardWriter(str(tmp_path / "b-%06d.tar")) as w:
            w.write("k0", {"jpg": encode_jpeg(synthetic_image(0, size=SIZE)), "boxes.npy": member})
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "boxes": gp.fields.Boxes("boxes.npy")})
        with pytest.raises(gp.SampleError, match=match) as raised:
            _batches(source, [T.CenterCrop(20)], batch_size=1, backend=backend)
        assert raised.value.key == "k0" and raised.value.kind == gp.Damage.BAD_FIELD

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_labels_that_do_not_match(self, tmp_path, backend):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.ShardWriter(str(tmp_path / "b-%06d.tar")) as w:
            w.write("k0", {"jpg": encode_jpeg(synthetic_image(0, size=SIZE)), "boxes.npy": _box(0),
                           "labels.npy": np.array([1, 2], np.int64)})  # fmt: skip
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "boxes": gp.fields.Boxes("boxes.npy", labels="l"),
                                                 "l": gp.fields.Array("labels.npy")})  # fmt: skip
        with pytest.raises(gp.SampleError, match="has 1 'boxes' boxes but 2 'l' labels"):
            _batches(source, [T.CenterCrop(20)], batch_size=1, backend=backend)

    @pytest.mark.parametrize(("member", "spec"), [
        ({"labels.npy": np.array(3)}, gp.fields.Array("labels.npy")),
        ({"labels.json": 3}, "labels.json"),
        ({"cls": 3}, "cls"),
    ], ids=["0-d array", "json number", "cls"])  # fmt: skip
    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_labels_that_are_not_rows(self, tmp_path, member, spec, backend):
        """Labels that are one value, not one row per box: a bad field naming the sample (was a
        ``TypeError`` from ``len()``, not skipped under ``on_error="skip"``)."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.ShardWriter(str(tmp_path / "b-%06d.tar")) as w:
            w.write("k0", {"jpg": encode_jpeg(synthetic_image(0, size=SIZE)), "boxes.npy": _box(0), **member})
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "boxes": gp.fields.Boxes("boxes.npy", labels="l"),
                                                 "l": spec})  # fmt: skip
        with pytest.raises(gp.SampleError, match=r"'l' labels .* are not a list or an array of one row") as raised:
            _batches(source, [T.CenterCrop(20)], batch_size=1, backend=backend)
        assert raised.value.key == "k0" and raised.value.kind == gp.Damage.BAD_FIELD

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_outside_the_image_clamped_or_dropped_with_their_labels(self, tmp_path, backend):
        """Boxes beyond the image as stored: one across its edge is clamped, one wholly outside
        (or inverted) is dropped with its label; the same on every backend."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        boxes = np.array([[-10, 5, 30, 25], [100, 70, 140, 90], [50, 40, 20, 10], [70, 50, 95, 75]], np.float32)
        with gp.ShardWriter(str(tmp_path / "o-%06d.tar")) as w:
            w.write("k0", {"jpg": encode_jpeg(synthetic_image(0, size=SIZE)), "boxes.npy": boxes,
                           "labels.npy": np.arange(4)})  # fmt: skip
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "boxes": gp.fields.Boxes("boxes.npy", labels="l"),
                                                 "l": gp.fields.Array("labels.npy")})  # fmt: skip
        (batch,) = _batches(source, [T.CenterCrop(SIZE)], batch_size=1, backend=backend)
        assert batch["boxes"].data[0].tolist() == [[0.0, 5.0, 30.0, 25.0], [70.0, 50.0, 80.0, 60.0]]
        assert batch["l"][0].tolist() == [0, 3]

    def test_options_refused(self):
        refused: list[tuple[dict, str]] = [(dict(format="YXYX"), "format"), (dict(min_size=-1), "min_size"),
                              (dict(labels="not a name"), "labels"), (dict(pad="x"), "pad"),
                              (dict(min_area=-1), "min_area"), (dict(min_area=float("nan")), "min_area")]  # fmt: skip
        for kwargs, match in refused:
            with pytest.raises(gp.ConfigError, match=match):
                gp.fields.Boxes("boxes.npy", **kwargs)
        with pytest.raises(gp.ConfigError, match="labels='classes' names no field"):
            gp.WebDataset("x.tar", fields={"image": "jpg", "boxes": gp.fields.Boxes("boxes.npy", labels="classes")})


@pytest.mark.gpu
def test_on_the_gpu_as_on_the_cpu(box_shards):
    """DALI on a GPU: masks and boxes on the loader's device, equal to the torch backend's (the
    GPU decoders' image sizes agree with the headers the host moved them by)."""
    pytest.importorskip("nvidia.dali")
    steps = GEOMETRIES["resized crop"][0]
    cpu = _batches(_source(box_shards), steps)
    with gp.Loader(gp.Pipeline(_source(box_shards), steps), 5, shuffle=True, seed=3, num_workers=0, backend="dali",
                   device="cuda") as loader:  # fmt: skip
        loader.set_epoch(1)
        gpu = list(loader)
    for a, b in zip(cpu, gpu, strict=True):
        assert b["inside"].is_cuda and b["boxes"].data.is_cuda and a.keys == b.keys
        assert torch.equal(a["inside"], b["inside"].cpu()) and torch.equal(a["boxes"].data, b["boxes"].data.cpu())


@pytest.fixture(scope="module")
def detection_shards(tmp_path_factory) -> list[str]:
    """12 images of several sizes and shapes, 1-3 boxes each with their classes (``labels.npy``)."""
    root = tmp_path_factory.mktemp("det")
    rng = np.random.default_rng(4)
    with gp.ShardWriter(str(root / "d-%06d.tar"), max_count=12) as w:
        for i in range(12):
            h, w_ = [(60, 80), (80, 60), (50, 50), (40, 90)][i % 4]
            k = i % 3 + 1
            x1, y1 = rng.uniform(0, w_ / 2, k), rng.uniform(0, h / 2, k)
            boxes = np.stack([x1, y1, x1 + rng.uniform(6, w_ / 2, k), y1 + rng.uniform(6, h / 2, k)], 1)
            w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=(h, w_))),
                              "boxes.npy": boxes.astype(np.float32), "labels.npy": np.arange(k) + 1})  # fmt: skip
    return w.shards


class TestDetectionRecipe:
    """``pipelines/detection.py``: torchvision's detection reference presets, padded into a canvas."""

    def test_train_and_val_on_every_backend_and_a_model_step(self, detection_shards):
        torchvision = pytest.importorskip("torchvision")
        recipe = gp.load_pipeline("pipelines/detection.py:train")
        pipe = recipe(detection_shards, min_size=(24, 32, 40), max_size=48)
        assert isinstance(pipe.transforms[0], T.RandomShortestSize) and pipe.targets == ("boxes",)
        backends = ("torch", "dali") if _has_dali() else ("torch",)
        out = check_target_parity(pipe.source, pipe.transforms, batch_size=4, backends=backends)
        batches = out["torch"]
        assert all(b.images.shape == (4, 3, 48, 48) and b.images.dtype == torch.float32 for b in batches)
        make_targets = gp.load_pipeline("pipelines/detection.py:targets")
        targets = [t for b in batches for t in make_targets(b)]
        assert len(targets) == 12 and all(len(t["boxes"]) == len(t["labels"]) for t in targets)
        assert all(bool(((t["boxes"] >= 0) & (t["boxes"] <= 48)).all()) for t in targets)
        model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=4, min_size=48, max_size=48
        ).train()
        losses = model(list(batches[0].images), make_targets(batches[0]))
        sum(losses.values()).backward()  # the targets are what torchvision's models train on
        val = gp.load_pipeline("pipelines/detection.py:val")(detection_shards, min_size=32, max_size=48)
        with gp.Loader(val, 4, num_workers=0) as loader:
            first = next(iter(loader))
        assert first.images.shape == (4, 3, 48, 48) and isinstance(first["boxes"], gp.fields.Padded)
        hflip = recipe(detection_shards, data_augmentation="hflip", min_size=32, max_size=48)
        assert [type(t) for t in hflip.transforms][:2] == [T.Resize, T.RandomHorizontalFlip]
        ssdlite = recipe(detection_shards, data_augmentation="ssdlite", size=40)
        assert isinstance(ssdlite.transforms[0], T.RandomIoUCrop)
        for ssd in (ssdlite, recipe(detection_shards, data_augmentation="ssd", size=40)):
            out = check_target_parity(ssd.source, ssd.transforms, batch_size=4, backends=backends)
            assert all(b.images.shape == (4, 3, 40, 40) for b in out["torch"])
        with pytest.raises(gp.ConfigError, match="data_augmentation must be"):
            recipe(detection_shards, data_augmentation="yolo")


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True
