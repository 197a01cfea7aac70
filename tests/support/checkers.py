"""Reusable checkers for transforms and backends, and the small pipelines the tests share."""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Posterize(T.ArrayFunction):
    """An ArrayFunction of the tests (uint8 in, uint8 out, same shape): keeps the top ``bits``."""

    bits: int = 4

    def apply(self, image, xp):
        return image & xp.uint8((0xFF << (8 - self.bits)) & 0xFF)


@dataclasses.dataclass(frozen=True)
class EveryOtherColumn(T.ArrayFunction):
    """An ArrayFunction that changes the shape, and declares it: every other column."""

    def apply(self, image, xp):
        return xp.ascontiguousarray(image[:, ::2])

    def output_spec(self, spec):
        return dataclasses.replace(spec, width=None if spec.width is None else (spec.width + 1) // 2)


def spec_of(image: torch.Tensor) -> T.ImageSpec:
    return T.ImageSpec(image.shape[-3], image.shape[-2], image.shape[-1], image.dtype)


def run_torch(t: T.Transform, image: torch.Tensor, params: Any) -> torch.Tensor:
    return LOWERINGS.lookup(t)(t, image, params)


def draw(t: T.Transform, seed: int, step: int = 0):
    """One sample's random factors for ``t`` (a row of ``t.sample``), as a backend draws them."""
    from gpupipe.core._random import uniforms

    return t.sample(uniforms(seed, 0, [0], step, t.draws))[0]


def drawn_params(t: T.Transform, height: int, width: int, n: int, *, seed: int = 0) -> list:
    """``t``'s parameters for ``n`` samples of a ``height x width`` image, drawn as every backend
    draws them (samples ``0..n-1``, epoch 0, step 0)."""
    from gpupipe.core._random import uniforms

    return [t.make_params(height, width, f) for f in t.sample(uniforms(seed, 0, range(n), 0, t.draws))]


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
        params = t.make_params(image.shape[-2], image.shape[-1], draw(t, seed)) if t.random else None
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


def check_torchvision_signature(ours: type, theirs: type) -> None:
    """``ours`` takes the arguments of torchvision's ``theirs``: the same names, kinds (positional or
    keyword-only) and defaults, in the same order."""
    import inspect

    def parameters(cls: type) -> list:
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]

    assert parameters(ours) == parameters(theirs)


def check_invalid(factory, match: str, exc=ValueError):
    """The factory must raise ``exc`` whose message names ``match`` (an argument name)."""
    import pytest

    import gpupipe as gp

    with pytest.raises(exc, match=match) as info:
        factory()
    assert isinstance(info.value, gp.GpupipeError)


# ------------------------------------------------------------------- backend parity --


def sample_factors(transforms, n: int, *, seed: int = 0, epoch: int = 0):
    """The random factors of samples ``0..n-1``, step by step (``[n, F]`` or None), as every
    backend draws them."""
    from gpupipe.core._random import factors

    return factors(list(transforms), seed, epoch, list(range(n)))


