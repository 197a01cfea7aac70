"""Segmentation masks (``gp.fields.Mask``, issue 39 step 3, first part): decoded safely, moved by
every geometric transform with the image's own draws (nearest, the mask's fill), left alone by the
others, as torchvision v2 treats ``tv_tensors.Mask``; on the torch backend (and Ray, through it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torchvision import tv_tensors

import gpupipe as gp
from gpupipe import backends
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, encode_png, synthetic_image

from .support.checkers import Posterize, check_target_parity

NEAREST = T.InterpolationMode.NEAREST
SIZE = (40, 52)  # (height, width)


def _label_map(i: int) -> np.ndarray:
    """A label map with structure in both directions (so every geometry shows)."""
    y, x = np.mgrid[: SIZE[0], : SIZE[1]]
    return ((y // 3 * 7 + x // 4 * 3 + i) % 200).astype(np.uint8)


@pytest.fixture(scope="module")
def seg_shards(tmp_path_factory) -> list[str]:
    """8 samples: a JPEG photo, its label map as PNG (``seg.png``), and the label map as a lossless
    RGB PNG image too (``lab.png``: each channel the mask), to compare geometry with."""
    root = tmp_path_factory.mktemp("seg")
    with gp.ShardWriter(str(root / "seg-%06d.tar"), max_count=8) as w:
        for i in range(8):
            label = _label_map(i)
            w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=SIZE)), "seg.png": encode_png(label),
                              "lab.png": encode_png(np.repeat(label[..., None], 3, axis=2)), "cls": i % 3})  # fmt: skip
    return w.shards


def _batches(source, steps, *, backend: str = "torch", **options) -> list[gp.Batch]:
    with gp.Loader(gp.Pipeline(source, steps), 4, shuffle=True, seed=7, num_workers=0, backend=backend,
                   **options) as loader:  # fmt: skip
        loader.set_epoch(1)
        return list(loader)


def _with_mask(urls, fill: int = 255):
    return gp.WebDataset(urls, fields={"image": "jpg", "label": "cls", "mask": gp.fields.Mask("seg.png", fill=fill)})


GEOMETRIES: dict[str, list[T.Transform]] = {
    "resized crop and flips": [T.RandomResizedCrop(24, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                               T.RandomVerticalFlip()],
    "rotation": [T.RandomRotation(35), T.CenterCrop(30)],
    "rotation, expanded": [T.RandomRotation(35, expand=True), T.Resize((30, 30))],
    "affine": [T.RandomAffine(20, translate=(0.2, 0.1), scale=(0.8, 1.2), shear=10), T.Resize(32), T.CenterCrop(28)],
    "padded random crop": [T.RandomCrop(48, pad_if_needed=True), T.RandomApply([T.RandomRotation(15)], p=0.5)],
    "padding": [T.RandomCrop((44, 56), padding=3)],
}  # fmt: skip


def _nearest(steps: list[T.Transform], fill: int) -> list[T.Transform]:
    """The same steps sampled nearest, bringing in ``fill``: what the mask goes through."""
    out: list[T.Transform] = []
    for t in steps:
        if isinstance(t, T.RandomApply):
            out.append(T.RandomApply(_nearest(list(t.transforms), fill), p=t.p))
            continue
        changes: dict = {}
        if hasattr(t, "interpolation"):
            changes["interpolation"] = NEAREST
        if hasattr(t, "fill"):
            changes["fill"] = fill
        if hasattr(t, "antialias"):
            changes["antialias"] = False
        out.append(dataclasses.replace(t, **changes))
    return out


class TestGeometry:
    @pytest.mark.parametrize("name", list(GEOMETRIES))
    def test_the_mask_moves_as_the_image_does_sampled_nearest(self, seg_shards, name):
        """Each sample's mask equals its label map put through the same steps as an image, with
        the same draws, nearest and with the mask's fill: the geometry is the image's."""
        steps = GEOMETRIES[name]
        got = _batches(_with_mask(seg_shards, fill=250), steps)
        as_image = gp.WebDataset(seg_shards, fields={"image": "lab.png", "label": "cls"})
        want = _batches(as_image, _nearest(steps, 250))
        for a, b in zip(got, want, strict=True):
            assert a.keys == b.keys and a["mask"].dtype == torch.uint8
            assert a["mask"].shape == b.images.shape[:1] + b.images.shape[2:] == (4, *a.images.shape[2:])
            assert torch.equal(a["mask"], b.images[:, 0]), name
        if name == "padding":
            assert any(bool((a["mask"] == 250).any()) for a in got)  # pixels brought in: the fill

    def test_other_transforms_leave_it(self, seg_shards):
        geometry = [T.RandomResizedCrop(24), T.RandomHorizontalFlip()]
        colour = [T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.GaussianBlur(3), T.RandomGrayscale(0.5),
                  T.ToDtype(torch.float32, scale=True), T.Normalize((0.5,) * 3, (0.2,) * 3),
                  T.RandomErasing(1.0)]  # fmt: skip
        plain = _batches(_with_mask(seg_shards), geometry)
        mixed = _batches(_with_mask(seg_shards), [*geometry, *colour])  # (a step's draws go by its place)
        for a, b in zip(plain, mixed, strict=True):
            assert torch.equal(a["mask"], b["mask"])

    def test_without_transforms_and_16_bit(self, tmp_path):
        deep = (_label_map(0).astype(np.uint16) * 300).astype(np.uint16)
        with gp.ShardWriter(str(tmp_path / "d-%06d.tar")) as w:
            for i in range(2):
                w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=SIZE)), "seg.png": encode_png(deep)})
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png")})
        (batch,) = _batches(source, [T.CenterCrop(SIZE)])
        assert batch["mask"].dtype == torch.int32 and torch.equal(
            batch["mask"][0], torch.from_numpy(deep.astype(np.int32))
        )


class TestCenterCrop:
    """A mask smaller than the crop is padded with its own fill (the ignore label), not with
    torchvision's 0, which a loss would read as class 0; the image keeps torchvision's 0."""

    @pytest.mark.parametrize("fill", [255, 7, -100, 1000])
    @pytest.mark.parametrize("size", [(45, 57), (46, 30)], ids=["padded", "padded rows, cropped columns"])
    def test_padded_with_the_masks_fill_on_every_backend(self, seg_shards, fill, size):
        from torchvision.transforms.v2 import functional as F

        out = check_target_parity(_with_mask(seg_shards, fill=fill), [T.CenterCrop(size)])  # torch and DALI-CPU
        for backend, batches in out.items():
            for b in batches:
                for j, key in enumerate(b.keys):
                    # torchvision's centre crop of the labels + 1: its padding is where it gives 0
                    shifted = tv_tensors.Mask(torch.from_numpy(_label_map(int(key[1:])).astype(np.int32) + 1)[None])
                    want = F.center_crop(shifted, list(size))[0].as_subclass(torch.Tensor) - 1
                    padded = want < 0
                    assert bool(padded.any()) and bool((~padded).any())
                    got = b["mask"][j].long()
                    assert got[padded].unique().tolist() == [fill], (backend, key)
                    assert torch.equal(got[~padded], want[~padded].long()), (backend, key)
                    assert int(b.images[j][:, padded].abs().max()) == 0, (backend, key)  # the image: 0
                # a fill a uint8 mask cannot hold (was an OverflowError): the masks int32
                assert b["mask"].dtype == (torch.uint8 if 0 <= fill <= 255 else torch.int32)

    def test_a_fill_beyond_int32_refused(self):
        with pytest.raises(gp.ConfigError, match="fill must be an int32"):
            gp.fields.Mask("seg.png", fill=1 << 31)


class TestBadMasks:
    @pytest.mark.parametrize(("member", "match"), [
        (encode_png(np.zeros((*SIZE, 3), np.uint8)), "is a RGB image: a mask has one channel"),
        (encode_png(np.zeros((10, 10), np.uint8)), "is 10x10, its image 40x52"),
        (encode_png(_label_map(0))[:-60], "cannot be decoded as a mask"),
    ], ids=["rgb", "other size", "cut"])  # fmt: skip
    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_named_and_skipped(self, tmp_path, member, match, backend):
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.ShardWriter(str(tmp_path / "b-%06d.tar")) as w:
            for i in range(4):
                seg = member if i == 2 else encode_png(_label_map(i))
                w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=SIZE)), "seg.png": seg})
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png")})
        with pytest.raises(gp.SampleError, match=match) as raised:
            _batches(source, [T.CenterCrop(20)], backend=backend, device="cpu")
        assert raised.value.key == "k2" and raised.value.kind == gp.Damage.BAD_FIELD
        with gp.Loader(gp.Pipeline(source, [T.CenterCrop(20)]), 4, on_error="skip", max_skipped=None,
                       num_workers=0, backend=backend, device="cpu") as loader:  # fmt: skip
            (batch,) = list(loader)
            assert [s.key for s in loader.skipped] == ["k2"] and batch.valid.tolist() == [True, True, False, True]

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_a_batch_with_no_good_sample(self, tmp_path, backend):
        """Skipped, a batch of bad masks alone stands in as zeros of the images' size (the
        stand-in mask was ``None``: an ``AttributeError`` when the batch was stacked)."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.ShardWriter(str(tmp_path / "b-%06d.tar")) as w:
            for i in range(2):
                seg = encode_png(np.zeros((10, 10), np.uint8)) if i == 1 else encode_png(_label_map(i))
                w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=SIZE)), "seg.png": seg})
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png")})
        with gp.Loader(gp.Pipeline(source, [T.CenterCrop(20)]), 1, on_error="skip", max_skipped=None,
                       num_workers=0, backend=backend, device="cpu") as loader:  # fmt: skip
            batches = list(loader)
            assert [s.key for s in loader.skipped] == ["k1"]
        assert [b.valid.tolist() for b in batches] == [[True], [False]]
        assert torch.equal(batches[1]["mask"], torch.zeros((1, 20, 20), dtype=torch.uint8))


