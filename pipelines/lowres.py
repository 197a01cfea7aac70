"""Progressive resizing (FFCV's ResNet recipes): train at a low resolution first and raise it
towards the end, on one loader.

The output size changes between epochs with ``loader.set_pipeline`` (the loader keeps its index,
plan and position; its backend's runner is rebuilt when the size changes)::

    import gpupipe as gp
    lowres = gp.load_pipeline("pipelines/lowres.py:train")
    resolution = gp.load_pipeline("pipelines/lowres.py:resolution")
    loader = gp.Loader(lowres(source, size=resolution(0)), 256, shuffle=True)
    for epoch in range(88):
        loader.set_pipeline(lowres(source, size=resolution(epoch)))
        loader.set_epoch(epoch)
        for images, labels in loader:
            ...

Validation runs at the final resolution (FFCV: 256, after a resize to 256 / 0.875): ``val``.
"""

import os

import numpy as np

import gpupipe as gp

_IMAGENET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "imagenet.py")
CROP_RATIO = 224 / 256  # the center crop's share of the resized image, as the standard recipe


def resolution(epoch, *, min_res=160, max_res=192, start_ramp=65, end_ramp=76, step=32):
    """FFCV's schedule: ``min_res`` up to epoch ``start_ramp``, ``max_res`` from ``end_ramp`` on,
    linear in between, rounded to a multiple of ``step``. Defaults: FFCV's 88-epoch ResNet-50
    configuration."""
    if not min_res <= max_res or not start_ramp <= end_ramp:
        raise ValueError("resolution: needs min_res <= max_res and start_ramp <= end_ramp")
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interpolated = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])[0]
    return int(np.round(interpolated / step)) * step


def train(source, size=160):
    """The ImageNet train recipe (``pipelines/imagenet.py:train``) at ``size``: output
    ``[3, size, size]`` float32."""
    return gp.load_pipeline(f"{_IMAGENET}:train")(source, size=size)


def val(source, size=256):
    """The ImageNet val recipe at ``size``: Resize(round(size / 0.875)) + CenterCrop(size); output
    ``[3, size, size]`` float32."""
    return gp.load_pipeline(f"{_IMAGENET}:val")(source, size=size, resize=round(size / CROP_RATIO))
