"""``make bench-gpu``: gpupipe's recipes beside DALI by hand on one GPU, in one run.

    python bench/gpu.py              # on a GPU machine: about 5 minutes
    python bench/gpu.py --quick      # anywhere (DALI's CPU operators without a GPU): under a minute
    python bench/gpu.py --sets imagenet-like --threads 8 --recipes "gpupipe train;gpupipe train v2"
                                     # a short run of the rows named (the others: --help)

On two sets of JPEGs — ImageNet-like (500 x 375, ~110 KB, 4:2:0) and large (2000 x 1500, 3 Mpx) —
and at several decoder thread counts, each row is one input pipeline read for a warm-up epoch and
then ``--epochs`` timed ones:

- ``by hand``: NVIDIA's documented ResNet-50 pipelines (``bench/dali_by_hand.py``), train and val,
  over an ImageFolder copy of the images, through ``DALIGenericIterator``; ``by hand, fancy`` is
  the train one with fancy upsampling, as gpupipe decodes by default (parity with torchvision);
- gpupipe's ``pipelines/imagenet.py`` train and val recipes, its ``train_v2`` (torchvision's
  IMAGENET1K_V2 recipe: TrivialAugmentWide, RandomErasing, MixUp/CutMix, at 176) and
  ``pipelines/ssl.py``'s DINO, over the tar shards, through ``gp.Loader``;
- last, issue 39's rows (set ``targets``, ImageNet-like photos with a label map and 1-4 boxes): the
  segmentation recipe with its masks and the SSD detection recipe with its boxes, moved on the
  host by the DALI reader threads, each beside the same recipe on the image alone.

Per row: images/s, the process's CPU-seconds per 1,000 images (DALI's threads run in it), the
DALI graph's operators, and where the JPEGs were decoded, from a separate probe run of a few
batches with nvImageCodec's log at INFO (``DALI_NVIMGCODEC_LOG_LEVEL=3``), which names the
decoder of each sample nvJPEG's CUDA decoder or libjpeg-turbo took — the hardware decoder's
batches are not logged, so its share is the rest — and the nvJPEG version nvImageCodec loaded.
``gpupipe train, tuned`` is the train recipe with the settings ``gp.tune`` chooses on this machine
(threads, prefetch, hardware-decoder share), beside the defaults' rows. Then the ResNet-50 (bf16,
channels_last) data stall with gpupipe's train recipe (``bench/data_stall.py``'s step). Writes
``bench/results/<date>-<device>-gpu.md``, ``.json`` and ``.png`` and prints the ratios against the
targets of issue 23.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpupipe as gp
from gpupipe.runtime._dist import cpu_cores, default_workers
from gpupipe.testing import encode_jpeg, encode_png, label_map, synthetic_image

SETS = {"imagenet-like": (375, 500), "large": (1500, 2000)}  # (height, width)
QUICK_SETS = {"imagenet-like": (375, 500), "large": (750, 1000)}
# The order rows run in: a run cut short by --budget keeps the first, so train and the V2 recipe
# (issue 37's ratio) come right after DALI by hand, and DINO, the slowest, last.
RECIPES = (
    "by hand",
    "by hand, fancy",
    "gpupipe train",
    "gpupipe train v2",
    "by hand val",
    "gpupipe val",
    "gpupipe dino",
)
# Issue 52's rows: the recipes whose tails the stage runs on a GPU (with V2 and DINO above), beside
# train; measured after the rows above (a budget cuts them first). DALI's own policy graph, which
# a "v2, stage=False" row measured, is gone (2026-11-29).
STAGE_RECIPES = ("gpupipe train timm", "gpupipe train v2 augmix")
CLASSES = 10
HW_ONLY = "gpupipe train, hw_decoder_load=1.0"  # the row of all JPEGs to the hardware decoder
# DALI's share: since 2026-11-28 gpupipe's default on Hopper GPUs is 1.0, so this row keeps the comparison
DALI_SHARE = "gpupipe train, hw_decoder_load=0.65"
# Issue 39's rows, on ImageNet-like photos with a label map and boxes: masks and boxes moved on the
# host (the DALI reader threads) against the same recipe without them
TARGET_RECIPES = ("gpupipe segmentation", "gpupipe segmentation, image only", "gpupipe ssd", "gpupipe ssd, image only")
TUNED = "gpupipe train, tuned"
STALL = "data stall"  # the ResNet-50 step fed by the train recipe (on a GPU also with every JPEG to the hw decoder)
# Every row --recipes can pick, in the order a run measures them
ROWS = (*RECIPES, TUNED, HW_ONLY, DALI_SHARE, STALL, *TARGET_RECIPES, *STAGE_RECIPES)


# ------------------------------------------------------------------------------- data --


def _photo(args: tuple[int, tuple[int, int]]) -> bytes:
    """A photo-like JPEG: a synthetic scene with sensor-like noise (real photos' detail), 4:2:0."""
    i, size = args
    image = synthetic_image(i, size=size).astype(np.float32)
    noisy = image + np.random.default_rng(i).normal(0.0, 20.0, image.shape)
    return encode_jpeg(np.clip(noisy, 0, 255).astype(np.uint8), quality=90)


def _targets(args: tuple[int, tuple[int, int]]) -> dict[str, Any]:
    """A photo-like JPEG with a label map (each pixel's brightness quartile, ``seg.png``) and 1-4
    boxes with their classes (``boxes.npy``, ``labels.npy``)."""
    i, size = args
    png = encode_png(label_map(synthetic_image(i, size=size)))
    rng = np.random.default_rng(i)
    k = int(rng.integers(1, 5))
    xy = rng.uniform(0, 0.6, (k, 2)) * (size[1], size[0])
    wh = rng.uniform(0.1, 0.4, (k, 2)) * (size[1], size[0])
    return {"jpg": _photo((i, size)), "seg.png": png, "boxes.npy": np.concatenate([xy, xy + wh], 1).astype(
        np.float32), "labels.npy": rng.integers(1, 10, k)}  # fmt: skip


def made_once(base: str, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The summary ``build()`` returned when it wrote its files under ``base``: run now unless an
    earlier run finished (its ``.done`` file holds that summary)."""
    done = os.path.join(base, ".done")
    if not os.path.exists(done):
        os.makedirs(base, exist_ok=True)
        summary = build()
        with open(done, "w") as f:
            f.write(json.dumps(summary))
    with open(done) as f:
        return json.load(f)


def make_targets_set(root: str, size: tuple[int, int], count: int, workers: int) -> tuple[list[str], float]:
    """``count`` samples of :func:`_targets` under ``root``: ``(shards, mean KB of the JPEGs)``; made once."""
    base = os.path.join(root, f"targets-{size[1]}x{size[0]}-{count}")

    def build() -> dict[str, Any]:
        with ProcessPoolExecutor(workers) as pool:
            samples = list(pool.map(_targets, [(i, size) for i in range(count)], chunksize=16))
        with gp.ShardWriter(os.path.join(base, "shard-%06d.tar"), max_count=256) as w:
            for i, sample in enumerate(samples):
                w.write(f"{i:07d}", sample)
        return {"shards": w.shards, "kb": sum(len(s["jpg"]) for s in samples) / len(samples) / 1e3}

    made = made_once(base, build)
    return made["shards"], made["kb"]


def make_set(root: str, name: str, size: tuple[int, int], count: int, workers: int) -> tuple[list[str], str, float]:
    """``count`` images of ``size`` under ``root``/``name``, as tar shards and as an ImageFolder
    tree: ``(shards, folder, mean KB)``; made once."""
    base = os.path.join(root, f"{name}-{size[1]}x{size[0]}-{count}")
    folder = os.path.join(base, "folder")

    def build() -> dict[str, Any]:
        with ProcessPoolExecutor(workers) as pool:
            jpegs = list(pool.map(_photo, [(i, size) for i in range(count)], chunksize=16))
        with gp.ShardWriter(os.path.join(base, "shard-%06d.tar"), max_count=256) as w:
            for i, data in enumerate(jpegs):
                w.write(f"{i:07d}", {"jpg": data, "cls": i % CLASSES})
                path = os.path.join(folder, f"c{i % CLASSES}", f"{i:07d}.jpg")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
        return {"shards": w.shards, "kb": sum(map(len, jpegs)) / len(jpegs) / 1e3}

    made = made_once(base, build)
    return made["shards"], folder, made["kb"]


# ------------------------------------------------------------------------- pipelines --


def batches(recipe: str, shards: list[str], folder: str, *, gpu: bool, batch: int, threads: int,
            prefetch: int = 2, hw_decoder_load: float | None = None) -> tuple[Any, Any, int | None]:  # fmt: skip
    """``(epoch, close, operators)`` of one row's input pipeline: ``epoch()`` yields one epoch's
    batches; ``operators``: its DALI graph's (issue 37 asks for the count), ``None`` unknown."""
    if recipe.startswith("by hand"):
        from dali_by_hand import ByHand

        hand = ByHand(folder, train="val" not in recipe, gpu=gpu, batch_size=batch, threads=threads,
                      fancy="fancy" in recipe, prefetch=prefetch)  # fmt: skip
        from gpupipe.backends._dali._proto import operator_count

        return hand.epoch, hand.close, operator_count(hand.pipe)
    loader = gp.Loader(gpupipe_recipe(recipe, shards), batch, backend="dali", device="cuda" if gpu else "cpu",
                       num_workers=threads, shuffle=True, drop_last=True, seed=0, prefetch=prefetch,
                       dali=gp.DaliOptions(hw_decoder_load=hw_decoder_load))  # fmt: skip
    state = {"epoch": 0}

    def epoch() -> Iterator[Any]:
        loader.set_epoch(state["epoch"])
        state["epoch"] += 1
        yield from loader

    return epoch, loader.close, loader._runner.describe().get("operators")  # (as its repr says)


def gpupipe_recipe(recipe: str, shards: list[str]) -> gp.Pipeline:
    if recipe in TARGET_RECIPES:
        seg = recipe.startswith("gpupipe segmentation")
        factory = gp.load_pipeline(os.path.join(ROOT, "pipelines", "segmentation.py:train" if seg else
                                                "detection.py:train"))  # fmt: skip
        pipe = factory(shards) if seg else factory(shards, data_augmentation="ssd", size=300)
        if not recipe.endswith("image only"):
            return pipe
        return gp.Pipeline(
            gp.WebDataset(shards, image="jpg", label=None), [t for t in pipe.transforms if not t.uses_boxes]
        )
    name = {
        "gpupipe train": "imagenet.py:train",
        "gpupipe val": "imagenet.py:val",
        "gpupipe dino": "ssl.py:dino",
        "gpupipe train v2": "imagenet.py:train_v2",
        "gpupipe train timm": "imagenet.py:train_timm",
        "gpupipe train v2 augmix": "imagenet.py:train_v2",
    }
    base = recipe.split(",")[0]
    options = {"auto_augment": "augmix"} if base.endswith("augmix") else {}
    return gp.load_pipeline(os.path.join(ROOT, "pipelines", name[base]))(shards, **options)


def _count(images: Any) -> int:
    return len(images[0]) if isinstance(images, tuple) else len(images)


def measure(recipe: str, shards: list[str], folder: str, *, gpu: bool, batch: int, threads: int,
            epochs: int, **settings: Any) -> dict[str, Any]:  # fmt: skip
    """Images/s (the best timed epoch) and CPU-seconds per 1,000 images (the least) of one row."""
    epoch, close, operators = batches(recipe, shards, folder, gpu=gpu, batch=batch, threads=threads, **settings)
    rates, cpu = [], []
    try:
        for e in range(epochs + 1):
            n, start, start_cpu = 0, time.perf_counter(), time.process_time()
            for images, _ in epoch():
                n += _count(images)
            if gpu:
                torch.cuda.synchronize()
            if e:  # the first epoch warms up: build, allocations, page cache
                rates.append(n / (time.perf_counter() - start))
                cpu.append(1000 * (time.process_time() - start_cpu) / n)
    finally:
        close()
    return {"recipe": recipe, "threads": threads, "images_per_s": round(max(rates), 1),
            "cpu_s_per_1000": round(min(cpu), 3), "epochs": [round(r, 1) for r in rates],
            "operators": operators}  # fmt: skip


# ----------------------------------------------------------------------------- probe --

PROBE_BATCHES = 3
PROBE_TIMEOUT = 300  # seconds
_DECODER = re.compile(r"(\w+_decoder) process #")
_VERSION = re.compile(r"nvJPEG version: ([0-9.]+)")


def probe(recipe: str, shards: list[str], folder: str, *, gpu: bool, batch: int, threads: int) -> dict[str, Any]:
    """Where ``recipe``'s JPEGs are decoded: a child decodes exactly :data:`PROBE_BATCHES` batches
    (no prefetch) with nvImageCodec's log at INFO, which names the decoder of every sample nvJPEG's
    CUDA decoder or a CPU decoder took; the hardware decoder's batches are not logged: its share
    is the rest."""
    argv = [sys.executable, os.path.abspath(__file__), "--probe", recipe, "--probe-shards", json.dumps(shards),
            "--probe-folder", folder, "--batch-size", str(batch), "--probe-threads", str(threads)]  # fmt: skip
    if not gpu:
        argv.append("--cpu")
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                             env={**os.environ, "DALI_NVIMGCODEC_LOG_LEVEL": "3"})  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"decoded": f"probe gave no answer in {PROBE_TIMEOUT} s"}
    log = out.stdout + out.stderr
    decoded = next((int(m) for m in re.findall(r"PROBED (\d+)", out.stdout)), 0)
    if not decoded:  # (an exit code alone, after PROBED, is the child's teardown: the log is whole)
        return {"decoded": f"probe failed ({out.returncode}): {(log.strip().splitlines() or [''])[-1][:200]}"}
    return decode_shares(log, decoded, gpu=gpu, hw=not gpu or _has_hw_decoder())


