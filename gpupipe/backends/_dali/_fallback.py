"""Images DALI's decoders do not read, delivered as gpupipe's own decoder reads them: one verdict
per file on every backend, whatever DALI's decoders make of it.

A file takes this way when

- its header says so (:func:`native` is false): a format DALI has no decoder for (one only Pillow
  reads: TGA, ICO, PCX, ...), JPEG 2000 (DALI's CPU decoder for it killed the process on a damaged
  file: it never gets one), TIFF (libtiff decodes a region's rows only, so a strip damaged or cut
  below a crop window passed on DALI and was refused on torch: found by the fuzzer), a JPEG with
  junk bytes before its frame header (libjpeg skips them, nvImageCodec refuses the file), an
  animated PNG (decoders disagree on its first frame), a PGM or PPM whose largest value is not 255
  or 65535 (DALI's decoder does not scale its values);
- or nvImageCodec's parser, the one DALI's decoders run first, refuses it (:func:`parsed`): a JPEG
  with junk after its frame header, a 16-bit or RLE4 BMP, a PNG without its end chunk. Such a file
  must never reach DALI: DALI 2.4's decoders parse a batch of 32 or more samples in blocks on
  several threads, and a parse error raised in the calling thread leaves the other threads running
  on freed memory (``ImageDecoder::RunImplImpl``'s ``setup_block``: a SIGSEGV, seen here in most
  runs of a batch of 33 with one such file);
- or DALI failed on its batch anyway (a bitstream damaged past its headers: an error, not a crash):
  :class:`Probe` runs the same graph one sample at a time and names the samples it fails on.

Either way the file is decoded by gpupipe's decoder in a child process
(:func:`gpupipe.runtime._decode.transcoded`): refused, that is the sample's verdict — skipped or raised, as
on the torch backend; read, its pixels go to the graph as a binary PPM, which DALI's decoders read
exactly, so the sample takes the same graph (and the same random draws) as every other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...core._imageinfo import header_size
from ...runtime._decode import Header
from ._failures import device_failure

__all__ = ["NATIVE", "native", "parsed", "ppm_size", "Probe"]

log = logging.getLogger("gpupipe")

# Formats DALI's decoders get (nvImageCodec: libjpeg-turbo or nvJPEG, libpng, libwebp, OpenCV's
# BMP and PNM); the variants of them it refuses are found by the Probe. Not JPEG 2000, not TIFF.
NATIVE = frozenset(("jpeg", "png", "webp", "bmp", "pnm"))


def native(header: Header) -> bool:
    """Whether DALI's decoders get the file itself (else its pixels, decoded by gpupipe)."""
    return header.format in NATIVE and not header.irregular


_DALI_DTYPES = ("uint8", "uint16")  # sample types DALI's decoders take (an int32 TIFF: "Invalid sample_type")
_nvimgcodec: Any = None


def parsed(data: Any) -> tuple[int, int] | None:
    """``(height, width)`` as nvImageCodec's parser reads the image (what DALI's decoders then
    decode), or ``None`` where it refuses it or gives a sample type DALI does not take. A few
    microseconds (C++), in the reader threads."""
    global _nvimgcodec
    if _nvimgcodec is None:
        try:
            from nvidia import nvimgcodec  # installed with DALI (nvidia-nvimgcodec-cu12 / -cu13)
        except ImportError:
            log.warning("gpupipe: nvImageCodec's Python module (nvidia.nvimgcodec) is not installed: files DALI's "
                        "decoders cannot parse reach them, and a batch of 32 or more holding one can crash DALI "
                        "2.4; install nvidia-nvimgcodec-cu12 (or -cu13)")  # fmt: skip
            nvimgcodec = False
        _nvimgcodec = nvimgcodec
    if _nvimgcodec is False:
        return header_size(data)
    try:
        stream = _nvimgcodec.CodeStream(data)
        if str(stream.dtype) not in _DALI_DTYPES:
            return None
        return int(stream.height), int(stream.width)
    except Exception:  # RuntimeError "Failed to get image info"; TypeError for a sample type numpy lacks
        return None


def ppm_size(ppm: bytes | np.ndarray) -> tuple[int, int]:
    """``(height, width)`` of a binary PPM written by :func:`gpupipe.runtime._decode.transcoded`."""
    width, height = bytes(ppm[:40]).split(b"\n", 2)[1].split()
    return int(height), int(width)


class Probe:
    """The runner's graph at batch size 1, built on first use (``define()`` returns it built):
    which samples of a batch DALI fails on, each run alone with its own fed arguments."""

    def __init__(self, define: Callable[[], Any]) -> None:
        self._define = define
        self._pipe: Any = None

    def refused(self, encoded: Sequence[Any], feeds: dict[str, np.ndarray], positions: Sequence[int], *,
                batch: int) -> list[int]:  # fmt: skip
        """The ``positions`` whose sample DALI's graph fails on. A device failure (out of memory,
        CUDA) is raised: it says nothing of the sample."""
        if self._pipe is None:
            self._pipe = self._define()
        pipe, refused = self._pipe, []
        for i in positions:
            pipe.feed_input("encoded", [encoded[i]])
            for name, value in feeds.items():
                pipe.feed_input(name, np.ascontiguousarray(value[i : i + 1]))
            try:
                outputs = pipe.run()
            except RuntimeError as e:
                failure = device_failure(e, batch=batch)
                if failure is not None:
                    raise failure from e
                refused.append(i)
            else:
                del outputs
        return refused

    def close(self) -> None:
        """Drops the pipeline (its threads end with it)."""
        self._pipe = None