def run_dali(
    transforms,
    encoded: list[bytes],
    *,
    device: str = "cpu",
    seed: int = 0,
    graph=None,
    exif: bool = False,
    host_geometry: bool = True,
    decode: gp.DecodeMode = gp.DecodeMode.ROI,
) -> list[Any]:
    """Runs gpupipe's DALI lowering of ``transforms`` on encoded images (one batch, samples
    ``0..n-1`` of epoch 0 for the random factors); returns the outputs as CHW tensors on the CPU,
    and for a sample that fails one of the graph's checks the SampleError message the runner would
    raise. ``graph(encoded_node, ctx)`` replaces the lowering; ``host_geometry=False`` computes the
    geometry in the graph (as with EXIF orientation), ``decode`` a GPU graph's decode strategy."""
    import numpy as np
    from nvidia.dali import Pipeline, fn, types

    from gpupipe.backends._dali._compiler import Ctx, Lowered, lower
    from gpupipe.backends._dali._host import HostEnv, evaluate, failures
    from gpupipe.core._imageinfo import header_size

    gpu = device == "gpu"
    pipe = Pipeline(
        batch_size=len(encoded),
        num_threads=1,
        device_id=0 if gpu else None,
        seed=seed,
        exec_dynamic=True,
        prefetch_queue_depth=1,
    )
    with pipe:
        data = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        decoder_args = gp.DaliOptions().decoder_args(ranks_per_node=None) if gpu else {}  # as the runner does
        ctx = Ctx(device, seed, decoder_args=decoder_args, exif=exif, host_geometry=host_geometry, decode=decode)
        if graph:
            lowered = Lowered((graph(data, ctx),), feeds=ctx.feeds, draws=frozenset(ctx.draws))
        else:
            lowered = lower([transforms], data, ctx)
        pipe.set_outputs(*lowered.outputs())
    pipe.build()
    drawn = sample_factors(transforms, len(encoded), seed=seed)
    sizes = np.array([header_size(e) or (0, 0) for e in encoded], dtype=np.int64)
    env = HostEnv(sizes, lambda view, step: drawn[step])
    refused = failures(lowered.host_checks, env, len(encoded))  # as the runner's reader: before feeding
    inputs = evaluate(lowered.feeds, env, len(encoded))
    out, *checks = pipe.run(encoded=[np.frombuffer(e, dtype=np.uint8) for e in encoded], **inputs)
    if gpu:
        out = out.as_cpu()
    results: list[Any] = [torch.from_numpy(np.array(out[i])) for i in range(len(encoded))]
    for i, size, message in lowered.failures(np.asarray(checks[0].as_tensor())) if checks else []:
        results[i] = str(gp.SampleError.at(message, shard="-", key=str(i), size=size))
    for i, message in refused.items():
        results[i] = str(gp.SampleError.at(message, shard="-", key=str(i), size=(int(sizes[i, 0]), int(sizes[i, 1]))))
    return results


def reference_outputs(transforms, encoded: list[bytes], *, seed: int = 0, exif: bool = False) -> list[Any]:
    """The torch backend's (torchvision's) outputs, with the random factors ``run_dali`` feeds, and
    the SampleError message for a sample it refuses."""
    from gpupipe.backends._torch._kernels import apply_pipeline
    from gpupipe.runtime._decode import decode_rgb

    drawn = sample_factors(transforms, len(encoded), seed=seed)
    results: list[Any] = []
    for i, e in enumerate(encoded):
        image = decode_rgb(e, shard="-", key=str(i), apply_exif_orientation=exif)
        try:
            results.append(apply_pipeline(transforms, image, [None if f is None else f[i] for f in drawn]))
        except ValueError as error:
            size = (int(image.shape[-2]), int(image.shape[-1]))
            results.append(str(gp.SampleError.at(str(error), shard="-", key=str(i), size=size)))
    return results


def check_backend_parity(
    transforms,
    encoded: list[bytes],
    *,
    device: str = "cpu",
    unit: float | None = None,
    mean_tol: float = 1.0,
    max_tol: float = 2.5,
    exif: bool = False,
) -> tuple[float, float]:
    """DALI vs torchvision on the same images and transforms, with the same random factors.

    A sample one backend refuses (an image too small for a crop) must be refused by the other,
    with the same message. Other outputs must have identical shapes; the mean absolute difference
    per image, in 0–255 units (``unit`` converts the output's scale; default 1 for integer outputs,
    255 for float ones), must be ``<= mean_tol`` on average and ``<= max_tol`` for the worst
    image. ``exif``: both apply EXIF orientation. Returns (average, worst) over the images both
    produced."""
    ref = reference_outputs(transforms, encoded, exif=exif)
    got = run_dali(transforms, encoded, device=device, exif=exif)
    errors = []
    for r, g in zip(ref, got, strict=True):
        if isinstance(r, str) or isinstance(g, str):
            assert g == r, (
                transforms,
                g if isinstance(g, str) else "an image",
                r if isinstance(r, str) else "an image",
            )
            continue
        assert tuple(g.shape) == tuple(r.shape), (transforms, g.shape, r.shape)
        assert g.dtype == r.dtype, (g.dtype, r.dtype)
        scale = unit if unit is not None else 255.0 if r.dtype.is_floating_point else 1.0
        errors.append(float((g.double() - r.double()).abs().mean()) * scale)
    if not errors:
        return 0.0, 0.0
    avg, worst = sum(errors) / len(errors), max(errors)
    assert avg <= mean_tol and worst <= max_tol, (transforms, avg, worst, errors)
    return avg, worst


