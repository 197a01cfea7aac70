"""The DALI backend's augmentation policies (TrivialAugmentWide, RandAugment, AutoAugment): one
graph whatever the operations and bins, each sample its own operation.

The host draws every sample's operations and magnitudes (``gpupipe.transforms._policies``, the
draws of every backend) and turns them into per-sample arguments. Each slot (one operation per
sample) runs each operation family in a conditional branch of the samples that drew it (DALI's
``_conditional.split``/``merge``, the operators behind its ``if``; the family's fed arguments are
split alike, ``Ctx.branch``), the other samples passing by untouched:

- geometry (ShearX/Y, TranslateX/Y, Rotate): ``warp_affine`` with the sample's inverse matrix
  (``gpupipe.core._geometry.affine_matrices``; shears about the top-left corner, as torchvision's
  policies), conjugated by the sample's flip where the compiler moved a flip before the policy
  into the fused tail (``Ctx.mirrored``: every other family commutes with a flip);
- Brightness, Color, Contrast, one branch: torchvision's blend ``x·f + other·(1 − f)`` with
  ``other`` 0, the pixel's luma or the image's mean luma (``_blend``);
- Sharpness: torchvision's interior blend with the rounded 3x3 smoothing;
- Posterize, Solarize, Invert: ``v & mask`` then ``v ≥ k → 255 − v`` (Invert is ``k = 0``);
- AutoContrast; Equalize (DALI's, OpenCV's table).

The graph has a fixed size: families × slots, not operations × bins. Each operator is a pass
over the image on the CPU and a launch on the GPU, so the families take the uint8 image as it is
where DALI's arithmetic promotes it exactly (no cast), and read the branch's sizes from the host:
the V2 train graph went from 124 operators to 87 (``bench/results/2026-11-26-v2-graph-cpu.md``),
and to 86 once its flip moved into the fused tail (87 on the CPU; fewer on the GPU, below).

On the GPU two families run on every sample instead, with no branch: geometry where its warp is
DALI's alone (one ``warp_affine`` in uint8, the identity map where the sample drew another
operation: no fill, or nearest neighbour with one value) and posterize, solarize, invert (four
uint8 operators; mask 255, from 256 elsewhere). The values are the same
(tested on the CPU), and each branch's ``split``, ``merge`` and argument splits are gone. There a
DALI operator costs about 0.2 ms per batch of 256 whatever its data, and a uint8 pass over the
whole batch about 40 µs more (``bench/results/2026-11-27-h100-gpu-run.md``). The blends and
sharpness have identities too (``f = 1``, ``alpha = 0``), but they work in float32: each of their
seven to nine passes would move four times the bytes over every sample, more than their branch's
operators cost, so they keep their branches; so does geometry with a fill of torchvision's kind
(``_warp.warp``: a mask channel and a float32 blend). So do AutoContrast and Equalize, which have
no identity. On the CPU the pass is what costs: every family on every sample was 2.9x slower there
(``bench/results/2026-11-25-v2-recipe-cpu.md``), so the CPU keeps every branch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import transforms as T
from ...core._geometry import affine_matrices, mirrored_matrices
from ...transforms._policies import _CODE, COLOR, GEOMETRY
from ._color import autocontrasted, luma, sharpened
from ._context import LOWERINGS, Ctx
from ._host import HostValue
from ._lowerings import _host_size
from ._warp import is_plain, warp

__all__: list[str] = []


def _matrices(h: Any, w: Any, codes: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """``[B, 6]`` inverse maps of each sample's geometric operation (the identity for the others),
    with torchvision's arguments: shears ``atan(m)`` in degrees about ``(0, 0)``, translations
    truncated to whole pixels, rotations counter-clockwise about the centre."""

    def on(name: str, value: np.ndarray) -> np.ndarray:
        return np.where(codes == _CODE[name], value, 0.0)

    shear = np.degrees(np.arctan(mags))
    batch = len(codes)
    hh = np.broadcast_to(np.asarray(h, dtype=np.float64), (batch,))
    ww = np.broadcast_to(np.asarray(w, dtype=np.float64), (batch,))
    sheared = (codes == _CODE["ShearX"]) | (codes == _CODE["ShearY"])
    center = (np.where(sheared, 0.0, ww / 2), np.where(sheared, 0.0, hh / 2))
    # torchvision's policies translate by whole pixels, timm's (...Rel) by fractions
    translate = (on("TranslateX", np.trunc(mags)) + on("TranslateXRel", mags),
                 on("TranslateY", np.trunc(mags)) + on("TranslateYRel", mags))  # fmt: skip
    return affine_matrices(hh, ww, on("Rotate", -mags), translate, 1.0, (on("ShearX", shear), on("ShearY", shear)),
                           center=center)  # fmt: skip


def _blends(channels: int) -> frozenset[int]:
    """The codes of the blend family: Brightness, Color, Contrast; torchvision keeps a 1-channel
    image as it is under Color (saturation), so there Color is not blended (``f = 1``)."""
    return COLOR if channels == 3 else COLOR - {_CODE["Color"]}


def _factor(codes: np.ndarray, mags: np.ndarray, kinds: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(f, 1 - f)`` of torchvision's blends, ``f = 1 + m`` where the code is of
    ``kinds``, 1 elsewhere (``1 - f`` as torch computes it: in float64, then float32)."""
    on = np.isin(codes, list(kinds))
    ratio = np.where(on, 1.0 + mags, 1.0)
    return ratio.astype(np.float32), (1.0 - ratio).astype(np.float32)


