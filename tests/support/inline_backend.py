"""A third backend, for the tests only: the torch backend's kernels run inline in the calling
thread, one sample at a time. It is what adding a backend takes — this module, defining
``BACKEND``, and an entry in ``gpupipe.backends.TABLE`` (tests/test_backends.py adds it)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from gpupipe.backends import Backend, RawBatch, RunSpec
from gpupipe.backends._torch._kernels import LOWERINGS, apply_pipeline
from gpupipe.core._random import factors
from gpupipe.plan._plan import RankPlan
from gpupipe.runtime._decode import decode_rgb


class InlineRunner:
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.closed = False

    def run(self, plan: RankPlan, start: int) -> Iterator[RawBatch]:
        index, views = self.spec.index, self.spec.views
        for b in range(start, plan.num_batches):
            images: list[list[torch.Tensor]] = [[] for _ in views]
            labels, keys = [], []
            samples = plan.batch(b)[0]
            # the whole batch's draws at once, view by view
            drawn = [factors(steps, plan.seed, plan.epoch, plan.drawn(b), view) for view, steps in enumerate(views)]
            for i, s in enumerate(map(int, samples)):
                raw = index.read(s)
                image = decode_rgb(raw.data, shard=raw.shard, key=raw.key)
                if self.spec.per_source:  # one output: the sample's source's list
                    source = int(index.source_of(np.array([s]))[0])  # type: ignore[attr-defined]
                    row = [None if f is None else f[i] for f in drawn[source]]
                    images[0].append(apply_pipeline(views[source], image, row))
                else:
                    for view, steps in enumerate(views):
                        row = [None if f is None else f[i] for f in drawn[view]]
                        images[view].append(apply_pipeline(steps, image, row))
                labels.append(raw.label)
                keys.append(raw.key)
            if self.spec.per_source:
                images = images[:1]
            batch = tuple(torch.stack(view).to(self.spec.device) for view in images)
            label_tensor = None if labels[0] is None else torch.tensor(labels, dtype=torch.int64)
            yield RawBatch(batch, label_tensor, keys)

    def describe(self) -> dict[str, object]:
        return {"inline": True}

    def close(self) -> None:
        self.closed = True


class InlineBackend(Backend):
    name = "inline"
    devices = ("cpu",)
    requirement = "nothing"
    lowerings = LOWERINGS  # the torch backend's kernels

    def runner(self, spec: RunSpec) -> InlineRunner:
        return InlineRunner(spec)


BACKEND = InlineBackend()