def _has_hw_decoder() -> bool:
    """Whether this GPU has the hardware JPEG decoder (doctor's table of models): only then is
    the share the log does not name the hardware decoder's."""
    from gpupipe.cli._doctor import hw_jpeg

    return hw_jpeg(torch.cuda.get_device_name()).startswith("yes")


def decode_shares(log: str, decoded: int, *, gpu: bool, hw: bool = True) -> dict[str, Any]:
    """Shares of the ``decoded`` samples per decoder, from nvImageCodec's INFO ``log``: the CUDA
    decoder's and the CPU decoders' samples are logged one by one (``<decoder> process #i``); the
    hardware decoder's batches are not, so its share is the rest (none without a GPU). On a GPU
    without the hardware decoder (``hw`` false) the rest is shown as ``unlogged``, not as hw."""
    counts: dict[str, int] = {}
    for decoder in _DECODER.findall(log):
        counts[decoder] = counts.get(decoder, 0) + 1
    cpu = sum(v for k, v in counts.items() if "turbo" in k or "opencv" in k)
    cuda = counts.get("nvjpeg_cuda_decoder", 0)
    rest = max(0, decoded - cpu - cuda) if gpu else 0
    shares = {"hw" if hw else "unlogged": rest / decoded, "cuda": cuda / decoded, "cpu": cpu / decoded}
    return {
        "decoded": " / ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items()),
        "cpu_share": round(shares["cpu"], 3),
        "nvjpeg": ",".join(sorted(set(_VERSION.findall(log)))) or None,
        "decoder_lines": counts,
    }


