"""RandomApply (a list of transforms applied together, with a probability) and RandomChoice (one
of several transforms per sample)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core._errors import ConfigError, PipelineError
from ..core._validate import valid_choice_weights
from ._base import Coin, ImageSpec, Transform

__all__ = ["RandomApply", "RandomApplyParams", "RandomChoice", "RandomChoiceParams"]


class RandomApplyParams(NamedTuple):
    """``params``: each inner transform's parameters (``None`` for a deterministic one), drawn
    whether or not the transforms are applied."""

    apply: bool
    params: tuple[Any, ...]


# Two image sizes the inner transforms must keep where the pipeline's size is not known at build
# time; no resize or crop maps both onto themselves (their shorter sides differ).
_PROBE_SIZES = ((97, 131), (389, 263))


@dataclasses.dataclass(frozen=True)
class RandomApply(Coin, Transform):
    """Applies ``transforms`` in order with probability ``p``; otherwise the image passes unchanged.

    Args:
        transforms: a non-empty sequence of gpupipe transforms (stored as a tuple) that keep the
            image's size and dtype, such as ``ColorJitter``, ``GaussianBlur``, ``RandomGrayscale``,
            ``RandomSolarize``: checked when the pipeline is built, so that the DALI backend can
            select per sample between the transformed image and the input. ``RandomApply`` itself
            qualifies, so it nests.
        p: probability of applying them. Default 0.5.

    Shapes and dtype unchanged. Randomness: one decision (``u < p``) and then each inner
    transform's own draws, so ``draws`` depends on the instance: ``1 + sum(t.draws for t in
    transforms)`` (an instance attribute; the class attribute is the minimum, 1). The inner
    transforms' parameters are drawn for every sample, applied or not. On DALI the inner
    transforms run on every sample and the decision selects the output (the cost of the inner
    transforms is paid for every sample, where the torch backend skips them).
    """

    keeps_size = True

    transforms: Sequence[Transform]  # stored as a tuple
    p: float = 0.5
    factor_slices: tuple[tuple[int, int], ...] = dataclasses.field(init=False, repr=False, compare=False)
    """``(start, stop)`` of each inner transform: its columns of :meth:`sample`'s output (empty
    for a deterministic one)."""

    random = True
    draws = 1  # the instance's count is set in __post_init__

    def __post_init__(self) -> None:
        _members(self)
        self._check_p()
        self._set("draws", 1 + sum(t.draws for t in self.transforms))

    def output_spec(self, spec: ImageSpec) -> ImageSpec:
        self._check_keeps(spec, probe=False)
        if not spec.fixed_size:  # the size is known per sample only: the transforms must keep any size
            for h, w in _PROBE_SIZES:
                self._check_keeps(dataclasses.replace(spec, height=h, width=w), probe=True)
        return spec

    def _check_keeps(self, spec: ImageSpec, *, probe: bool) -> None:
        current = spec
        for t in self.transforms:
            try:
                out = t.output_spec(current)
            except PipelineError:
                if not probe:
                    raise
                out = None  # refuses some sizes: depends on the size
            if out != current:
                raise self._fail(
                    f"needs transforms that keep the image's size and dtype (such as ColorJitter, GaussianBlur, "
                    f"RandomGrayscale, RandomSolarize), so that a backend can choose per sample between the "
                    f"transformed image and the input; {t!r} changes {_change(current, out)}"
                )
            current = out

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1 + F1 + F2 + ...]``: 1.0 where the transforms apply (``u < p``), then each inner
        transform's factors from its own slice of the uniforms (see :attr:`factor_slices`)."""
        return _member_factors(self, self._coin(u[..., :1]), u)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> RandomApplyParams:
        return RandomApplyParams(bool(factors[0]), _member_params(self, height, width, factors))


def _change(before: ImageSpec, after: ImageSpec | None) -> str:
    if after is None or (after.height, after.width) != (before.height, before.width):
        return "the size"
    return "the dtype" if after.dtype != before.dtype else "the number of channels"