# The devices on which the uint8 families with an identity run on every sample, without a branch
# (module docstring); the tests add "cpu" to check their values there.
EVERY_SAMPLE_ON = frozenset({"gpu"})


def _slot(t: Any, img: Any, ctx: Ctx, drawn: HostValue, slot: int, height: Any, width: Any) -> Any:
    """One operation per sample: each family of the policy's space in a branch of its own samples
    (DALI's ``split``/``merge``), the others passed through; on the GPU, geometry and the tone
    family on every sample instead (module docstring)."""
    fn = ctx.fn

    def codes_of(cm: Any) -> np.ndarray:
        return cm[0][:, slot]

    tone = frozenset({_CODE["Posterize"], _CODE["Solarize"], _CODE["Invert"], _CODE["SolarizeAdd"]})
    nearest = t.interpolation == T.InterpolationMode.NEAREST
    families = [  # (its operations, its lowering, whether it runs on every sample where it may)
        (GEOMETRY, _geometry, is_plain(t.fill, nearest=nearest)),  # uint8 throughout only
        (_blends(ctx.channels), _blend, False),  # float32: dearer on every sample than its branch (module docstring)
        (frozenset({_CODE["Sharpness"]}), _sharpness, False),
        (tone, _tone, True),
        (frozenset({_CODE["AutoContrast"]}), _autocontrast, False),
        (frozenset({_CODE["Equalize"]}), _equalize, False),
    ]
    # the branch's sizes from the host (a policy keeps the size), as per-sample values even where
    # the pipeline fixes them, so that what is made from them is of the branch's samples
    sizes = (HostValue(_per_sample, height, drawn), HostValue(_per_sample, width, drawn))
    for members, lower, every in families:
        if not members & t.ops:
            continue

        def arg(value_of: Any, dtype: Any) -> Any:
            """A per-sample argument of the samples being lowered (fed for the batch, then split
            inside a branch)."""
            return ctx.arg(HostValue(lambda cm: value_of(cm[0][:, slot], cm[1][:, slot]), drawn), dtype)

        def matrices() -> tuple[HostValue, tuple[Any, Any]]:  # the host's maps, and the size they are of
            value = HostValue(lambda h, w, cm: _matrices(h, w, cm[0][:, slot], cm[1][:, slot]), height, width, drawn)
            if ctx.mirrored is not None:  # the image is not flipped yet: the flip's conjugate (Ctx.mirrored)
                flips = ctx.host_random(ctx.mirrored)
                value = HostValue(lambda m, w, f: mirrored_matrices(m, w, f[:, 0] != 0), value, width, flips)
            return value, (height, width)

        if every and ctx.device in EVERY_SAMPLE_ON:
            with ctx.branched(None, size=sizes):
                img = lower(t, img, ctx, arg, matrices)
            continue
        member = list(members)
        predicate = ctx.arg(HostValue(lambda cm, m=member: np.isin(codes_of(cm), m), drawn), np.bool_)
        inside, outside = fn._conditional.split(img, predicate=predicate)
        with ctx.branched(predicate, size=sizes):
            out = lower(t, inside, ctx, arg, matrices)
        img = fn._conditional.merge(out, outside, predicate=predicate)
    return img


