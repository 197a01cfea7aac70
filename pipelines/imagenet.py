"""The standard torchvision ImageNet recipes, in the gpupipe DSL: the classic ``train``/``val``
(2017), torchvision's ``IMAGENET1K_V2`` recipe (``train_v2``/``val_v2``: TrivialAugmentWide,
RandomErasing, MixUp/CutMix at 176 px, validated at 232 → 224), timm's ``rand-m9-mstd0.5-inc1``
recipe (``train_timm``) and DeiT III's 3-Augment (``train_3augment``).

Load by path: ``gp.load_pipeline("pipelines/imagenet.py:train")(source)``, or from the CLI:
``python -m gpupipe bench pipelines/imagenet.py:train 'data/train-{000000..000007}.tar'``.
"""

import torch

import gpupipe as gp
from gpupipe import transforms as T

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def train(source, size=224):
    """RandomResizedCrop(size) + horizontal flip, then float and ImageNet normalisation.

    Output ``[3, size, size]`` float32."""
    return gp.Pipeline(
        source,
        [
            T.RandomResizedCrop(size),
            T.RandomHorizontalFlip(),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(mean=MEAN, std=STD),
        ],
    )


def val(source, size=224, resize=256):
    """Resize(resize) of the shorter side + CenterCrop(size), then float and ImageNet normalisation.

    Output ``[3, size, size]`` float32."""
    return gp.Pipeline(
        source,
        [
            T.Resize(resize),
            T.CenterCrop(size),
            T.ToDtype(torch.float32, scale=True),
            T.Normalize(mean=MEAN, std=STD),
        ],
    )


# torchvision's reference script's --auto-augment values.
AUTO_AUGMENT = {
    "ta_wide": lambda interpolation: T.TrivialAugmentWide(interpolation=interpolation),
    "ra": lambda interpolation: T.RandAugment(interpolation=interpolation),
    "augmix": lambda interpolation: T.AugMix(interpolation=interpolation),
    "imagenet": lambda interpolation: T.AutoAugment(T.AutoAugmentPolicy.IMAGENET, interpolation=interpolation),
    "cifar10": lambda interpolation: T.AutoAugment(T.AutoAugmentPolicy.CIFAR10, interpolation=interpolation),
    "svhn": lambda interpolation: T.AutoAugment(T.AutoAugmentPolicy.SVHN, interpolation=interpolation),
}


def _mixing(mixup_alpha, cutmix_alpha, *, num_classes, label_smoothing, p=None):
    """The batch transform of the recipes: MixUp and/or CutMix (an alpha of 0 leaves one out), one
    of them per batch with probabilities ``p`` where both are in; ``None`` where neither is."""
    mixing = [
        cls(alpha=alpha, num_classes=num_classes, label_smoothing=label_smoothing)
        for cls, alpha in ((T.MixUp, mixup_alpha), (T.CutMix, cutmix_alpha))
        if alpha
    ]
    return None if not mixing else mixing[0] if len(mixing) == 1 else T.RandomChoice(mixing, p=p)


def train_v2(
    source,
    size=176,
    *,
    auto_augment="ta_wide",
    random_erase=0.1,
    mixup_alpha=0.2,
    cutmix_alpha=1.0,
    num_classes=1000,
    label_smoothing=0.0,
):
    """torchvision's ResNet-50 ``IMAGENET1K_V2`` training recipe (references/classification:
    ``--auto-augment ta_wide --random-erase 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0
    --train-crop-size 176``): RandomResizedCrop(size, bilinear) + flip, the ``auto_augment``
    policy (``None``: none), float and ImageNet normalisation, RandomErasing(``random_erase``);
    per batch, one of MixUp and CutMix (the labels become soft targets ``[B, num_classes]``).

    ``label_smoothing``: smoothed targets here; torchvision's script smooths in its loss
    instead (``--label-smoothing 0.1``), so keep 0 with a loss that smooths.

    Output ``[3, size, size]`` float32."""
    steps = [T.RandomResizedCrop(size, interpolation="bilinear"), T.RandomHorizontalFlip()]
    if auto_augment is not None:
        if auto_augment not in AUTO_AUGMENT:
            raise gp.ConfigError(f"train_v2: auto_augment must be one of {sorted(AUTO_AUGMENT)} or None, "
                                 f"got {auto_augment!r}")  # fmt: skip
        steps.append(AUTO_AUGMENT[auto_augment]("bilinear"))
    steps += [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=MEAN, std=STD)]
    if random_erase:
        steps.append(T.RandomErasing(p=random_erase))
    batch = _mixing(mixup_alpha, cutmix_alpha, num_classes=num_classes, label_smoothing=label_smoothing)
    return gp.Pipeline(source, steps, batch_transform=batch)


def val_v2(source, size=224, resize=232):
    """The ``IMAGENET1K_V2`` weights' evaluation: Resize(232, bilinear) + CenterCrop(224).

    Output ``[3, size, size]`` float32."""
    return val(source, size=size, resize=resize)


def train_timm(
    source,
    size=224,
    *,
    rand_augment="rand-m9-mstd0.5-inc1",
    random_erase=0.25,
    mixup_alpha=0.8,
    cutmix_alpha=1.0,
    switch_prob=0.5,
    label_smoothing=0.1,
    num_classes=1000,
):
    """timm's (and DeiT's) training transforms: RandomResizedCrop(size, bicubic) + flip, timm's
    RandAugment ``rand-m9-mstd0.5-inc1`` (mean fill), float and ImageNet normalisation,
    RandomErasing in pixel mode (N(0, 1) noise, ``reprob`` 0.25); per batch MixUp 0.8 or CutMix
    1.0 (``switch_prob`` 0.5) with label smoothing 0.1 in the targets (timm's ``Mixup``).

    Output ``[3, size, size]`` float32."""
    steps = [T.RandomResizedCrop(size, interpolation="bicubic"), T.RandomHorizontalFlip()]
    if rand_augment:
        steps.append(T.TimmRandAugment.from_config(rand_augment))
    steps += [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=MEAN, std=STD)]
    if random_erase:
        steps.append(T.RandomErasing(p=random_erase, value="random"))
    batch = _mixing(
        mixup_alpha,
        cutmix_alpha,
        num_classes=num_classes,
        label_smoothing=label_smoothing,
        p=[1 - switch_prob, switch_prob],
    )
    return gp.Pipeline(source, steps, batch_transform=batch)


def train_3augment(source, size=224, *, color_jitter=0.3):
    """DeiT III's 3-Augment: RandomResizedCrop(size, bicubic) + flip, then per sample one of
    grayscale, solarization (threshold 128) and a Gaussian blur (σ uniform in [0.1, 2]), then
    ColorJitter(``color_jitter`` for brightness, contrast and saturation), float and ImageNet
    normalisation.

    Output ``[3, size, size]`` float32."""
    three: list[T.Transform] = [
        T.RandomGrayscale(p=1.0),
        T.RandomSolarize(128, p=1.0),
        T.GaussianBlur(23, sigma=(0.1, 2.0)),
    ]
    steps = [T.RandomResizedCrop(size, interpolation="bicubic"), T.RandomHorizontalFlip(), T.RandomChoice(three)]
    if color_jitter:
        steps.append(T.ColorJitter(color_jitter, color_jitter, color_jitter))
    steps += [T.ToDtype(torch.float32, scale=True), T.Normalize(mean=MEAN, std=STD)]
    return gp.Pipeline(source, steps)
