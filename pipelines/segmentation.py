"""Semantic segmentation: torchvision's segmentation reference presets (``references/segmentation``,
the FCN / DeepLabV3 recipes), in the gpupipe DSL. Each sample is an image and its label map
(``key.jpg`` + ``key.seg.png`` by default); the mask follows the image's resize, flip and crop
(``gp.fields.Mask``: nearest, 255 where padding brings pixels in: the loss's ``ignore_index``).

Load by path: ``gp.load_pipeline("pipelines/segmentation.py:train")(source)``; each batch gives
``images [B, 3, crop, crop]`` float32 (normalized) and ``batch["mask"]`` ``[B, crop, crop]`` uint8.
Masks are moved alike on every backend (DALI's moves them on the host, from each image's header).
"""

import torch

import gpupipe as gp
from gpupipe import transforms as T

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def source_of(source, mask="seg.png", image="jpg;jpeg;png"):
    """``source`` (shard URLs or a pattern) as a WebDataset of an image and its ``mask`` member; a
    gpupipe source is taken as it is (its fields must name the mask)."""
    if isinstance(source, gp.sources.Source):
        return source
    return gp.WebDataset(source, fields={"image": image, "mask": gp.fields.Mask(mask, fill=255)})


def train(source, base_size=520, crop_size=480, *, hflip_prob=0.5, mask="seg.png"):
    """torchvision's ``SegmentationPresetTrain``: the shorter side resized to a size uniform in
    ``[0.5, 2) x base_size``, a horizontal flip, a random ``crop_size`` crop (padded where the
    image is smaller: 0 for the image, 255 for the mask), float and ImageNet normalisation."""
    steps: list[T.Transform] = [T.RandomResize(int(0.5 * base_size), int(2.0 * base_size))]
    if hflip_prob > 0:
        steps.append(T.RandomHorizontalFlip(hflip_prob))
    steps += [
        T.RandomCrop(crop_size, pad_if_needed=True, fill=0),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=MEAN, std=STD),
    ]
    return gp.Pipeline(source_of(source, mask), steps)


def val(source, base_size=520, crop_size=480, *, mask="seg.png"):
    """torchvision's ``SegmentationPresetEval`` resizes the shorter side to ``base_size`` and
    evaluates images one at a time; batched, the loader needs one size: the shorter side to
    ``base_size``, then the central ``crop_size`` square (the border beyond it is not scored)."""
    steps = [
        T.Resize(base_size),
        T.CenterCrop(crop_size),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=MEAN, std=STD),
    ]
    return gp.Pipeline(source_of(source, mask), steps)
