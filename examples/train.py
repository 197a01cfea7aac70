"""Train a small ResNet on WebDataset shards with gpupipe.

    python -m gpupipe make-shards data --synthetic 2048 --shard-size 256
    python examples/train.py 'data/train-{000000..000007}.tar' --epochs 2

The loader drops into the usual loop: ``len``, ``set_epoch``, ``for images, labels in loader``.
"""

import argparse
import logging
import time

import torch
import torchvision

import gpupipe as gp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards")
    parser.add_argument("--pipeline", default="pipelines/imagenet.py:train")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)

    pipe = gp.load_pipeline(args.pipeline)(args.shards, size=args.size)
    loader = gp.Loader(pipe, batch_size=args.batch_size, shuffle=True, drop_last=True, seed=0, backend=args.backend)
    device = torch.device(loader.device)
    model = torchvision.models.resnet18(num_classes=args.classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        start, seen, correct = time.perf_counter(), 0, 0
        for step, (images, labels) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(out := model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += labels.numel()
            correct += (out.argmax(1) == labels).sum().item()
            if step % 10 == 0:
                logging.info("epoch %d step %d/%d loss %.3f", epoch, step, len(loader), loss.item())
        logging.info("epoch %d: %.0f images/s, train accuracy %.2f", epoch,
                     seen / (time.perf_counter() - start), correct / max(seen, 1))


if __name__ == "__main__":
    main()
