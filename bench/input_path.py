"""The DALI backend's input path alone, against DALI's own C++ reader, on the same shards.

    python bench/input_path.py                 # makes shards in .bench-data/input-path/ once
    python bench/input_path.py --rounds 7 --images 3072

Both sides read WebDataset shards of ImageNet-sized JPEGs (about 110 KB, 500x375) and deliver
every sample's encoded bytes to a DALI graph whose only operator is a pass-through (the shapes:
decode is left out, so that only the input path is timed); 2 CPU threads each, batch 256,
prefetch 2, the page cache warm:

- ``gpupipe``: the DALI backend's runner, as a loader runs it — the epoch plan (shuffled, as for
  training), the index, reader threads that hand each batch over as views of the shards mapped
  under read leases (``pread`` into a reused buffer where no lease can be had), zero-copy
  feeding, the random-factor draws of the ImageNet train recipe and the crop windows computed
  from the images' sizes, labels and keys per batch. Each image's header was read and checked
  (gpupipe's rules, nvImageCodec's parser) in the warm-up epoch: the runner remembers the sizes
  (``backends/_dali/_headers.py``), as in every epoch of a training run after its first;
- ``gpupipe, first epoch``: the same, each epoch a run's first (the runner's memory of the sizes
  new), with the sizes an earlier run recorded beside the index cache files: a restarted job, or a
  rank reading shards another rank of the node read before;
- ``gpupipe, headers read``: the same, with the headers read and checked again in every epoch,
  as in a run's first epoch without recorded sizes (a few microseconds a sample of Python, and each sample's first page
  touched: a page fault this pass-through bench counts to gpupipe's threads, which in training
  DALI's decoder takes anyway);
- ``gpupipe, pread``: the same as ``gpupipe`` with the shards read by ``pread`` into a reused
  buffer, as for a GPU pipeline or shards that cannot be leased;
- ``dali reader``: ``fn.readers.webdataset`` (C++), reading the same shards in file order with
  gpupipe's cached DALI-format index files.

Each round runs one full epoch of each, interleaved (this machine is noisy); the report gives
medians of images/s, MB/s, CPU-seconds per 10k images of the whole process, and of the Python
threads alone (the training thread and gpupipe's reader threads: everything that holds the GIL;
user and system time apart), and the ratio last.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import tarfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish

BATCH, THREADS, PREFETCH, SHARDS = 256, 2, 2, 8
TICK = os.sysconf("SC_CLK_TCK")


def make_shards(root: str, images: int, width: int = 500, height: int = 375) -> list[str]:
    """``SHARDS`` shards of JPEGs of ``width`` x ``height`` (one in three turned: ``height`` x
    ``width``; noisy photo-like content, quality 90)."""
    from PIL import Image

    urls = [os.path.join(root, f"train-{i:06d}.tar") for i in range(SHARDS)]
    if all(os.path.exists(u) for u in urls):
        return urls
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    pool = []
    for i in range(48):  # distinct encodings, reused: sizes and content of real photos
        h, w = (height, width) if i % 3 else (width, height)
        base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3)).astype(np.float32)
        img = np.kron(base, np.ones((8, 8, 1)))[:h, :w] + rng.normal(0, 18, (h, w, 3))
        buf = io.BytesIO()
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        pool.append(buf.getvalue())
    per = images // SHARDS
    for s, url in enumerate(urls):
        with tarfile.open(url + ".tmp", "w") as tar:
            for j in range(per):
                key = f"{s:03d}{j:06d}"
                for ext, data in (("jpg", pool[(s * per + j) % len(pool)]), ("cls", str(j % 1000).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        os.replace(url + ".tmp", url)
    return urls


def make_folder(root: str, urls: list[str]) -> str:
    """The shards' JPEGs as an ImageFolder tree, ``root/<class>/<key>.jpg`` (8 classes), once."""
    done = os.path.join(root, ".done")
    if os.path.exists(done):
        return root
    for s, url in enumerate(urls):
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".jpg"):
                    folder = os.path.join(root, f"class{s % 8}")
                    os.makedirs(folder, exist_ok=True)
                    data = tar.extractfile(member)
                    assert data is not None
                    with open(os.path.join(folder, member.name), "wb") as f:
                        f.write(data.read())
    open(done, "w").close()
    return root


def python_cpu() -> tuple[float, float]:
    """User and system CPU seconds of this process's Python threads (every thread ``threading``
    knows): user time is the interpreter's work, under the GIL; system time is the kernel's
    (copying file pages into the batch buffers, with the GIL released)."""
    user = system = 0
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            user, system = user + int(fields[11]), system + int(fields[12])
        except (OSError, TypeError):
            pass
    return user / TICK, system / TICK