def _probe_child(args: argparse.Namespace) -> None:
    """In the probe's child: decode exactly PROBE_BATCHES batches, prefetching nothing (by hand:
    ``pipe.run()`` with a queue of one, which runs one iteration per call)."""
    gpu, shards = not args.cpu, json.loads(args.probe_shards)
    n = 0
    if args.probe.startswith("by hand"):
        from dali_by_hand import pipeline

        pipe = pipeline(args.probe_folder, train="val" not in args.probe, gpu=gpu, batch_size=args.batch_size,
                        threads=args.probe_threads, fancy="fancy" in args.probe, prefetch=1)  # fmt: skip
        for _ in range(PROBE_BATCHES):
            pipe.run()
            n += args.batch_size
        del pipe
    else:
        epoch, close, _ = batches(args.probe, shards, args.probe_folder, gpu=gpu, batch=args.batch_size,
                               threads=args.probe_threads, prefetch=1)  # fmt: skip
        for i, (images, _) in enumerate(epoch()):
            n += _count(images)
            if i + 1 == PROBE_BATCHES:
                break
        close()
    print(f"PROBED {n}", flush=True)


# ------------------------------------------------------------------------ data stall --


def data_stall(shards: list[str], *, gpu: bool, quick: bool, hw_decoder_load: float | None = None) -> dict[str, Any]:
    """ResNet-50 (bf16, channels_last) fed by gpupipe's train recipe against the same step on a
    batch already on the device (``bench/data_stall.py``'s step and timing); ``hw_decoder_load``:
    the loader's ``DaliOptions`` share (default DALI's)."""
    import data_stall as stall

    args = argparse.Namespace(
        arch="tiny" if quick or not gpu else "resnet50",
        image_size=64 if quick else 224,
        batch_size=16 if quick else 256,
        steps=5 if quick else 60,
        warmup=2 if quick else 10,
    )
    device = torch.device("cuda" if gpu else "cpu")
    memory_format = torch.channels_last if gpu else torch.contiguous_format
    step = stall.step_fn(args, device)
    ceiling, _, _ = stall.timed(stall.on_device(args, device, memory_format), step, args, device)
    pipe = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train"))(shards, size=args.image_size)
    dali = gp.DaliOptions(hw_decoder_load=hw_decoder_load)
    with gp.Loader(pipe, args.batch_size, shuffle=True, drop_last=True, seed=0, backend="dali", device=str(device),
                   memory_format=memory_format, dali=dali) as loader:  # fmt: skip
        fed, wait, meter = stall.timed(stall.endless(loader, device, memory_format), step, args, device,
                                       meter=loader._meter)  # fmt: skip
        describe = repr(loader)
    return {"arch": args.arch, "batch_size": args.batch_size, "ceiling": round(ceiling, 1), "fed": round(fed, 1),
            "wait_percent": round(wait, 1), "stall_percent": round(max(0.0, 100 * (1 - fed / ceiling)), 1),
            "meter_percent": None if meter is None else round(meter, 1),  # the loader's own meter, same steps
            "loader": describe}  # fmt: skip


