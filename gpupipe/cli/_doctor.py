"""``python -m gpupipe doctor``: what this machine has for gpupipe, what ``backend="auto"`` picks,
and every mismatch found, with the command that fixes it; ``--run`` pushes a few batches through
each backend and device present and compares them with the torch backend.

The facts (:func:`probe`) and the diagnosis (:func:`diagnose`) are separate: the diagnosis is a
pure function of the facts, so every branch — GPUs, drivers and builds this machine does not have
— is tested with facts made up in the tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import importlib.metadata
import platform
import re
import sys
from typing import Any

from ..backends._dali._strategy import ROI_FANCY_NVJPEG, Strategy, choose
from ..core._config import DaliOptions, DecodeMode
from ..loader._observed import last_verdict, verdict_file
from ..runtime._children import fork_can_freeze
from ..runtime._nvjpeg import Nvjpeg, in_process
from ._doctor_run import run_check

__all__ = [
    "Gpu",
    "Environment",
    "Advice",
    "Level",
    "probe",
    "diagnose",
    "auto_choice",
    "decode_strategy",
    "report",
    "hw_jpeg",
    "verdict_lines",
]

TORCH_CUDA12_INDEX = "https://download.pytorch.org/whl/cu126"  # torch for a CUDA 12 driver (also in the Makefile)

# GPUs with a hardware JPEG decoder that nvJPEG's hardware backend uses. nvJPEG's documentation
# names A100, A30 and H100; the others are the same chips or their data-center successors.
_HW_JPEG_DOCUMENTED = ("A100", "A30", "H100")
_HW_JPEG_SAME_FAMILY = ("A800", "H800", "H200", "H20", "GH200", "B100", "B200", "B300", "GB200", "GB300")


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]
    memory_gib: float


@dataclasses.dataclass(frozen=True)
class Environment:
    """What :func:`probe` found. CUDA versions are ``(major, minor)``; ``None`` where absent."""

    python: str
    torch: str
    torch_cuda: tuple[int, int] | None  # the CUDA torch was built for
    torchvision: str | None
    dali: str | None
    dali_cuda: int | None  # the CUDA major DALI was built for
    cupy: str | None
    cupy_cuda: int | None
    driver_cuda: tuple[int, int] | None  # the newest CUDA the driver supports
    gpus: tuple[Gpu, ...]
    torch_sees_cuda: bool  # torch.cuda.is_available()
    nvjpeg: Nvjpeg | None = None  # the nvJPEG DALI's GPU decoders use in this process
    last_verdict: dict[str, Any] | None = None  # what a loader here said limited it, last (loader._observed)


class Level(str, enum.Enum):
    OK = "ok"
    NOTE = "note"
    WARNING = "warning"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class Advice:
    """One line of :func:`diagnose`: a mismatch (or a note) about this machine, how serious it is,
    and the command that fixes it where there is one."""

    level: Level
    message: str
    fix: str | None = None  # the command that fixes it


def hw_jpeg(name: str) -> str:
    """Whether GPU ``name`` has a hardware JPEG decoder nvJPEG uses, and how that is known: DALI
    has no query, so from the model name (nvJPEG falls back to CUDA decoding without one)."""
    upper = name.upper()
    words = upper.replace("-", " ").split()
    if "MIG" in words or upper.startswith("MIG"):
        return "depends on the MIG profile (only profiles with media extensions have a JPEG engine)"
    if any(model in words for model in _HW_JPEG_DOCUMENTED):
        return "yes (nvJPEG documents this model)"
    if any(model in words for model in _HW_JPEG_SAME_FAMILY):
        return "yes (same data-center family as A100/H100)"
    if any(w in words for w in ("GEFORCE", "RTX", "QUADRO", "TITAN", "V100", "T4", "P100", "K80")):
        return "no (a consumer or pre-Ampere GPU): nvJPEG decodes with CUDA"
    return "unknown (not in nvJPEG's documented list: A100, A30, H100): measure with python bench/backends.py"


def _version(x: int | None) -> str:
    return "none" if x is None else str(x)


def _cuda(v: tuple[int, int] | None) -> str:
    return "none" if v is None else f"{v[0]}.{v[1]}"


# ---------------------------------------------------------------------------- probing --


class CudaDriver:
    """The NVIDIA driver, read through ``libcuda`` (no torch, no CUDA context kept)."""

    def __init__(self) -> None:
        self.lib: Any = None
        with contextlib.suppress(OSError):  # no NVIDIA driver
            self.lib = ctypes.CDLL("libcuda.so.1")

    def version(self) -> tuple[int, int] | None:
        if self.lib is None:
            return None
        v = ctypes.c_int()
        if self.lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
        return v.value // 1000, (v.value % 1000) // 10

    def gpus(self) -> tuple[Gpu, ...]:
        if self.lib is None or self.lib.cuInit(0) != 0:
            return ()
        count = ctypes.c_int()
        if self.lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return ()
        gpus = []
        for i in range(count.value):
            dev, name, mem = ctypes.c_int(), ctypes.create_string_buffer(256), ctypes.c_size_t()
            major, minor = ctypes.c_int(), ctypes.c_int()
            self.lib.cuDeviceGet(ctypes.byref(dev), i)
            self.lib.cuDeviceGetName(name, 256, dev)
            self.lib.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
            self.lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
            self.lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
            gpus.append(Gpu(i, name.value.decode(), (major.value, minor.value), round(mem.value / 2**30, 1)))
        return tuple(gpus)


def _dist_version(*names: str) -> tuple[str | None, str | None]:
    """(version, distribution name) of the first of ``names`` installed."""
    for name in names:
        try:
            return importlib.metadata.version(name), name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def probe(driver: CudaDriver | None = None) -> Environment:
    """Reads this machine: Python, torch, torchvision, DALI and CuPy with their CUDA builds, the
    driver and the GPUs."""
    import torch

    driver = driver or CudaDriver()
    tv, _ = _dist_version("torchvision")
    dali, dali_dist = _dist_version("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110")
    dali_cuda = None
    if dali_dist:
        dali_cuda = int(dali_dist.removeprefix("nvidia-dali-cuda")) // 10
    cupy, cupy_dist = _dist_version("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")
    cupy_cuda = int(cupy_dist[len("cupy-cuda") : -1]) if cupy_dist and cupy_dist != "cupy" else None
    torch_cuda = None
    if torch.version.cuda:
        major, minor = torch.version.cuda.split(".")[:2]
        torch_cuda = int(major), int(minor)
    return Environment(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch_cuda,
        torchvision=tv,
        dali=dali,
        dali_cuda=dali_cuda,
        cupy=cupy,
        cupy_cuda=cupy_cuda,
        driver_cuda=driver.version(),
        gpus=driver.gpus(),
        torch_sees_cuda=torch.cuda.is_available(),
        nvjpeg=in_process(dali_cuda) if dali_cuda else None,
        last_verdict=last_verdict(),
    )


# --------------------------------------------------------------------------- diagnosis --


def auto_choice(env: Environment) -> tuple[str, str, str]:
    """``(backend, device, why)`` for ``backend="auto", device=None`` on ``env``, for a pipeline
    every backend runs: the backend table's own rule (``gpupipe.backends.auto_choice``), asked
    about ``env``'s libraries."""
    from .. import backends

    if env.torch_sees_cuda:
        device, why = "cuda", "CUDA is available to torch"
    else:
        device, why = "cpu", "torch sees no usable GPU"
    installed = {"dali": env.dali is not None, "torch": env.torchvision is not None}
    backend, because = backends.auto_choice(device, available=lambda b: installed.get(b.name, b.available()))
    return backend.name, device, f"{why}; {because}"


