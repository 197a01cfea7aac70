"""The stage: a view's per-sample steps after decode and geometry (the policies, ``ToDtype``,
``Normalize``, ``RandomErasing``), run as batched torch kernels over the whole batch on its device,
each sample with its own draws, exact to torchvision's per-sample kernels.

Each policy operation is defined once here (``_ops.OPERATIONS``: its kernel and its arguments);
the torch and ray backends run a view's tail through it where :func:`stage_start` finds one.
"""

from __future__ import annotations

from ._ops import OPERATIONS, Warp, apply_slot
from ._steps import STAGE, run_stage, stage_start

__all__ = ["STAGE", "OPERATIONS", "Warp", "apply_slot", "run_stage", "stage_start"]
