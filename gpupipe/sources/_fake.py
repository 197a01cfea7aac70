"""FakeData: synthetic photo-like JPEGs, for ``--dummy`` runs and benchmarks without a dataset."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from ..core._errors import ConfigError
from ..core._validate import valid_int
from ..shards._shard import RawSample, ShardIndex
from ..storage import LocalStorage, Storage
from ._index import Index, Source

__all__ = ["FakeData"]

_SHARD = 10_000  # samples per shard of the index (their keys are made when a shard is first read)


@dataclasses.dataclass(frozen=True)
class FakeData(Source):
    """``size`` labeled samples of synthetic photo-like JPEGs, generated in memory — the role of
    ``torchvision.datasets.FakeData`` (same argument names) for ``--dummy`` runs and benchmarks,
    except that the images are real JPEGs: every backend decodes them, so a run measures the input
    pipeline it will have on real data.

    Args:
        size: samples per epoch. Default 1000.
        image_size: ``(C, H, W)`` of the images; ``C`` must be 3. Default ``(3, 224, 224)``.
        num_classes: labels are ``n % num_classes``. Default 10.
        random_offset: shifts which image each sample is (torchvision's name). Default 0.
        distinct: how many different images there are (made once per process, a few ms each);
            sample ``n`` is image ``(n + random_offset) % distinct``. Default 64.

    Keys are ``"fake/<n>"``.
    """

    size: int = 1000
    _: dataclasses.KW_ONLY
    image_size: tuple[int, int, int] = (3, 224, 224)
    num_classes: int = 10
    random_offset: int = 0
    distinct: int = 64

    def __post_init__(self) -> None:
        valid_int("FakeData", self.size, "size", minimum=1)
        valid_int("FakeData", self.num_classes, "num_classes", minimum=1)
        valid_int("FakeData", self.random_offset, "random_offset", minimum=0)
        valid_int("FakeData", self.distinct, "distinct", minimum=1)
        size = tuple(self.image_size)
        if len(size) != 3 or size[0] != 3 or not all(isinstance(v, int) and v > 0 for v in size):
            raise ConfigError(f"FakeData: image_size must be (3, H, W) with H, W > 0, got {self.image_size!r}")
        object.__setattr__(self, "image_size", size)

    def index(self, *, rank: int = 0, world_size: int = 1, on_error: Any = "raise") -> Index:
        shards = []
        for start in range(0, self.size, _SHARD):
            count = min(_SHARD, self.size - start)
            loader = functools.partial(_detail, start, count, self.num_classes)
            shards.append(ShardIndex(f"fakedata:{start}", size=count, loader=loader))
        return Index(shards, reader=_FakeReader(self), sequential=False, labeled=True)


def _detail(start: int, count: int, classes: int) -> tuple[list[str], dict[str, np.ndarray]]:
    numbers = np.arange(start, start + count)
    return [f"fake/{n}" for n in numbers.tolist()], {"label": (numbers % classes).astype(np.int64)}


@functools.lru_cache(maxsize=4)
def _images(distinct: int, height: int, width: int) -> tuple[bytes, ...]:
    from ..testing import encode_jpeg, synthetic_image

    return tuple(encode_jpeg(synthetic_image(i, size=(height, width)), quality=90) for i in range(distinct))


class _FakeReader:
    """Reads a FakeData sample: one of the ``distinct`` images, made once per process."""

    def __init__(self, source: FakeData) -> None:
        self.source = source
        self.storage: Storage = LocalStorage()  # what readers have; FakeData reads none
        self.max_image_bytes: int | None = None  # (its images are a few KB, made here)

    def read(self, shard: ShardIndex, i: int) -> RawSample:
        source = self.source
        n = int(shard.path.split(":")[1]) + i
        images = _images(source.distinct, source.image_size[1], source.image_size[2])
        data = images[(n + source.random_offset) % source.distinct]
        return RawSample(shard.keys[i], shard.path, data, n % source.num_classes)

    def close(self) -> None:
        self.storage.close()
