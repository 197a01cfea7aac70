"""Start-up at scale: 10,000 shards, 10 M samples, per rank.

    python bench/startup.py                    # 10,000 shards x 1,000 samples, 8 ranks
    python bench/startup.py --shards 1024 --per-shard 1250 --world 1 --dali   # ImageNet's size, one rank,
                                               # with and without index files, beside DALI's reader

Builds one real tar of ``--per-shard`` small JPEGs and makes ``--shards`` shard paths that link
to it, each with its own cached index file (hard links of one real index: 10 M index lines in
all, without writing 10 M lines). Then, for each rank of ``--world`` (one after the other, in
this process, page cache warm): the source's index (one header line per shard), the Loader, its
epoch plan, and its first batch (which loads the index files of the shards that batch reads).
``--no-index-cache`` leaves the index files out: the first batch then scans the tars it reads.
``--dali`` adds, for each rank, NVIDIA DALI's own ``fn.readers.webdataset`` over the same shards
(with the same index files, or without them it scans every tar when built): its ``build()`` and
its first batch, beside gpupipe's ``Loader()`` and first batch.

Results go to ``bench/results/<date>-startup[-no-index-cache].md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.shards import _indexcache
from gpupipe.sources import LocalStorage
from gpupipe.testing import encode_jpeg, synthetic_image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--per-shard", type=int, default=1_000)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--no-index-cache", action="store_true", help="no index files: the tars are scanned")
    parser.add_argument("--dali", action="store_true", help="DALI's own webdataset reader, beside")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["GPUPIPE_CACHE_DIR"] = os.path.join(tmp, "cache")
        jpg = encode_jpeg(synthetic_image(0, size=(40, 40)))
        with gp.ShardWriter(os.path.join(tmp, "real-%d.tar"), max_count=args.per_shard) as w:
            for i in range(args.per_shard):
                w.write(f"{i:07d}", {"jpg": jpg, "cls": i % 1000})
        real = gp.WebDataset(w.shards[0]).index().shards[0].dali_index
        assert real is not None, "the index cache could not be written"
        urls = []
        for s in range(args.shards):
            path = os.path.join(tmp, f"train-{s:06d}.tar")
            os.symlink(w.shards[0], path)
            if not args.no_index_cache:
                os.link(real, index_file(path))
            urls.append(path)
        if args.no_index_cache:
            os.remove(real)  # (the real shard's own, made above)
        rows = []
        for rank in range(args.world):
            t0 = time.perf_counter()
            source = gp.WebDataset(urls)
            index_s = time.perf_counter() - t0
            pipeline = gp.Pipeline(source, [T.RandomResizedCrop(32)])
            t1 = time.perf_counter()
            loader = gp.Loader(
                pipeline,
                args.batch_size,
                shuffle=True,
                seed=0,
                rank=rank,
                world_size=args.world,
                backend=args.backend,
                device="cpu",
                num_workers=0,
            )
            loader_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            plan = loader.plan()
            plan_s = time.perf_counter() - t2
            t3 = time.perf_counter()
            batches = iter(loader)
            next(batches)
            batches.close()
            first_s = time.perf_counter() - t3
            total_s = time.perf_counter() - t0
            loaded = sum(s.loaded for s in loader.index.shards)
            loader.close()
            dali = dali_reader(urls, rank, args) if args.dali else None
            rows.append((rank, index_s, loader_s, plan_s, first_s, total_s, len(loader), loaded, len(plan.samples),
                         dali))  # fmt: skip
            print(rows[-1], flush=True)
    total = args.shards * args.per_shard
    cache = "no index files: tars scanned" if args.no_index_cache else "cached index files"
    header = ["rank", "WebDataset()", "Loader()", "epoch plan", "first batch", "total", "batches",
              "shard indexes loaded", "samples in plan"]  # fmt: skip
    if args.dali:
        header += ["DALI reader build()", "DALI first batch", "DALI total"]
    table = []
    for r, a, b, c, d, e, n, lo, m, dali in rows:
        row = [str(r), f"{a:.2f}", f"{b:.2f}", f"{c:.2f}", f"{d:.2f}", f"{e:.2f}", str(n), str(lo), f"{m:,}"]
        table.append(row + ([f"{dali[0]:.2f}", f"{dali[1]:.2f}", f"{sum(dali):.2f}"] if dali else []))
    publish(
        args.out,
        "startup" + ("-no-index-cache" if args.no_index_cache else ""),
        f"Start-up at scale, {os.cpu_count()}-core CPU, backend {args.backend}",
        f"{args.shards} shards, {total:,} samples ({cache}), world size {args.world}, batch "
        f"{args.batch_size}, shuffle=True. Seconds, per rank, page cache warm. `Loader()` includes indexing "
        "(one header line per shard) and the plan's consistency checks; the first batch loads the index "
        "files of the shards it reads (or scans them)."
        + (
            " DALI: `fn.readers.webdataset` over the same shards (shard_id=rank, random_shuffle, the same "
            "index files where there are), CPU-only pipeline, 2 threads: `build()`, then its first batch."
            if args.dali
            else ""
        ),
        header,
        table,
    )


def index_file(path: str) -> str:
    """gpupipe's index file of shard ``path`` (DALI's format) in the cache."""
    return _indexcache.index_path(os.path.abspath(path), LocalStorage().stat(path), ("jpg", "jpeg", "png"), "cls")


def dali_reader(urls: list[str], rank: int, args: argparse.Namespace) -> tuple[float, float]:
    """DALI's own webdataset reader over ``urls`` as rank ``rank``: seconds of ``build()`` and of
    its first batch."""
    from nvidia.dali import fn, pipeline_def

    indexes = None if args.no_index_cache else [index_file(u) for u in urls]

    @pipeline_def(batch_size=args.batch_size, num_threads=2, device_id=None, prefetch_queue_depth=1)
    def reader() -> Any:
        jpg, cls = fn.readers.webdataset(paths=urls, index_paths=indexes, ext=["jpg", "cls"], shard_id=rank,  # type: ignore[misc]
                                         num_shards=args.world, random_shuffle=True, name="reader")  # fmt: skip
        return jpg, cls

    t0 = time.perf_counter()
    pipe = reader()
    pipe.build()
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    pipe.run()
    first = time.perf_counter() - t1
    del pipe
    return built, first


if __name__ == "__main__":
    main()
