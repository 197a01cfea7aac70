"""Issue 11: images as real datasets hold them, on every backend under both policies — PNG and
WebP named ``.jpg``, CMYK and grayscale JPEGs (RGB out), progressive JPEGs, EXIF orientation (as
stored by default, upright on request), 1x1 and very thin images through every transform, and the
pixel limit (refused from the header, before any decoder allocates)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe as gp
from gpupipe import backends
from gpupipe import transforms as T
from gpupipe.runtime._decode import decode_rgb, read_header
from gpupipe.testing import synthetic_image

from .support.checkers import check_backend_parity
from .support.data import bomb_jpeg, png16, tiff16, write_webdataset_shards

PHOTO = Image.fromarray(synthetic_image(3, size=(40, 56)))


def encode(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def exif_rotated(image: Image.Image = PHOTO, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, quality=95, exif=exif)


ENCODINGS = {  # each stored as a .jpg member
    "png": encode(PHOTO, "PNG"),
    "webp-lossless": encode(PHOTO, "WEBP", lossless=True),
    "webp": encode(PHOTO, "WEBP", quality=90),
    "cmyk-jpeg": encode(PHOTO.convert("CMYK"), quality=95),
    "gray-jpeg": encode(PHOTO.convert("L"), quality=95),
    "progressive-jpeg": encode(PHOTO, quality=95, progressive=True),
    "exif-rotated-jpeg": exif_rotated(),
    "gray-png": encode(PHOTO.convert("L"), "PNG"),
    "palette-png": encode(PHOTO.convert("P"), "PNG"),
    "rgba-png": encode(PHOTO.convert("RGBA"), "PNG"),
}
TINY = {f"{w}x{h}": encode(PHOTO.resize((w, h)), quality=95) for w, h in [(1, 1), (300, 1), (1, 300), (3, 2)]}

needs_dali = pytest.mark.skipif(not backends.get("dali").available(), reason="needs DALI")


class TestFormats:
    @pytest.mark.parametrize("name", list(ENCODINGS))
    def test_decoded_rgb_as_stored(self, name):
        """Every encoding decodes to the RGB pixels it stores, uint8 ``[3, H, W]`` in the stored
        orientation: those of the source exactly where the encoding is lossless (gray replicated to
        3 channels, a palette looked up), within a lossy codec's error otherwise."""
        stored = {"gray-jpeg": PHOTO.convert("L"), "gray-png": PHOTO.convert("L"), "palette-png": PHOTO.convert("P")}
        want = torch.from_numpy(np.array(stored.get(name, PHOTO).convert("RGB"))).permute(2, 0, 1)
        image = decode_rgb(ENCODINGS[name], shard="s", key=name)
        assert image.dtype == torch.uint8 and tuple(image.shape) == (3, 40, 56)
        error = (image.int() - want.int()).abs()
        if name.endswith("png") or name == "webp-lossless":
            assert int(error.max()) == 0
        else:  # quality 90-95: a mean of 1.3-3.6 and at most 24 (a wrong channel order or flip: 40+)
            assert float(error.double().mean()) < 5 and int(error.max()) <= 40, (error.double().mean(), error.max())
        if name.startswith("gray"):
            assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])

    @needs_dali
    @pytest.mark.parametrize("exif", [False, True])
    @pytest.mark.parametrize("name", list(ENCODINGS))
    def test_dali_decodes_the_same(self, name, exif):
        check_backend_parity([T.Resize(20)], [ENCODINGS[name]], exif=exif, mean_tol=0.5, max_tol=0.5)


class TestExifOrientation:
    def test_as_stored_by_default_upright_on_request(self):
        data = exif_rotated()
        assert tuple(decode_rgb(data, shard="s", key="k").shape) == (3, 40, 56)
        upright = decode_rgb(data, shard="s", key="k", apply_exif_orientation=True)
        assert torch.equal(upright, decode_rgb(data, shard="s", key="k").rot90(-1, dims=(1, 2)))

    @needs_dali
    @pytest.mark.parametrize("exif", [False, True])
    def test_dali_crops_the_same_oriented_image(self, exif):
        images = [exif_rotated(orientation=o) for o in (3, 6, 8)] * 2
        for t in (T.RandomResizedCrop(16, scale=(0.1, 0.5)), T.CenterCrop((30, 20)), T.RandomCrop(20)):
            check_backend_parity([t], images, exif=exif)

    @pytest.mark.parametrize("exif", [False, True])
    def test_the_loader_option_reaches_every_backend(self, backend, tmp_path, exif):
        half = np.zeros((40, 56, 3), np.uint8)
        half[:, 28:] = 255  # stored: dark left half; orientation 6 turns the left side to the top
        urls = write_webdataset_shards(str(tmp_path), (1,), prefix="exif",
                                        patch={0: {"jpg": exif_rotated(Image.fromarray(half))}})  # fmt: skip
        pipeline = gp.Pipeline(urls, [T.Resize((16, 16))])
        with backend.loader(pipeline, 1, num_workers=0, apply_exif_orientation=exif) as loader:
            image = next(iter(loader)).images[0].float().cpu()
        top, left = image[:, :4].mean(), image[:, :, :4].mean()
        assert (top < 30 and left > 100) if exif else (left < 30 and top > 100)


