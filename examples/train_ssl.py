"""Self-supervised pre-training (SimCLR) on WebDataset shards, fed by a pipeline of two views.

    python -m gpupipe make-shards data --synthetic 2048 --shard-size 256
    python examples/train_ssl.py 'data/train-{000000..000007}.tar' --epochs 2
    torchrun --nproc_per_node=2 examples/train_ssl.py 'data/train-{000000..000007}.tar'

``pipelines/ssl.py:simclr`` gives each image two independently augmented views, decoded once;
the loader yields ``(view1, view2), labels`` (labels unused). The loss is SimCLR's NT-Xent over
the rank's batch (each view's positive is the other view of its image; the other 2B - 2 views
are its negatives). ``--pipeline pipelines/ssl.py:dino`` trains on DINO's two global crops
instead (its local crops are left out here: DINO's own loss needs a teacher network).
"""

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

import gpupipe as gp


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss for ``[B, D]`` embeddings of the two views of ``B`` images."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = z @ z.T / temperature
    logits.fill_diagonal_(float("-inf"))  # a view is not its own negative
    n = len(z1)
    positives = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(logits, positives)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards")
    parser.add_argument("--pipeline", default="pipelines/ssl.py:simclr")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    distributed = "RANK" in os.environ
    if distributed:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    recipe = gp.load_pipeline(args.pipeline)
    dino = args.pipeline.endswith(":dino")
    pipe = recipe(args.shards, global_size=args.size, local_crops=0) if dino else recipe(args.shards, size=args.size)
    loader = gp.Loader(pipe, args.batch_size, shuffle=True, drop_last=True, seed=0, backend=args.backend)
    device = torch.device(loader.device)
    backbone = torchvision.models.resnet18(num_classes=128)  # the last layer as a projection head
    model = backbone.to(device, memory_format=torch.channels_last)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    try:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            start, seen, total = time.perf_counter(), 0, 0.0
            for step, ((view1, view2, *_), _labels) in enumerate(loader):
                loss = nt_xent(model(view1), model(view2), args.temperature)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += len(view1)
                total += loss.item()
                if step % 10 == 0:
                    logging.info("epoch %d step %d/%d loss %.3f", epoch, step, len(loader), loss.item())
            logging.info(
                "epoch %d: mean loss %.3f, %.0f images/s (2 views each)",
                epoch,
                total / max(1, len(loader)),
                seen / (time.perf_counter() - start),
            )
    finally:
        loader.close()
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
