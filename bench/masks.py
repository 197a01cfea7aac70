"""Where a segmentation mask is best moved: what it costs on the host, and how near DALI's
nearest-neighbour resize comes to torchvision's.

gpupipe decodes a mask with Pillow (DALI's decoders expand a palette PNG to RGB and decode PNG on
the CPU anyway) and moves it on the host with the image's draws, by index arithmetic
(``backends/_torch/_maskindex``), on every backend. This measures, per 500 x 375 label map (VOC's
size), through torchvision's segmentation train preset (``pipelines/segmentation.py:train``):

- the host's CPU time: decoding the PNG, and moving the mask (one thread);
- how many pixels DALI's ``resize`` with ``INTERP_NN`` gives otherwise than torchvision's nearest
  resize (``F.resize`` of a ``tv_tensors.Mask``) at the recipe's drawn sizes: as it is (DALI samples
  at pixel centres, torchvision at ``floor(i * in / out)``), and with its region of interest
  shifted by half an output step, which turns the one rule into the other but for rounding.

    python bench/masks.py                 # --samples 256

Two kinds of map: ``regions`` (a background with a few ellipses of classes 1-20 outlined in 255,
like VOC's) and ``noisy`` (each pixel the brightness quartile of a synthetic photo: boundaries
everywhere, the worst case for any difference). Results go to ``bench/results/<date>-masks-cpu.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish

import gpupipe as gp
from gpupipe.backends._torch._targets import move_targets
from gpupipe.core._geometry import resize_size
from gpupipe.core._random import factors
from gpupipe.testing import encode_png, label_map, synthetic_image

SIZE = (375, 500)  # (height, width): PASCAL VOC's usual label map


def regions(seed: int) -> np.ndarray:
    """A background of 0 with 2-5 ellipses of classes 1-20, each outlined in 255 (VOC's
    boundary band): uint8 ``[H, W]``."""
    rng = np.random.default_rng(seed)
    h, w = SIZE
    y, x = np.mgrid[0:h, 0:w]
    out = np.zeros(SIZE, np.uint8)
    for _ in range(int(rng.integers(2, 6))):
        cy, cx, ry, rx = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(20, h / 2), rng.uniform(20, w / 2)
        r = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
        out[r < 1.0] = 255
        out[r < 0.95] = int(rng.integers(1, 21))
    return out


def noisy(seed: int) -> np.ndarray:
    return label_map(synthetic_image(seed, size=SIZE))


def host_ms(maps: list[np.ndarray], steps, repeats: int) -> tuple[float, float]:
    """Milliseconds per mask on one thread: decoding its PNG, and moving it through ``steps``
    (after a pass that warms up)."""
    field = gp.fields.Mask("seg.png", fill=255)
    pngs = [encode_png(m) for m in maps]
    drawn = factors(steps, 0, 0, np.arange(len(maps)))
    per_sample = [[None if f is None else f[i] for f in drawn] for i in range(len(maps))]
    start = time.perf_counter()
    for _ in range(repeats):
        decoded = [field.decode(png, shard="bench", key=str(i)) for i, png in enumerate(pngs)]
    decode = (time.perf_counter() - start) / (repeats * len(maps))
    for _ in range(2):  # the first pass warms up; the second is timed
        start = time.perf_counter()
        for mask, f in zip(decoded * repeats, per_sample * repeats, strict=True):
            move_targets({"mask": field}, {"mask": mask}, steps, f, SIZE, shard="bench", key="k")
    move = (time.perf_counter() - start) / (repeats * len(maps))
    return decode * 1e3, move * 1e3


def dali_nearest(maps: list[np.ndarray], sizes: list[tuple[int, int]], shifted: bool) -> list[np.ndarray]:
    """``maps`` resized to ``sizes`` by DALI's CPU ``resize`` (``INTERP_NN``), its region of
    interest shifted by half an output step where ``shifted``: ``src = roi_start + (i + 0.5) *
    in / out`` becomes ``i * in / out``, torchvision's sampling point."""
    from nvidia.dali import fn, pipeline_def, types

    def roi(size: tuple[int, int], end: bool) -> np.ndarray:
        whole = np.array(SIZE, np.float32)
        step = whole / np.array(size, np.float32) if shifted else np.zeros(2, np.float32)
        return (whole if end else np.zeros(2, np.float32)) - 0.5 * step

    @pipeline_def(batch_size=len(maps), num_threads=2, device_id=None)
    def pipe():
        def fed(values):
            return fn.external_source(source=lambda: values, batch=True)

        labels = fn.external_source(source=lambda: [m[:, :, None] for m in maps], batch=True, layout="HWC")
        return fn.resize(labels, size=fed([np.array(s, np.float32) for s in sizes]), interp_type=types.INTERP_NN,
                         antialias=False, roi_start=fed([roi(s, False) for s in sizes]),
                         roi_end=fed([roi(s, True) for s in sizes]), roi_relative=False)  # fmt: skip

    p = pipe()
    p.build()
    (out,) = p.run()
    return [np.array(out[i])[:, :, 0] for i in range(len(maps))]


def differing(maps: list[np.ndarray], sizes: list[tuple[int, int]], shifted: bool) -> tuple[float, float]:
    """Mean and largest share of pixels where DALI's nearest resize differs from torchvision's."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    shares = []
    for got, m, s in zip(dali_nearest(maps, sizes, shifted), maps, sizes, strict=True):
        want = F.resize(tv_tensors.Mask(torch.from_numpy(m)[None]), list(s))[0].numpy()
        shares.append(float((got != want).mean()))
    return float(np.mean(shares)), float(np.max(shares))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = gp.load_pipeline(os.path.join(ROOT, "pipelines", "segmentation.py:train"))
    steps = recipe(gp.WebDataset("unused-{000000..000001}.tar")).views[0]
    resize = steps[0]
    drawn = factors([resize], 0, 0, np.arange(args.samples))[0]
    sizes = [resize_size(*SIZE, (resize.make_params(*SIZE, f).size,), None) for f in drawn]
    rows = []
    for name, make in (("regions", regions), ("noisy", noisy)):
        maps = [make(i) for i in range(args.samples)]
        decode, move = host_ms(maps, steps, args.repeats)
        plain = differing(maps, sizes, shifted=False)
        shifted = differing(maps, sizes, shifted=True)
        rows.append([name, f"{decode:.2f}", f"{move:.2f}", f"{plain[0]:.2%} / {plain[1]:.2%}",
                     f"{shifted[0]:.3%} / {shifted[1]:.3%}"])  # fmt: skip
    intro = (
        f"`python bench/masks.py --samples {args.samples}` on {platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores, one thread used). 500 x 375 label maps through "
        "`pipelines/segmentation.py:train` (RandomResize 260-1040, flip, RandomCrop 480 padded with "
        "255). Host: milliseconds per mask. DALI: share of pixels differing from torchvision's nearest "
        "resize at the recipe's drawn sizes, mean / largest over the masks."
    )
    header = ["label map", "PNG decode ms", "move ms", "DALI resize differs", "DALI, ROI shifted, differs"]
    publish(args.out, "masks-cpu", "Masks: host cost, and DALI's nearest resize against torchvision's", intro,
            header, rows)  # fmt: skip


if __name__ == "__main__":
    main()
