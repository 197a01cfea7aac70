"""Which nvJPEG DALI's GPU decoders get (``gpupipe.runtime._nvjpeg``), checked without a GPU: the dynamic
linker answers nvImageCodec's bare-name open (``libnvjpeg.so.13``) with the first library of that
name loaded in the process, and torchvision's CUDA wheels bring an older one under that name. The
CUDA 13 nvJPEG package (``nvidia-nvjpeg``, a test dependency) is loaded beside torchvision's, in
subprocesses so that each starts with nothing loaded."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from gpupipe.runtime import _nvjpeg

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _torchvision_nvjpeg() -> list[str]:
    import torchvision

    return glob.glob(os.path.join(os.path.dirname(torchvision.__file__), "..", "torchvision.libs", "libnvjpeg*.so.13"))


needs_both = pytest.mark.skipif(
    _nvjpeg.pip_library(13) is None or not _torchvision_nvjpeg(),
    reason="needs nvidia-nvjpeg (CUDA 13) and a torchvision CUDA 13 wheel with its own nvJPEG",
)

# Loads gpupipe/runtime/_nvjpeg.py alone (standard library only), so that torchvision is imported only
# where the script says; prints what DALI's open of libnvjpeg.so.13 would get.
SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("nvj", {path!r})
nvj = importlib.util.module_from_spec(spec); sys.modules["nvj"] = nvj; spec.loader.exec_module(nvj)
if {torchvision_first}:
    import torchvision.io
preloaded = nvj.preload(13)
import torchvision.io
found = nvj.in_process(13)
print(json.dumps({{"preloaded": preloaded, "path": found.path, "version": found.version, "pip": found.pip,
                  "pip_version": found.pip_version}}))
"""


def _run(*, torchvision_first: bool, env: dict[str, str] | None = None) -> dict:
    script = SCRIPT.format(
        path=os.path.join(ROOT, "gpupipe", "runtime", "_nvjpeg.py"), torchvision_first=torchvision_first
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_both
def test_the_package_loaded_first_is_what_dali_gets():
    got = _run(torchvision_first=False)
    pip = os.path.realpath(_nvjpeg.pip_library(13) or "")
    assert got["preloaded"] and os.path.realpath(got["path"]) == pip and tuple(got["version"][:2]) >= (13, 2)
    assert got["pip"] is None  # the package is the one in use: nothing shadowed


@needs_both
def test_torchvision_first_shadows_the_package_and_says_so():
    got = _run(torchvision_first=True)
    assert got["preloaded"] is None  # a libnvjpeg.so.13 was loaded already
    assert "torchvision.libs" in got["path"] and tuple(got["version"]) < tuple(got["pip_version"])
    assert os.path.realpath(got["pip"]) == os.path.realpath(_nvjpeg.pip_library(13) or "")


@needs_both
def test_the_preload_can_be_turned_off():
    got = _run(torchvision_first=False, env={"GPUPIPE_NVJPEG_PRELOAD": "0"})
    assert got["preloaded"] is None and "torchvision.libs" in got["path"]


def test_import_gpupipe_preloads_before_torchvision():
    """``import gpupipe`` imports torchvision itself: the preload comes first, for DALI's CUDA."""
    script = (
        "import gpupipe, json; from gpupipe.runtime import _nvjpeg\n"
        "found = _nvjpeg.in_process()\n"
        "print(json.dumps({'cuda': _nvjpeg.dali_cuda(), 'preloaded': _nvjpeg.PRELOADED,"
        " 'path': found and found.path, 'shadowed': found and found.pip}))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if got["cuda"] is None or _nvjpeg.pip_library(got["cuda"]) is None:
        pytest.skip("no DALI, or no nvJPEG package for its CUDA")
    assert [os.path.realpath(p) for p in got["preloaded"]] == [os.path.realpath(got["path"])]
    assert got["shadowed"] is None


def test_no_dali_no_nvjpeg(monkeypatch):
    monkeypatch.setattr(_nvjpeg, "dali_cuda", lambda: None)
    assert _nvjpeg.in_process() is None and _nvjpeg.preload() is None
