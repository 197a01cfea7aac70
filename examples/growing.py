"""A dataset that grows while training: a producer writes shards in the background, and each
epoch trains on the shards present when it starts.

    python examples/growing.py /tmp/growing --shards 6 --interval 1 --epochs 4

The producer stands for the background job that samples a remote store into local shards. It
writes each shard under a staging name and renames it into place when complete, so that the
pattern never matches a half-written shard. The loader reads
``gp.WebDataset("DIR/train-*.tar", relist=True)``; ``set_epoch`` lists the pattern again, and
``len(loader)`` and ``loader.stats()`` follow it. A checkpoint's state records the shards its
epoch read, so that a resumed epoch reads exactly those. The last epoch runs after the producer
has finished and sees every shard.
"""

import argparse
import logging
import multiprocessing
import os
import time

import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.testing import encode_jpeg, synthetic_image


def produce(root: str, shards: int, per_shard: int, interval: float) -> None:
    """Writes ``shards`` shards of ``per_shard`` synthetic photos, one every ``interval`` s."""
    staging = os.path.join(root, "staging")
    os.makedirs(staging, exist_ok=True)
    for s in range(shards):
        with gp.ShardWriter(os.path.join(staging, f"train-{s:06d}-%d.tar"), max_count=per_shard) as writer:
            for i in range(per_shard):
                n = s * per_shard + i
                writer.write(f"{n:08d}", {"jpg": encode_jpeg(synthetic_image(n, label=n % 10, size=(48, 64))),
                                          "cls": n % 10})  # fmt: skip
        os.replace(writer.shards[0], os.path.join(root, f"train-{s:06d}.tar"))  # complete: now it matches
        time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", help="the folder the producer writes shards into")
    parser.add_argument("--shards", type=int, default=6)
    parser.add_argument("--per-shard", type=int, default=32)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two shards")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.makedirs(args.root, exist_ok=True)
    pattern = os.path.join(args.root, "train-*.tar")
    producer = multiprocessing.get_context("spawn").Process(
        target=produce, args=(args.root, args.shards, args.per_shard, args.interval), daemon=True
    )
    producer.start()
    try:
        while not gp.WebDataset(pattern, relist=True).listing():  # the first shard
            time.sleep(0.05)
        pipe = gp.Pipeline(gp.WebDataset(pattern, relist=True), [T.RandomResizedCrop(32), T.ToDtype(torch.float32)])
        with gp.Loader(pipe, 16, shuffle=True, seed=0, backend=args.backend) as loader:
            device = torch.device(loader.device)
            model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10)).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for epoch in range(args.epochs):
                if epoch == args.epochs - 1:
                    producer.join()  # the last epoch: every shard written
                loader.set_epoch(epoch)
                seen, loss = 0, torch.zeros(())
                for images, labels in loader:
                    loss = torch.nn.functional.cross_entropy(model(images / 255), labels)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    seen += len(labels)
                shards = len(loader.index.shards)
                print(f"epoch {epoch}: {shards} shards, {seen} samples, {len(loader)} batches, loss {loss.item():.3f}",
                      flush=True)  # fmt: skip
    finally:
        if producer.is_alive():
            producer.terminate()
        producer.join()


if __name__ == "__main__":
    main()
