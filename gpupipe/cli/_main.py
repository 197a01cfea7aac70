"""python -m gpupipe: make-shards (write WebDataset shards), index (build the shard index cache),
check (validate every sample), bench (images/s of a pipeline), inspect (see what a pipeline does)
and doctor (check this machine).

Exit status: 0 done; 1 check or doctor found something wrong; 2 a usage error or a gpupipe error
(printed on one line); 130 interrupted (Ctrl-C), with every worker process ended.

Long commands show a progress bar on stderr; --quiet turns it off."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from .._children import process_pool
from .._errors import GpupipeError
from .._imageinfo import MAX_IMAGE_PIXELS
from .._shards import ShardWriter
from ..testing import encode_jpeg, synthetic_image

__all__ = ["main"]
T = TypeVar("T")


def _synthetic_sample(args: tuple[int, int, int, int]) -> tuple[str, dict]:
    i, seed, num_classes, quality = args
    label = i % num_classes
    jpeg = encode_jpeg(synthetic_image(seed * 1_000_003 + i, label=label, num_classes=num_classes), quality=quality)
    return f"{i:08d}", {"jpg": jpeg, "cls": label}


def _imagefolder_samples(root: str, quality: int) -> Iterator[tuple[str, dict[str, Any]]]:
    from PIL import Image

    from ..sources import ImageFolder

    index = ImageFolder(root).index()
    for n in range(len(index)):
        raw = index.read(n)
        ext = raw.key.rpartition(".")[2].lower()
        data = raw.data
        if ext not in ("jpg", "jpeg", "png"):  # store what every backend decodes
            with Image.open(io.BytesIO(data)) as im:
                data, ext = encode_jpeg(np.asarray(im.convert("RGB")), quality=quality), "jpg"
        yield f"{n:08d}", {"jpg" if ext == "jpeg" else ext: data, "cls": raw.label}


def _progress(args: argparse.Namespace, total: int | None, unit: str, desc: str) -> Any:
    """A tqdm progress bar on stderr (none with ``--quiet``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=bool(getattr(args, "quiet", False)), file=sys.stderr)


def _counted(items: Iterable[T], bar: Any) -> Iterator[T]:
    for item in items:
        yield item
        bar.update(1)


def make_shards(args: argparse.Namespace) -> int:
    pattern = os.path.join(args.out, f"{args.prefix}-%06d.tar")
    with ShardWriter(pattern, max_count=args.shard_size) as writer:
        if args.from_imagefolder:
            with _progress(args, None, "img", "gpupipe make-shards") as bar:
                writer.write_all(_counted(_imagefolder_samples(args.from_imagefolder, args.quality), bar))
        else:
            jobs = [(i, args.seed, args.classes, args.quality) for i in range(args.synthetic)]
            workers = args.workers or os.cpu_count() or 1
            with (
                process_pool(workers, "gpupipe make-shards") as pool,
                _progress(args, len(jobs), "img", "gpupipe make-shards") as bar,
            ):
                writer.write_all(_counted(pool.map(_synthetic_sample, jobs, chunksize=16), bar))
    n = len(writer.shards)
    brace = f"{args.prefix}-{{000000..{n - 1:06d}}}.tar" if n > 1 else os.path.basename(writer.shards[0])
    print(f"wrote {writer.samples} samples in {n} shards: {os.path.join(args.out, brace)}")
    return 0


