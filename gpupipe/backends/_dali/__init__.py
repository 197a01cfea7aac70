"""The DALI backend: the pipeline compiled into one NVIDIA DALI graph — nvJPEG (``mixed``) and GPU
operators for ``cuda``, DALI's CPU operators for ``cpu`` — fed by gpupipe's reader and handed to
torch through DLPack. DALI itself is imported only when a graph is built."""

from __future__ import annotations

from ... import transforms as T
from .._base import Backend, Runner, RunSpec
from . import _color, _lowerings, _policies, _warp  # noqa: F401 - register the lowerings
from ._context import LOWERINGS

__all__ = ["BACKEND", "DaliBackend"]


class DaliBackend(Backend):
    name = "dali"
    requirement = "NVIDIA DALI: pip install 'gpupipe[cuda12]' (or [cuda13])"
    lowerings = LOWERINGS
    reads_fields = True  # read and decoded by the runner's reader threads, beside the images' bytes
    reads_targets = True  # masks and boxes moved there too, from the images' header sizes (_targets)
    # DALI's CPU operators run the policies' colour arithmetic a pass per operator: the torch
    # backend ran them as fast or up to 2.5x faster on a 2-core CPU (the GPU is not measured yet)
    slower = (
        ("cpu", (T.TrivialAugmentWide, T.RandAugment, T.AutoAugment, T.TimmRandAugment, T.AugMix),
         "bench/results/2026-11-25-v2-recipe-cpu.md"),
        # its CPU resize upscaling, and the photometric arithmetic: 0.28-0.80x on the recipes
        ("cpu", (T.RandomResize, T.RandomShortestSize, T.RandomPhotometricDistort),
         "bench/results/2026-11-26-targets-cpu.md"),
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
