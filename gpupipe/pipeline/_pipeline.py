"""Pipeline: a source and a list of transforms, checked as a whole before anything runs."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..core._errors import ConfigError, PipelineError
from ..core._targets import TARGETS, Boxes
from ..core._tracebacks import raised
from ..sources import Source, WebDataset
from ..sources._listing import directory_hint
from ..transforms import BatchTransform, ImageSpec, Transform
from ..transforms._masks import boxes_refusal, mask_refusal

__all__ = ["Pipeline", "load_pipeline", "require_runnable"]


class Pipeline:
    """A data source and the transforms applied to each decoded image: one transform list, or
    several views of the same image.

    Args:
        source: a :class:`~gpupipe.WebDataset` or :class:`~gpupipe.ImageFolder`; a shard pattern or
            a list of shard paths is taken as ``WebDataset(source)``.
        transforms: transform definitions from :mod:`gpupipe.transforms`, applied in order to
            uint8 RGB ``[3, H, W]`` images. The loader yields ``images, labels``.
        views: keyword-only, instead of ``transforms``: several transform lists, each applied to
            the same decoded image (multi-crop recipes: DINO's 2 global + N local crops, SimCLR's
            two views). Each view has its own random draws, keyed by ``(seed, epoch, sample,
            view, step)``, even where two views' lists are the same; view 0 draws as a pipeline
            of its list alone. The loader then yields ``views, labels``, ``views`` a tuple of
            ``[B, C, H, W]`` tensors, one per view (their sizes may differ). Default: ``None``.
        per_source: keyword-only, instead of ``transforms``: one transform list per source of a
            :class:`~gpupipe.Mix` (``source``), applied to that source's samples (stronger
            augmentation for web data than for a curated set, another resize for another
            resolution). Every list must end in the same shape and dtype: the loader yields one
            ``images, labels`` batch, ``[B, C, H, W]``, its rows from the sources' lists. Draws are
            keyed by ``(seed, epoch, sample, source, step)``. Default: ``None``.
        batch_transform: keyword-only: a batch transform applied to each whole batch after
            batching, on the loader's device: :class:`~gpupipe.transforms.MixUp`,
            :class:`~gpupipe.transforms.CutMix`, or a
            :class:`~gpupipe.transforms.RandomChoice` of them. The loader's labels are then
            float32 soft targets ``[B, num_classes]``. Its draws are keyed by ``(seed, epoch,
            rank, batch)``. Not with ``views``. Default: ``None``.

    The pipeline is checked when constructed: every step must accept what the step before gives
    (``Normalize`` needs a float image, saturation needs 3 channels, …). :attr:`output_specs`
    then says the shape and dtype of each view's output image (:attr:`output_spec`: the one
    output of a single transform list).

    Backends: the DALI backend decodes each image once and branches into the views (with several
    views, a leading ``RandomResizedCrop`` is not fused into a region-of-interest decode); the
    torch backend decodes once per sample and applies each view's list in turn. With
    ``per_source``, the torch backend applies each sample's own source's list only; the DALI
    backend runs every source's list on every sample of the batch (as branches of one graph) and
    selects each sample's row: a cost of one branch per source.

    Example:
        >>> import torch, gpupipe as gp
        >>> from gpupipe import transforms as T
        >>> pipe = gp.Pipeline("data/train-{000000..000007}.tar",  # doctest: +SKIP
        ...                    [T.Resize(256), T.CenterCrop(224), T.ToDtype(torch.float32, scale=True)])
        >>> str(pipe.output_spec)  # doctest: +SKIP
        '[3, 224, 224] float32'
        >>> two = gp.Pipeline("data/train-{000000..000007}.tar", views=[  # doctest: +SKIP
        ...     [T.RandomResizedCrop(224), T.ToDtype(torch.float32, scale=True)],
        ...     [T.RandomResizedCrop(96, scale=(0.05, 0.4)), T.ToDtype(torch.float32, scale=True)]])
        >>> [str(s) for s in two.output_specs]  # doctest: +SKIP
        ['[3, 224, 224] float32', '[3, 96, 96] float32']
    """

    def __init__(
        self,
        source: Source | str | Sequence[str],
        transforms: Sequence[Transform] = (),
        *,
        views: Sequence[Sequence[Transform]] | None = None,
        per_source: Sequence[Sequence[Transform]] | None = None,
        batch_transform: BatchTransform | None = None,
    ) -> None:
        if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
            raise ConfigError(f"Pipeline: {os.fspath(source)!r} is a directory; {directory_hint(os.fspath(source))}")
        if isinstance(source, (str, os.PathLike, list, tuple)):
            source = WebDataset(source)
        if not isinstance(source, Source):
            raise ConfigError(
                f"Pipeline: source must be a gp.WebDataset, a gp.ImageFolder, a shard pattern or a "
                f"list of shard paths, got {type(source).__name__}"
            )
        self.source = source
        self.has_image = bool(getattr(source, "has_image", True))  # not: a source of fields alone
        if not self.has_image and (transforms or views is not None or per_source is not None or batch_transform):
            raise ConfigError("Pipeline: the source's samples have no image (fields= without an image field): "
                              "give no transforms, views, per_source or batch_transform")  # fmt: skip
        self.per_source = per_source is not None
        if per_source is not None:
            views = self._per_source(source, transforms, views, per_source)
        if views is None:
            self.views: tuple[tuple[Transform, ...], ...] = (_transform_list(transforms, "transforms"),)
        else:
            if transforms:
                raise ConfigError("Pipeline: give transforms or views=[...], not both")
            if isinstance(views, (Transform, str)) or not isinstance(views, Sequence) or not views:
                raise ConfigError("Pipeline: views must be a non-empty list of transform lists")
            self.views = tuple(_transform_list(v, f"views[{i}]") for i, v in enumerate(views))
        self.has_views = views is not None and not self.per_source
        what = "per_source" if self.per_source else "views"
        self.view_specs: tuple[tuple[ImageSpec, ...], ...] = tuple(
            self._specs(steps, f"{what}[{i}] " if views is not None else "") for i, steps in enumerate(self.views)
        )
        if self.per_source and len({str(specs[-1]) for specs in self.view_specs}) > 1:
            ends = ", ".join(f"per_source[{i}]: {specs[-1]}" for i, specs in enumerate(self.view_specs))
            raise PipelineError(f"Pipeline: every per_source list must end in the same shape and dtype ({ends})")
        self.batch_transform = _batch_transform(batch_transform, self)
        if self.targets:
            self._require_targets_follow()
        extra = getattr(self.source, "extra_fields", None)
        has_boxes = any(isinstance(f, Boxes) for f in (extra() if extra is not None else {}).values())
        for steps in self.views:
            refused = boxes_refusal(steps, has_boxes)
            if refused is not None:
                raise ConfigError(f"Pipeline: {refused}")

    def _require_targets_follow(self) -> None:
        """Masks and boxes (``gp.fields.Mask``, ``Boxes``) follow one image through its transforms
        (``transforms._masks``)."""
        names = ", ".join(map(repr, self.targets))
        if not self.has_image:
            raise ConfigError(f"Pipeline: mask and box fields ({names}) need the image they belong to: give one")
        if self.has_views or self.per_source:
            raise ConfigError(f"Pipeline: mask and box fields ({names}) follow one image: not with views=[...] or "
                              "per_source")  # fmt: skip
        if self.batch_transform is not None:
            raise ConfigError(f"Pipeline: batch_transform mixes images, not masks or boxes ({names}): leave it out")
        refused = mask_refusal(self.views[0])
        if refused is not None:
            raise ConfigError(f"Pipeline: the masks and boxes ({names}) cannot follow the image: {refused}")

    @staticmethod
    def _per_source(source: Source, transforms: Sequence[Transform], views: Any, per_source: Any) -> Any:
        from ..sources import Mix

        if transforms or views is not None:
            raise ConfigError("Pipeline: give one of transforms, views=[...] and per_source=[...]")
        if not isinstance(source, Mix):
            raise ConfigError(f"Pipeline: per_source needs a gp.Mix source, got {type(source).__name__}")
        if isinstance(per_source, (Transform, str)) or not isinstance(per_source, Sequence):
            raise ConfigError("Pipeline: per_source must be a list of transform lists, one per source")
        if len(per_source) != len(source.sources):
            raise ConfigError(f"Pipeline: per_source has {len(per_source)} lists for {len(source.sources)} sources")
        return per_source

    @staticmethod
    def _specs(transforms: tuple[Transform, ...], where: str) -> tuple[ImageSpec, ...]:
        specs = [ImageSpec()]
        for i, t in enumerate(transforms):
            try:
                specs.append(t.output_spec(specs[-1]))
            except PipelineError as e:
                raise PipelineError(f"{where}step {i}: {e} (input {specs[-1]})") from None
            if 0 in (specs[-1].height, specs[-1].width):  # (every sample would be refused as too small)
                raise PipelineError(f"{where}step {i}: {t} makes an empty image, {specs[-1]}, of its input "
                                    f"{specs[-2]}")  # fmt: skip
        return tuple(specs)

    @property
    def transforms(self) -> tuple[Transform, ...]:
        """The transform list of a single-output pipeline (a pipeline of views has one per view:
        :attr:`views`)."""
        return self.views[self._single("transform lists are pipeline.views")]

    @property
    def specs(self) -> tuple[ImageSpec, ...]:
        """The image spec before and after each step of :attr:`transforms`."""
        return self.view_specs[self._single("specs are pipeline.view_specs")]

    def _single(self, where: str) -> int:
        if self.has_views or self.per_source:
            raise PipelineError(f"this pipeline has {'per_source' if self.per_source else 'views'}=[...]: its {where}")
        return 0

    @property
    def random(self) -> bool:
        """Whether the pipeline draws anything: a random transform in a view, or a batch
        transform (every rank must then share the seed, :func:`gpupipe.runtime._dist.shared_seed`)."""
        return self.batch_transform is not None or any(t.random for view in self.views for t in view)

    @property
    def num_classes(self) -> int | None:
        """The classes a label must lie in, ``0 .. num_classes - 1``: its ``batch_transform``'s
        (one-hot rows that wide); ``None`` without one (any int64 label). A loader refuses a
        sample whose label is outside, as damage of kind ``bad-label``."""
        return None if self.batch_transform is None else self.batch_transform.num_classes

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the source's fields beyond the image and the label (``WebDataset(...,
        fields=)``), which each batch carries (``batch["text"]``); empty for most sources."""
        extra = getattr(self.source, "extra_fields", None)
        return tuple(extra()) if extra is not None else ()

    @property
    def targets(self) -> tuple[str, ...]:
        """The names of the source's fields that follow the image's geometric transforms: its
        :class:`gpupipe.fields.Mask` and :class:`gpupipe.fields.Boxes` fields."""
        extra = getattr(self.source, "extra_fields", None)
        return tuple(n for n, f in (extra() if extra is not None else {}).items() if isinstance(f, TARGETS))

    @property
    def output_specs(self) -> tuple[ImageSpec, ...]:
        """Shape and dtype of each view's output image (one for a single transform list, or
        ``per_source`` lists); ``height``/``width`` are None where they vary. None for a source
        without images."""
        if not self.has_image:
            return ()
        if self.per_source:
            return (self.view_specs[0][-1],)
        return tuple(specs[-1] for specs in self.view_specs)

    @property
    def output_spec(self) -> ImageSpec:
        """Shape and dtype of the one output image (``height``/``width`` are None where they vary)."""
        if self.per_source:
            return self.view_specs[0][-1]
        return self.view_specs[self._single("outputs are pipeline.output_specs")][-1]

    def __repr__(self) -> str:
        if not self.has_views and not self.per_source:
            steps = ",\n  ".join(repr(t) for t in self.transforms)
            return f"Pipeline({self.source!r}, [\n  {steps}]) -> {self.output_spec}"
        lists = ",\n  ".join("[" + ", ".join(repr(t) for t in v) + "]" for v in self.views)
        outputs = ", ".join(str(s) for s in self.output_specs)
        what = "per_source" if self.per_source else "views"
        return f"Pipeline({self.source!r}, {what}=[\n  {lists}]) -> ({outputs})"


