"""The stage never makes the host wait for the device: host values reach it through pinned memory
in a few copies per step, never one per sample, and nothing is read back. On the CPU the copies
are counted (through ``_kernels.upload``); on a GPU (``gpu``-marked) the CUDA profiler sees no
copy from pageable memory and torch's sync debug mode no synchronization."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gpupipe import transforms as T
from gpupipe.backends._stage import _kernels as K
from gpupipe.backends._stage import run_stage
from gpupipe.core._random import factors

from .test_stage import batch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _float(*steps: Any) -> list[Any]:
    return [*steps, T.ToDtype(torch.float32, scale=True), T.Normalize(mean=MEAN, std=STD)]


# the recipes' tails (bench/stage_profile.py's), on small images
TAILS = {
    "v2": [*_float(T.TrivialAugmentWide()), T.RandomErasing(p=0.1)],
    "timm": [*_float(T.TimmRandAugment.from_config("rand-m9-mstd0.5-inc1")), T.RandomErasing(p=0.25, value="random")],
    "augmix": _float(T.AugMix()),
    "dino": _float(T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8), T.RandomGrayscale(p=0.2),
                   T.RandomApply([T.GaussianBlur(9, sigma=(0.1, 2.0))], p=0.5), T.RandomSolarize(128, p=0.2)),
}  # fmt: skip


def uploads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``_kernels.upload``'s calls (each one copy on a GPU): the list's length."""
    calls: list[int] = []
    real = K.upload

    def counted(values: np.ndarray, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(np.asarray(values).size)
        return real(values, *args, **kwargs)

    monkeypatch.setattr(K, "upload", counted)
    monkeypatch.setattr("gpupipe.backends._stage._steps.upload", counted)
    monkeypatch.setattr("gpupipe.backends._stage._mix.upload", counted)
    return calls


# the batch transforms, and the validity of the batch's rows they mix (a row left out: padding)
MIXES = {
    "mixup": (T.MixUp(alpha=0.2, num_classes=10), True),
    "cutmix": (T.CutMix(alpha=1.0, num_classes=10), True),
    "timm-per-sample": (T.RandomChoice([T.MixUp(alpha=0.8, num_classes=10, mode="elem"),
                                        T.CutMix(alpha=1.0, num_classes=10, mode="elem")]), True),
    "mixup-padded": (T.MixUp(alpha=0.2, num_classes=10), False),
    "cutmix-padded": (T.CutMix(alpha=1.0, num_classes=10), False),
    "per-sample-padded": (T.RandomChoice([T.MixUp(alpha=0.8, num_classes=10, mode="elem"),
                                          T.CutMix(alpha=1.0, num_classes=10, mode="elem")]), False),
}  # fmt: skip


def mix_inputs(name: str, n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of ``n`` float images and labels on ``device``, and its rows' validity (host)."""
    valid = torch.ones(n, dtype=torch.bool)
    if not MIXES[name][1]:
        valid[-1] = False
    return batch(n, 24, 24, device=device).float(), torch.arange(n, device=device) % 10, valid


def mixed(name: str, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from gpupipe.backends._stage._mix import apply_batch

    return apply_batch(MIXES[name][0], *inputs, seed=3, epoch=0, rank=0, batch=5)


def run(steps: list[Any], n: int, device: str = "cpu") -> torch.Tensor:
    images = batch(n, 24, 24, device=device)
    return run_stage(steps, images, factors(steps, 3, 0, np.arange(n)))


class TestCopies:
    @pytest.mark.parametrize("n", [1, 4, 64])
    def test_noise_is_one_copy_whatever_the_samples_erased(self, n, monkeypatch):
        """``value="random"``: each erased box's noise drawn into one buffer, then one copy of it
        (it was a copy and a wait per erased sample), each box written from its slice: the values
        of each box's own generator, as the torch backend draws them. A box 0 wide is nothing."""
        from gpupipe.backends._stage._steps import erase_with_noise

        rng = np.random.default_rng(n)
        images = torch.from_numpy(rng.normal(size=(n + 3, 3, 20, 24)).astype(np.float32))
        eh, ew = rng.integers(1, 20, n), rng.integers(0, 24, n)
        ew[0] = 0
        windows = np.stack([rng.integers(0, 21 - eh), rng.integers(0, 25 - ew), eh, ew], axis=1)
        rows, seeds = np.sort(rng.choice(n + 3, n, replace=False)), rng.random(n)
        calls = uploads(monkeypatch)
        got = erase_with_noise(images, windows, rows, seeds)
        assert len(calls) == 1
        want = images.clone()
        for i, (top, left, h, w), seed in zip(rows.tolist(), windows.tolist(), seeds.tolist(), strict=True):
            generator = torch.Generator().manual_seed(int(float(seed) * 2**53))
            want[i, :, top : top + h, left : left + w] = torch.empty(3, h, w).normal_(generator=generator)
        torch.testing.assert_close(got, want, atol=0, rtol=0)

    def test_each_group_of_rows_shares_one_copy(self, monkeypatch):
        """``on_rows``: the row indices of every group in one copy (a slot of a policy: one copy
        for every operation its samples drew, then each operation's arguments)."""
        calls = uploads(monkeypatch)
        images = batch(12, 8, 8)
        out = K.on_rows(images, [(np.array([0, 3]), lambda x, at: x + 1), (np.array([5]), lambda x, at: x + 2),
                                 (np.array([], dtype=np.int64), lambda x, at: x)])  # fmt: skip
        assert calls == [3]
        assert torch.equal(out[[0, 3]], images[[0, 3]] + 1) and torch.equal(out[5], images[5] + 2)
        assert torch.equal(out[[1, 2, 4, *range(6, 12)]], images[[1, 2, 4, *range(6, 12)]])

    def test_copies_do_not_grow_with_the_batch(self, monkeypatch):
        """DINO's view tail copies per step and adjustment, not per sample: 16 times the samples,
        the same copies. (A policy's slot on the CPU runs once per operation and magnitude, so
        its copies grow with the magnitudes drawn; on a GPU once per operation: the gpu test.)"""
        calls = uploads(monkeypatch)
        run(TAILS["dino"], 16)
        few = len(calls)
        calls.clear()
        run(TAILS["dino"], 256)
        assert len(calls) == few

    @pytest.mark.parametrize("name", MIXES)
    def test_a_batch_transforms_copies_do_not_grow_with_the_batch(self, name, monkeypatch):
        """MixUp and CutMix send their per-row values to the device in a few copies (each
        ``upload``: pinned memory on a GPU), the same for 8 samples as for 128."""
        small, large = mix_inputs(name, 8), mix_inputs(name, 128)
        calls = uploads(monkeypatch)
        mixed(name, small)
        few = len(calls)
        calls.clear()
        mixed(name, large)
        assert len(calls) == few <= 5

    def test_a_constant_is_made_once(self):
        cpu = torch.device("cpu")
        a = K.constant(cpu, (0.5, 2.0))
        assert a is K.constant(cpu, (0.5, 2.0)) and a.dtype == torch.float32 and a.tolist() == [0.5, 2.0]

    def test_upload_casts_on_the_host_as_a_copy_would(self):
        values = np.array([0.1, 1e-8, 3.7, 255.9])
        got = K.upload(values, torch.device("cpu"), torch.float32)
        assert torch.equal(got, torch.from_numpy(values).to(torch.float32))
        assert torch.equal(K.upload(np.array([1.9, -2.5]), torch.device("cpu"), torch.int32),
                           torch.tensor([1, -2], dtype=torch.int32))  # fmt: skip


def host_events(warm: Any, run: Any) -> set[str]:
    """The names of the CPU and CUDA events of ``run()`` (after ``warm()``, which makes the
    constants and picks cuDNN's algorithms), run under torch's sync debug mode (which raises on a
    synchronization) and then waited for (one ``cudaDeviceSynchronize``, ours)."""
    from torch.profiler import ProfilerActivity, profile

    warm()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            run()
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {e.key for e in p.key_averages()}


@pytest.mark.gpu
@pytest.mark.parametrize("name", MIXES)
def test_on_a_gpu_a_batch_transform_never_makes_the_host_wait(name):
    """MixUp and CutMix on a GPU batch: no copy from pageable memory, no synchronization (the
    stage runs them one batch ahead on its own stream: a wait there would stall the loop)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    first, second = mix_inputs(name, 64, "cuda"), mix_inputs(name, 64, "cuda")
    names = host_events(lambda: mixed(name, first), lambda: mixed(name, second))
    assert not [k for k in names if "Pageable" in k], sorted(names)
    assert "cudaStreamSynchronize" not in names


@pytest.mark.gpu
@pytest.mark.parametrize("name", TAILS)
def test_on_a_gpu_the_host_never_waits(name):
    """The second batch through each tail (the first makes the constants and picks cuDNN's
    algorithms): no copy from pageable memory, and no synchronization (torch's sync debug mode
    raises on one). The H200 run of 2026-11-28 counted 135 copies and 72 waits per timm batch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = TAILS[name]
    images = batch(64, 48, 48, device="cuda")
    drawn = factors(steps, 3, 0, np.arange(64))
    names = host_events(lambda: run_stage(steps, images, drawn), lambda: run_stage(steps, images, drawn))
    assert not [k for k in names if "Pageable" in k], sorted(names)
    assert "cudaStreamSynchronize" not in names and "cudaDeviceSynchronize" in names  # ours, at the end