def process_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Gpupipe:
    """The DALI backend's runner; ``mapped=False`` forces its ``pread`` path (GPU pipelines, and
    shards without a read lease)."""

    def __init__(self, urls: list[str], *, mapped: bool = True, headers: bool = False, first: bool = False,
                 folder: str | None = None) -> None:  # fmt: skip
        import torch

        import gpupipe as gp
        from gpupipe.backends import RunSpec
        from gpupipe.backends._dali._runner import DaliRunner
        from gpupipe.plan._plan import PlanSpec, rank_plan

        source = gp.WebDataset(urls) if folder is None else gp.ImageFolder(folder)
        self.index = source.index()
        config = gp.LoaderConfig(BATCH, backend="dali", device="cpu", num_workers=THREADS, prefetch=PREFETCH)
        train = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train"))
        spec = RunSpec(self.index, train(source).views, config, torch.device("cpu"), THREADS, 0, 0)
        self.runner = DaliRunner(spec, graph=lambda encoded, ctx: pass_through(encoded, ctx, factors=True))
        self.runner.mapped, self.headers, self.first = mapped, headers, first
        self.name = ("gpupipe, headers read" if headers else "gpupipe, first epoch" if first
                     else "gpupipe" if mapped else "gpupipe, pread")  # fmt: skip
        if folder is not None:
            self.name = "ImageFolder" + (", first epoch" if first else ", headers read" if headers else "")
        self.spec = PlanSpec(len(self.index), 1, BATCH, True, True, 1000, 8)
        self.plan = lambda epoch: rank_plan(
            self.index.shard_sizes, self.spec, sequential=True, seed=0, epoch=epoch, rank=0
        )
        self.epoch = 0

    def epoch_run(self) -> tuple[int, int]:
        from gpupipe.backends._dali._headers import Sizes

        self.epoch += 1
        n = nbytes = 0
        plan = self.plan(self.epoch)
        if self.headers:  # a run's first epoch without the sizes recorded: every header checked
            self.runner._sizes = Sizes(self.runner.index, record=False)
        elif self.first:  # a run's first epoch (a new runner), the sizes recorded by an earlier run
            self.runner._sizes = Sizes(self.runner.index)
        for batch in self.runner.run(plan, 0):
            n += len(batch.keys)
            nbytes += int(batch.images[0][:, 0].sum())
        return n, nbytes

    def close(self) -> None:
        self.runner.close()


def pass_through(encoded, ctx, *, factors: bool = False):
    """The graph of the timed runs: the encoded bytes' shapes (decode left out). With ``factors``,
    the train recipe's crop windows enter the graph too: computed per batch from the images'
    headers and the random factors, and fed, as in training."""
    from gpupipe.backends._dali._lowerings import crop_window

    shapes = encoded.shape(dtype=ctx.types.INT64)
    if not factors:
        return shapes
    window = ctx.arg_vector(crop_window(ctx, *ctx.encoded_shape(encoded)), "int32")
    return ctx.fn.cat(shapes, ctx.fn.cast(window, dtype=ctx.types.INT64))


class DaliReader:
    name = "dali reader"

    def __init__(self, urls: list[str]) -> None:
        from nvidia.dali import Pipeline, fn, types

        import gpupipe as gp

        index = gp.WebDataset(urls).index()
        paths = [str(shard.dali_index) for shard in index.shards]
        self.size = len(index)
        self.pipe = Pipeline(batch_size=BATCH, num_threads=THREADS, device_id=None, prefetch_queue_depth=PREFETCH,
                             exec_dynamic=True)  # fmt: skip
        with self.pipe:
            jpg, cls = fn.readers.webdataset(  # type: ignore[misc]
                paths=urls, index_paths=paths, ext=["jpg", "cls"], missing_component_behavior="error",
                name="reader", pad_last_batch=False, dtypes=[types.UINT8, types.UINT8],
            )  # fmt: skip
            self.pipe.set_outputs(jpg.shape(dtype=types.INT64), cls.shape(dtype=types.INT64))
        self.pipe.build()

    def epoch_run(self) -> tuple[int, int]:
        n = nbytes = 0
        while n < self.size - BATCH + 1:
            shapes, _ = self.pipe.run()
            arr = np.asarray(shapes.as_tensor())
            n += len(arr)
            nbytes += int(arr.sum())
        return n, nbytes

    def close(self) -> None:
        del self.pipe