def _batch_transform(t: Any, pipeline: Pipeline) -> BatchTransform | None:
    if t is None:
        return None
    if not isinstance(t, BatchTransform):
        raise ConfigError("Pipeline: batch_transform must be a gpupipe.transforms.MixUp, CutMix or RandomChoice of "
                          f"them, got {type(t).__name__}")  # fmt: skip
    if pipeline.has_views:
        raise ConfigError("Pipeline: batch_transform mixes one image per sample: not with views=[...]")
    try:
        t.output_spec(pipeline.output_spec)
    except ConfigError as e:
        raise PipelineError(f"Pipeline: batch_transform: {e}") from None
    return t


def _transform_list(transforms: Any, name: str) -> tuple[Transform, ...]:
    if isinstance(transforms, Transform) or not isinstance(transforms, Sequence) or isinstance(transforms, str):
        raise ConfigError(f"Pipeline: {name} must be a list of transforms")
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            hint = (
                " (torchvision transforms are not accepted: use gpupipe.transforms)"
                if type(t).__module__.startswith("torchvision")
                else ""
            )
            raise ConfigError(f"Pipeline: {name} step {i} is a {type(t).__name__}, not a gpupipe transform{hint}")
    return tuple(transforms)


def load_pipeline(spec: str) -> Callable[..., Any]:
    """Loads a pipeline factory by ``"path/to/file.py:function"`` (or ``"package.module:function"``).

    Example: ``load_pipeline("pipelines/imagenet.py:train")(source)`` returns a Pipeline.

    Raises:
        ConfigError: a malformed spec, a missing file, a file or module that fails to import
            (the error and its line; the original chained), or no such function.
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
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"pipeline file {target!r} failed to import: {raised(e)}") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise ConfigError(f"pipeline module {target!r} failed to import: {raised(e)}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{target!r} has no function {attr!r}")
    return fn


def require_runnable(pipeline: Pipeline, backend: Any) -> None:
    """Raises unless every output of ``pipeline`` has a fixed size (batching needs one) and
    ``backend`` (a ``gpupipe.backends.Backend``) can run every step of every view: before anything
    is built or read."""
    for i, output in enumerate(pipeline.output_specs):
        if not output.fixed_size:
            which = f"view {i}'s output size" if pipeline.has_views else "the pipeline's output size"
            raise PipelineError(
                f"{which} varies ({output}); batching needs a fixed size: end it "
                "with CenterCrop, RandomCrop, RandomResizedCrop or Resize((h, w))"
            )
    backend.require_fields(pipeline.fields, images=pipeline.has_image, targets=pipeline.targets)
    for steps in pipeline.views:
        backend.require_supported(steps)