class TestMissingMask:
    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_an_error_naming_the_sample_or_left_out(self, tmp_path, backend):
        """A sample without its mask: ``Damage.MISSING_FIELD`` naming it (``missing="error"``), or
        left out of the numbering (``missing="skip"``), on every backend."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        with gp.ShardWriter(str(tmp_path / "m-%06d.tar")) as w:
            for i in range(4):
                members = {"jpg": encode_jpeg(synthetic_image(i, size=SIZE))}
                if i != 1:
                    members["seg.png"] = encode_png(_label_map(i))
                w.write(f"k{i}", members)
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png")})
        with pytest.raises(gp.SampleError, match="has no 'mask' field") as raised:
            _batches(source, [T.CenterCrop(20)], backend=backend, device="cpu")
        assert raised.value.key == "k1" and raised.value.kind == gp.Damage.MISSING_FIELD
        skipping = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png", missing="skip")})
        with gp.Loader(gp.Pipeline(skipping, [T.CenterCrop(20)]), 4, num_workers=0, backend=backend, device="cpu",
                       max_skipped=None) as loader:  # fmt: skip
            (batch,) = list(loader)  # (counted: loader.skipped names it)
            assert [s.key for s in loader.skipped] == ["k1"]
        assert sorted(batch.keys[:3]) == ["k0", "k2", "k3"] and int(batch.valid.sum()) == 3


class TestRefused:
    def test_what_cannot_follow(self, seg_shards):
        source = _with_mask(seg_shards)
        refused: list[tuple[list[T.Transform], str]] = [
            ([T.RandomResizedCrop(24), T.TrivialAugmentWide()], r"step 1 \(TrivialAugmentWide\) chooses its"),
            ([T.RandomApply([T.AugMix()])], r"step 0 \(RandomApply\): step 0 \(AugMix\)"),
            ([T.CenterCrop(24), Posterize()], "whose geometry gpupipe cannot follow"),
        ]
        for steps, match in refused:
            with pytest.raises(gp.ConfigError, match=match):
                gp.Pipeline(source, steps)
        with pytest.raises(gp.ConfigError, match="follow one image: not with views"):
            gp.Pipeline(source, views=[[T.CenterCrop(24)], [T.CenterCrop(16)]])
        with pytest.raises(gp.ConfigError, match="batch_transform mixes images, not masks or boxes"):
            gp.Pipeline(source, [T.CenterCrop(24), T.ToDtype(torch.float32)], batch_transform=T.MixUp(num_classes=3))
        with pytest.raises(gp.ConfigError, match="missing='empty' has no mask"):
            gp.fields.Mask("seg.png", missing="empty")
        with pytest.raises(gp.ConfigError, match="fill must be an int"):
            gp.fields.Mask("seg.png", fill=0.5)  # type: ignore[arg-type]


class TestDali:
    """The DALI backend moves masks in its reader threads, from each image's size in its header,
    with the torch backend's code: the same masks, exactly."""

    @pytest.mark.parametrize("name", [n for n in GEOMETRIES if "expanded" not in n])  # (DALI: no expand)
    def test_the_same_masks_as_torch(self, seg_shards, name):
        out = check_target_parity(_with_mask(seg_shards, fill=250), GEOMETRIES[name])
        assert all(b["mask"].shape == (4, *b.images.shape[2:]) for b in out["dali"])

    def test_auto_picks_dali_where_it_runs_every_step(self, seg_shards):
        """DALI reads masks (``reads_targets``): ``auto`` does not pass it by for them on the GPU
        (on the CPU it picks the torch backend for any pipeline)."""
        pytest.importorskip("nvidia.dali")
        from gpupipe import backends

        pipe = gp.Pipeline(_with_mask(seg_shards), [T.CenterCrop(24)])
        assert pipe.targets == ("mask",)
        backend, _ = backends.auto_choice("cuda", pipe.views, targets=pipe.targets, available=lambda b: True)
        assert backend.name == "dali"

    @pytest.mark.parametrize("backend", ["torch", "dali"])
    def test_exif_orientation_refused(self, seg_shards, backend):
        """Masks and boxes are in the stored image's pixels: the torch backend turned the image
        upright and left its mask as stored (misaligned, without a word); DALI refused. Both refuse."""
        if backend == "dali":
            pytest.importorskip("nvidia.dali")
        pipe = gp.Pipeline(_with_mask(seg_shards), [T.CenterCrop(24)])
        with pytest.raises(gp.UnsupportedTransformError, match=r"'mask'.*not with apply_exif_orientation=True"):
            gp.Loader(pipe, 4, backend=backend, device="cpu", num_workers=0 if backend == "torch" else 1,
                      apply_exif_orientation=True)  # fmt: skip


