"""Fixtures: small real-JPEG datasets built by the tests themselves, ``backend``: every backend of
the table (on each device it delivers to) that the contract suite runs on, and from
tests/support/: ``fake_cuda``, the loopback servers ``http_server`` (a factory: servers for one
test) and ``s3_endpoint`` (SeaweedFS, one per module that uses it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gpupipe import backends
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.data import SHARD_SIZES, UNEVEN_SIZES, write_webdataset_shards
from .support.fake_cuda import fake_cuda  # noqa: F401 - a fixture for every test module
from .support.http_server import http_server  # noqa: F401 - a fixture for every test module
from .support.parts import parse_part, part_slice
from .support.s3_server import s3_endpoint  # noqa: F401 - a fixture for every test module
from .support.targets import DIST_ENV, Target, targets


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--part", default=None, metavar="K/N",
                     help="run the K-th of N contiguous, near-equal slices of the selected tests (a long GPU run "
                          "split over several device calls: make test-gpu PART=K/N)")  # fmt: skip


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    text = config.getoption("--part")
    if text is None:
        return
    try:
        part = parse_part(text)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    chosen = part_slice(len(items), part)
    config.hook.pytest_deselected(items=items[: chosen.start] + items[chosen.stop :])
    items[:] = items[chosen]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``GPUPIPE_TEST_LOG=FILE``: each failure and error appended to FILE as it happens, named
    and with its traceback — a lent machine's command cut short by its time limit still says
    which tests failed and why (pytest's own summary and JUnit XML are written only at the end)."""
    path = os.environ.get("GPUPIPE_TEST_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.when} FAILED {report.nodeid} ({report.duration:.1f} s)\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> list[str]:
    """3 shards of 7, 5 and 4 small synthetic-photo JPEGs; sample n has key img/SS/nnnnnn."""
    return write_webdataset_shards(str(tmp_path_factory.mktemp("wds")), SHARD_SIZES)


@pytest.fixture(scope="session")
def uneven_shards(tmp_path_factory) -> list[str]:
    """4 shards of 7, 2, 5 and 3 samples: 17 in all, which no world size of 2 or more divides."""
    return write_webdataset_shards(str(tmp_path_factory.mktemp("uneven")), UNEVEN_SIZES, prefix="uneven")


@pytest.fixture(scope="session")
def unlabeled_shards(tmp_path_factory) -> list[str]:
    return write_webdataset_shards(str(tmp_path_factory.mktemp("wds_nolabel")), (3, 2), label=False)


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
    from gpupipe.runtime._decode import decode_rgb

    data = encode_jpeg(synthetic_image(7, label=3, size=(120, 160)))
    return decode_rgb(data, shard="-", key="photo")


@pytest.fixture
def clean_env(monkeypatch):
    """No rank variables of torchrun or SLURM in the environment."""
    for name in DIST_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def two_threads():
    """This thread's intra-op thread count at 2 (the development VM's and CI's default), then as
    it was (tests of gpupipe's one-thread work on the training thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


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


@pytest.fixture(params=list(targets()))
def backend(request) -> Target:
    """The contract suite's parameter: each backend of the table, skipped where not installed."""
    target = request.param
    b = backends.get(target.backend)
    if not b.available():
        pytest.skip(f"the {b.name} backend is not installed: it needs {b.requirement}")
    if target.backend == "ray":
        request.getfixturevalue("ray_session")
    return target


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (loopback, 2 CPUs) for the session's ray-backend tests, started as a loader
    starts it: the loaders attach to it instead of each starting and stopping their own."""
    from gpupipe import RayOptions
    from gpupipe.backends._ray import _cluster

    _cluster.attach(RayOptions(local_cpus=2))
    yield
    _cluster.detach()


@pytest.fixture(autouse=True)
def _skip_gpu_without_cuda(request):
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
