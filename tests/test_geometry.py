"""Geometry defined once (gpupipe.core._geometry): torchvision's rules on ints, the same functions on
the DALI backend's host values (NumPy over a batch) and on DALI graph nodes giving the same
numbers, and one decision for an image too small for its crop on every backend."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torchvision.transforms.v2 import RandomCrop as TVRandomCrop
from torchvision.transforms.v2.functional import _geometry as tvg

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.core._geometry import (
    center_crop_anchor,
    centered_inverse_maps,
    crop_padding,
    crop_start,
    crop_too_large,
    resize_size,
    resized_crop_window,
    resized_crop_windows,
)
from gpupipe.testing import encode_jpeg, synthetic_image

from .support.checkers import check_backend_parity

SIDES = [1, 2, 3, 7, 64, 99, 100, 224, 255, 256, 257, 333, 375, 500, 641, 1024, 4097]
RESIZES = [((256,), None), ((224,), 300), ((32,), 33), ((1,), None), (None, 100), (None, 7), ((10, 20), None)]


class TestIntRules:
    """The int form against torchvision's own functions, on a grid of sizes."""

    @pytest.mark.parametrize("size, max_size", RESIZES)
    def test_resize_size(self, size, max_size):
        for h, w in itertools.product(SIDES, SIDES):
            tv = tvg._compute_resized_output_size((h, w), None if size is None else list(size), max_size)
            assert list(resize_size(h, w, size, max_size)) == tv, (h, w, size, max_size)

    def test_center_crop_anchor(self):
        for crop, size in itertools.product(SIDES, SIDES):
            if crop <= size:
                expected = tvg._center_crop_compute_crop_anchor(crop, crop, size, size)[0]
            else:  # torchvision pads (crop - size) // 2 before the image
                expected = -tvg._center_crop_compute_padding(crop, crop, size, size)[1]
            assert center_crop_anchor(crop, size) == expected, (crop, size)

    @pytest.mark.parametrize(
        "padding, pad_if_needed", [(None, False), (None, True), ((3, 1, 0, 5), False), ((3, 1, 0, 5), True)]
    )
    def test_crop_padding_and_too_small(self, padding, pad_if_needed):
        for crop, size in itertools.product([1, 7, 64, 100, 257], [1, 7, 64, 100, 257, 300]):
            tv = TVRandomCrop((crop, crop), padding=padding, pad_if_needed=pad_if_needed)
            left, top, right, bottom = padding or (0, 0, 0, 0)
            t_before, t_after, ph = crop_padding(size, top, bottom, crop, pad_if_needed)
            l_before, l_after, pw = crop_padding(size + 1, left, right, crop, pad_if_needed)
            try:
                params = tv.make_params([torch.empty(1, size, size + 1)])
            except ValueError:
                assert ph < crop or pw < crop
                continue
            assert ph >= crop and pw >= crop
            assert params["padding"] == [l_before, t_before, l_after, t_after]


def host_eval(fn_of_values, rows: np.ndarray) -> np.ndarray:
    """Evaluates ``fn_of_values(*column_values)`` on host values, one sample per row of ``rows``,
    as the DALI runner's reader does per batch; returns ``[len(rows), k]``."""
    from gpupipe.backends._dali._host import HostEnv, HostValue

    columns = [HostValue(lambda i=i: rows[:, i]) for i in range(rows.shape[1])]
    env = HostEnv(np.zeros((len(rows), 2), np.int64), lambda view, step: np.zeros((len(rows), 0)))
    outs = [np.broadcast_to(np.asarray(env.value(o)), (len(rows),)) for o in fn_of_values(*columns)]
    return np.stack(outs, axis=1)


class TestHostValues:
    """What only the host values have: no truth value, and the vectorized functions."""

    def test_a_host_value_has_no_truth_value(self):
        from gpupipe.backends._dali._host import HostValue

        with pytest.raises(TypeError, match="no truth value"):
            bool(HostValue(lambda: np.ones(2)) > 0)

    @pytest.mark.parametrize(
        "scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (2.0, 3.0)), ((0.5, 2.0), (0.1, 0.2))]
    )
    def test_resized_crop_windows_are_the_per_sample_windows(self, scale, ratio):
        """The vectorized window (the DALI runner's, per batch) is the torch backend's per-sample
        window for every size and draw, the fallback (no attempt fits) and 1-pixel images included."""
        rng = np.random.default_rng(5)
        t = T.RandomResizedCrop(8, scale=scale, ratio=ratio)
        sizes = np.array([*itertools.product([1, 2, 7, 300, 375, 500, 4097], repeat=2)] * 20)
        sizes = np.concatenate([sizes, rng.integers(1, 3000, size=(3000, 2))])
        factors = t.sample(rng.random((len(sizes), t.draws)))
        got = resized_crop_windows(sizes[:, 0], sizes[:, 1], factors)
        rows = zip(sizes.tolist(), factors, strict=True)
        expected = [resized_crop_window(h, w, list(f), t.ratio) for (h, w), f in rows]
        assert got.tolist() == [list(e) for e in expected]

    def test_crop_start(self):
        rng = np.random.default_rng(6)
        u, room = rng.random(5000), rng.integers(1, 5000, size=5000)
        assert crop_start(u, room).tolist() == [crop_start(float(a), int(r)) for a, r in zip(u, room, strict=True)]
        assert crop_start(0.999999999, 3) == 2 and crop_start(0.0, 1) == 0


