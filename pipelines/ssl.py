"""Self-supervised multi-crop recipes, in the gpupipe DSL: each image gives several views, each with
its own augmentation (``gp.Pipeline(source, views=[...])``); the loader yields ``views, labels``,
``views`` a tuple of ``[B, 3, H, W]`` float32 tensors, one per view.

Load by path: ``gp.load_pipeline("pipelines/ssl.py:dino")(source)``; see what it does with
``python -m gpupipe inspect pipelines/ssl.py:dino DATA --draws 2``.
"""

import torch

import gpupipe as gp
from gpupipe import transforms as T

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
BLUR_SIGMA = (0.1, 2.0)


def _normalize():
    return [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=MEAN, std=STD)]


def _flip_and_color_jitter(jitter):
    steps: list[T.Transform] = [T.RandomHorizontalFlip(p=0.5)]
    if jitter is not None:
        steps.append(T.RandomApply([T.ColorJitter(*jitter)], p=0.8))
    return [*steps, T.RandomGrayscale(p=0.2)]


def dino(
    source,
    *,
    global_size=224,
    local_size=96,
    local_crops=8,
    global_scale=(0.4, 1.0),
    local_scale=(0.05, 0.4),
    blur_kernel=9,
    color_jitter=(0.4, 0.4, 0.2, 0.1),
):
    """DINO's multi-crop augmentation (Caron et al. 2021, ``DataAugmentationDINO``): 2 global crops
    and ``local_crops`` local ones.

    - global view 1: ``RandomResizedCrop(global_size, scale=global_scale, bicubic)``, flip,
      ``ColorJitter(*color_jitter)`` (brightness, contrast, saturation, hue) with p 0.8 (``None``:
      none), grayscale (p 0.2), Gaussian blur (always);
    - global view 2: the same, blur with p 0.1, then ``RandomSolarize(128, p=0.2)``;
    - each local view: ``RandomResizedCrop(local_size, scale=local_scale, bicubic)``, flip, color
      jitter, grayscale, blur with p 0.5.

    Every view ends with ImageNet normalisation. Outputs: 2 x ``[3, global_size, global_size]``,
    then ``local_crops`` x ``[3, local_size, local_size]``, float32. The blur is torchvision's
    ``GaussianBlur(blur_kernel, sigma=(0.1, 2.0))`` (DINOv2's choice; DINO blurred with Pillow's
    radius, which has no kernel size). The views' colour steps run in the stage on every backend
    by default (on the torch backend's CPU workers, sample by sample), exact to torchvision; in
    DALI's graph (``stage=False``) ``ColorJitter`` differs by the order of its adjustments
    (docs/guide/dali.md).
    """

    def crop(size, scale):
        return T.RandomResizedCrop(size, scale=scale, interpolation=T.InterpolationMode.BICUBIC)

    def blur(p):
        step = T.GaussianBlur(blur_kernel, sigma=BLUR_SIGMA)
        return step if p == 1.0 else T.RandomApply([step], p=p)

    global1 = [crop(global_size, global_scale), *_flip_and_color_jitter(color_jitter), blur(1.0), *_normalize()]
    global2 = [
        crop(global_size, global_scale),
        *_flip_and_color_jitter(color_jitter),
        blur(0.1),
        T.RandomSolarize(128, p=0.2),
        *_normalize(),
    ]
    local = [crop(local_size, local_scale), *_flip_and_color_jitter(color_jitter), blur(0.5), *_normalize()]
    return gp.Pipeline(source, views=[global1, global2, *[local] * local_crops])


def simclr(source, *, size=224, strength=1.0, blur_kernel=23):
    """SimCLR's two views (Chen et al. 2020), each: ``RandomResizedCrop(size)``, flip, color jitter
    of ``strength`` s (0.8s, 0.8s, 0.8s, 0.2s) with p 0.8, grayscale (p 0.2), Gaussian blur with p
    0.5 (kernel about 10% of the crop: 23 for 224), ImageNet normalisation. Outputs: 2 x
    ``[3, size, size]`` float32.
    """
    s = strength
    view = [
        T.RandomResizedCrop(size),
        T.RandomHorizontalFlip(),
        T.RandomApply([T.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, 0.2 * s)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([T.GaussianBlur(blur_kernel, sigma=BLUR_SIGMA)], p=0.5),
        *_normalize(),
    ]
    return gp.Pipeline(source, views=[view, view])
