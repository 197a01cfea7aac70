"""Reusable checkers for transforms and backends."""

from __future__ import annotations

import random
from typing import Any

import torch

from gpupipe import transforms as T
from gpupipe.backends._torch import LOWERINGS


def spec_of(image: torch.Tensor) -> T.ImageSpec:
    return T.ImageSpec(image.shape[-3], image.shape[-2], image.shape[-1], image.dtype)


def run_torch(t: T.Transform, image: torch.Tensor, params: Any) -> torch.Tensor:
    return LOWERINGS.lookup(t)(t, image, params)


def check_transform(t: T.Transform, image: torch.Tensor, reference, *, seeds=range(5), atol: float = 0.0):
    """Checks a transform on the torch backend, for several random parameter draws:

    - the output's shape and dtype are what ``t.output_spec`` promised at build time;
    - the output equals ``reference(image, params)`` — torchvision's transform applied with the
      same parameters (exactly, unless ``atol``).

    Returns the list of (params, output).
    """
    spec = t.output_spec(spec_of(image))
    results = []
    for seed in seeds:
        params = t.make_params(image.shape[-2], image.shape[-1], random.Random(seed)) if t.random else None
        out = run_torch(t, image, params)
        assert out.dtype == spec.dtype, (t, out.dtype, spec)
        assert out.shape[-3] == spec.channels, (t, out.shape, spec)
        if spec.fixed_size:
            assert tuple(out.shape[-2:]) == (spec.height, spec.width), (t, out.shape, spec)
        expected = reference(image, params)
        assert expected.dtype == out.dtype
        torch.testing.assert_close(out, expected, atol=atol, rtol=0)
        results.append((params, out))
    return results


def check_invalid(factory, match: str, exc=ValueError):
    """The factory must raise ``exc`` whose message names ``match`` (an argument name)."""
    import pytest

    import gpupipe as gp

    with pytest.raises(exc, match=match) as info:
        factory()
    assert isinstance(info.value, gp.GpupipeError)