def dali_eval(fn_of_nodes, rows: np.ndarray) -> np.ndarray:
    """Evaluates ``fn_of_nodes(*column_nodes)`` (tuple of int nodes) in a DALI graph, one sample per
    row of ``rows``; returns ``[len(rows), k]``."""
    from nvidia.dali import Pipeline, fn, types

    pipe = Pipeline(batch_size=len(rows), num_threads=1, device_id=None)
    with pipe:
        data = fn.external_source(
            source=lambda: [np.asarray(r, np.int32) for r in rows], batch=True, dtype=types.INT32, ndim=1
        )
        outs = fn_of_nodes(*(data[i] for i in range(rows.shape[1])))
        pipe.set_outputs(fn.stack(*(fn.cast(o, dtype=types.INT32) for o in outs)))
    pipe.build()
    (out,) = pipe.run()
    return np.asarray(out.as_tensor())


class TestOnBatches:
    """The same functions on the DALI backend's host values (NumPy over a batch: how the runner
    computes the graph's geometry from the images' headers) and on DALI graph nodes (where only
    the graph knows the size) give the ints' numbers."""

    @pytest.fixture(params=["host", "graph"])
    def on(self, request):
        """``(evaluate, ops)``: an evaluator of a function of per-sample columns, and its ops."""
        if request.param == "host":
            from gpupipe.backends._dali._host import HOST_OPS

            return host_eval, HOST_OPS
        pytest.importorskip("nvidia.dali")
        from gpupipe.backends._dali._compiler import DALI_OPS

        return dali_eval, DALI_OPS

    @pytest.mark.parametrize("size, max_size", RESIZES)
    def test_resize_size(self, on, size, max_size):
        evaluate, ops = on
        rows = np.array(list(itertools.product(SIDES, SIDES)))
        got = evaluate(lambda h, w: resize_size(h, w, size, max_size, ops), rows)
        assert got.tolist() == [list(resize_size(h, w, size, max_size)) for h, w in rows.tolist()]

    def test_center_crop_anchor(self, on):
        evaluate, ops = on
        rows = np.array([[s] for s in SIDES])
        for crop in SIDES:
            got = evaluate(lambda size, crop=crop: (center_crop_anchor(crop, size, ops),), rows)
            assert got[:, 0].tolist() == [center_crop_anchor(crop, s) for (s,) in rows.tolist()], crop

    @pytest.mark.parametrize("pad_if_needed", [False, True])
    def test_crop_padding(self, on, pad_if_needed):
        evaluate, ops = on
        rows = np.array([[s] for s in SIDES])
        for crop in (1, 100, 300):
            got = evaluate(lambda size, crop=crop: crop_padding(size, 3, 1, crop, pad_if_needed, ops), rows)
            assert got.tolist() == [list(crop_padding(s, 3, 1, crop, pad_if_needed)) for (s,) in rows.tolist()]


# ------------------------------------------------------------------ too-small images --


@pytest.fixture(scope="module")
def mixed_sizes() -> list[bytes]:
    """120x160 (too small for a 200 crop), 200x200 (exactly the crop) and 120x400 (too short)."""
    return [encode_jpeg(synthetic_image(i, size=s)) for i, s in enumerate([(120, 160), (200, 200), (120, 400)])]


class TestCenteredInverseMaps:
    def test_bit_for_bit_torchvisions(self):
        """The stage's warps take torchvision's own float64 map, cast to float32 as it casts it:
        every value is the bit ``_get_inverse_affine_matrix`` computes (its libm trigonometry)."""
        rng = np.random.default_rng(5)
        n = 4000
        angle, tx, ty = rng.uniform(-400, 400, n), rng.uniform(-50, 50, n), np.trunc(rng.uniform(-50, 50, n))
        sx, sy = rng.uniform(-60, 60, n), rng.uniform(-60, 60, n)
        cx, cy = rng.uniform(-100, 0, n), np.zeros(n)
        got = centered_inverse_maps(angle, (tx, ty), (sx, sy), (cx, cy))
        want = np.array([tvg._get_inverse_affine_matrix([cx[i], cy[i]], angle[i], [tx[i], ty[i]], 1.0, [sx[i], sy[i]])
                         for i in range(n)])  # fmt: skip
        assert np.array_equal(got, want)