# ---------------------------------------------------------------------------- report --

TARGETS = [  # issue 23, on one H100 with ImageNet-like JPEGs and default settings
    ("train ≥ 0.95× DALI by hand (fancy)", lambda r: r["train_vs_hand_fancy"] >= 0.95),
    ("train ≥ 0.8× val", lambda r: r["train_vs_val"] >= 0.8),
    ("train ≥ 10,000 images/s", lambda r: r["train"] >= 10_000),
    ("≤ 0.5 CPU-s per 1,000 images (train)", lambda r: r["train_cpu"] <= 0.5),
    ("ResNet-50 data stall ≤ 3%", lambda r: r["stall"] <= 3.0),
    (
        "V2 recipe (TrivialAugmentWide, erasing, MixUp/CutMix) ≥ 0.9× train (issue 37)",
        lambda r: r["v2_vs_train"] >= 0.9,
    ),
]


def ratios(rows: list[dict[str, Any]], stall: dict[str, Any] | None, threads: int) -> dict[str, Any]:
    """The headline numbers on ImageNet-like images at the default thread count, and tuned; a
    figure whose rows a run cut short (``--budget``, a lent machine's time) did not measure is None."""

    def rate(recipe: str, key: str = "images_per_s") -> float | None:
        want = ("imagenet-like", recipe, threads)
        return next((r[key] for r in rows if (r["set"], r["recipe"], r["threads"]) == want), None)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    train = rate("gpupipe train")
    return {
        "threads": threads,
        "train": train,
        "train_cpu": rate("gpupipe train", "cpu_s_per_1000"),
        "train_vs_hand": ratio(train, rate("by hand")),
        "train_vs_hand_fancy": ratio(train, rate("by hand, fancy")),
        "train_vs_val": ratio(train, rate("gpupipe val")),
        "val_vs_hand_val": ratio(rate("gpupipe val"), rate("by hand val")),
        "stall": stall["stall_percent"] if stall else None,
        "v2_vs_train": ratio(rate("gpupipe train v2"), train),
        "tuned_train": next((r["images_per_s"] for r in rows if r["recipe"] == TUNED), None),
        "train_hw_only": rate(HW_ONLY),
        "train_hw_only_cpu": rate(HW_ONLY, "cpu_s_per_1000"),
        "train_dali_share": rate(DALI_SHARE),
        "stall_hw_only": (stall.get("hw_decoder_load=1.0") or {}).get("stall_percent") if stall else None,
    }


