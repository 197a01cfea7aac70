"""Fixtures: small real-JPEG datasets built by the tests themselves, and ``backend``: every
backend of the table (on each device it delivers to) that the contract suite runs on."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

import gpupipe as gp
from gpupipe import backends
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.fake_cuda import fake_cuda  # noqa: F401 - a fixture for every test module

SHARD_SIZES = (7, 5, 4)  # uneven on purpose
UNEVEN_SIZES = (7, 2, 5, 3)
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def label_of(i: int) -> int:
    return (i * 7) % 5


def _small_image(n: int) -> np.ndarray:
    return synthetic_image(n, label=label_of(n), size=(64 + 8 * (n % 5), 80 + 4 * (n % 3)))


def truncated_jpeg(n: int) -> bytes:
    """The first half of sample ``n``'s JPEG: every decoder refuses it."""
    data = encode_jpeg(_small_image(n), quality=90)
    return data[: len(data) // 2]


def bomb_jpeg(height: int = 30000, width: int = 30000) -> bytes:
    """A small real JPEG whose frame header declares ``height`` x ``width``: a decompression bomb
    (a decoder that trusts it allocates ``height * width * 3`` bytes)."""
    data = bytearray(encode_jpeg(_small_image(0), quality=90))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = height.to_bytes(2, "big") + width.to_bytes(2, "big")
    return bytes(data)


def _write_webdataset_shards(root, sizes, *, prefix="train", label=True, image=_small_image, patch=None):
    """Writes shards with webdataset's own TarWriter (independent of gpupipe's writer); sample
    ``n`` is ``image(n)`` as a JPEG, labelled ``label_of(n)``. ``patch`` maps a sample number to
    members that replace its own (bytes; ``None`` leaves the member out): damaged samples."""
    import webdataset as wds

    paths, n = [], 0
    for s, size in enumerate(sizes):
        path = os.path.join(root, f"{prefix}-{s:06d}.tar")
        with wds.TarWriter(path) as sink:
            for _ in range(size):
                img = image(n)
                sample = {"__key__": f"img/{s:02d}/{n:06d}", "jpg": encode_jpeg(img, quality=90)}
                if label:
                    sample["cls"] = str(label_of(n)).encode()
                for ext, value in (patch or {}).get(n, {}).items():
                    if value is None:
                        sample.pop(ext, None)
                    else:
                        sample[ext] = value
                sink.write(sample)
                n += 1
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> list[str]:
    """3 shards of 7, 5 and 4 small synthetic-photo JPEGs; sample n has key img/SS/nnnnnn."""
    return _write_webdataset_shards(str(tmp_path_factory.mktemp("wds")), SHARD_SIZES)


@pytest.fixture(scope="session")
def uneven_shards(tmp_path_factory) -> list[str]:
    """4 shards of 7, 2, 5 and 3 samples: 17 in all, which no world size of 2 or more divides."""
    return _write_webdataset_shards(str(tmp_path_factory.mktemp("uneven")), UNEVEN_SIZES, prefix="uneven")


@pytest.fixture(scope="session")
def unlabeled_shards(tmp_path_factory) -> list[str]:
    return _write_webdataset_shards(str(tmp_path_factory.mktemp("wds_nolabel")), (3, 2), label=False)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> str:
    """ImageFolder tree: 3 classes, JPEG and PNG files, a nested folder, a non-image file."""
    from PIL import Image

    root = tmp_path_factory.mktemp("folder")
    for c, cls in enumerate(["zebra", "ant", "moose"]):
        os.makedirs(root / cls / "sub")
        for i in range(3 + c):
            img = synthetic_image(100 + 10 * c + i, label=c, size=(48, 56))
            if i % 2:
                Image.fromarray(img).save(root / cls / f"{i:03d}.png")
            else:
                (root / cls / f"{i:03d}.JPEG").write_bytes(encode_jpeg(img))
        Image.fromarray(img).save(root / cls / "sub" / "deep.jpg")
        (root / cls / "notes.txt").write_text("not an image")
    return str(root)


@pytest.fixture(scope="session")
def photo() -> torch.Tensor:
    """A decoded photograph-like JPEG, uint8 [3, 120, 160]."""
    from gpupipe._decode import decode_rgb

    data = encode_jpeg(synthetic_image(7, label=3, size=(120, 160)))
    return decode_rgb(data, shard="-", key="photo")


@pytest.fixture
def clean_env(monkeypatch):
    """No rank variables of torchrun or SLURM in the environment."""
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Index files go to a per-run cache, never the user's."""
    old = os.environ.get("GPUPIPE_CACHE_DIR")
    os.environ["GPUPIPE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("GPUPIPE_CACHE_DIR", None)
    else:
        os.environ["GPUPIPE_CACHE_DIR"] = old


@dataclasses.dataclass(frozen=True)
class Target:
    """One backend on one device: what a contract test runs against."""

    backend: str
    device: str

    def loader(self, pipeline, batch_size, **options) -> gp.Loader:
        return gp.Loader(pipeline, batch_size, backend=self.backend, device=self.device, **options)

    def __str__(self) -> str:
        return f"{self.backend}-{self.device}"


def targets():
    """Every backend of the table on every device it delivers to; CUDA ones are marked ``gpu``."""
    for name in backends.names():
        for device in backends.get(name).devices:
            marks = [pytest.mark.gpu] if device == "cuda" else []
            yield pytest.param(Target(name, device), id=f"{name}-{device}", marks=marks)


@pytest.fixture(params=list(targets()))
def backend(request) -> Target:
    """The contract suite's parameter: each backend of the table, skipped where not installed."""
    target = request.param
    b = backends.get(target.backend)
    if not b.available():
        pytest.skip(f"the {b.name} backend is not installed: it needs {b.requirement}")
    return target


@pytest.fixture(autouse=True)
def _skip_gpu_without_cuda(request):
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