def _list(text: str, what: str, convert: Callable[[str], T]) -> list[T]:
    from .._errors import ConfigError

    try:
        return [convert(part.strip()) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be a value or values separated by commas, got {text!r}") from None


def _workers(text: str) -> int | None:
    return None if text == "auto" else int(text)


def tune(args: argparse.Namespace) -> int:
    """``gpupipe tune``: measure and record the loader's throughput settings for a pipeline."""
    from .._pipeline import load_pipeline
    from .._tune import tune as run_tune
    from .._tuned import tune_file

    pipeline = load_pipeline(args.pipeline)(args.source)
    print(f"pipeline {args.pipeline}, batch {args.batch_size}: {args.seconds:g} s per trial")

    def say(trial: dict[str, Any]) -> None:
        share = "" if trial["hw_decoder_load"] is None else f" hw_decoder_load={trial['hw_decoder_load']}"
        print(f"  num_workers={trial['num_workers']} prefetch={trial['prefetch']}{share}: "
              f"{trial['images_per_s']:.0f} images/s", flush=True)  # fmt: skip

    tuned = run_tune(pipeline, args.batch_size, seconds=args.seconds, record=not args.no_record, progress=say,
                     backend=args.backend, device=args.device)  # fmt: skip
    print(f"chosen: {tuned}")
    if not args.no_record:
        print(f"recorded in {tune_file()}: loaders of this pipeline and batch size on this machine that leave "
              "num_workers, prefetch and hw_decoder_load unset use it")  # fmt: skip
    return 0


def bench(args: argparse.Namespace) -> int:
    from .._loader import _cpu_count
    from .._pipeline import load_pipeline
    from ._bench import BASELINE, check_baseline, plot, run_baseline, run_loader, table

    logging_level = os.environ.get("GPUPIPE_LOG")
    if logging_level:
        import logging

        logging.basicConfig(level=logging_level.upper())
    pipeline = load_pipeline(args.pipeline)(args.source)
    backends = _list(args.backend, "--backend", str)
    sizes = _list(args.batch_size, "--batch-size", int)
    workers = _list(args.workers, "--workers", _workers)
    if args.baseline:
        check_baseline(pipeline)
    print(f"pipeline {args.pipeline}: output {', '.join(map(str, pipeline.output_specs))}")

    def progress(name: str) -> Callable[[int, int], Any]:
        return lambda epoch, total: _progress(args, total, "batch", f"{name} epoch {epoch}")

    runs = []
    for backend in backends:
        for size in sizes:
            for w in workers:
                run = run_loader(pipeline, backend=backend, device=args.device, batch_size=size, workers=w,
                                 epochs=args.epochs, progress=progress(backend))  # fmt: skip
                _say(run)
                runs.append(run)
    if args.baseline:
        for size in sizes:
            for w in workers:
                count = w if w is not None else min(8, _cpu_count())  # the Loader's default
                for decoder in _list(args.baseline_decoder, "--baseline-decoder", str):
                    run = run_baseline(pipeline, batch_size=size, workers=count, epochs=args.epochs,
                                       progress=progress(BASELINE), decoder=decoder)  # fmt: skip
                    _say(run)
                    runs.append(run)
    if len(runs) > 1:
        print(table(runs))
    if args.plot:
        title = f"{args.pipeline} on {args.source} ({os.cpu_count()} cores)"
        plot(runs, args.plot, title=title)
        print(f"plot: {args.plot}")
    if args.json:
        first = runs[0]
        with open(args.json, "w") as f:
            json.dump(
                {
                    "pipeline": args.pipeline,
                    "backend": first.backend,
                    "device": first.device,
                    "batch_size": first.batch_size,
                    "workers": first.workers,
                    "epochs": first.epochs,
                    "runs": [r.as_dict() for r in runs],
                },
                f,
                indent=2,
            )
    return 0


def _say(run: Any) -> None:
    print(f"backend={run.backend} device={run.device} workers={run.workers} batch={run.batch_size}")
    for e in run.epochs:
        print(
            f"epoch {e['epoch']}: {e['images']} images in {e['seconds']:.2f} s = {e['images_per_s']:.0f} images/s"
            + (" (includes start-up)" if e["epoch"] == 0 else "")
        )


def _storage_options(text: str | None) -> dict[str, Any] | None:
    """``--storage-options``: a JSON object (parsed as data, never evaluated)."""
    if text is None:
        return None
    from .._errors import ConfigError

    try:
        options = json.loads(text)
    except ValueError as e:
        example = '{"endpoint_url": "http://host:8333"}'
        raise ConfigError(f"--storage-options must be a JSON object, e.g. '{example}': {e}") from e
    if not isinstance(options, dict):
        raise ConfigError(f"--storage-options must be a JSON object, got {type(options).__name__}")
    return options


def _index_one(job: tuple[str, tuple[str, ...], str | None, bool, dict[str, Any] | None]) -> tuple[int, int]:
    """Indexes one shard; with ``beside``, writes its index file next to it. Returns the samples
    and the index files written (0 or 1)."""
    from ..sidefiles._summary import write_summary
    from ..sources import storage_for
    from ..sources._webdataset import cached_scan, shard_samples

    url, image_exts, label_ext, beside, options = job
    with storage_for([url], storage_options=options) as storage:
        if not beside:
            return len(cached_scan(storage, url, image_exts, label_ext)), 0
        shard, samples = shard_samples(storage, url, image_exts, label_ext)
        if samples is None or shard.nbytes is None:  # missing or unreadable: nothing to describe
            return len(shard), 0
        write_summary(storage, url, size=shard.nbytes, detail=samples, image_exts=image_exts,
                      label_ext=label_ext, problems=shard.problems)  # fmt: skip
        return len(shard), 1


def index(args: argparse.Namespace) -> int:
    """Builds the index cache of every shard, in parallel: a large dataset's first Loader then
    starts from the cache on every rank (point ``GPUPIPE_CACHE_DIR`` at storage all nodes see)."""
    from ..sources import WebDataset, _wdsindex

    options = _storage_options(args.storage_options)
    label = None if args.label == "none" else args.label
    source = WebDataset(args.source, image=args.image, label=label, storage_options=options)
    jobs = [(u, *source.extensions(), args.beside, options) for u in source.urls]
    start = time.perf_counter()
    with _progress(args, len(jobs), "shard", "gpupipe index") as bar:
        if args.workers == 0:
            done = list(_counted(map(_index_one, jobs), bar))
        else:
            with process_pool(args.workers, "gpupipe index") as pool:
                done = list(_counted(pool.map(_index_one, jobs, chunksize=max(1, len(jobs) // 64)), bar))
    total, written = sum(n for n, _ in done), sum(w for _, w in done)
    print(
        f"{total} samples in {len(jobs)} shards, indexed in {time.perf_counter() - start:.1f} s; "
        f"cache: {_wdsindex.cache_dir()}"
        + (f"; {written} index files written beside the shards" if args.beside else "")
    )
    return 0


def check(args: argparse.Namespace) -> int:
    from .._check import check as run_check
    from ..sources import WebDataset

    label = None if args.label == "none" else args.label
    options = _storage_options(args.storage_options)
    source = WebDataset(args.shards, image=args.image, label=label, storage_options=options)
    limit = None if args.max_image_pixels == 0 else args.max_image_pixels
    report = run_check(
        source, workers=args.workers, write=not args.no_write, progress=not args.quiet, max_image_pixels=limit
    )
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(report.summary())
    return 0 if report.ok else 1


def inspect(args: argparse.Namespace) -> int:
    from .. import backends
    from .._errors import ConfigError
    from .._pipeline import load_pipeline
    from ..sources import ImageFolder
    from ._inspect import inspect as run_inspect

    source: Any = ImageFolder(args.data) if os.path.isdir(args.data) else args.data
    pipeline = load_pipeline(args.pipeline)(source)
    if args.compare:
        names = [n for n in backends.names() if backends.get(n).available()]
        if len(names) < 2:
            raise ConfigError(f"--compare needs two backends; only {names} is installed (pip install gpupipe[cuda12])")
    else:
        names = [args.backend]
    lines = run_inspect(pipeline, args.out, samples=args.samples, draws=args.draws, backends=names, seed=args.seed,
                        cell=args.cell, device=args.device)  # fmt: skip
    print("\n".join(lines))
    return 0


def doctor(args: argparse.Namespace) -> int:
    from ._doctor import main as doctor_main

    return doctor_main(run=args.run, images=args.images)


def _command(sub: Any, name: str, summary: str, description: str, example: str) -> argparse.ArgumentParser:
    """A subcommand whose help is plain text, with an example."""
    return sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog="example:\n  " + example.replace("\n", "\n  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _shard_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the commands that read every shard (index, check)."""
    p.add_argument("--image", default="jpg;jpeg;png", help="image extensions, in order of preference")
    p.add_argument("--label", default="cls", help="label extension, or 'none' for unlabeled data")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores; 0: this process)")
    p.add_argument("--storage-options", metavar="JSON", help="remote shards: the fsspec filesystem's options, "
                   "e.g. '{\"endpoint_url\": \"http://host:8333\"}' (default: the driver's environment)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpupipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m gpupipe make-shards data --synthetic 2048 --shard-size 256\n"
        "  python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar'",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    p = _command(
        sub, "make-shards", "write WebDataset shards of real JPEGs",
        "Writes WebDataset tar shards (key.jpg + key.cls) of generated photograph-like images, or converts an "
        "ImageFolder tree (PNG and JPEG kept, other formats re-encoded as JPEG).",
        "python -m gpupipe make-shards data --synthetic 2048 --shard-size 256\n"
        "python -m gpupipe make-shards shards/ --from-imagefolder /data/imagenet/train --shard-size 1000",
    )  # fmt: skip
    p.add_argument("out", help="output folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N", help="N generated photograph-like images")
    src.add_argument("--from-imagefolder", metavar="ROOT", help="an ImageFolder tree to convert")
    p.add_argument("--classes", type=int, default=10, help="classes of the synthetic images (default 10)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--prefix", default="train", help="shard name prefix (default 'train')")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="encoding processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=make_shards)
    i = _command(
        sub, "index", "build the index cache of a dataset's shards (in parallel)",
        "Reads the tar headers of every shard, in parallel, into the index cache ($GPUPIPE_CACHE_DIR, default "
        "~/.cache/gpupipe): a loader then starts from the cache on every rank. With --beside, also writes "
        "<shard>.gpupipe.json beside each shard (local or remote), so that nodes start on a remote dataset "
        "without downloading it and ranks download only their part of shards they split.",
        "python -m gpupipe index 'data/train-{000000..001281}.tar'\n"
        "python -m gpupipe index 's3://bucket/train-{000000..001281}.tar' --beside "
        "--storage-options '{\"endpoint_url\": \"http://host:8333\"}'",
    )  # fmt: skip
    i.add_argument("source", nargs="+", help="shard paths, URLs or patterns, e.g. 'data/train-{000000..001281}.tar'")
    _shard_arguments(i)
    i.add_argument("--beside", action="store_true", help="also write <shard>.gpupipe.json beside each shard")
    i.set_defaults(fn=index)
    c = _command(
        sub, "check", "validate every sample of WebDataset shards; list the bad ones beside their shards",
        "Reads every shard's tar structure and every sample's label and image (header, pixel limit, full "
        "decode), in parallel, prints a summary per kind of damage and writes <shard>.bad.json beside each "
        "damaged shard: every gpupipe loader then leaves those samples out. Exits 1 when anything is bad.",
        "python -m gpupipe check 'data/train-{000000..001281}.tar' --json > check.json",
    )  # fmt: skip
    c.add_argument("shards", nargs="+", help="shard paths or brace patterns")
    _shard_arguments(c)
    c.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                   help=f"pixel limit (default {MAX_IMAGE_PIXELS}, as Pillow; 0: none)")  # fmt: skip
    c.add_argument("--no-write", action="store_true", help="only report: write no bad-sample lists")
    c.add_argument("--json", action="store_true", help="print the report as JSON (every finding) instead")
    c.set_defaults(fn=check)
    b = _command(
        sub, "bench", "run a pipeline through the Loader and print images/s",
        "Runs a pipeline's epochs through gp.Loader (shuffled, drop_last) and prints images/s per epoch; the "
        "first epoch includes start-up. --backend, --batch-size and --workers take lists (commas): every "
        "combination runs, one after another, and a table compares them. --baseline also runs the usual way "
        "(webdataset + torchvision's transforms of the same names in a torch DataLoader); --plot draws images/s "
        "per backend and against batch size and workers (matplotlib: the plot extra).",
        "python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' --backend dali\n"
        "python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' "
        "--backend torch,dali --batch-size 32,64,128 --workers 1,2 --baseline --plot bench.png",
    )  # fmt: skip
    b.add_argument("pipeline", help="pipeline factory, e.g. pipelines/imagenet.py:train")
    b.add_argument("source", help="shard pattern, e.g. 'data/train-{000000..000007}.tar'")
    b.add_argument("--batch-size", default="64", help="one or more, e.g. 32,64 (default 64)")
    b.add_argument("--backend", default="auto", help="one or more, e.g. torch,dali (default auto)")
    b.add_argument("--device", default=None)
    b.add_argument("--workers", default="auto", help="one or more, e.g. 1,2 (default auto: the Loader's)")
    b.add_argument("--epochs", type=int, default=2)
    b.add_argument("--baseline", action="store_true", help="also run webdataset + torchvision in a DataLoader")
    b.add_argument(
        "--baseline-decoder",
        default="pillow",
        metavar="DECODERS",
        help="the baseline's decoder(s): pillow (default), torchvision, or both: pillow,torchvision",
    )
    b.add_argument("--plot", metavar="PNG", help="draw the results (matplotlib)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(fn=bench)
    t = _command(
        sub, "tune", "measure and record the loader's threads, prefetch and hardware-decoder share",
        "Runs a pipeline through gp.Loader with candidate settings — num_workers (DALI's threads or the torch "
        "backend's workers), then prefetch, then on a GPU DaliOptions.hw_decoder_load — a few seconds each, "
        "and records the fastest (the cheaper of two within 3%) in $GPUPIPE_CACHE_DIR/tune.json for this "
        "machine, backend, device, batch size and pipeline. Loaders that leave those options unset then use "
        "the recorded values (their repr says tuned=<date>). Run it on the machine type that trains, with the "
        "batch size of one rank.",
        "python -m gpupipe tune pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' --batch-size 256 "
        "--device cuda",
    )  # fmt: skip
    t.add_argument("pipeline", help="pipeline factory, e.g. pipelines/imagenet.py:train")
    t.add_argument("source", help="shard pattern, e.g. 'data/train-{000000..000007}.tar'")
    t.add_argument("--batch-size", type=int, default=64, help="per rank (default 64)")
    t.add_argument("--backend", default="auto")
    t.add_argument("--device", default=None)
    t.add_argument("--seconds", type=float, default=3.0, help="measured per trial (default 3)")
    t.add_argument("--no-record", action="store_true", help="only measure and print")
    t.set_defaults(fn=tune)
    n = _command(
        sub, "inspect", "draw what a pipeline does to images: a PNG grid of samples x augmentation draws",
        "Runs a pipeline on the first samples of a dataset several times (the augmentation draws of epochs "
        "0, 1, ...) and writes a PNG grid: one row per sample, with its key and label, one column per draw "
        "(for a pipeline of views, one per view of each draw, at its size). A Normalize is undone for "
        "display. With --compare, each draw of every installed backend is "
        "shown side by side (they make the same random draws) and their largest difference is printed.",
        "python -m gpupipe inspect pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' --out grid.png\n"
        "python -m gpupipe inspect pipelines/imagenet.py:train /data/imagenet/val --samples 4 --compare\n"
        "python -m gpupipe inspect pipelines/ssl.py:dino 'data/train-{000000..000007}.tar' --draws 1 --cell 96",
    )  # fmt: skip
    n.add_argument("pipeline", help="pipeline factory, e.g. pipelines/imagenet.py:train")
    n.add_argument("data", help="shard pattern, or an ImageFolder directory")
    n.add_argument("--samples", type=int, default=8, help="rows: the first samples of the dataset (default 8)")
    n.add_argument("--draws", type=int, default=4, help="columns: augmentation draws per sample (default 4)")
    n.add_argument("--compare", action="store_true", help="every installed backend side by side")
    n.add_argument("--backend", default="auto", help="without --compare: the backend (default auto)")
    n.add_argument("--device", default="cpu", help="where the loaders deliver: cpu (default) or cuda (the GPU path)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--cell", type=int, default=None, help="scale each image to this many pixels (longer side)")
    n.add_argument("--out", default="inspect.png", help="the PNG to write (default inspect.png)")
    n.set_defaults(fn=inspect)
    d = _command(
        sub, "doctor", "check this machine for gpupipe: versions, CUDA builds, GPUs, what backend='auto' picks, fixes",
        "Prints Python, torch, torchvision, DALI and CuPy with their CUDA builds, the driver's CUDA version, the "
        "GPUs and whether each has a hardware JPEG decoder, what backend='auto' picks and why, and every "
        "mismatch with the command that fixes it. Exits 1 when something is broken.",
        "python -m gpupipe doctor --run",
    )  # fmt: skip
    d.add_argument("--run", action="store_true", help="also push generated images through each backend and "
                   "device present: images/s and the difference from the torch backend")  # fmt: skip
    d.add_argument("--images", type=int, default=64, help="images for --run (default 64)")
    d.set_defaults(fn=doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "synthetic", None) is not None and args.synthetic <= 0:
        parser.error("--synthetic must be positive")
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: worker processes are already ended (process_pool)
        print(f"gpupipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except GpupipeError as e:
        print(f"gpupipe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
