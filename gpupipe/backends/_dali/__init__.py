"""The DALI backend: the pipeline compiled into one NVIDIA DALI graph — nvJPEG (``mixed``) and GPU
operators for ``cuda``, DALI's CPU operators for ``cpu`` — fed by gpupipe's reader and handed to
torch through DLPack. DALI itself is imported only when a graph is built."""

from __future__ import annotations

from ... import transforms as T
from .._base import Backend, Runner, RunSpec
from . import _color, _lowerings, _warp  # noqa: F401 - register the lowerings
from ._context import LOWERINGS

__all__ = ["BACKEND", "DaliBackend"]


class DaliBackend(Backend):
    name = "dali"
    requirement = "NVIDIA DALI: pip install 'gpupipe[cuda12]' (or [cuda13])"
    lowerings = LOWERINGS
    reads_fields = True  # read and decoded by the runner's reader threads, beside the images' bytes
    reads_targets = True  # masks and boxes moved there too, from the images' header sizes (_targets)
    # On the CPU, DALI's kernels take longer per image than torchvision's: its antialiased resize
    # 3.8x torchvision's uint8 resize, its bilinear warp 1.6x torchvision's affine, its arithmetic
    # 1.2-1.8 ns per value. The torch backend ran every recipe measured faster on 2 cores (train
    # 0.84-0.89x for DALI, val 0.89x, V2 0.73-0.81x, the policies, issue 39's), at the same ratio
    # with 1 and 2 workers, and on 16 cores with 8 (an H100 machine, 2026-11-22: train 0.89x, val
    # 0.77x). So on the CPU DALI runs when named, or where torch cannot run the pipeline. (The
    # GPU: DALI.)
    slower = (("cpu", None, "bench/results/2026-11-26-dali-cpu-kernels.md"),)
    # The policies run in the stage only, after the graph: batched torch kernels, exact to
    # torchvision's. DALI's own graph of them (a conditional branch per operation family) was 6%
    # of values off torchvision's and slower on both devices: on an H100 5.81 ms per batch of 256
    # against the stage's 2.95 (TrivialAugmentWide, bench/results/2026-11-27-*), and on 2 cores
    # the stage ran 1.14x (TrivialAugmentWide), 1.32x (RandAugment), 1.47x (AugMix) and 1.45x
    # (timm's) its rate. So it was removed (issue 52); the stage is on for them on the CPU too.
    stage_only = (T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, T.TimmRandAugment, T.AugMix)
    # The colour and tone steps' tails too: on 2 cores the stage ran 3-Augment 1.11x, SimCLR
    # 1.22x, DINO 1.84x, RandomPhotometricDistort 2.54x and the tone steps 1.12x DALI's own graph
    # (and exact to torchvision, where that graph orders ColorJitter's adjustments its own way).
    stage_pays = (
        *(("cpu", (t,), f"{ratio}, bench/results/2026-11-29-stage-dali-one-thread-cpu.md")
          for t, ratio in ((T.TrivialAugmentWide, "1.14x"), (T.RandAugment, "1.32x"), (T.AugMix, "1.47x"),
                           (T.TimmRandAugment, "1.45x"), (T.AutoAugment, "as TrivialAugmentWide"))),
        *(("cpu", types, f"{ratio}, bench/results/2026-11-29-stage-dali-colour-cpu.md")
          for types, ratio in (((T.ColorJitter, T.GaussianBlur, T.RandomGrayscale, T.RandomSolarize),
                                "3-Augment 1.11x, SimCLR 1.22x, DINO 1.84x"),
                               ((T.RandomPhotometricDistort,), "2.54x"),
                               ((T.RandomInvert, T.RandomPosterize, T.RandomAutocontrast, T.RandomAdjustSharpness,
                                 T.RandomEqualize), "1.12x together"))),
    )  # fmt: skip

    def available(self) -> bool:
        try:
            import nvidia.dali  # noqa: F401
        except ImportError:
            return False
        return True

    def runner(self, spec: RunSpec) -> Runner:
        from ._runner import DaliRunner

        return DaliRunner(spec)


BACKEND = DaliBackend()
