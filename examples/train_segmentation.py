"""Train a small segmentation network on image + mask shards with gpupipe (one process, CPU or GPU).

    python examples/train_segmentation.py --make seg-data 256            # writes synthetic shards first
    python examples/train_segmentation.py 'seg-data/seg-{000000..000003}.tar' --epochs 3
    python examples/train_segmentation.py 'voc/train-{000000..000014}.tar' --classes 21 --base-size 520 \\
        --crop-size 480 --arch deeplabv3_resnet50

Shards hold ``key.jpg`` and its label map ``key.seg.png`` (one channel of class indices, 255 for
"ignore"), as ``pipelines/segmentation.py`` (torchvision's segmentation reference presets) reads
them: the mask follows the image's random resize, flip and crop. The loss is cross-entropy with
``ignore_index=255`` (where the crop padded the image); each epoch logs the mean loss and the
pixel accuracy on the training batches.

``--make DIR N`` writes N synthetic samples whose classes are learnable from the pixels: each
pixel's class is its brightness quartile in a smooth synthetic photo.
"""

import argparse
import logging
import os
import sys

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpupipe as gp
from gpupipe.testing import encode_jpeg, encode_png, label_map, synthetic_image

IGNORE = 255


def make(out: str, count: int, size: tuple[int, int] = (96, 128)) -> str:
    """``count`` synthetic image + mask samples in shards of 64 under ``out``; returns the pattern."""
    with gp.ShardWriter(os.path.join(out, "seg-%06d.tar"), max_count=64) as w:
        for i in range(count):
            image = synthetic_image(i, size=size)
            w.write(f"{i:06d}", {"jpg": encode_jpeg(image, quality=95), "seg.png": encode_png(label_map(image))})
    last = len(w.shards) - 1
    return os.path.join(out, f"seg-{{000000..{last:06d}}}.tar")


class Tiny(torch.nn.Module):
    """A few convolutions to per-pixel class scores (CPU-friendly)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(16, classes, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.net(x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards", nargs="?")
    parser.add_argument("--make", nargs=2, metavar=("DIR", "N"), help="write N synthetic samples to DIR first")
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--arch", default="tiny", help="tiny, or a torchvision segmentation model name")
    parser.add_argument("--base-size", type=int, default=96)
    parser.add_argument("--crop-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shards = make(args.make[0], int(args.make[1])) if args.make else args.shards
    if shards is None:
        parser.error("give shards, or --make DIR N")

    pipeline = gp.load_pipeline("pipelines/segmentation.py:train")(shards, args.base_size, args.crop_size)
    loader = gp.Loader(pipeline, args.batch_size, shuffle=True, drop_last=True, seed=0, num_workers=args.workers)
    device = torch.device(loader.device)
    if args.arch == "tiny":
        model: torch.nn.Module = Tiny(args.classes)
    else:
        model = torchvision.models.segmentation.__dict__[args.arch](weights=None, num_classes=args.classes)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
    with loader:
        logging.info("%r", loader)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            model.train()
            losses, right, scored = [], 0, 0
            for batch in loader:
                images, masks = batch.images, batch["mask"].to(device).long()
                out = model(images)["out"]
                loss = criterion(out, masks)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                keep = masks != IGNORE
                right += int((out.argmax(1) == masks)[keep].sum())
                scored += int(keep.sum())
            logging.info("epoch %d: mean loss %.4f, pixel accuracy %.3f over %d pixels", epoch,
                         sum(losses) / len(losses), right / max(scored, 1), scored)  # fmt: skip


if __name__ == "__main__":
    main()
