"""Train a small ResNet on WebDataset shards with gpupipe, on one process or with DDP.

    python -m gpupipe make-shards data --synthetic 2048 --shard-size 256
    python examples/train.py 'data/train-{000000..000007}.tar' --epochs 2
    torchrun --nproc_per_node=2 examples/train.py 'data/train-{000000..000007}.tar' --checkpoint ckpt.pt

The loader drops into the usual loop: ``len``, ``set_epoch``, ``for images, labels in loader``.
Under torchrun each rank gets its own part of every epoch, the same number of batches on every
rank; the evaluation counts each sample exactly once (``batch.valid``), and ``--checkpoint``
saves each rank's loader position so that a restarted job resumes mid-epoch where it stopped.
"""

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torchvision

import gpupipe as gp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards")
    parser.add_argument("--pipeline", default="pipelines/imagenet.py")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--checkpoint", default=None, help="save here every 10 steps and resume from it")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    distributed = "RANK" in os.environ
    if distributed:
        if torch.cuda.is_available():  # each rank on its own GPU, before NCCL starts
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    train_pipe = gp.load_pipeline(f"{args.pipeline}:train")(args.shards, size=args.size)
    val_pipe = gp.load_pipeline(f"{args.pipeline}:val")(args.shards, size=args.size, resize=args.size * 8 // 7)
    train = gp.Loader(train_pipe, args.batch_size, shuffle=True, drop_last=True, seed=0, backend=args.backend)
    val = gp.Loader(val_pipe, args.batch_size, backend=args.backend)
    device = torch.device(train.device)
    model = torchvision.models.resnet18(num_classes=args.classes).to(device)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start_epoch, first_step = 0, 0  # first_step: a resumed epoch's batches already trained on
    if args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train.load_state_dict(ckpt["loaders"][rank])  # one loader state per rank
        start_epoch, first_step = ckpt["loaders"][rank]["epoch"], ckpt["loaders"][rank]["batches_yielded"]
        logging.info("resumed at epoch %d, batch %d", start_epoch, first_step)

    for epoch in range(start_epoch, args.epochs):
        train.set_epoch(epoch)  # keeps a resumed mid-epoch position
        model.train()
        start, seen = time.perf_counter(), 0
        # (a resumed epoch's steps count on from the batches trained before; len(train) counts them too)
        for step, (images, labels) in enumerate(train, start=first_step if epoch == start_epoch else 0):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += labels.numel()
            if step % 10 == 0:
                logging.info("epoch %d step %d/%d loss %.3f", epoch, step, len(train), loss.item())
                if args.checkpoint:
                    save(args.checkpoint, model, opt, train, distributed, rank)
        logging.info("epoch %d: %.0f images/s on rank %d", epoch, seen / (time.perf_counter() - start), rank)

        model.eval()
        counts = torch.zeros(2, dtype=torch.int64, device=device)  # correct, evaluated
        with torch.no_grad():
            for batch in val:
                images, labels = batch
                hit = model(images).argmax(1) == labels
                counts += torch.stack([hit[batch.valid].sum(), batch.valid.sum()])
        if distributed:
            dist.all_reduce(counts)
        logging.info(
            "epoch %d: accuracy %.3f on %d samples (each counted once)",
            epoch,
            counts[0].item() / max(1, counts[1].item()),
            counts[1].item(),
        )
    if distributed:
        dist.destroy_process_group()


def save(path: str, model, opt, loader: gp.Loader, distributed: bool, rank: int) -> None:
    states: list[dict | None] = [None] * (dist.get_world_size() if distributed else 1)
    if distributed:
        dist.all_gather_object(states, loader.state_dict())
    else:
        states[0] = loader.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "loaders": states}, path + ".tmp")
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
