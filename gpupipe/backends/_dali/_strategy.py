"""How the GPU graph decodes a leading ``RandomResizedCrop``: region-of-interest decode on the GPU
where nvJPEG can do it with the requested chroma upsampling, else the whole image on the GPU.

DALI 2.4 decodes through nvImageCodec 0.9, which tries its decoders in order — nvJPEG's hardware
decoder (A100/H100 JPEG engines), nvJPEG's CUDA decoder, then libjpeg-turbo on the CPU — and gives
each image to the first that accepts it. With fancy upsampling (libjpeg-turbo's chroma
interpolation, which the CPU decoders and torchvision use: ``DaliOptions.jpeg_fancy_upsampling``,
on by default for parity) both nvJPEG decoders decline a *region* of a chroma-subsampled JPEG
(4:2:0, 4:2:2: nearly every photo) unless nvJPEG is 13.2 or newer — so those images are decoded on
the CPU, silently, at a few hundred images/s per thread. A whole image they decode on the GPU
with fancy upsampling. Hence :func:`choose`.

The decision is a pure function of the facts (:func:`choose`), so every branch is tested on a
machine without a GPU with made-up versions; :func:`nvjpeg_version` finds the fact in the process
(``gpupipe.runtime._nvjpeg``: which nvJPEG DALI gets is not simply the newest installed).
"""

from __future__ import annotations

import dataclasses

from ...core._config import DaliOptions, DecodeMode

__all__ = ["ROI_FANCY_NVJPEG", "Strategy", "choose", "nvjpeg_version"]

ROI_FANCY_NVJPEG = (13, 2)  # the first nvJPEG whose decoders take a region with fancy upsampling


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The decode strategy a GPU graph gets, and why (for ``doctor``, the loader's repr, logs)."""

    mode: DecodeMode  # ROI or FULL
    reason: str

    def __str__(self) -> str:
        return f"{self.mode.value} ({self.reason})"


def _version(v: tuple[int, ...] | None) -> str:
    return "unknown" if v is None else ".".join(map(str, v))


def choose(options: DaliOptions, *, nvjpeg: tuple[int, ...] | None) -> Strategy:
    """The strategy for a GPU graph with ``options``, given the nvJPEG version DALI loads
    (``None``: not found)."""
    if options.decode != DecodeMode.AUTO:
        return Strategy(DecodeMode(options.decode), "set by DaliOptions(decode=...)")
    if not options.jpeg_fancy_upsampling:
        return Strategy(DecodeMode.ROI, "nvJPEG decodes regions without fancy upsampling")
    if nvjpeg is not None and tuple(nvjpeg[:2]) >= ROI_FANCY_NVJPEG:
        return Strategy(DecodeMode.ROI, f"nvJPEG {_version(nvjpeg)} decodes regions with fancy upsampling")
    need = _version(ROI_FANCY_NVJPEG)
    return Strategy(
        DecodeMode.FULL,
        f"nvJPEG {_version(nvjpeg)} declines regions with fancy upsampling (needs {need}+), which would go to the CPU",
    )


def nvjpeg_version() -> tuple[int, int, int] | None:
    """The version of the nvJPEG DALI's GPU decoders use in this process (``gpupipe.runtime._nvjpeg``),
    or ``None`` where there is none."""
    from ...runtime._nvjpeg import in_process

    found = in_process()
    return None if found is None else found.version
