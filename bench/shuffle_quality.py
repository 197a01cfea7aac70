"""Shuffle quality: classes per batch on a dataset whose shards each hold one class.

    python bench/shuffle_quality.py            # 256 shards x 256 samples, batch 64, buffer 1024

Side by side in one run, same shards, same buffer: gpupipe's two-level shuffle (shard permutation,
per-rank interleave, window buffer) on 1 and 8 ranks; DALI's ``readers.webdataset`` with
``random_shuffle`` (buffer only, shards in a fixed order); and a perfect shuffle. The proportions
follow ImageNet in 1,000-sample shards with a 4,096-sample buffer (buffer = 4 shards). The gpupipe
figures are the Loader's plans (the Loader yields exactly its plan on every backend; tested).
Results go to ``bench/results/<date>-shuffle-quality.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import contextlib

from _report import publish

import gpupipe as gp
from gpupipe.plan._plan import PlanSpec, rank_plan
from gpupipe.testing import encode_jpeg, synthetic_image


def classes_per_batch(labels: np.ndarray, batch: int) -> float:
    n = len(labels) // batch
    return float(np.mean([len(np.unique(labels[i * batch : (i + 1) * batch])) for i in range(n)]))


def dali_buffer_only(shards: list[str], batch: int, buffer: int, epoch: int) -> float:
    from nvidia.dali import Pipeline, fn

    index = gp.WebDataset(shards).index()
    pipe = Pipeline(batch_size=batch, num_threads=2, device_id=None, seed=epoch + 1)
    with pipe:
        _, cls = fn.readers.webdataset(  # type: ignore[misc]
            paths=shards,
            index_paths=[str(s.dali_index) for s in index.shards],
            ext=["jpg", "cls"],
            random_shuffle=True,
            initial_fill=buffer,
        )
        pipe.set_outputs(cls)
    pipe.build()
    labels = []
    for _ in range(len(index) // batch):
        (cls,) = pipe.run()
        labels += [int(bytes(np.asarray(cls[i]))) for i in range(batch)]
    return classes_per_batch(np.array(labels), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    S, n, B, K = args.per_shard, args.shards * args.per_shard, args.batch_size, args.buffer
    rows: list[tuple[str, float]] = []
    sizes = np.full(args.shards, S)
    for world in (1, 8):
        for interleave in (1, 16, 64):
            spec = PlanSpec(
                num_samples=int(sizes.sum()),
                world_size=world,
                batch_size=B,
                drop_last=True,
                shuffle=True,
                shuffle_buffer=K,
                interleave=interleave,
            )
            got = [
                classes_per_batch(rank_plan(sizes, spec, sequential=True, seed=0, epoch=e, rank=0).samples // S, B)
                for e in range(args.epochs)
            ]
            default = " (default)" if interleave == 64 else ""
            rows.append((f"gpupipe, {world} rank(s), interleave={interleave}{default}", float(np.mean(got))))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("GPUPIPE_CACHE_DIR", os.path.join(tmp, "cache"))
        jpg = encode_jpeg(synthetic_image(0, size=(8, 8)))
        with gp.ShardWriter(os.path.join(tmp, "c-%06d.tar"), max_count=S) as w:
            for c in range(args.shards):
                for i in range(S):
                    w.write(f"c{c:04d}_{i:04d}", {"jpg": jpg, "cls": c})
        with contextlib.suppress(ImportError):
            rows.append(
                (
                    "DALI readers.webdataset, random_shuffle (buffer only)",
                    float(np.mean([dali_buffer_only(w.shards, B, K, e) for e in range(args.epochs)])),
                )
            )
    perfect = [classes_per_batch(np.random.default_rng(e).permutation(n) // S, B) for e in range(args.epochs)]
    rows.append(("perfect shuffle", float(np.mean(perfect))))
    publish(
        args.out,
        "shuffle-quality",
        "Shuffle quality",
        f"{args.shards} shards x {S} samples, one class per shard; batch {B}; buffer {K} samples; "
        f"mean over {args.epochs} epochs; rank 0 shown for 8 ranks.",
        ["order", "classes per batch"],
        [[name, f"{value:.1f}"] for name, value in rows],
    )


if __name__ == "__main__":
    main()