def diagnose(env: Environment) -> list[Advice]:
    """Every mismatch in ``env``, most serious first, each with the command that fixes it."""
    found: list[Advice] = []
    driver = env.driver_cuda
    if not env.gpus or driver is None:
        found.append(Advice(Level.NOTE, "no NVIDIA GPU or driver: gpupipe runs torch (DALI on the CPU when named)"))
    else:
        if env.torch_cuda and env.torch_cuda[0] > driver[0]:
            found.append(Advice(
                Level.ERROR,
                f"torch {env.torch} is built for CUDA {_cuda(env.torch_cuda)} but the driver supports CUDA "
                f"{_cuda(driver)}: torch cannot use the GPUs. Install torch built for CUDA {driver[0]} (or "
                "update the driver)",
                f"pip install --force-reinstall torch=={env.torch.split('+')[0]} torchvision --index-url "
                f"{TORCH_CUDA12_INDEX}" if driver[0] == 12 else None,
            ))  # fmt: skip
        elif env.torch_cuda is None:
            found.append(Advice(
                Level.ERROR, f"torch {env.torch} is a CPU-only build: it cannot use the GPUs",
                f"pip install --force-reinstall torch=={env.torch.split('+')[0]} torchvision" if driver[0] >= 13
                else f"pip install --force-reinstall torch torchvision --index-url {TORCH_CUDA12_INDEX}",
            ))  # fmt: skip
        elif not env.torch_sees_cuda:
            found.append(Advice(Level.ERROR, "torch has a CUDA build but torch.cuda.is_available() is False: check "
                                "CUDA_VISIBLE_DEVICES and the driver (nvidia-smi)"))  # fmt: skip
        if env.dali_cuda and env.dali_cuda > driver[0]:
            found.append(
                Advice(
                    Level.ERROR,
                    f"DALI {env.dali} is built for CUDA {env.dali_cuda} but the driver supports CUDA {_cuda(driver)}: "
                    "the dali backend cannot use the GPUs",
                    f"pip uninstall -y nvidia-dali-cuda{env.dali_cuda}0 && pip install 'gpupipe[cuda{driver[0]}]'",
                )
            )
        elif env.dali is None:
            major = env.torch_cuda[0] if env.torch_cuda else driver[0]
            found.append(Advice(
                Level.WARNING, "DALI is not installed: backend='auto' uses the torch backend, decoding on the CPU",
                f"pip install 'gpupipe[cuda{major}]'",
            ))  # fmt: skip
        elif env.torch_cuda and env.dali_cuda and env.dali_cuda != env.torch_cuda[0]:
            found.append(Advice(
                Level.WARNING,
                f"DALI is built for CUDA {env.dali_cuda}, torch for CUDA {_cuda(env.torch_cuda)}: both work on this "
                "driver, but the process loads two CUDA runtimes (more memory, two sets of libraries)",
                f"pip uninstall -y nvidia-dali-cuda{env.dali_cuda}0 && pip install 'gpupipe[cuda{env.torch_cuda[0]}]'",
            ))  # fmt: skip
        if env.cupy and env.cupy_cuda and env.cupy_cuda > driver[0]:
            found.append(Advice(
                Level.ERROR, f"CuPy {env.cupy} is built for CUDA {env.cupy_cuda}: ArrayFunction steps fail on the GPU",
                f"pip uninstall -y cupy-cuda{env.cupy_cuda}x && pip install cupy-cuda{driver[0]}x",
            ))  # fmt: skip
        found += _decode_advice(env)
        without = [g.name for g in env.gpus if hw_jpeg(g.name).startswith("no")]
        if without:
            names = ", ".join(sorted(set(without)))
            found.append(Advice(Level.NOTE, f"no hardware JPEG decoder on {names}: nvJPEG decodes with CUDA kernels "
                                "(DaliOptions.hw_decoder_load has no effect)"))  # fmt: skip
        unknown = [g.name for g in env.gpus if not hw_jpeg(g.name).startswith(("no", "yes"))]
        if unknown:
            found.append(Advice(Level.NOTE, f"whether {', '.join(sorted(set(unknown)))} has a hardware JPEG decoder "
                                "nvJPEG uses is not known here: nvJPEG uses it if present, else CUDA"))  # fmt: skip
    found += _fork_advice(env.python)
    order = [Level.ERROR, Level.WARNING, Level.NOTE, Level.OK]
    return sorted(found, key=lambda f: order.index(f.level))