TINY_TRANSFORMS = [
    T.RandomResizedCrop(8),
    T.Resize(8),
    T.Resize((8, 8)),
    T.Resize(8, max_size=12),  # a 300x1 image would become 0x12: refused on both
    T.CenterCrop(8),
    T.RandomCrop(8),  # larger than the image: refused on both
    T.RandomCrop(8, pad_if_needed=True),
    T.RandomCrop(8, padding=4, pad_if_needed=True),
    T.RandomHorizontalFlip(1.0),
    T.RandomVerticalFlip(1.0),
    T.RandomGrayscale(1.0),
    T.GaussianBlur(3),
    T.GaussianBlur(5, sigma=(0.1, 2.0)),
]


@needs_dali
class TestTinyImages:
    @pytest.mark.parametrize("t", TINY_TRANSFORMS, ids=lambda t: type(t).__name__)
    def test_every_transform_agrees_or_refuses_on_both(self, t):
        check_backend_parity([t], list(TINY.values()))

    def test_color_jitter_and_normalize(self):
        check_backend_parity([T.ColorJitter(brightness=0.4, saturation=0.4)], list(TINY.values()))
        check_backend_parity(
            [T.ToDtype(torch.float32, scale=True), T.Normalize([0.5] * 3, [0.2] * 3)], list(TINY.values()), unit=51.0
        )


RAMP = (np.arange(48 * 64).reshape(48, 64) * 21).astype(np.uint16)  # 0 .. 64491
WIDE_GRAY = {fmt: encode(Image.fromarray(RAMP), fmt) for fmt in ("PNG", "TIFF", "PPM")}  # PPM: a 16-bit PGM