class TestStaged:
    """A tail of photometric steps runs in the stage with masks too (their geometry is the
    backend's, up to the tail); the masks and images are those of the unstaged run."""

    GEOMETRY = (T.RandomResizedCrop(24, scale=(0.3, 1.0)), T.RandomHorizontalFlip())
    TAIL = (T.ColorJitter(0.4, 0.4, 0.4, 0.1), T.RandomGrayscale(0.3), T.ToDtype(torch.float32, scale=True),
            T.Normalize((0.5,) * 3, (0.2,) * 3), T.RandomErasing(0.5))  # fmt: skip

    def test_the_masks_and_images_of_the_unstaged_run(self, seg_shards):
        staged = _batches(_with_mask(seg_shards, fill=250), [*self.GEOMETRY, *self.TAIL], stage=True)
        plain = _batches(_with_mask(seg_shards, fill=250), [*self.GEOMETRY, *self.TAIL], stage=False)
        unmoved = _batches(_with_mask(seg_shards, fill=250), list(self.GEOMETRY))
        for a, b, c in zip(staged, plain, unmoved, strict=True):
            assert a.keys == b.keys == c.keys
            assert torch.equal(a["mask"], b["mask"]) and torch.equal(a["mask"], c["mask"])
            torch.testing.assert_close(a.images, b.images, atol=0, rtol=0)

    def test_on_dali_the_same_masks(self, seg_shards):
        out = check_target_parity(_with_mask(seg_shards, fill=250), [*self.GEOMETRY, *self.TAIL], stage=True)
        plain = check_target_parity(_with_mask(seg_shards, fill=250), list(self.GEOMETRY), backends=("torch",))
        for a, b in zip(out["dali"], plain["torch"], strict=True):
            assert torch.equal(a["mask"], b["mask"])