def _fork_advice(python: str) -> list[Advice]:
    """A Python whose fork can freeze a child for good (``fork_can_freeze``): a torch-backend worker
    that never starts."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", python)
    fixed = fork_can_freeze(tuple(int(p) for p in match.groups())) if match else None
    if fixed is None:
        return []
    return [Advice(
        Level.WARNING,
        f"Python {python} can freeze a torch-backend worker inside fork (CPython gh-112275, fixed in "
        f"{'.'.join(map(str, fixed))}): the torch backend finds such a worker within 30 s and starts "
        "another",
        f"use Python {'.'.join(map(str, fixed))} or newer (or 3.12)",
    )]  # fmt: skip


def decode_strategy(env: Environment) -> Strategy:
    """How a pipeline starting with ``RandomResizedCrop`` is decoded on this machine's GPUs with
    the default ``DaliOptions``."""
    return choose(DaliOptions(), nvjpeg=env.nvjpeg.version if env.nvjpeg else None)


def _nvjpeg_line(found: Nvjpeg | None) -> str:
    if found is None:
        return "not found (DALI's GPU decoders need it: pip install 'gpupipe[cuda13]')"
    line = f"{found} ({found.path})"
    if found.pip is not None:
        line += f"; nvidia-nvjpeg {'.'.join(map(str, found.pip_version or ()))} ({found.pip}) is shadowed by it"
    return line


def _strategy_line(env: Environment) -> str:
    strategy = decode_strategy(env)
    where = "" if env.gpus else "on a GPU (none here), "
    return (f"{where}pipelines starting with RandomResizedCrop: {strategy.mode.value} ({strategy.reason}); "
            "others decode whole images")  # fmt: skip


def _decode_advice(env: Environment) -> list[Advice]:
    """Why a train recipe would not decode regions on the GPU, and the fix."""
    if not env.dali or decode_strategy(env).mode == DecodeMode.ROI:
        return []
    found = env.nvjpeg
    if found is not None and found.pip_version is not None and found.pip_version[:2] >= ROI_FANCY_NVJPEG:
        return [Advice(
            Level.WARNING,
            f"DALI gets nvJPEG {found} ({found.path}), loaded before gpupipe could load nvidia-nvjpeg "
            f"{'.'.join(map(str, found.pip_version))}: pipelines starting with RandomResizedCrop decode whole images "
            "(a little slower than regions). Import gpupipe before torchvision (torchvision's CUDA wheels bring their "
            "own nvJPEG), or preload it",
            f"LD_PRELOAD={found.pip} python ...",
        )]  # fmt: skip
    if env.dali_cuda is not None and env.dali_cuda >= 13:
        return [Advice(
            Level.WARNING,
            f"nvJPEG {found or 'not found'} cannot decode a region with fancy upsampling (13.2 or newer can): "
            "pipelines starting with RandomResizedCrop decode whole images on the GPU",
            "pip install 'nvidia-nvjpeg>=13.2'",
        )]  # fmt: skip
    driver = env.driver_cuda
    return [Advice(
        Level.NOTE,
        f"DALI for CUDA {env.dali_cuda} comes with nvJPEG {found or '12.x'}, which cannot decode a region with fancy "
        "upsampling (13.2 or newer can): pipelines starting with RandomResizedCrop decode whole images on the GPU",
        "pip uninstall -y nvidia-dali-cuda120 && pip install 'gpupipe[cuda13]'" if driver and driver[0] >= 13 else None,
    )]  # fmt: skip


def report(env: Environment, advice: list[Advice]) -> str:
    """The text ``doctor`` prints."""
    backend, device, why = auto_choice(env)
    lines = [
        f"python       {env.python} ({sys.platform})",
        f"torch        {env.torch} (CUDA build {_cuda(env.torch_cuda)}; sees CUDA: {env.torch_sees_cuda})",
        f"torchvision  {env.torchvision or 'not installed'}",
        f"DALI         {env.dali or 'not installed'}" + (f" (built for CUDA {env.dali_cuda})" if env.dali else ""),
        f"CuPy         {env.cupy or 'not installed'}" + (f" (for CUDA {env.cupy_cuda})" if env.cupy_cuda else ""),
        f"driver       {'CUDA ' + _cuda(env.driver_cuda) if env.driver_cuda else 'no NVIDIA driver'}",
    ]
    for g in env.gpus:
        lines.append(f"GPU {g.index}        {g.name}, compute {g.capability[0]}.{g.capability[1]}, {g.memory_gib} GiB; "
                     f"hardware JPEG decoder: {hw_jpeg(g.name)}")  # fmt: skip
    if env.dali:
        lines.append(f"nvJPEG       {_nvjpeg_line(env.nvjpeg)}")
        lines.append(f"GPU decode   {_strategy_line(env)}")
        if env.gpus:
            from ..loader._records import default_share

            share, why = default_share(env.gpus[0].capability)
            lines.append(f"JPEG split   hw_decoder_load={share} by default on GPU 0: {why} (gpupipe tune measures "
                         "it for a pipeline)")  # fmt: skip
    lines.append(f"auto         backend={backend!r} device={device!r}: {why}")
    lines += verdict_lines(env.last_verdict)
    for f in advice:
        lines.append(f"{f.level.value.upper():12} {f.message}" + (f"\n             fix: {f.fix}" if f.fix else ""))
    if not any(f.level in (Level.ERROR, Level.WARNING) for f in advice):
        lines.append("OK           nothing to fix")
    return "\n".join(lines)


def verdict_lines(found: dict[str, Any] | None) -> list[str]:
    """The last verdict a loader left on this machine (``loader.stats()["bound"]``, written at each
    epoch's end and at ``close()`` by the node's first rank), as ``report`` prints it."""
    if found is None:
        return [f"last run     no loader verdict recorded here yet ({verdict_file()})"]
    rate = found.get("images_per_s")
    shown = f", {rate:,.0f} images/s" if isinstance(rate, (int, float)) else ""
    stall = found.get("stall")
    stall_text = f", stall {stall:.0%}" if isinstance(stall, (int, float)) else ""
    what = (f"{found.get('date', '?')}: backend={found.get('backend')!r} device={found.get('device')!r} "
            f"batch={found.get('batch_size')} workers={found.get('num_workers')}, epoch {found.get('epoch')} "
            f"({found.get('batches')} batches{shown}{stall_text})")  # fmt: skip
    return [f"last run     {what}",
            f"  bound      {found['bound']}: {found.get('why', '')}",
            f"  remedy     {found.get('remedy', '')}"]  # fmt: skip


def main(*, run: bool = False, images: int = 64, out: Any = print) -> int:
    """``python -m gpupipe doctor [--run]``: 0 when nothing is broken, 1 otherwise."""
    env = probe()
    advice = diagnose(env)
    out(report(env, advice))
    broken = any(f.level == Level.ERROR for f in advice)
    if run and not run_check(env, images=images, out=out):
        broken = True
    return 1 if broken else 0