def _per_sample(value: Any, drawn: tuple[np.ndarray, ...]) -> np.ndarray:
    """``value`` (an int, or one per sample) for each sample of the batch ``drawn`` is of."""
    return np.broadcast_to(np.asarray(value), (len(drawn[0]),))


def _geometry(t: Any, img: Any, ctx: Ctx, arg: Any, matrices: Any) -> Any:
    """ShearX/Y, TranslateX/Y(Rel), Rotate: ``warp_affine`` by each sample's inverse map, with
    torchvision's fill (a fill per channel too: ``_warp.warp``)."""
    maps, size = matrices()
    return warp(ctx, img, maps, t.fill, nearest=t.interpolation == T.InterpolationMode.NEAREST, size=size)


def _blend(t: Any, img: Any, ctx: Ctx, arg: Any, matrices: Any) -> Any:
    """Brightness, Color, Contrast in one branch: torchvision's ``_blend`` of the uint8 image ``x``
    (as float32) with ``other`` by the sample's ``f``, ``x·f + other·(1 − f)``, ``other`` being 0,
    the pixel's luma or the image's mean luma; truncated to uint8 (the floor, then DALI's
    saturating cast: torchvision's clamp and ``.to(uint8)``). ``other·(1 − f)`` is ``luma·a +
    mean·b``, the host giving ``a`` (Color) and ``b`` (Contrast) as ``1 − f`` or 0: a term of 0
    adds exactly nothing, so each sample gets torchvision's float32 arithmetic. The uint8 image
    goes in as it is: DALI's arithmetic promotes it to float32, exactly as a cast would."""
    import nvidia.dali.math as dmath

    fn = ctx.fn
    color = _CODE["Color"] in t.ops and ctx.channels == 3
    kinds = _blends(ctx.channels)
    out = img * arg(lambda c, m: _factor(c, m, kinds)[0], np.float32)
    contrast = _CODE["Contrast"] in t.ops
    if color or contrast:

        def weight(name: str) -> Any:  # 1 - f where the code is ``name``, else 0
            return arg(lambda c, m: np.where(c == _CODE[name], _factor(c, m, kinds)[1], np.float32(0)), np.float32)

        gray = luma(ctx, img)
        terms = [gray * weight("Color")] if color else []
        if contrast:
            terms.append(fn.reductions.mean(gray) * weight("Contrast"))
        out = out + (terms[0] if len(terms) == 1 else terms[0] + terms[1])
    return fn.cast(dmath.floor(out), dtype=ctx.types.UINT8, device=ctx.device)


def _sharpness(t: Any, img: Any, ctx: Ctx, arg: Any, matrices: Any) -> Any:
    return sharpened(ctx, img, arg(lambda c, m: _factor(c, m, frozenset({_CODE["Sharpness"]}))[1], np.float32))