class TestSegmentationRecipe:
    """``pipelines/segmentation.py``: torchvision's segmentation reference presets."""

    def test_train_and_val(self, seg_shards):
        recipe = gp.load_pipeline("pipelines/segmentation.py:train")
        pipe = recipe(seg_shards, base_size=40, crop_size=48)  # sizes 20-79: some padded
        assert isinstance(pipe.transforms[0], T.RandomResize) and pipe.targets == ("mask",)
        with gp.Loader(pipe, 4, num_workers=0, seed=1, shuffle=True) as loader:
            batches = list(loader)
        assert all(b.images.shape == (4, 3, 48, 48) and b["mask"].shape == (4, 48, 48) for b in batches)
        padded = [b["mask"] == 255 for b in batches]
        assert any(bool(p.any()) for p in padded)  # the crop padded the mask with the ignore index
        for b, p in zip(batches, padded, strict=True):  # ... exactly where it padded the image with 0
            normalized_zero = -torch.tensor((0.485, 0.456, 0.406)) / torch.tensor((0.229, 0.224, 0.225))
            where = (b.images - normalized_zero[None, :, None, None]).abs().amax(1) < 1e-5
            assert bool((where | ~p).all())
        if backends.get("dali").available():  # the same masks on DALI-CPU
            check_target_parity(pipe.source, pipe.transforms, batch_size=4)
        val = gp.load_pipeline("pipelines/segmentation.py:val")(seg_shards, base_size=40, crop_size=32)
        with gp.Loader(val, 4, num_workers=0) as loader:
            assert next(iter(loader))["mask"].shape == (4, 32, 32)


