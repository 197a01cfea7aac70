"""Reusable checkers for transforms and backends, and the small pipelines the tests share."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.backends._torch._kernels import LOWERINGS


def val(source, size=16):
    """A small evaluation pipeline: deterministic, fixed output ``[3, size, size]`` float32."""
    return gp.Pipeline(source, [T.Resize(24), T.CenterCrop(size), T.ToDtype(torch.float32, scale=True)])


def yielded(loader):
    """One epoch as ``[(keys, valid), ...]``."""
    return [(b.keys, b.valid.tolist()) for b in loader]


def all_keys(index):
    return [index.key(i) for i in range(len(index))]


@dataclasses.dataclass(frozen=True)
class AddMult(T.Arithmetic):
    """The custom transform of the tests: written once, run on every backend."""

    add: float = 0.0
    mult: float = 1.0

    def apply(self, x):
        return (x + self.add) * self.mult


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


# ------------------------------------------------------------------- backend parity --


def run_dali(transforms, encoded: list[bytes], *, device: str = "cpu", seed: int = 0, graph=None) -> list[torch.Tensor]:
    """Runs gpupipe's DALI lowering of ``transforms`` on encoded images (one batch); returns the
    outputs as CHW tensors on the CPU. ``graph(encoded_node, ctx)`` replaces the lowering."""
    import numpy as np
    from nvidia.dali import Pipeline, fn

    from gpupipe.backends._dali._compiler import Ctx, lower

    gpu = device == "gpu"
    pipe = Pipeline(batch_size=len(encoded), num_threads=1, device_id=0 if gpu else None, seed=seed,
                    exec_dynamic=True)
    with pipe:
        data = fn.external_source(source=lambda: [np.frombuffer(e, dtype=np.uint8) for e in encoded], batch=True)
        ctx = Ctx(device, seed)
        pipe.set_outputs(graph(data, ctx) if graph else lower(transforms, data, ctx))
    pipe.build()
    (out,) = pipe.run()
    if gpu:
        out = out.as_cpu()
    return [torch.from_numpy(np.array(out[i])) for i in range(len(encoded))]


def reference_outputs(transforms, encoded: list[bytes]) -> list[torch.Tensor]:
    """The torch backend's (torchvision's) outputs; for deterministic transforms only."""
    from gpupipe._decode import decode_rgb
    from gpupipe.backends._torch._kernels import apply_pipeline

    return [apply_pipeline(transforms, decode_rgb(e, shard="-", key=str(i)), random.Random(0))
            for i, e in enumerate(encoded)]


def check_backend_parity(transforms, encoded: list[bytes], *, device: str = "cpu", unit: float | None = None,
                         mean_tol: float = 1.0, max_tol: float = 2.5) -> tuple[float, float]:
    """DALI vs torchvision on the same images and (deterministic) transforms.

    Output shapes must be identical; the mean absolute difference per image, in 0–255 units
    (``unit`` converts the output's scale; default 1 for integer outputs, 255 for float ones), must be ``<= mean_tol`` on average and ``<= max_tol``
    for the worst image. Returns (average, worst)."""
    ref = reference_outputs(transforms, encoded)
    got = run_dali(transforms, encoded, device=device)
    errors = []
    if unit is None:
        unit = 255.0 if ref[0].dtype.is_floating_point else 1.0
    for r, g in zip(ref, got):
        assert tuple(g.shape) == tuple(r.shape), (transforms, g.shape, r.shape)
        assert g.dtype == r.dtype, (g.dtype, r.dtype)
        errors.append(float((g.double() - r.double()).abs().mean()) * unit)
    avg, worst = sum(errors) / len(errors), max(errors)
    assert avg <= mean_tol and worst <= max_tol, (transforms, avg, worst, errors)
    return avg, worst


def check_epoch_partition(per_rank, all_keys, *, world_size: int, batch_size: int, drop_last: bool) -> dict:
    """The distributed epoch contract, checked on what every rank yielded in one epoch.

    ``per_rank[r]`` is rank r's list of batches, each ``(keys, valid)``. Checks: all ranks yield
    the same number of batches, of the same sizes step by step; no valid sample twice;
    ``drop_last=False``: the valid samples are ``all_keys`` exactly once, padding (at most one
    sample per rank) only at the end; ``drop_last=True``: no padding, full batches, fewer than
    ``world_size * batch_size`` samples skipped. Returns counts for further checks."""
    assert len(per_rank) == world_size
    lengths = [len(batches) for batches in per_rank]
    assert len(set(lengths)) == 1, f"ranks yield different numbers of batches: {lengths}"
    for step, batches in enumerate(zip(*per_rank)):
        sizes = [len(keys) for keys, _ in batches]
        assert len(set(sizes)) == 1, f"step {step}: batch sizes differ between ranks: {sizes}"
        assert all(len(keys) == len(valid) for keys, valid in batches)
        assert 0 < sizes[0] <= batch_size
    valid_keys = [k for batches in per_rank for keys, valid in batches for k, v in zip(keys, valid) if v]
    assert len(valid_keys) == len(set(valid_keys)), "a sample is valid twice"
    assert set(valid_keys) <= set(all_keys)
    padding = [sum(not v for _, valid in batches for v in valid) for batches in per_rank]
    if drop_last:
        assert sum(padding) == 0
        assert all(len(keys) == batch_size for batches in per_rank for keys, _ in batches)
        assert 0 <= len(all_keys) - len(valid_keys) < world_size * batch_size
    else:
        assert sorted(valid_keys) == sorted(all_keys), "drop_last=False must yield every sample exactly once"
        assert all(p <= 1 for p in padding), padding
        for batches in per_rank:  # padding only at the very end of a rank's epoch
            flags = [v for _, valid in batches for v in valid]
            assert flags == sorted(flags, reverse=True)
    return {"batches": lengths[0], "valid": len(valid_keys), "padding": sum(padding)}
