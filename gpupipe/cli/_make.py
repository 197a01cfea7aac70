"""``gpupipe make-shards``: WebDataset shards of generated photograph-like images (with the
fields the recipes read) or of an ImageFolder tree, never mixed with an earlier run's shards."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..core._errors import ConfigError, Damage, SampleError
from ..core._shards import ShardWriter
from ..runtime._children import process_pool
from ..runtime._dist import cpu_cores
from ..testing import encode_jpeg, encode_png, label_map, paint_boxes, synthetic_image
from . import _commands

__all__ = ["make_shards", "FIELDS"]

FIELDS = ("text", "meta", "mask", "boxes")  # what make-shards --fields writes besides jpg and cls


def _synthetic_sample(args: tuple[Any, ...]) -> tuple[str, dict]:
    i, seed, num_classes, quality, *more = args
    fields = more[0] if more else ()
    label = i % num_classes
    image = synthetic_image(seed * 1_000_003 + i, label=label, num_classes=num_classes)
    members: dict[str, Any] = {"cls": label}
    if "boxes" in fields:  # 1-3 rectangles painted on, a colour per box class: what the boxes enclose
        members["boxes.npy"], members["labels.npy"] = paint_boxes(image, seed * 1_000_003 + i)
    if "mask" in fields:  # each pixel's class: its brightness quartile (learnable from the pixels)
        members["seg.png"] = encode_png(label_map(image))
    if "text" in fields:
        members["txt"] = f"a synthetic photo of class {label}, number {i}"
    if "meta" in fields:
        members["json"] = {"label": label, "height": image.shape[0], "width": image.shape[1], "seed": seed}
    members["jpg"] = encode_jpeg(image, quality=quality)
    return f"{i:08d}", members


def _imagefolder_samples(root: str, quality: int, *, seed: int | None,
                         allow_empty: bool = False) -> Iterator[tuple[str, dict[str, Any]]]:  # fmt: skip
    """The tree's samples, keyed by their number in the tree (class by class), in an order shuffled
    by ``seed`` (``None``: the tree's). An ImageFolder is sorted by class: written in its order,
    each shard would hold one or two classes, and shuffling shards and a buffer within them mixes
    labels far less than a true shuffle (measured in issue 54: 2.6 to 5 points of accuracy lost)."""
    from PIL import Image

    from ..sources import ImageFolder

    index = ImageFolder(root, allow_empty=allow_empty).index()
    order = np.arange(len(index)) if seed is None else np.random.default_rng(seed).permutation(len(index))
    for n in order.tolist():
        raw = index.read(n)
        ext = raw.key.rpartition(".")[2].lower()
        data = raw.data
        if ext not in ("jpg", "jpeg", "png"):  # store what every backend decodes
            try:
                with Image.open(io.BytesIO(data)) as im:
                    data, ext = encode_jpeg(np.asarray(im.convert("RGB")), quality=quality), "jpg"
            except Exception as e:  # (Pillow's errors: OSError, ValueError, DecompressionBombError, ...)
                raise SampleError.at(f"cannot be re-encoded as JPEG: {type(e).__name__}: {e} (mend or remove the "
                                     "file)", shard=raw.shard, key=raw.key, kind=Damage.UNDECODABLE) from e  # fmt: skip
        yield f"{n:08d}", {"jpg" if ext == "jpeg" else ext: data, "cls": raw.label}


def _old_shards(out: str, prefix: str) -> list[str]:
    """The shards ``<prefix>-NNNNNN.tar`` already in folder ``out`` (a ``prefix`` may name a
    folder in it: ``sub/train``)."""
    import re

    folder, base = os.path.split(os.path.join(out, prefix))
    if not os.path.isdir(folder):
        return []
    name = re.compile(re.escape(base) + r"-[0-9]{6,}\.tar")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if name.fullmatch(f))


def make_shards(args: argparse.Namespace) -> int:
    literal = str.maketrans({"%": "%%"})  # a '%' of the folder or prefix is the name's, not a field
    pattern = os.path.join(args.out.translate(literal), f"{args.prefix.translate(literal)}-%06d.tar")
    if args.from_imagefolder and getattr(args, "fields", None):
        raise ConfigError("make-shards --fields writes synthetic fields: with --synthetic, not --from-imagefolder")
    fields = tuple(_commands._list(args.fields or "", "--fields", str))
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ConfigError(f"make-shards --fields: {', '.join(unknown)} unknown: choose from "
                          f"{', '.join(FIELDS)}")  # fmt: skip
    # shards of an earlier run left beside fewer new ones: a pattern or the folder would read them too
    old = _old_shards(args.out, args.prefix)
    if old and not args.overwrite:
        raise ConfigError(f"make-shards: {args.out} already holds {len(old)} shards named {args.prefix}-NNNNNN.tar "
                          f"({os.path.basename(old[0])}, ...): pass --overwrite to remove them first, or write into "
                          "another folder or with another --prefix")  # fmt: skip
    for shard in old:  # (--overwrite) with what gpupipe wrote beside them, stale for the new shards
        from ..shards._indexfile import index_file_url
        from ..shards._mask import mask_url

        for path in (shard, mask_url(shard), index_file_url(shard)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    writer = ShardWriter(pattern, max_count=args.shard_size)
    try:
        with writer:
            if args.from_imagefolder:
                with _commands._progress(args, None, "img", "gpupipe make-shards") as bar:
                    seed = None if args.keep_order else args.seed
                    samples = _imagefolder_samples(args.from_imagefolder, args.quality, seed=seed,
                                                   allow_empty=args.allow_empty)  # fmt: skip
                    writer.write_all(_commands._counted(samples, bar))
            else:
                jobs = [(i, args.seed, args.classes, args.quality, fields) for i in range(args.synthetic)]
                workers = args.workers or cpu_cores()
                with (
                    process_pool(workers, "gpupipe make-shards") as pool,
                    _commands._progress(args, len(jobs), "img", "gpupipe make-shards") as bar,
                ):
                    writer.write_all(_commands._counted(pool.map(_synthetic_sample, jobs, chunksize=16), bar))
    except BaseException:  # an error or Ctrl-C: no part of a dataset left to be read as a whole one
        for shard in writer.shards:
            with contextlib.suppress(FileNotFoundError):
                os.remove(shard)
        raise
    n = len(writer.shards)
    brace = f"{args.prefix}-{{000000..{n - 1:06d}}}.tar" if n > 1 else os.path.basename(writer.shards[0])
    if old:
        print(f"removed {len(old)} shards of an earlier run (--overwrite)")
    print(f"wrote {writer.samples} samples in {n} shards: {os.path.join(args.out, brace)}")
    return 0