class TestTooSmall:
    """torchvision's decision (an error), on every backend, with the same message."""

    def test_message(self):
        assert crop_too_large((200, 200), (120, 160), padding=False) == (
            "RandomCrop: crop size (200, 200) is larger than the image size (120, 160); "
            "set pad_if_needed=True to pad small images"
        )

    @pytest.mark.parametrize(
        "steps",
        [
            [T.RandomCrop(200)],
            [T.RandomCrop((240, 200), padding=(0, 20))],  # padded 160x160, 240x200 (fits exactly), 160x400
        ],
    )
    def test_parity(self, mixed_sizes, steps):
        pytest.importorskip("nvidia.dali")
        from .support.checkers import reference_outputs

        refused = [isinstance(r, str) for r in reference_outputs(steps, mixed_sizes)]
        assert any(refused)
        check_backend_parity(steps, mixed_sizes)  # the same samples refused, with the same message

    def test_every_sample_too_small_is_refused_when_built(self):
        """Too small after a resize, every sample: known from the specs, refused by the pipeline."""
        with pytest.raises(gp.PipelineError, match=r"step 1: RandomCrop: every sample would be refused"):
            gp.Pipeline(gp.FakeData(4), [T.Resize((100, 100)), T.RandomCrop(120)])

    def test_padding_instead(self, mixed_sizes):
        pytest.importorskip("nvidia.dali")
        check_backend_parity([T.RandomCrop((140, 180), padding=10)], mixed_sizes[:1])  # exactly fits: deterministic


@pytest.mark.parametrize("workers", [0, 2])
def test_a_too_small_sample_names_itself_on_every_backend(backend, tmp_path, workers):
    with gp.ShardWriter(str(tmp_path / "small-%d.tar")) as w:
        w.write("big", {"jpg": encode_jpeg(synthetic_image(0, size=(60, 60))), "cls": 0})
        w.write("tiny", {"jpg": encode_jpeg(synthetic_image(1, size=(30, 40))), "cls": 1})
    pipe = gp.Pipeline(w.shards, [T.RandomCrop(50), T.ToDtype(torch.float32, scale=True)])
    message = (
        r"sample 'tiny' in shard '.*small-0\.tar' \(30x40\): RandomCrop: crop size \(50, 50\) is larger than "
        r"the image size \(30, 40\); set pad_if_needed=True"
    )
    with pytest.raises(gp.SampleError, match=message) as info:
        list(backend.loader(pipe, 2, num_workers=workers))
    assert (info.value.key, info.value.shard) == ("tiny", w.shards[0])
    padded = gp.Pipeline(w.shards, [T.RandomCrop(50, pad_if_needed=True), T.ToDtype(torch.float32, scale=True)])
    images, _ = next(iter(backend.loader(padded, 2, num_workers=0)))
    assert images.shape == (2, 3, 50, 50)


def test_a_reflecting_pad_too_large_names_the_sample(tmp_path):
    """``padding_mode="reflect"`` pads less than each side (torch's reflection): a thinner image
    is a too-small sample naming itself (skipped under ``on_error="skip"``), not a torch
    RuntimeError ending the epoch. DALI refuses the mode when the loader is built."""
    with gp.ShardWriter(str(tmp_path / "thin-%d.tar")) as w:
        w.write("big", {"jpg": encode_jpeg(synthetic_image(0, size=(40, 40))), "cls": 0})
        w.write("thin", {"jpg": encode_jpeg(np.full((3, 40, 3), 100, np.uint8)), "cls": 1})
    pipe = gp.Pipeline(w.shards, [T.RandomCrop(8, padding=4, padding_mode="reflect")])
    with pytest.raises(
        gp.SampleError, match=r"sample 'thin' .*\(3x40\): RandomCrop: padding .* padding_mode='reflect'"
    ) as info:
        list(gp.Loader(pipe, batch_size=2, backend="torch", num_workers=0))
    assert (info.value.key, info.value.shard) == ("thin", w.shards[0])
    with gp.Loader(pipe, batch_size=2, backend="torch", num_workers=0, on_error="skip", max_skipped=0.5) as loader:
        assert len(list(loader)) == 1
        assert [(s.key, s.kind) for s in loader.skipped] == [("thin", "too-small")]