class TestWebdatasetWriter:
    def test_masks_written_by_webdataset_read_as_torchvision_reads_them(self, tmp_path):
        """``seg.png`` members from webdataset's own writer (a palette PIL image, an 8-bit and a
        16-bit array): an 8-bit map as webdataset's ``"l8"`` decoder reads it, and each as
        torchvision's segmentation reference does (``np.asarray(PIL.Image.open(...))``: a
        palette's indices, which webdataset's image decoders convert away)."""
        import io
        import tarfile

        wds = pytest.importorskip("webdataset")
        from PIL import Image
        from webdataset.autodecode import imagehandler

        palette = Image.fromarray(_label_map(1), mode="L").convert("P")
        members = {
            "pal.seg.png": palette,
            "l.seg.png": _label_map(2),
            "i.seg.png": _label_map(3).astype(np.uint16) * 250,
        }
        path = str(tmp_path / "w.tar")
        with wds.TarWriter(path) as sink:
            sink.write({"__key__": "k0", "jpg": synthetic_image(0, size=SIZE), **members})
        with tarfile.open(path) as tar:
            raw = {m.name.partition(".")[2]: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
        fields = {name.split(".")[0]: gp.fields.Mask(name) for name in members}
        source = gp.WebDataset(path, fields={"image": "jpg", **fields})
        with gp.Loader(gp.Pipeline(source, [T.CenterCrop(SIZE)]), 1, num_workers=0, backend="torch") as loader:
            (batch,) = list(loader)
        for name in members:
            with Image.open(io.BytesIO(raw[name])) as im:
                want = np.asarray(im)
            assert np.array_equal(batch[name.split(".")[0]][0].numpy(), want), name
        assert np.array_equal(batch["l"][0].numpy(), imagehandler("l8")("png", raw["l.seg.png"]))
        assert np.array_equal(batch["pal"][0].numpy(), _label_map(1))  # the indices, not grey levels


class TestIndexedMask:
    """``backends/_torch/_maskindex``: masks moved by index arithmetic, pixel for pixel as
    torchvision's mask kernels move them."""

    def test_nearest_indices_are_atens(self):
        from gpupipe.backends._torch._maskindex import nearest_index

        rng = np.random.default_rng(0)
        sizes = [(5, 10), (10, 5), (7, 7), (375, 1040), (500, 1386), (1040, 480), *rng.integers(1, 1500, (300, 2))]
        for n_in, n_out in sizes:
            x = torch.arange(int(n_in), dtype=torch.float32)[None, None, None]
            want = torch.nn.functional.interpolate(x, size=(1, int(n_out)), mode="nearest")[0, 0, 0].long().numpy()
            assert np.array_equal(nearest_index(int(n_out), int(n_in)), want), (n_in, n_out)

    def test_random_chains_equal_torchvisions_kernels(self):
        """Chains of resizes, crops (beyond the mask too), padding and flips on random label maps."""
        from torchvision.transforms.v2 import functional as F

        from gpupipe.backends._torch._maskindex import IndexedMask

        rng = np.random.default_rng(1)
        for _ in range(200):
            src = rng.integers(0, 30, (int(rng.integers(3, 60)), int(rng.integers(3, 60)))).astype(np.uint8)
            lazy, ref = IndexedMask(src.copy(), 250), tv_tensors.Mask(torch.from_numpy(src)[None])
            for _ in range(4):
                h, w = lazy.shape
                op = rng.integers(0, 4)
                if op == 0:
                    nh, nw = int(rng.integers(1, 90)), int(rng.integers(1, 90))
                    lazy.resize(nh, nw)
                    ref = F.resize(ref, [nh, nw])
                elif op == 1:
                    top, left = int(rng.integers(-5, h)), int(rng.integers(-5, w))  # (overlapping the mask:
                    # torchvision's crop of a window wholly before it slices with negative ends)
                    ch, cw = int(rng.integers(max(1, 1 - top), h + 6)), int(rng.integers(max(1, 1 - left), w + 6))
                    lazy.crop(top, left, ch, cw)
                    ref = F.crop(ref, top, left, ch, cw)
                elif op == 2:
                    pad = [int(v) for v in rng.integers(0, 6, 4)]
                    lazy.pad(*pad)
                    ref = F.pad(ref, pad, fill=250)
                else:
                    horizontal = bool(rng.integers(0, 2))
                    lazy.flip(horizontal=horizontal)
                    ref = F.horizontal_flip(ref) if horizontal else F.vertical_flip(ref)
                assert torch.equal(lazy.tensor(), ref[0].as_subclass(torch.Tensor))