class TestPillowsOwnRules:
    """Pillow's process-wide settings and its 16-bit modes made gpupipe's decoder (the torch
    backend's, ``gpupipe check``'s, DALI's fallback) differ from DALI's decoders on the same file
    (found by a review, 2026-11-29). gpupipe's rules hold whatever the program set."""

    @pytest.mark.parametrize("fmt", list(WIDE_GRAY))
    def test_16_bit_gray_is_scaled_not_clipped(self, fmt):
        """``convert("RGB")`` clipped each value to 255 (a white image); DALI scales v / 257."""
        image = decode_rgb(WIDE_GRAY[fmt], shard="s", key=fmt)
        want = torch.from_numpy(np.round(RAMP / 257).astype(np.uint8))
        assert tuple(image.shape) == (3, 48, 64) and all(torch.equal(c, want) for c in image)

    @needs_dali
    @pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
    def test_16_bit_gray_dali_decodes_the_same(self, fmt):
        check_backend_parity([T.CenterCrop((48, 64))], [WIDE_GRAY[fmt]], mean_tol=0.0, max_tol=0.0)

    @pytest.mark.parametrize("channels", [3, 4, 2])
    @pytest.mark.parametrize("interlaced", [False, True], ids=["plain", "adam7"])
    def test_16_bit_colour_png_is_rounded_as_dali_rounds(self, channels, interlaced):
        """Pillow keeps each value's high byte (``v >> 8``) of a 16-bit RGB, RGBA or gray-alpha
        PNG; DALI rounds ``v / 257``: 28% of values were one level apart (alpha is dropped)."""
        values = np.random.default_rng(channels).integers(0, 65536, (13, 11, channels)).astype(np.uint16)
        image = decode_rgb(png16(values, interlaced=interlaced), shard="s", key="k")
        colour = values[..., :1].repeat(3, -1) if channels == 2 else values[..., :3]
        want = torch.from_numpy(np.round(colour / 257).astype(np.uint8)).permute(2, 0, 1)
        assert torch.equal(image, want)

    @pytest.mark.parametrize("deflate", [False, True], ids=["raw", "deflate"])
    @pytest.mark.parametrize("big_endian", [False, True], ids=["le", "be"])
    def test_16_bit_rgb_tiff_is_rounded_as_dali_rounds(self, deflate, big_endian):
        """Likewise a 16-bit RGB TIFF, raw (Pillow's own decoder) or compressed (libtiff's)."""
        values = np.random.default_rng(9).integers(0, 65536, (13, 11, 3)).astype(np.uint16)
        want = torch.from_numpy(np.round(values / 257).astype(np.uint8)).permute(2, 0, 1)
        data = tiff16(values, deflate=deflate, big_endian=big_endian)
        assert torch.equal(decode_rgb(data, shard="s", key="k"), want)

    def test_16_bit_colour_png_turned_upright(self):
        values = np.random.default_rng(5).integers(0, 65536, (6, 9, 3)).astype(np.uint16)
        exif = Image.Exif()
        exif[0x0112] = 6  # turned 90 degrees clockwise to be upright
        data = png16(values, exif=exif.tobytes())
        want = torch.from_numpy(np.round(values / 257).astype(np.uint8)).permute(2, 0, 1)
        assert torch.equal(decode_rgb(data, shard="s", key="k"), want)
        upright = decode_rgb(data, shard="s", key="k", apply_exif_orientation=True)
        assert torch.equal(upright, torch.rot90(want, -1, dims=(1, 2)))

    @needs_dali
    @pytest.mark.parametrize("kind", ["png-rgb", "png-rgba", "tiff-deflate"])
    def test_16_bit_colour_dali_decodes_the_same(self, kind):
        values = np.random.default_rng(len(kind)).integers(0, 65536, (48, 64, 4)).astype(np.uint16)
        data = {"png-rgb": png16(values[..., :3]), "png-rgba": png16(values), "tiff-deflate": tiff16(values[..., :3])}
        check_backend_parity([T.CenterCrop((48, 64))], [data[kind]], mean_tol=0.0, max_tol=0.0)

    @pytest.mark.parametrize("maxval", [100, 1000, 255, 65535])
    def test_a_pnm_of_any_largest_value_is_scaled(self, maxval):
        """Scaled to 0 .. 255; DALI's decoder does not scale a binary PPM of maxval 100 (0 .. 100)
        or 1000 (``v >> 8``), so such a file takes gpupipe's decoder on DALI too
        (``Header.irregular``; the loaders' parity: tests/test_dali_fallback.py)."""
        values = np.random.default_rng(maxval).integers(0, maxval + 1, (6, 9, 3))
        data = b"P6\n# a comment\n9 6\n%d\n" % maxval + values.astype(">u2" if maxval > 255 else np.uint8).tobytes()
        header = read_header(data, None, shard="s", key="k")
        assert header.irregular == (maxval not in (255, 65535))
        want = torch.from_numpy(np.round(values * 255 / maxval).astype(np.uint8)).permute(2, 0, 1)
        assert torch.equal(decode_rgb(data, shard="s", key="k"), want)

    @pytest.mark.parametrize("pixels", [b" ", b"\n", b"\t\r"], ids=["space", "newline", "tab-return"])
    def test_a_pnms_largest_value_is_read_whatever_its_pixels(self, pixels):
        """The header alone tells the largest value: a binary PGM whose pixel bytes are all ASCII
        whitespace (a flat image of value 32 or 10) of maxval 100 went to DALI's decoder, which
        does not scale it (32 where gpupipe's gives 82), and a header of long comments likewise."""
        values = pixels * (54 // len(pixels))
        flat = b"P5\n9 6\n100\n" + values
        commented = b"P5\n" + b"# a long comment\n" * 80 + b"9 6 100\n" + bytes(range(54))
        for data in (flat, commented):
            assert read_header(data, None, shard="s", key="k").irregular, data[:20]
        want = np.round(np.frombuffer(values, np.uint8).astype(np.int64) * 255 / 100).astype(np.uint8).reshape(6, 9)
        assert torch.equal(decode_rgb(flat, shard="s", key="k"), torch.from_numpy(want).expand(3, 6, 9))

    def test_pillows_pixel_limit_is_not_gpupipes(self, monkeypatch):
        """``Image.open`` refuses twice ``PIL.Image.MAX_IMAGE_PIXELS`` (a program may lower it; a
        PNG over 179 MP passes ``max_image_pixels=None`` and met it): gpupipe's limit alone counts."""
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
        image = decode_rgb(ENCODINGS["png"], shard="s", key="k", max_pixels=None)
        assert tuple(image.shape) == (3, 40, 56) and Image.MAX_IMAGE_PIXELS == 1000
        with pytest.raises(gp.SampleError, match="more than max_image_pixels=100"):
            decode_rgb(ENCODINGS["png"], shard="s", key="k", max_pixels=100)

    def test_a_truncated_png_is_refused_whatever_the_program_set(self, monkeypatch):
        """``ImageFile.LOAD_TRUNCATED_IMAGES = True`` (common in training scripts) made Pillow
        deliver a PNG cut in its image data, where ``check`` (its own process) refused it."""
        from PIL import ImageFile

        big = encode(Image.fromarray(synthetic_image(5, size=(200, 240))), "PNG")
        cut = big[: len(big) // 2]
        monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
        with pytest.raises(gp.SampleError) as raised:
            decode_rgb(cut, shard="s", key="cut")
        assert raised.value.kind is gp.Damage.UNDECODABLE and ImageFile.LOAD_TRUNCATED_IMAGES is True

    def test_a_forked_decode_imports_nothing(self):
        """The sandbox forks while reader threads run; a fork taken while another thread is
        inside an import of one of Pillow's ~40 plugins left that import's lock held for ever in the
        child, whose decode then hung until the sandbox's timeout (a good file called undecodable
        after 120 s). ``imported_for_fork`` (before each fork) imports all a decode needs."""
        import subprocess
        import sys

        code = """
import io, sys
from PIL import Image
import numpy as np
from gpupipe.runtime._decode import decode_rgb, imported_for_fork
files = []
for fmt in ("PNG", "TIFF", "BMP", "PPM", "WEBP", "JPEG"):
    out = io.BytesIO(); Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(out, fmt); files.append(out.getvalue())
imported_for_fork()
before = set(sys.modules)
for data in files:
    decode_rgb(data, shard="s", key="k", apply_exif_orientation=True)
print("NEW", sorted(set(sys.modules) - before))
"""
        # (the files are made after the first import of PIL, as a fresh process's are not)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.stdout.strip().startswith("NEW"), out.stderr[-2000:]
        assert out.stdout.strip() == "NEW []"


class TestInLoaders:
    """All of them in one dataset, with a decompression bomb and a thin image a crop refuses."""

    @pytest.fixture
    def mixed(self, tmp_path) -> list[str]:
        members = [*ENCODINGS.values(), *TINY.values()]
        patch = {n: {"jpg": data} for n, data in enumerate(members)}
        patch[len(members)] = {"jpg": bomb_jpeg()}
        return write_webdataset_shards(str(tmp_path), (len(members) + 1,), prefix="mixed", patch=patch)

    @pytest.mark.parametrize("on_error", ["raise", "skip"])
    def test_every_image_decodes_and_the_bomb_is_refused(self, backend, mixed, on_error):
        pipeline = gp.Pipeline(mixed, [T.RandomResizedCrop(16), T.RandomHorizontalFlip()])
        bomb = len(ENCODINGS) + len(TINY)
        with backend.loader(pipeline, 5, num_workers=0, on_error=on_error, max_skipped=None) as loader:
            if on_error == "raise":
                with pytest.raises(gp.SampleError, match="declares 30000x30000 pixels") as info:
                    list(loader)
                assert info.value.kind is gp.Damage.TOO_LARGE and info.value.key == f"img/00/{bomb:06d}"
                return
            valid = [v for b in loader for v in b.valid.tolist()]
            assert valid.count(True) == bomb and [s.kind for s in loader.skipped] == ["too-large"]

    @pytest.mark.parametrize("on_error", ["raise", "skip"])
    def test_a_crop_larger_than_a_thin_image(self, backend, mixed, on_error):
        thin = gp.Pipeline(mixed, [T.RandomCrop(2), T.Resize((8, 8))])  # not for 1x1, 300x1 and 1x300
        with backend.loader(thin, 4, num_workers=0, on_error=on_error, max_skipped=None) as loader:
            if on_error == "raise":
                with pytest.raises(gp.SampleError, match="RandomCrop: crop size") as info:
                    list(loader)
                assert info.value.kind is gp.Damage.TOO_SMALL
                return
            list(loader)
            kinds = {s.key: s.kind for s in loader.skipped}
        first, bomb = len(ENCODINGS), len(ENCODINGS) + len(TINY)
        assert kinds == {**{f"img/00/{n:06d}": "too-small" for n in range(first, first + 3)},
                         f"img/00/{bomb:06d}": "too-large"}  # fmt: skip

    def test_the_pixel_limit_is_an_option(self, backend, mixed):
        pipeline = gp.Pipeline(mixed, [T.RandomResizedCrop(16)])
        with (
            backend.loader(pipeline, 4, num_workers=0, max_image_pixels=1000) as loader,
            pytest.raises(gp.SampleError, match="40x56 pixels, more than max_image_pixels=1000"),
        ):
            list(loader)


class TestConfig:
    @pytest.mark.parametrize("value", [0, -5, 1.5, "big"])
    def test_bad_pixel_limits(self, value):
        with pytest.raises(gp.ConfigError, match="max_image_pixels"):
            gp.LoaderConfig(4, max_image_pixels=value)

    def test_defaults(self):
        config = gp.LoaderConfig(4)
        assert config.max_image_pixels == Image.MAX_IMAGE_PIXELS and config.apply_exif_orientation is False
        assert gp.LoaderConfig(4, max_image_pixels=None).max_image_pixels is None
        with pytest.raises(gp.ConfigError, match="apply_exif_orientation"):
            gp.LoaderConfig(4, apply_exif_orientation=1)  # type: ignore[arg-type]