def check_target_parity(source, steps, *, batch_size: int = 4, backends=("torch", "dali"), **options) -> dict:
    """Every field of every batch (masks, boxes and their labels above all) the same on each of
    ``backends`` (on the CPU, same seed and epoch): the targets are moved by shared host code, so
    exactly. The images may differ by their kernels (``check_backend_parity``'s business). Returns
    each backend's batches."""
    out = {}
    for backend in backends:
        if backend == "dali":
            import pytest

            pytest.importorskip("nvidia.dali")
        with gp.Loader(gp.Pipeline(source, steps), batch_size, shuffle=True, seed=5, num_workers=0, backend=backend,
                       device="cpu", **options) as loader:  # fmt: skip
            assert loader.backend == backend
            loader.set_epoch(1)
            out[backend] = list(loader)
    first, *others = backends
    for other in others:
        for a, b in zip(out[first], out[other], strict=True):
            assert a.keys == b.keys and torch.equal(a.valid, b.valid) and a.images.shape == b.images.shape
            assert set(a.fields) == set(b.fields)
            for name in a.fields:
                _same(a[name], b[name], f"{other} {name!r} {a.keys}")
    return out


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, gp.fields.Padded):
        assert torch.equal(a.data, b.data) and torch.equal(a.lengths, b.lengths), what
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), what
    else:
        assert a == b, what


def check_exact_resume(make, *, epoch: int, at: int = 1):
    """Runs epoch ``epoch`` of the loader ``make()`` whole, saving its state after each batch; a
    fresh ``make()`` resumed from the state after batch ``at`` must then yield exactly the rest:
    the same keys, ``valid`` masks and images. Returns the saved states and the resumed loader
    (closed)."""

    def host(batch):
        return batch.keys, batch.valid.cpu().clone(), torch.cat([v.cpu().flatten(1) for v in batch.views], 1)

    with make() as loader:
        loader.set_epoch(epoch)
        states, whole = [], []
        for batch in loader:
            states.append(loader.state_dict())
            whole.append(host(batch))
    with make() as resumed:
        resumed.load_state_dict(states[at - 1])
        resumed.set_epoch(epoch)
        rest = [host(b) for b in resumed]
    assert len(rest) == len(whole) - at
    for (k1, v1, i1), (k2, v2, i2) in zip(rest, whole[at:], strict=True):
        assert k1 == k2 and torch.equal(v1, v2) and torch.equal(i1, i2)
    return states, resumed


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
    for step, batches in enumerate(zip(*per_rank, strict=True)):
        sizes = [len(keys) for keys, _ in batches]
        assert len(set(sizes)) == 1, f"step {step}: batch sizes differ between ranks: {sizes}"
        assert all(len(keys) == len(valid) for keys, valid in batches)
        assert 0 < sizes[0] <= batch_size
    valid_keys = [k for batches in per_rank for keys, valid in batches for k, v in zip(keys, valid, strict=True) if v]
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


# A file that crashes its decoder, on purpose: the decoder is replaced by one that kills its process
# (SIGSEGV) on a JPEG whose first segment is CRASH_MARK, in every process forked afterwards.
CRASH_MARK = b"\xff\xd8\xff\xfe\x00\x08CRASH!"  # a JPEG comment segment: every other decoder reads on


def crasher() -> bytes:
    """A JPEG that the decoder :func:`make_decoders_crash` installs kills its process on."""
    from gpupipe.testing import encode_jpeg, synthetic_image

    return CRASH_MARK + encode_jpeg(synthetic_image(5, size=(24, 32)))[2:]


def make_decoders_crash(monkeypatch, *modules) -> None:
    """In each of ``modules``, ``decode_rgb`` kills its process on :func:`crasher`'s file."""
    import os
    import signal

    for module in modules:
        real = module.decode_rgb

        def decode(data, _real=real, **kwargs):
            if bytes(data).startswith(CRASH_MARK):
                os.kill(os.getpid(), signal.SIGSEGV)
            return _real(data, **kwargs)

        monkeypatch.setattr(module, "decode_rgb", decode)