def timed(reader, epochs: int) -> dict[str, float]:
    """``epochs`` epochs of ``reader`` timed together (CPU times come in 10 ms ticks: a measure of
    a few ticks is as coarse as 25%)."""
    cpu0, (user0, sys0), t0 = process_cpu(), python_cpu(), time.perf_counter()
    n = nbytes = 0
    for _ in range(epochs):
        got, size = reader.epoch_run()
        n, nbytes = n + got, nbytes + size
    wall = time.perf_counter() - t0
    user, system = python_cpu()
    return {
        "images/s": n / wall,
        "MB/s": nbytes / wall / 1e6,
        "process CPU-s / 10k": (process_cpu() - cpu0) / n * 1e4,
        "Python threads, user CPU-s / 10k": (user - user0) / n * 1e4,
        "Python threads, system CPU-s / 10k": (system - sys0) / n * 1e4,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3072)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per round and reader (default: enough for 40k images)")  # fmt: skip
    parser.add_argument("--size", default="500x375", help="the JPEGs' WIDTHxHEIGHT (3-megapixel photos: 2048x1536)")
    parser.add_argument("--data", default=None, help="where the shards are made (.bench-data/input-path[-SIZE])")
    parser.add_argument("--folder", action="store_true", help="also the same JPEGs as an ImageFolder tree")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()

    width, height = (int(x) for x in args.size.lower().split("x"))
    suffix = "" if args.size == "500x375" else f"-{args.size}"
    data = args.data or os.path.join(ROOT, ".bench-data", "input-path" + suffix)
    urls = make_shards(data, args.images, width, height)
    with tarfile.open(urls[0]) as tar:  # shards made before, maybe for another --images: what they hold
        images = len(urls) * sum(m.name.endswith(".jpg") for m in tar)
    for url in urls:  # warm the page cache
        with open(url, "rb") as f:
            while f.read(1 << 24):
                pass
    size_mb = sum(os.path.getsize(u) for u in urls) / 1e6
    readers: list[Gpupipe | DaliReader] = [Gpupipe(urls), Gpupipe(urls, first=True), Gpupipe(urls, headers=True),
                                           Gpupipe(urls, mapped=False), DaliReader(urls)]  # fmt: skip
    if args.folder:
        folder = make_folder(data + "-folder", urls)
        readers += [Gpupipe(urls, folder=folder), Gpupipe(urls, folder=folder, first=True),
                    Gpupipe(urls, folder=folder, headers=True)]  # fmt: skip
    epochs = args.epochs or max(1, -(-40_000 // images))
    for r in readers:  # warm-up epoch: builds, first allocations
        r.epoch_run()
    results: dict[str, list[dict[str, float]]] = {r.name: [] for r in readers}
    for _ in range(args.rounds):
        for r in readers:
            results[r.name].append(timed(r, epochs))
    for r in readers:
        r.close()

    metrics = ["images/s", "MB/s", "process CPU-s / 10k", "Python threads, user CPU-s / 10k",
               "Python threads, system CPU-s / 10k"]  # fmt: skip
    medians = {name: {m: statistics.median(x[m] for x in runs) for m in metrics} for name, runs in results.items()}
    rows = [[name, *(f"{medians[name][m]:,.3f}" if "CPU" in m else f"{medians[name][m]:,.0f}" for m in metrics)]
            for name in results]  # fmt: skip
    ratio = medians["gpupipe"]["images/s"] / medians["dali reader"]["images/s"]
    intro = (
        f"`python bench/input_path.py --images {args.images} --rounds {args.rounds}"
        f"{f' --size {args.size}' if args.size != '500x375' else ''}"
        f"{f' --epochs {args.epochs}' if args.epochs else ''}{' --folder' if args.folder else ''}` "
        f"on {platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), no GPU. {len(urls)} shards, "
        f"{size_mb:.0f} MB, {images:,} JPEGs of ~{size_mb * 1e6 / images / 1e3:.0f} KB ({width}x{height}). "
        f"Batch {BATCH}, "
        f"{THREADS} threads each, prefetch {PREFETCH}, decode replaced by a pass-through; medians of "
        f"{args.rounds} interleaved rounds of {epochs} epoch(s) each. gpupipe's epochs are shuffled (the training "
        "plan) and include the train recipe's random-factor draws and crop windows; their images' "
        "headers were read in the warm-up epoch, as after a training run's first epoch ('first epoch': each "
        "epoch a new runner's first, the sizes recorded beside the index cache; 'headers read': read again "
        "every epoch, as in a first epoch without records); DALI's reader reads in file order. "
        "'Python threads' are the threads that run Python (the iterating thread and gpupipe's readers): "
        "user time is interpreter work under the GIL, system time the kernel's (mapping shards, or "
        "copying file pages into batch buffers where a shard cannot be mapped). CPU times come from "
        "/proc at 10 ms resolution."
    )
    path = publish(args.out, "input-path" + suffix, "Input path: gpupipe vs DALI's webdataset reader", intro,
                   ["reader", *metrics], rows)  # fmt: skip
    line = f"gpupipe / DALI reader (images/s): {ratio:.2f}x"
    with open(path, "a") as f:
        f.write(f"\n{line}\n")
    print(line)


if __name__ == "__main__":
    main()
