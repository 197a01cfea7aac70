"""The standard torchvision ImageNet recipes, in the gpupipe DSL.

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
