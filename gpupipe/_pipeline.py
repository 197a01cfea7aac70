"""Pipeline: a source and a list of transforms, checked as a whole before anything runs."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import ConfigError, PipelineError
from .sources import Source, WebDataset
from .transforms import ImageSpec, Transform

__all__ = ["Pipeline", "load_pipeline"]


class Pipeline:
    """A data source and the transforms applied to each decoded image.

    Args:
        source: a :class:`~gpupipe.WebDataset` or :class:`~gpupipe.ImageFolder`; a shard pattern or
            a list of shard paths is taken as ``WebDataset(source)``.
        transforms: transform definitions from :mod:`gpupipe.transforms`, applied in order to
            uint8 RGB ``[3, H, W]`` images.

    The pipeline is checked when constructed: every step must accept what the step before gives
    (``Normalize`` needs a float image, saturation needs 3 channels, …). :attr:`output_spec`
    then says the shape and dtype of each output image.

    Example:
        >>> import torch, gpupipe as gp
        >>> from gpupipe import transforms as T
        >>> pipe = gp.Pipeline("data/train-{000000..000007}.tar",  # doctest: +SKIP
        ...                    [T.Resize(256), T.CenterCrop(224), T.ToDtype(torch.float32, scale=True)])
        >>> str(pipe.output_spec)  # doctest: +SKIP
        '[3, 224, 224] float32'
    """

    def __init__(self, source: Source | str | Sequence[str], transforms: Sequence[Transform] = ()) -> None:
        if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            raise ConfigError(
                f"Pipeline: {os.fspath(source)!r} is a directory; use gp.ImageFolder(root) for an "
                "ImageFolder tree, or a shard pattern for WebDataset shards"
            )
        if isinstance(source, (str, os.PathLike, list, tuple)):
            source = WebDataset(source)
        if not isinstance(source, Source):
            raise ConfigError(
                f"Pipeline: source must be a gp.WebDataset, a gp.ImageFolder, a shard pattern or a "
                f"list of shard paths, got {type(source).__name__}"
            )
        if isinstance(transforms, Transform) or not isinstance(transforms, Sequence):
            raise ConfigError("Pipeline: transforms must be a list of transforms")
        for i, t in enumerate(transforms):
            if not isinstance(t, Transform):
                hint = (
                    " (torchvision transforms are not accepted: use gpupipe.transforms)"
                    if type(t).__module__.startswith("torchvision")
                    else ""
                )
                raise ConfigError(f"Pipeline: step {i} is a {type(t).__name__}, not a gpupipe transform{hint}")
        self.source = source
        self.transforms: tuple[Transform, ...] = tuple(transforms)
        self.specs: tuple[ImageSpec, ...] = self._check()

    def _check(self) -> tuple[ImageSpec, ...]:
        specs = [ImageSpec()]
        for i, t in enumerate(self.transforms):
            try:
                specs.append(t.output_spec(specs[-1]))
            except PipelineError as e:
                raise PipelineError(f"step {i}: {e} (input {specs[-1]})") from None
        return tuple(specs)

    @property
    def output_spec(self) -> ImageSpec:
        """Shape and dtype of one output image (``height``/``width`` are None where they vary)."""
        return self.specs[-1]

    def __repr__(self) -> str:
        steps = ",\n  ".join(repr(t) for t in self.transforms)
        return f"Pipeline({self.source!r}, [\n  {steps}]) -> {self.output_spec}"


def load_pipeline(spec: str) -> Callable[..., Any]:
    """Loads a pipeline factory by ``"path/to/file.py:function"`` (or ``"package.module:function"``).

    Example: ``load_pipeline("pipelines/imagenet.py:train")(source)`` returns a Pipeline.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"pipeline spec must be 'file.py:function' or 'module:function', got {spec!r}")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ConfigError(f"pipeline file {target!r} does not exist")
        name = "gpupipe_user_" + os.path.splitext(os.path.basename(target))[0]
        mod_spec = importlib.util.spec_from_file_location(name, target)
        if mod_spec is None or mod_spec.loader is None:
            raise ConfigError(f"pipeline file {target!r} cannot be imported")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{target!r} has no function {attr!r}")
    return fn
