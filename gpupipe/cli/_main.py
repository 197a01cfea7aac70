"""python -m gpupipe: make-shards (write WebDataset shards), index (build the shard index cache),
check (validate every sample), bench (images/s of a pipeline), tune (measure and record the
loader's settings), inspect (see what a pipeline does) and doctor (check this machine).

PIPELINE is a factory, file.py:function or module:function; its data argument is a shard pattern
or URL, a directory of tar shards (every *.tar in it) or an ImageFolder tree.

Exit status: 0 done; 1 check or doctor found something wrong; 2 a usage error or a gpupipe error
(printed on one line); 130 interrupted (Ctrl-C), with every worker process ended; 141 the reader of
the output went away (`| head`), as a process SIGPIPE ends.

Long commands show a progress bar on stderr; --quiet turns it off."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..core._errors import GpupipeError
from ..core._imageinfo import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from ._commands import bench, check, doctor, index, inspect, tune
from ._make import make_shards

__all__ = ["main"]


def _int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An int option's type: a number out of range is a usage error naming the option (exit 2)
    before any work, not a traceback or a silently odd result later."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"{minimum} or more" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


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
    p.add_argument("--fields", metavar="NAME=EXTS,...", help="the other fields a loader reads (WebDataset("
                   "fields=)), e.g. 'text=txt,meta=json,emb=npy': indexed, and decoded by check")  # fmt: skip
    p.add_argument("--workers", type=_int(0), default=None,
                   help="processes (default: one per usable CPU; 0: this process)")  # fmt: skip
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
        "ImageFolder tree (PNG and JPEG kept, other formats re-encoded as JPEG; the samples shuffled, each keyed "
        "by its number in the tree).",
        "python -m gpupipe make-shards data --synthetic 2048 --shard-size 256\n"
        "python -m gpupipe make-shards shards/ --from-imagefolder /data/imagenet/train --shard-size 1000",
    )  # fmt: skip
    p.add_argument("out", help="output folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", type=int, metavar="N", help="N generated photograph-like images")
    src.add_argument("--from-imagefolder", metavar="ROOT", help="an ImageFolder tree to convert")
    p.add_argument("--classes", type=_int(1), default=10, help="classes of the synthetic images (default 10)")
    p.add_argument("--fields", metavar="LIST", default=None,
                   help="with --synthetic, also write these fields (comma-separated): text (key.txt, a caption), "
                        "meta (key.json: size, class), mask (key.seg.png: each pixel's brightness quartile), boxes "
                        "(key.boxes.npy XYXY + key.labels.npy: 1-3 rectangles painted on): what pipelines/clip.py, "
                        "segmentation.py and detection.py read")  # fmt: skip
    p.add_argument("--shard-size", type=_int(1), default=1000, help="samples per shard (default 1000)")
    p.add_argument("--prefix", default="train", help="shard name prefix (default 'train')")
    p.add_argument("--quality", type=_int(1, 100), default=90, help="JPEG quality, 1 to 100 (default 90)")
    p.add_argument("--seed", type=_int(0), default=0, help="the synthetic images' seed, and the shuffle's (default 0)")
    p.add_argument("--keep-order", action="store_true", help="--from-imagefolder: write the samples in the tree's "
                   "order, class by class (default: shuffled with --seed, so that every shard mixes the classes; "
                   "synthetic samples cycle through the classes either way)")  # fmt: skip
    p.add_argument("--allow-empty", action="store_true", help="--from-imagefolder: keep a class folder without "
                   "images as a class without samples (default: refused, as torchvision's does)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="remove the shards named <prefix>-NNNNNN.tar already in "
                   "OUT (and their bad-sample lists and index files) first; without it, such shards are refused: a "
                   "pattern or the folder would read them beside the new ones")  # fmt: skip
    p.add_argument("--workers", type=_int(0), default=None, help="encoding processes (default: one per usable CPU)")
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
    i.add_argument("--sizes", action="store_true", help="also read every image once, check its header as the DALI "
                   "backend does and record its size in the cache: a DALI loader's first epoch then reads no "
                   "header (an epoch records what it checks anyway)")  # fmt: skip
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
    c.add_argument("--max-image-pixels", type=_int(0), default=MAX_IMAGE_PIXELS,
                   help=f"pixel limit (default {MAX_IMAGE_PIXELS}, as Pillow; 0: none)")  # fmt: skip
    c.add_argument("--max-image-bytes", default=str(MAX_IMAGE_BYTES), metavar="BYTES",
                   help=f"image member byte limit, e.g. 512MiB (default {MAX_IMAGE_BYTES}, as the loaders; "
                        "0: none)")  # fmt: skip
    c.add_argument("--no-write", action="store_true", help="only report: write no bad-sample lists")
    c.add_argument("--json", action="store_true", help="print the report as JSON (every finding) instead")
    c.set_defaults(fn=check)
    b = _command(
        sub, "bench", "run a pipeline through the Loader and print images/s",
        "Runs a pipeline's epochs through gp.Loader (shuffled, drop_last) and prints images/s per epoch; the "
        "first epoch includes start-up. --backend, --batch-size and --workers take lists (commas): every "
        "combination runs, one after another, and a table compares them (--rounds N: N times, alternating, each "
        "ratio taken within a round, the table giving medians and ranges). --baseline also runs the usual way "
        "(webdataset + torchvision's transforms of the same names in a torch DataLoader); --plot draws images/s "
        "per backend and against batch size and workers (matplotlib: the plot extra); --profile prints each "
        "configuration's time per stage and what limits it, and --profile PNG plots the time per batch. "
        "GPUPIPE_LOG=info shows the loaders' log (what each chose).",
        "python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' --backend dali\n"
        "python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' "
        "--backend torch,dali --batch-size 32,64,128 --workers 1,2 --baseline --plot bench.png\n"
        "python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' --backend torch "
        "--workers 1,2 --profile profile.png",
    )  # fmt: skip
    b.add_argument("pipeline", help="pipeline factory, e.g. pipelines/imagenet.py:train")
    b.add_argument("source", help="shard pattern, e.g. 'data/train-{000000..000007}.tar'")
    b.add_argument("--batch-size", default="64", help="one or more, e.g. 32,64 (default 64)")
    b.add_argument("--backend", default="auto", help="one or more, e.g. torch,dali (default auto)")
    b.add_argument("--device", default=None)
    b.add_argument("--workers", default="auto", help="one or more, e.g. 1,2 (default auto: the Loader's)")
    b.add_argument("--epochs", type=_int(1), default=2)
    b.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, alternating, for ratios on a noisy machine: the "
                   "table gives medians and ranges (default 1)")  # fmt: skip
    b.add_argument("--baseline", action="store_true", help="also run webdataset + torchvision in a DataLoader")
    b.add_argument(
        "--baseline-decoder",
        default="pillow",
        metavar="DECODERS",
        help="the baseline's decoder(s): pillow (default), torchvision, or both: pillow,torchvision",
    )
    b.add_argument("--plot", metavar="PNG", help="draw the results (matplotlib)")
    b.add_argument("--profile", nargs="?", const="", default=None, metavar="PNG",
                   help="also print where each configuration's time went per batch in its last epoch (the loader's "
                   "stage clocks, the loop's wait) and what limits it (loader.stats()['bound']); with PNG, plot the "
                   "stage time per batch (matplotlib)")  # fmt: skip
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
        "batch size of one rank and the ranks per node that train.",
        "python -m gpupipe tune pipelines/imagenet.py:train 'data/train-{000000..000007}.tar' --batch-size 256 "
        "--device cuda",
    )  # fmt: skip
    t.add_argument("pipeline", help="pipeline factory, e.g. pipelines/imagenet.py:train")
    t.add_argument("source", help="shard pattern, e.g. 'data/train-{000000..000007}.tar'")
    t.add_argument("--batch-size", type=int, default=64, help="per rank (default 64)")
    t.add_argument("--backend", default="auto")
    t.add_argument("--device", default=None)
    t.add_argument("--seconds", type=float, default=3.0, help="measured per trial (default 3)")
    t.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                   help="training ranks that will share this node's CPUs, e.g. its GPUs (default: "
                        "LOCAL_WORLD_SIZE, else SLURM_NTASKS_PER_NODE, else 1): a trial gets a rank's share of the "
                        "cores")  # fmt: skip
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
    n.add_argument("--samples", type=_int(1), default=8, help="rows: the first samples of the dataset (default 8)")
    n.add_argument("--draws", type=_int(1), default=4, help="columns: augmentation draws per sample (default 4)")
    n.add_argument("--compare", action="store_true", help="every installed backend side by side")
    n.add_argument("--backend", default="auto", help="without --compare: the backend (default auto)")
    n.add_argument("--device", default="cpu", help="where the loaders deliver: cpu (default) or cuda (the GPU path)")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--cell", type=_int(1), default=None, help="scale each image to this many pixels (longer side)")
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
    d.add_argument("--images", type=_int(1), default=64, help="images for --run (default 64)")
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
    except BrokenPipeError:  # the reader went away (`| head`): end as SIGPIPE would, with no traceback
        with contextlib.suppress(OSError, ValueError):  # and nothing more written at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except GpupipeError as e:
        print(f"gpupipe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
