"""Train a torchvision detection model on image + boxes shards with gpupipe (one process, CPU or GPU).

    python examples/train_detection.py --make det-data 256               # writes synthetic shards first
    python examples/train_detection.py 'det-data/det-{000000..000003}.tar' --epochs 3
    python examples/train_detection.py 'coco/train-{000000..000117}.tar' --classes 91 \\
        --data-augmentation multiscale --arch fasterrcnn_resnet50_fpn_v2

Shards hold ``key.jpg``, its boxes ``key.boxes.npy`` (``[K, 4]`` XYXY pixels) and their classes
``key.labels.npy`` (``[K]``, 1.. for torchvision's models, 0 being the background), as
``pipelines/detection.py`` (torchvision's detection reference presets) reads them: the boxes follow
the image's resize, flip, crop and padding, and those left under a pixel are dropped with their
labels. Each batch becomes torchvision's list of images and of ``{"boxes", "labels"}`` targets
(``detection.targets``); each epoch logs the mean of the model's summed losses.

``--make DIR N`` writes N synthetic samples: photo-like images with 1-3 rectangles painted on, a
colour per class, and their boxes (``gpupipe make-shards --fields boxes`` writes the same).
"""

import argparse
import logging
import os
import sys

import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpupipe as gp
from gpupipe.testing import encode_jpeg, paint_boxes, synthetic_image


def make(out: str, count: int, size: tuple[int, int] = (96, 128)) -> str:
    """``count`` synthetic image + boxes samples in shards of 64 under ``out``; returns the pattern."""
    with gp.ShardWriter(os.path.join(out, "det-%06d.tar"), max_count=64) as writer:
        for i in range(count):
            image = synthetic_image(i, size=size)
            boxes, labels = paint_boxes(image, i)
            writer.write(f"{i:06d}", {"jpg": encode_jpeg(image, quality=95), "boxes.npy": boxes, "labels.npy": labels})
    last = len(writer.shards) - 1
    return os.path.join(out, f"det-{{000000..{last:06d}}}.tar")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shards", nargs="?")
    parser.add_argument("--make", nargs=2, metavar=("DIR", "N"), help="write N synthetic samples to DIR first")
    parser.add_argument("--classes", type=int, default=4, help="classes, the background included (default 4)")
    parser.add_argument("--arch", default="fasterrcnn_mobilenet_v3_large_320_fpn", help="a torchvision detection model")
    parser.add_argument("--data-augmentation", default="ssdlite", help="multiscale, hflip, ssd or ssdlite")
    parser.add_argument("--size", type=int, default=128, help="the square the ssd presets resize to")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shards = make(args.make[0], int(args.make[1])) if args.make else args.shards
    if shards is None:
        parser.error("give shards, or --make DIR N")

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines", "detection.py")
    train, targets = gp.load_pipeline(recipe + ":train"), gp.load_pipeline(recipe + ":targets")
    pipeline = train(shards, data_augmentation=args.data_augmentation, size=args.size)
    loader = gp.Loader(pipeline, args.batch_size, shuffle=True, drop_last=True, seed=0, num_workers=args.workers)
    device = torch.device(loader.device)
    side = pipeline.output_spec.height  # the model's own transform leaves the batch's size as it is
    build = torchvision.models.detection.__dict__[args.arch]
    model = build(weights=None, weights_backbone=None, num_classes=args.classes, min_size=side, max_size=side)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    with loader:
        logging.info("%r", loader)
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            model.train()
            losses = []
            for batch in loader:
                found = [{k: v.to(device) for k, v in t.items()} for t in targets(batch)]
                loss = sum(model(list(batch.images), found).values())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            logging.info("epoch %d: mean loss %.4f over %d batches", epoch, sum(losses) / len(losses), len(losses))


if __name__ == "__main__":
    main()