class RandomChoiceParams(NamedTuple):
    """The ``chosen`` transform's index and every transform's parameters (``None`` for a
    deterministic one), drawn whichever is chosen."""

    chosen: int
    params: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class RandomChoice(Transform):
    """One of ``transforms`` per sample, ``transforms[i]`` with probability ``p[i]`` (``None``:
    uniform; normalized as torchvision does), as ``torchvision.transforms.v2.RandomChoice``: DeiT
    III's 3-Augment ``RandomChoice([RandomGrayscale(p=1), RandomSolarize(128, p=1),
    GaussianBlur(...)])``. Made by ``gpupipe.transforms.RandomChoice`` when its transforms are
    per-sample ones (with MixUp and CutMix it is the batch transform of that name).

    The transforms must keep the image's size and dtype (checked when the pipeline is built), as
    :class:`RandomApply`'s. Randomness: the choice, then each transform's own draws (drawn for every
    sample, chosen or not). On DALI each transform runs in a conditional branch of the samples
    that chose it (DALI's ``split``/``merge``): each sample pays for its own transform only.
    """

    transforms: Sequence[Transform]
    p: Sequence[float] | None = None
    factor_slices: tuple[tuple[int, int], ...] = dataclasses.field(init=False, repr=False, compare=False)

    random = True
    draws = 1  # the instance's count is set in __post_init__

    def __post_init__(self) -> None:
        _members(self)
        self._set("draws", 1 + sum(t.draws for t in self.transforms))
        if self.p is not None:
            self._set("p", valid_choice_weights("RandomChoice", self.p, len(self.transforms)))

    output_spec = RandomApply.output_spec
    _check_keeps = RandomApply._check_keeps

    def sample(self, u: np.ndarray) -> np.ndarray:
        """``[..., 1 + F1 + F2 + ...]``: the chosen index, then each transform's factors."""
        k = len(self.transforms)
        cumulative = np.cumsum(self.p if self.p is not None else np.full(k, 1 / k))
        index = np.minimum(np.searchsorted(cumulative, u[..., :1], side="right"), len(self.transforms) - 1)
        return _member_factors(self, index.astype(np.float64), u)

    def make_params(self, height: int, width: int, factors: np.ndarray) -> RandomChoiceParams:
        return RandomChoiceParams(int(factors[0]), _member_params(self, height, width, factors))


def _members(t: Any) -> None:
    """Checks and stores a composite transform's ``transforms`` (a tuple) and the columns of each
    in its factors (``factor_slices``; column 0 is the composite's own decision)."""
    name = type(t).__name__
    steps = t.transforms
    if isinstance(steps, (Transform, str)) or not isinstance(steps, Sequence) or not steps:
        raise ConfigError(f"{name}: transforms must be a non-empty sequence of gpupipe transforms, got {steps!r}")
    for i, inner in enumerate(steps):
        if not isinstance(inner, Transform):
            hint = " (use gpupipe.transforms)" if type(inner).__module__.startswith("torchvision") else ""
            raise ConfigError(f"{name}: transforms[{i}] is a {type(inner).__name__}, not a gpupipe transform{hint}")
    t._set("transforms", tuple(steps))
    bounds, start = [], 1
    for inner in t.transforms:  # each inner transform's columns of the factors
        width = inner.sample(np.full((1, inner.draws), 0.5)).shape[-1] if inner.draws else 0
        bounds.append((start, start + width))
        start += width
    t._set("factor_slices", tuple(bounds))


def _member_factors(t: Any, decision: np.ndarray, u: np.ndarray) -> np.ndarray:
    """A composite's factors: its ``decision`` ``[..., 1]``, then each inner transform's factors
    from its own slice of the uniforms ``u`` (after the decision's)."""
    parts, start = [decision], 1
    for inner in t.transforms:
        if inner.draws:
            parts.append(np.asarray(inner.sample(u[..., start : start + inner.draws]), dtype=np.float64))
            start += inner.draws
    return np.concatenate(parts, axis=-1)


def _member_params(t: Any, height: int, width: int, factors: np.ndarray) -> tuple[Any, ...]:
    """Each inner transform's parameters from its columns of the factors (``None``: deterministic)."""
    return tuple(
        inner.make_params(height, width, factors[a:b]) if inner.draws else None
        for inner, (a, b) in zip(t.transforms, t.factor_slices, strict=True)
    )