def verdict(test: Any, head: dict[str, Any]) -> str:
    """``MET``, ``MISS`` or ``----`` (not measured: a run cut short) for one target."""
    try:
        return "MET " if test(head) else "MISS"
    except TypeError:  # a None figure
        return "----"


def stem_of(out: str, date: str, device: str, *, quick: bool) -> str:
    """The results' path without its suffix: ``<out>/<date>-<device>-gpu`` (``-quick``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return os.path.join(out, f"{date}-{slug}-{'quick' if quick else 'gpu'}")


def write(out: str, meta: dict[str, Any], rows: list[dict[str, Any]], stall: dict[str, Any] | None,
          head: dict[str, Any]) -> str:  # fmt: skip
    os.makedirs(out, exist_ok=True)
    stem = stem_of(out, meta["date"], meta["device"], quick=meta["quick"])
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "data_stall": stall, "headline": head}, f, indent=2)
    lines = [f"# gpupipe against DALI by hand — {meta['device']}, {meta['date']}", "",
             ", ".join(f"{k} {v}" for k, v in meta.items() if k not in ("date", "device")), "",
             *(["**A smoke run (--quick): a few images, one epoch; the figures are not measurements.**", ""]
               if meta["quick"] else []),
             "| set | pipeline | threads | images/s | CPU-s / 1000 images | decoded (hw / cuda / cpu) | nvJPEG "
             "| operators |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        recipe = f"{r['recipe']} ({r['tuned'].split(':')[0]})" if "tuned" in r else r["recipe"]
        lines.append(f"| {r['set']} | {recipe} | {r['threads']} | {r['images_per_s']:.0f} | "
                     f"{r['cpu_s_per_1000']:.2f} | {r.get('decoded', '')} | {r.get('nvjpeg') or ''} | "
                     f"{r.get('operators') or ''} |")  # fmt: skip
    headline = ", ".join(f"{k} {v}" for k, v in head.items())
    lines += ["", f"ResNet-50 data stall ({stall['arch']}, batch {stall['batch_size']}): ceiling "
              f"{stall['ceiling']:.0f} images/s, fed by gpupipe {stall['fed']:.0f}, data wait "
              f"{stall['wait_percent']}% (the loader's own meter: {stall.get('meter_percent')}%), stall "
              f"{stall['stall_percent']}%; loader: `{stall['loader']}`"
              if stall else "ResNet-50 data stall: not measured (the run was cut short"
              + (", or --recipes did not name it)" if "recipes" in meta else ")"), "",
              *([f"With all JPEGs to the hardware decoder (hw_decoder_load=1.0): fed "
                 f"{hw['fed']:.0f} images/s, stall {hw['stall_percent']}%", ""]
                if stall and (hw := stall.get("hw_decoder_load=1.0")) else []),
              f"Headline (ImageNet-like, {head['threads']} threads): {headline}",
              "", "| target (issue 23) | met |", "|---|---|"]  # fmt: skip
    met = {"MET ": "yes", "MISS": "no", "----": "not measured"}
    lines += [f"| {name} | {met[verdict(test, head)]} |" for name, test in TARGETS]
    if not meta["device"].startswith("NVIDIA"):
        lines += ["", "The targets are for one H100 (16 cores); on this machine they are shown, not expected."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, stem + ".png", title=f"{meta['device']}, {meta['date']}")
    return stem


def plot(rows: list[dict[str, Any]], path: str, *, title: str) -> None:
    """Images/s per pipeline and thread count, one panel per set of images (none, said so,
    without matplotlib: a lent GPU machine may not have it)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot ({path}): matplotlib is not installed", flush=True)
        return

    sets = list(dict.fromkeys(r["set"] for r in rows))
    if not sets:
        print(f"no plot ({path}): no row was measured", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sets), figsize=(7 * len(sets), 4), constrained_layout=True, squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        mine = [r for r in rows if r["set"] == name]
        recipes, threads = list(dict.fromkeys(r["recipe"] for r in mine)), sorted({r["threads"] for r in mine})
        width = 0.8 / len(threads)
        for i, t in enumerate(threads):
            values = [
                next((r["images_per_s"] for r in mine if (r["recipe"], r["threads"]) == (p, t)), 0) for p in recipes
            ]
            ax.bar([j + i * width for j in range(len(recipes))], values, width, label=f"{t} threads")
        ax.set_xticks([j + width * (len(threads) - 1) / 2 for j in range(len(recipes))], recipes, rotation=20)
        ax.set(ylabel="images/s", title=f"{name} — {title}")
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ main --


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few images, 1-2 threads (CI; any machine)")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "gpupipe-bench-gpu"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument(
        "--epochs", type=int, default=None, help="timed epochs per row, after a warm-up one (default 2; 1 with --quick)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default: 256 on a GPU, 16 with --quick")
    parser.add_argument("--cpu", action="store_true", help="DALI's CPU operators even where there is a GPU")
    parser.add_argument("--sets", default=None, help="comma-separated sets of images (default: imagenet-like,large)")
    parser.add_argument(
        "--threads",
        default=None,
        help="comma-separated thread counts (default: 4,8,16 up to the cores); with --report: the headline's",
    )
    parser.add_argument(
        "--recipes",
        default=None,
        help=f"rows to run, separated by ';' (names hold commas), in their order (default: all: {'; '.join(ROWS)})",
    )
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: no row starts after them; the report has what was measured")  # fmt: skip
    parser.add_argument(
        "--report", metavar="PARTIAL", help="write the report of a run cut short from its .partial.jsonl"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--probe-shards", help=argparse.SUPPRESS)
    parser.add_argument("--probe-folder", help=argparse.SUPPRESS)
    parser.add_argument("--probe-threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        return _probe_child(args)
    if args.report:
        return report_of_partial(args.report, args.out, threads=int(args.threads) if args.threads else None)
    recipes = [r.strip() for r in args.recipes.split(";")] if args.recipes else list(ROWS)
    unknown = [r for r in recipes if r not in ROWS]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(map(repr, unknown))}; the rows are {'; '.join(ROWS)}")
    gpu = torch.cuda.is_available() and not args.cpu
    cores = cpu_cores()
    # A cache of its own: a `gpupipe tune` recorded on this machine must not make the default rows tuned ones.
    os.environ["GPUPIPE_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="gpupipe-bench-gpu-cache-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    date = datetime.date.today().isoformat()
    device = torch.cuda.get_device_name() if gpu else f"{cores}-core CPU (DALI CPU operators)"
    os.makedirs(args.out, exist_ok=True)
    batch = args.batch_size or (16 if args.quick else 256)
    epochs = args.epochs or (1 if args.quick else 2)
    all_sets = QUICK_SETS if args.quick else SETS
    sets = {name: all_sets[name] for name in (args.sets.split(",") if args.sets else all_sets)}
    counts = {"imagenet-like": 32, "large": 16} if args.quick else {"imagenet-like": 4096, "large": 512}
    if args.threads:
        thread_counts = [int(t) for t in args.threads.split(",")]
    else:
        thread_counts = [2] if args.quick else [t for t in (4, 8, 16) if t <= cores] or [cores]
    default_threads = thread_counts[0] if args.quick else default_workers()  # the Loader's
    started = time.perf_counter()
    import nvidia.dali

    from gpupipe.runtime._nvjpeg import in_process

    nvjpeg = in_process()
    meta = {
        "date": date,
        "device": device,
        "cpus": cores,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "dali": nvidia.dali.__version__,
        "nvjpeg (in process)": f"{nvjpeg} ({nvjpeg.path})" if nvjpeg else None,
        "batch_size": batch,
        "images": {name: counts[name] for name in sets},
        "seconds": None,
        "default_threads": default_threads,
        "quick": args.quick,
        **({"recipes": recipes} if args.recipes else {}),
    }
    # Each row as it is measured, so that a run cut short (a lent machine's 10-minute command) leaves
    # them: `--report` writes the report from this file.
    partial = stem_of(args.out, date, device, quick=args.quick) + ".partial.jsonl"
    with open(partial, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")

    def emit(row: dict[str, Any]) -> None:
        line = json.dumps({k: v for k, v in row.items() if k != "decoder_lines"})
        print(line, flush=True)
        with open(partial, "a") as f:
            f.write(line + "\n")

    def in_budget() -> bool:
        return args.budget is None or time.perf_counter() - started < args.budget

    made = {name: make_set(args.data, name, sets[name], counts[name], workers=min(cores, 16)) for name in sets}
    rows: list[dict[str, Any]] = []
    stall: dict[str, Any] | None = None
    # The headline first (ImageNet-like rows, tuned, the data stall), then the other sets.
    for name, (shards, folder, kb) in made.items():
        size = sets[name]
        for recipe in [r for r in (*RECIPES, *STAGE_RECIPES) if r in recipes]:
            if recipe == "gpupipe dino" and name == "large":
                continue  # ten crops of 3 Mpx images: the set's point is decoding, not multi-crop
            if not in_budget():
                break
            probed = not args.quick or recipe in ("by hand, fancy", "gpupipe train")  # CI: the parser, kept working
            found = probe(recipe, shards, folder, gpu=gpu, batch=batch, threads=default_threads) if probed else {}
            for threads in thread_counts:
                row = {
                    "set": name,
                    "image": f"{size[1]}x{size[0]}, {kb:.0f} KB",
                    **found,
                    **measure(recipe, shards, folder, gpu=gpu, batch=batch, threads=threads, epochs=epochs),
                }
                emit(row)
                rows.append(row)
        if name != "imagenet-like":
            continue
        if in_budget() and TUNED in recipes:
            # Tuned against default: gp.tune's choice for the train recipe (not recorded), measured as a row.
            tuned = gp.tune(gpupipe_recipe("gpupipe train", shards), batch, seconds=0.5 if args.quick else 2.0,
                            record=False, backend="dali", device="cuda" if gpu else "cpu")  # fmt: skip
            row = {"set": name, "image": f"{size[1]}x{size[0]}, {kb:.0f} KB",
                   **measure(TUNED, shards, folder, gpu=gpu, batch=batch, threads=tuned.num_workers,
                             epochs=epochs, prefetch=tuned.prefetch, hw_decoder_load=tuned.hw_decoder_load),
                   "tuned": str(tuned), "trials": [dict(t) for t in tuned.trials]}  # fmt: skip
            emit(row)
            rows.append(row)
        for share_row, share in ((HW_ONLY, 1.0), (DALI_SHARE, 0.65)):
            if in_budget() and gpu and share_row in recipes:
                # The hardware decoder's share alone, all of it and DALI's 0.65, at the default threads.
                row = {"set": name, "image": f"{size[1]}x{size[0]}, {kb:.0f} KB",
                       **measure(share_row, shards, folder, gpu=gpu, batch=batch, threads=default_threads,
                                 epochs=epochs, hw_decoder_load=share)}  # fmt: skip
                emit(row)
                rows.append(row)
        if in_budget() and STALL in recipes:
            stall = data_stall(shards, gpu=gpu, quick=args.quick)
            emit({"data_stall": stall})
        if in_budget() and gpu and stall is not None:
            stall["hw_decoder_load=1.0"] = data_stall(shards, gpu=gpu, quick=args.quick, hw_decoder_load=1.0)
            emit({"data_stall": stall})
        if in_budget() and set(recipes) & set(TARGET_RECIPES):
            targets, kb = make_targets_set(args.data, size, 16 if args.quick else 1024, workers=min(cores, 16))
            for recipe in [r for r in TARGET_RECIPES if r in recipes]:
                if not in_budget():
                    break
                row = {"set": "targets", "image": f"{size[1]}x{size[0]}, {kb:.0f} KB",
                       **measure(recipe, targets, "", gpu=gpu, batch=batch, threads=default_threads,
                                 epochs=epochs)}  # fmt: skip
                emit(row)
                rows.append(row)
    meta["seconds"] = round(time.perf_counter() - started)
    threads = default_threads if default_threads in thread_counts else thread_counts[-1]
    finish(args.out, meta, rows, stall, threads)
    os.remove(partial)  # all of it is in the .json now


def finish(out: str, meta: dict[str, Any], rows: list[dict[str, Any]], stall: dict[str, Any] | None,
           threads: int) -> None:  # fmt: skip
    """Writes the report and prints the targets."""
    head = ratios(rows, stall, threads)
    stem = write(out, meta, rows, stall, head)
    wrote = ", ".join(stem + suffix for suffix in (".md", ".json", ".png") if os.path.exists(stem + suffix))
    print(f"wrote {wrote} in {meta['seconds']} s")
    for name, test in TARGETS:
        print(f"{verdict(test, head)} {name}")
    print("headline:", json.dumps(head))


def report_of_partial(path: str, out: str, *, threads: int | None = None) -> None:
    """The report of a run cut short, from the rows its ``.partial.jsonl`` kept (``--report``).
    A file from before the meta line was written names only the date and the device (its name)."""
    meta: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    stall = None
    with open(path) as f:
        for line in f:
            item = json.loads(line)
            if "meta" in item:
                meta = item["meta"]
            elif "data_stall" in item:
                stall = item["data_stall"]
            else:
                rows.append(item)
    if not meta:
        stem = os.path.basename(path).removesuffix(".partial.jsonl")
        date, slug = stem[:10], stem[11:].removesuffix("-gpu").removesuffix("-quick")
        meta = {"date": date, "device": slug, "quick": stem.endswith("-quick")}
    meta["seconds"] = meta.get("seconds") or "(cut short)"
    meta["cut short"] = "the report of the rows measured before the run ended"
    measured = sorted({r["threads"] for r in rows})
    threads = threads or meta.get("default_threads") or measured[-1]
    finish(out, meta, rows, stall, threads)


if __name__ == "__main__":
    main()
