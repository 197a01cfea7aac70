"""DALI by hand: the ResNet-50 training and validation input pipelines as NVIDIA documents them
(DALI's PyTorch ResNet-50 example, ``docs/examples/use_cases/pytorch/resnet50``), written here
for ``bench/gpu.py`` to run beside gpupipe's recipes on the same files.

What the documented recipe does, operator by operator:

- read: ``readers.file`` over an ImageFolder tree (``random_shuffle`` for training,
  ``pad_last_batch``), labels from the folder names;
- train: ``decoders.image_random_crop`` on the ``mixed`` device (nvJPEG; region-of-interest
  decode of a random window: area 0.1-1.0, aspect ratio 0.8-1.25, 100 attempts, DALI's own random
  generator), ``resize`` to 224 x 224 (triangular filter), a ``random.coin_flip`` mirror;
- val: ``decoders.image`` (``mixed``), ``resize(size=256, mode="not_smaller")``, then a 224
  center crop;
- both: ``crop_mirror_normalize`` to float CHW with ImageNet's mean and std, on the GPU, and
  ``DALIGenericIterator`` handing the batches to PyTorch.

The decoders get the recipe's ``preallocate_width_hint``/``height_hint`` (ImageNet's largest
image) on the GPU, and otherwise DALI's defaults: ``jpeg_fancy_upsampling=False`` and
``hw_decoder_load=0.65``. ``fancy=True`` sets fancy upsampling, as gpupipe does by default for
parity with torchvision (its cost is one of the things the benchmark shows).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def pipeline(
    root: str,
    *,
    train: bool,
    gpu: bool,
    batch_size: int,
    threads: int,
    crop: int = 224,
    size: int = 256,
    fancy: bool = False,
    seed: int = 0,
    prefetch: int = 2,
) -> Any:
    """The documented ResNet-50 pipeline over the ImageFolder tree ``root``, built."""
    from nvidia.dali import fn, pipeline_def, types

    decoder = "mixed" if gpu else "cpu"
    hints: dict[str, Any] = {"preallocate_width_hint": 5980, "preallocate_height_hint": 6430} if gpu else {}
    if gpu and fancy:
        hints["jpeg_fancy_upsampling"] = True

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=0 if gpu else None, seed=seed,
                  prefetch_queue_depth=prefetch, exec_dynamic=True)  # fmt: skip
    def define() -> Any:
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=train, pad_last_batch=True, name="Reader")
        if train:
            images = fn.decoders.image_random_crop(
                jpegs, device=decoder, output_type=types.RGB, random_aspect_ratio=[0.8, 1.25],
                random_area=[0.1, 1.0], num_attempts=100, **hints,
            )  # fmt: skip
            images = fn.resize(images, resize_x=crop, resize_y=crop, interp_type=types.INTERP_TRIANGULAR)
            mirror: Any = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **hints)
            images = fn.resize(images, size=size, mode="not_smaller", interp_type=types.INTERP_TRIANGULAR)
            mirror = False
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", crop=(crop, crop), mean=MEAN, std=STD, mirror=mirror
        )
        return images, labels.gpu() if gpu else labels

    pipe = define()
    pipe.build()
    return pipe


class ByHand:
    """A documented pipeline and the ``DALIGenericIterator`` over it, epoch after epoch, as a
    training script by hand reads them."""

    def __init__(self, root: str, **options: Any) -> None:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.pipe = pipeline(root, **options)
        self.iterator = DALIGenericIterator(self.pipe, ["data", "label"], reader_name="Reader",
                                            last_batch_policy=LastBatchPolicy.DROP, auto_reset=False)  # fmt: skip

    def epoch(self) -> Iterator[tuple[Any, Any]]:
        """One epoch of ``(images [B, 3, 224, 224] float32, labels)``."""
        for out in self.iterator:
            yield out[0]["data"], out[0]["label"]
        self.iterator.reset()

    def close(self) -> None:
        del self.iterator, self.pipe


__all__ = ["pipeline", "ByHand", "MEAN", "STD"]