def _tone(t: Any, img: Any, ctx: Ctx, arg: Any, matrices: Any) -> Any:
    """Posterize, Solarize, Invert: ``v & mask``, then ``v ≥ start → 255 − v`` (as ``v ^ 255``);
    timm's SolarizeAdd: ``min(255, v + add)`` below 128 (where its policy has it)."""
    import nvidia.dali.math as dmath

    fn, types = ctx.fn, ctx.types
    x = img & arg(_posterize_mask, np.uint8)  # uint8 throughout: no cast back
    x = x ^ ((x >= arg(_solarize_from, np.int32)) * types.Constant(255, dtype=types.UINT8))
    if _CODE["SolarizeAdd"] in t.ops:
        add = arg(lambda c, m: np.where(c == _CODE["SolarizeAdd"], m, 0).astype(np.int32), np.int32)
        x = fn.cast(dmath.min(x + (x < 128) * add, 255), dtype=types.UINT8, device=ctx.device)
    return x


def _autocontrast(t: Any, img: Any, ctx: Ctx, arg: Any, matrices: Any) -> Any:
    return autocontrasted(ctx, img)


def _equalize(t: Any, img: Any, ctx: Ctx, arg: Any, matrices: Any) -> Any:
    return ctx.fn.equalize(img, device=ctx.device)


def _posterize_mask(codes: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """torchvision's posterize mask of ``int(m)`` bits; 255 (the identity) for other operations."""
    bits = np.where(codes == _CODE["Posterize"], np.trunc(mags), 8).astype(np.int64)
    return (((1 << bits) - 1) << (8 - bits)).astype(np.uint8)


def _solarize_from(codes: np.ndarray, mags: np.ndarray) -> np.ndarray:
    """The smallest value solarize inverts: torch compares a uint8 image with the float32
    threshold ``255 · m``, so ``v >= ceil(float32(255 · m))``; 0 for Invert, 256 (none) for other
    operations."""
    threshold = np.ceil((255.0 * mags).astype(np.float32)).astype(np.int32)
    return np.where(codes == _CODE["Solarize"], threshold, np.where(codes == _CODE["Invert"], 0, 256)).astype(np.int32)


@LOWERINGS.register(T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, T.TimmRandAugment)
def _policy(t: Any, img: Any, ctx: Ctx) -> Any:
    """Each slot in order (:func:`_slot`), from the host's draws."""
    if t.slots == 0:
        return img
    height, width = _host_size(ctx, img, type(t).__name__)
    drawn = HostValue(lambda h, w, f: t.magnitudes(h, w, f), height, width, ctx.host_random())
    for slot in range(t.slots):
        img = _slot(t, img, ctx, drawn, slot, height, width)
    return img


@LOWERINGS.register(T.AugMix)
def _augmix(t: T.AugMix, img: Any, ctx: Ctx) -> Any:
    """Each chain's positions as slots (:func:`_slot`; ``-1`` past a chain's depth: no branch),
    then torchvision's mix: ``w0 · x + Σ wi · chain_i(x)`` in float32, in that order, truncated to
    uint8. The host draws each sample's chains and weights (:meth:`AugMix.drawn`)."""
    import nvidia.dali.math as dmath

    fn, types = ctx.fn, ctx.types
    height, width = _host_size(ctx, img, "AugMix")
    drawn = HostValue(lambda h, w, f: t.drawn(h, w, f), height, width, ctx.host_random())

    def weight(k: int) -> Any:
        return ctx.arg(HostValue(lambda d: d[2][:, k], drawn), np.float32)

    mix = img * weight(0)  # float32: DALI promotes the uint8 image exactly, no cast
    for i in range(t.mixture_width):
        aug = img
        for j in range(t.depth):
            aug = _slot(t, aug, ctx, drawn, i * t.depth + j, height, width)
        mix = mix + aug * weight(1 + i)
    return fn.cast(dmath.clamp(dmath.floor(mix), 0.0, 255.0), dtype=types.UINT8, device=ctx.device)
