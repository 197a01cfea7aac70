"""The DALI backend: the pipeline compiled into one NVIDIA DALI graph — nvJPEG (``mixed``) and GPU
operators for ``cuda``, DALI's CPU operators for ``cpu`` — fed by gpupipe's reader and handed to
torch through DLPack. DALI itself is imported only when a graph is built."""

from __future__ import annotations

from .._base import Backend, Runner, RunSpec
from . import _color, _lowerings, _policies  # noqa: F401 - register the lowerings
from ._context import LOWERINGS

__all__ = ["BACKEND", "DaliBackend"]


class DaliBackend(Backend):
    name = "dali"
    requirement = "NVIDIA DALI: pip install 'gpupipe[cuda12]' (or [cuda13])"
    lowerings = LOWERINGS

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
