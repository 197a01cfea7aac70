"""Start-up at scale: 10,000 shards, 10 M samples, per rank.

    python bench/startup.py                    # 10,000 shards x 1,000 samples, 8 ranks

Builds one real tar of ``--per-shard`` small JPEGs and makes ``--shards`` shard paths that link
to it, each with its own cached index file (hard links of one real index: 10 M index lines in
all, without writing 10 M lines). Then, for each rank of ``--world`` (one after the other, in
this process, page cache warm): the source's index (one header line per shard), the Loader, its
epoch plan, and its first batch (which loads the index files of the shards that batch reads).
Results go to ``bench/results/<date>-startup.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

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
            os.link(
                real,
                _indexcache.index_path(os.path.abspath(path), LocalStorage().stat(path), ("jpg", "jpeg", "png"), "cls"),
            )
            urls.append(path)
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
            loaded = sum(s.loaded for s in loader.index.shards)
            rows.append(
                (
                    rank,
                    index_s,
                    loader_s,
                    plan_s,
                    first_s,
                    time.perf_counter() - t0,
                    len(loader),
                    loaded,
                    len(plan.samples),
                )
            )
            print(rows[-1], flush=True)
    total = args.shards * args.per_shard
    publish(
        args.out,
        "startup",
        f"Start-up at scale, {os.cpu_count()}-core CPU, backend {args.backend}",
        f"{args.shards} shards, {total:,} samples (cached index files), world size {args.world}, batch "
        f"{args.batch_size}, shuffle=True. Seconds, per rank, page cache warm. `Loader()` includes indexing "
        "(one header line per shard) and the plan's consistency checks; the first batch loads the index "
        "files of the shards it reads.",
        [
            "rank",
            "WebDataset()",
            "Loader()",
            "epoch plan",
            "first batch",
            "total",
            "batches",
            "shard indexes loaded",
            "samples in plan",
        ],
        [
            [str(r), f"{a:.2f}", f"{b:.2f}", f"{c:.2f}", f"{d:.2f}", f"{e:.2f}", str(n), str(lo), f"{m:,}"]
            for r, a, b, c, d, e, n, lo, m in rows
        ],
    )


if __name__ == "__main__":
    main()
