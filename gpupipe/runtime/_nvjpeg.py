"""Which nvJPEG DALI's GPU decoders use, and making it the newest one installed.

nvImageCodec (DALI 2.4's decoder library) opens nvJPEG by its bare name — ``libnvjpeg.so.13`` for
DALI's CUDA 13 build, ``.so.12`` for CUDA 12 — and the dynamic linker answers a bare name with the
first library of that name already loaded in the process, wherever it came from. torchvision's
CUDA wheels bundle their own nvJPEG under that name (13.0 in torchvision 0.29), loaded as soon as
torchvision is imported; DALI then decodes with it, however new the ``nvidia-nvjpeg`` package is.
That matters: nvJPEG 13.2 is the first whose GPU decoders take a region of a JPEG with fancy
upsampling (``backends/_dali/_strategy``); with an older one a train recipe's crops go to the CPU.

So ``import gpupipe`` loads the pip package's nvJPEG (:func:`preload`) before anything imports
torchvision — where DALI is installed and no library of that name is loaded yet — and
:func:`in_process` says which one DALI will get. Only the standard library here: this module runs
first. ``GPUPIPE_NVJPEG_PRELOAD=0`` turns the preload off.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import importlib.metadata
import os
import sys

__all__ = ["Nvjpeg", "dali_cuda", "pip_library", "preload", "in_process", "PRELOADED"]

PRELOADED: list[str] = []  # the library preload() loaded, if it did


@dataclasses.dataclass(frozen=True)
class Nvjpeg:
    """The nvJPEG a bare-name open of ``soname`` gets in this process: its file and version, and
    the pip package's library where that one is another file (shadowed by one loaded earlier)."""

    soname: str
    path: str
    version: tuple[int, int, int]
    pip: str | None = None  # the nvidia-nvjpeg package's library, where it is not the one in use
    pip_version: tuple[int, int, int] | None = None

    def __str__(self) -> str:
        return ".".join(map(str, self.version))


def dali_cuda() -> int | None:
    """The CUDA major the installed DALI is built for (its wheel's name), or ``None``."""
    for major in (13, 12, 11):
        try:
            importlib.metadata.version(f"nvidia-dali-cuda{major}0")
        except importlib.metadata.PackageNotFoundError:
            continue
        return major
    return None


def pip_library(cuda: int) -> str | None:
    """The nvJPEG of the pip packages for CUDA ``cuda`` — ``nvidia-nvjpeg`` (CUDA 13:
    ``nvidia/cu13/lib``), ``nvidia-nvjpeg-cu12`` (``nvidia/nvjpeg/lib``) — where nvImageCodec's own
    search path finds it; ``None`` if not installed."""
    name = f"libnvjpeg.so.{cuda}"
    for root in dict.fromkeys(p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))):
        for folder in (f"nvidia/cu{cuda}/lib", "nvidia/nvjpeg/lib"):
            found = glob.glob(os.path.join(root, folder, name))
            if found:
                return found[0]
    return None


def _version(lib: ctypes.CDLL) -> tuple[int, int, int] | None:
    version = []
    for prop in (0, 1, 2):  # libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        value = ctypes.c_int()
        if lib.nvjpegGetProperty(prop, ctypes.byref(value)) != 0:
            return None
        version.append(value.value)
    return version[0], version[1], version[2]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]  # fmt: skip


def _path(lib: ctypes.CDLL) -> str:
    """The file a loaded library was mapped from (``dladdr`` of one of its functions)."""
    info = _DlInfo()
    address = ctypes.cast(lib.nvjpegGetProperty, ctypes.c_void_p)
    if ctypes.CDLL(None).dladdr(address, ctypes.byref(info)) and info.dli_fname:
        return os.path.realpath(info.dli_fname.decode())
    return lib._name


def _loaded(soname: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def preload(cuda: int | None = None) -> str | None:
    """Loads the pip package's nvJPEG for DALI's CUDA major (or ``cuda``), so that DALI's bare-name
    open gets it rather than a copy another library brings later; returns its path, or ``None``
    where DALI or the package is absent, a library of that name is loaded already, or
    ``GPUPIPE_NVJPEG_PRELOAD=0``."""
    if os.environ.get("GPUPIPE_NVJPEG_PRELOAD", "1") == "0":
        return None
    cuda = cuda or dali_cuda()
    path = pip_library(cuda) if cuda else None
    if path is None or _loaded(f"libnvjpeg.so.{cuda}") is not None:
        return None
    try:
        ctypes.CDLL(path)
    except OSError:
        return None
    PRELOADED.append(path)
    return path


def in_process(cuda: int | None = None) -> Nvjpeg | None:
    """The nvJPEG DALI's GPU decoders use in this process (for DALI's CUDA major, or ``cuda``):
    the library of its name loaded first, else the one its search path finds (the pip package's,
    then CUDA's); ``None`` where there is none. Loads it, as DALI would."""
    cuda = cuda or dali_cuda()
    if cuda is None:
        return None
    soname = f"libnvjpeg.so.{cuda}"
    pip = pip_library(cuda)
    lib = _loaded(soname)
    for name in [pip, soname, f"/usr/local/cuda/lib64/{soname}"] if lib is None else []:
        if name is None:
            continue
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return None
    version = _version(lib)
    if version is None:
        return None
    path = _path(lib)
    if pip is None or os.path.realpath(pip) == path:
        return Nvjpeg(soname, path, version)
    return Nvjpeg(soname, path, version, pip, _version(ctypes.CDLL(pip)))
