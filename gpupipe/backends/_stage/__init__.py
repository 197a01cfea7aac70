"""The stage: a view's per-sample steps after decode and geometry (the policies, the colour steps
and their composites, ``ToDtype``, ``Normalize``, ``RandomErasing``), run as batched torch kernels
over the whole batch on its device, each sample with its own draws, exact to torchvision's
per-sample kernels.

Each policy operation is defined once here (``_ops.OPERATIONS``: its kernel and its arguments);
the loader runs a view's tail through it on each delivered batch where :func:`stage_for` hands it
one (``LoaderConfig.stage``), the backend having stopped the view there.
"""

from __future__ import annotations

from . import _color  # noqa: F401 - register the colour steps and composites
from ._delivered import Stage, candidate_tails, require_staged, stage_for, staged_refusal
from ._ops import OPERATIONS, Warp, apply_slot
from ._steps import STAGE, run_stage, stage_start, tail_start

__all__ = [
    "STAGE",
    "OPERATIONS",
    "Warp",
    "Stage",
    "apply_slot",
    "candidate_tails",
    "require_staged",
    "run_stage",
    "stage_for",
    "staged_refusal",
    "stage_start",
    "tail_start",
]
