"""Raw NumPy arrays from WebDataset shards to the training process (issue 39: a source of
``.npy`` fields alone, no image), side by side on the same shards:

    python bench/arrays.py                       # 2 MB float32 samples, 1 GB, 3 rounds
    python bench/arrays.py --mb 4 --samples 256 --rounds 5

- ``gpupipe``: ``gp.WebDataset(urls, fields={"x": gp.fields.Array("npy", dtype="float32")})``
  through ``gp.Loader`` (the torch backend: the arrays are read, checked and stacked in its
  worker processes, and the batch crosses to the training process in shared memory);
- ``gpupipe, fresh shared memory per batch``: the same, with the workers' batch buffers not reused
  (``gpupipe/backends/_slots.py``; as before 2026-11-26);
- ``webdataset + DataLoader``: ``wds.WebDataset(urls).decode().to_tuple("npy").batched(B)`` in a
  ``DataLoader`` with the same workers (webdataset's own ``np.load``);
- ``dali numpy``: ``fn.readers.webdataset(ext="npy")`` and ``fn.decoders.numpy`` on DALI's CPU
  operators, through ``DALIGenericIterator`` (its threads run in the training process).

Each round runs one epoch of each, interleaved, after a warm-up epoch (the page cache warm). The
report gives medians of GB/s (the arrays' bytes delivered) and the training process's CPU-seconds
per GB (``time.process_time``: its own threads, DALI's included; worker processes not), and
writes ``bench/results/<date>-arrays-cpu.md``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpupipe as gp


def make(root: str, mb: float, samples: int, per_shard: int) -> list[str]:
    """``samples`` float32 arrays of ``mb`` MB each, ``per_shard`` to a shard; made once."""
    base = os.path.join(root, f"arrays-{mb:g}mb-{samples}")
    done = os.path.join(base, ".done")
    pattern = os.path.join(base, "shard-%06d.tar")
    if not os.path.exists(done):
        os.makedirs(base, exist_ok=True)
        n = int(mb * (1 << 20) / 4) // 256 * 256  # rows of 256 float32
        rng = np.random.default_rng(0)
        with gp.ShardWriter(pattern, max_count=per_shard) as w:
            for i in range(samples):
                out = io.BytesIO()
                np.save(out, rng.standard_normal(n, dtype=np.float32).reshape(-1, 256), allow_pickle=False)
                w.write(f"{i:07d}", {"npy": out.getvalue()})
        with open(done, "w") as f:
            f.write("\n".join(w.shards))
    with open(done) as f:
        return f.read().split("\n")


def gpupipe_epochs(urls: list[str], batch: int, workers: int, *, reuse: bool = True
                   ) -> tuple[Callable[[], Iterator[torch.Tensor]], Any]:  # fmt: skip
    source = gp.WebDataset(urls, fields={"x": gp.fields.Array("npy", dtype="float32")})
    loader = gp.Loader(gp.Pipeline(source), batch, num_workers=workers, shuffle=True, seed=0, drop_last=True)

    def epoch() -> Iterator[torch.Tensor]:
        if not reuse:  # every batch in fresh shared memory, as before the workers' buffers were reused
            loader._runner._loader.collate_fn.slots = None  # type: ignore[attr-defined]  # before the workers fork
        for b in loader:
            yield b["x"]

    return epoch, loader.close


def gpupipe_fresh_epochs(urls: list[str], batch: int, workers: int) -> tuple[Callable[[], Iterator[torch.Tensor]], Any]:
    return gpupipe_epochs(urls, batch, workers, reuse=False)


def webdataset_epochs(urls: list[str], batch: int, workers: int) -> tuple[Callable[[], Iterator[torch.Tensor]], Any]:
    import webdataset as wds

    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .decode()
        .to_tuple("npy")
        .batched(batch, partial=False)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True)

    def epoch() -> Iterator[torch.Tensor]:
        for (x,) in loader:
            yield torch.as_tensor(x)

    return epoch, lambda: None


def dali_epochs(urls: list[str], batch: int, workers: int) -> tuple[Callable[[], Iterator[torch.Tensor]], Any]:
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def(batch_size=batch, num_threads=workers, device_id=None, prefetch_queue_depth=2)
    def pipe():
        raw = fn.readers.webdataset(paths=urls, ext=["npy"], name="reader")
        return fn.decoders.numpy(raw)

    p = pipe()
    p.build()
    it = DALIGenericIterator([p], ["x"], reader_name="reader", last_batch_policy=LastBatchPolicy.DROP,
                             auto_reset=True)  # fmt: skip

    def epoch() -> Iterator[torch.Tensor]:
        for out in it:
            yield out[0]["x"]

    return epoch, lambda: None


ROWS = {
    "gpupipe": gpupipe_epochs,
    "gpupipe, fresh shared memory per batch": gpupipe_fresh_epochs,
    "webdataset + DataLoader": webdataset_epochs,
    "dali numpy": dali_epochs,
}


def timed(epoch: Callable[[], Iterator[torch.Tensor]]) -> tuple[float, float, int]:
    """(GB/s, training-process CPU-s per GB, samples) of one epoch."""
    nbytes = samples = 0
    start, cpu = time.perf_counter(), time.process_time()
    for x in epoch():
        nbytes += x.numel() * x.element_size()
        samples += x.shape[0]
    wall, used = time.perf_counter() - start, time.process_time() - cpu
    return nbytes / 1e9 / wall, used / (nbytes / 1e9), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=2.0, help="each array's size in MB (default 2)")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--per-shard", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="worker processes / DALI threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    urls = make(args.data, args.mb, args.samples, args.per_shard)
    made = {name: build(urls, args.batch_size, args.workers) for name, build in ROWS.items()}
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ROWS}
    try:
        for epoch, _ in made.values():
            timed(epoch)  # warm-up: the page cache, workers, pipelines
        for r in range(args.rounds):
            for name, (epoch, _) in made.items():
                results[name].append(timed(epoch))
                gbs, cpu, n = results[name][-1]
                print(f"round {r}: {name}: {gbs:.2f} GB/s, {cpu:.3f} CPU-s/GB in the training process ({n} samples)",
                      flush=True)  # fmt: skip
    finally:
        for _, close in made.values():
            close()
    date = datetime.date.today().isoformat()
    lines = [f"# Raw arrays to the training process — {os.cpu_count()}-core CPU, {date}", "",
             f"`python bench/arrays.py --mb {args.mb:g} --samples {args.samples} --batch-size {args.batch_size} "
             f"--workers {args.workers} --rounds {args.rounds}` on {platform.node()} ({os.cpu_count()} CPUs), no GPU. "
             f"{args.samples} float32 arrays of {args.mb:g} MB in shards of {args.per_shard}, page cache warm; "
             f"medians of {args.rounds} interleaved rounds of one epoch each.", "",
             "| reader | GB/s | training-process CPU-s per GB | samples per epoch |", "|---|---|---|---|"]  # fmt: skip
    for name, rows in results.items():
        gbs, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        lines.append(f"| {name} | {gbs:.2f} | {cpu:.3f} | {rows[0][2]} |")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{date}-arrays-cpu.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
