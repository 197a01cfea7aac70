"""Object detection: torchvision's detection reference presets (``references/detection``, the
Faster R-CNN / RetinaNet recipes), in the gpupipe DSL. Each sample is an image, its boxes and their
classes (``key.jpg`` + ``key.boxes.npy`` ``[K, 4]`` XYXY pixels + ``key.labels.npy`` ``[K]`` int64
by default); the boxes follow every resize, flip and pad (``gp.fields.Boxes``), are clamped to the
image, and those left under a pixel wide or high are dropped with their labels (torchvision's
``SanitizeBoundingBoxes``).

torchvision's detection models take a list of images of any size and batch them themselves; a
loader batch has one size, so the images are resized as the model's own transform would
(``GeneralizedRCNNTransform``: the shorter side to ``min_size``, the longer at most ``max_size``)
and padded into a ``canvas`` (``CenterCrop``: the image in the middle, zeros around; the boxes
moved with it). The model's resize then leaves them as they are (give it ``min_size=canvas`` and
``max_size=canvas``), and normalizes them itself: the images stay in ``[0, 1]``.

Load by path: ``gp.load_pipeline("pipelines/detection.py:train")(source)``; each batch gives
``images [B, 3, canvas, canvas]`` float32, ``batch["boxes"]`` (a ``gp.fields.Padded``: ``[B, K, 4]``
and each sample's count) and ``batch["labels"]`` (one ``[K]`` tensor per sample); :func:`targets`
makes the list of ``{"boxes", "labels"}`` dicts torchvision's models train on.
"""

import torch

import gpupipe as gp
from gpupipe import transforms as T

# torchvision's "multiscale" data augmentation: the shorter side drawn from these
MULTISCALE = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)


def source_of(source, boxes="boxes.npy", labels="labels.npy", image="jpg;jpeg;png", box_format="XYXY"):
    """``source`` (shard URLs or a pattern) as a WebDataset of an image, its ``boxes`` and their
    ``labels``; a gpupipe source is taken as it is (its fields must name ``boxes`` and ``labels``)."""
    if isinstance(source, gp.sources.Source):
        return source
    return gp.WebDataset(source, fields={
        "image": image,
        "boxes": gp.fields.Boxes(boxes, format=box_format, labels="labels"),
        "labels": gp.fields.Array(labels),
    })  # fmt: skip


def train(source, *, data_augmentation="multiscale", min_size=MULTISCALE, max_size=1333, canvas=None,
          hflip_prob=0.5, size=320):  # fmt: skip
    """torchvision's ``DetectionPresetTrain``:

    - ``"multiscale"`` (default): the shorter side one of ``min_size`` (torchvision's 480-800),
      the longer at most ``max_size`` (``RandomShortestSize``), then a horizontal flip;
    - ``"hflip"``: the flip alone, at the model's single scale (the shorter side ``min_size``, an
      int, 800 where a sequence is given);
    - ``"ssdlite"``: ``RandomIoUCrop`` (by the boxes) and the flip, then the ``size`` square SSD's
      own transform resizes to (320 for SSDlite, 300 for SSD300);
    - ``"ssd"``: ``RandomPhotometricDistort(p=1)``, ``RandomZoomOut`` onto the ImageNet mean (a
      mask's own fill), then as ``"ssdlite"``.

    The first two are then padded into a ``canvas`` square (default ``max_size``); all are made
    float in ``[0, 1]``."""
    side = canvas or max_size
    if data_augmentation == "multiscale":
        sizes = (min_size,) if isinstance(min_size, int) else tuple(min_size)
        steps: list[T.Transform] = [T.RandomShortestSize(sizes, max_size)]
    elif data_augmentation == "hflip":
        steps = [T.Resize(min_size if isinstance(min_size, int) else 800, max_size=max_size)]
    elif data_augmentation == "ssdlite":
        steps = [T.RandomIoUCrop()]
    elif data_augmentation == "ssd":
        steps = [T.RandomPhotometricDistort(p=1.0), T.RandomZoomOut(fill=(123.0, 117.0, 104.0)), T.RandomIoUCrop()]
    else:
        raise gp.ConfigError(
            f"detection.train: data_augmentation must be 'multiscale', 'hflip', 'ssd' or 'ssdlite', got "
            f"{data_augmentation!r}"
        )
    if hflip_prob > 0:
        steps.append(T.RandomHorizontalFlip(hflip_prob))
    steps.append(T.Resize((size, size)) if data_augmentation.startswith("ssd") else T.CenterCrop(side))
    steps.append(T.ToDtype(torch.float32, scale=True))
    return gp.Pipeline(source_of(source), steps)


def val(source, *, min_size=800, max_size=1333, canvas=None):
    """torchvision's ``DetectionPresetEval`` with the model's own resize (the shorter side
    ``min_size``, the longer at most ``max_size``), padded into a ``canvas`` square (default
    ``max_size``), float in ``[0, 1]``."""
    steps = [T.Resize(min_size, max_size=max_size), T.CenterCrop(canvas or max_size),
             T.ToDtype(torch.float32, scale=True)]  # fmt: skip
    return gp.Pipeline(source_of(source), steps)


def targets(batch):
    """A batch's boxes and labels as torchvision's detection models take them: one dict per
    sample, ``{"boxes": [K, 4] float32, "labels": [K] int64}``, the padding left out."""
    boxes, counts = batch["boxes"].data, batch["boxes"].lengths[:, 0].tolist()
    labels = batch["labels"]
    return [{"boxes": boxes[i, :n], "labels": labels[i].reshape(-1).long()} for i, n in enumerate(counts)]
