"""``python -m gpupipe doctor --run``: a few batches through each backend and device this machine
has, compared with the torch backend's (the facts and diagnosis: ``_doctor``)."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["targets", "run_check"]


class Environment(Protocol):
    """What ``--run`` reads of ``_doctor.Environment``."""

    @property
    def dali(self) -> str | None: ...

    @property
    def torch_sees_cuda(self) -> bool: ...


def targets(env: Environment) -> list[tuple[str, str]]:
    """The (backend, device) pairs ``--run`` tries: torch on the CPU (the reference) and every
    other one this machine can run."""
    found = [("torch", "cpu")]
    if env.dali:
        found.append(("dali", "cpu"))
    if env.torch_sees_cuda:
        found += [("dali", "cuda")] if env.dali else []
        found.append(("torch", "cuda"))
    return found


def run_check(env: Environment, *, images: int = 64, batch_size: int = 16, out: Any = print) -> bool:
    """Pushes ``images`` generated photographs through each backend and device of
    :func:`targets`: prints images/s and, per image, the difference from the torch backend's
    output (0-255 units; the tests' tolerances: mean <= 1.0, worst <= 2.5). Returns whether every
    one ran and agreed."""
    import os
    import tempfile
    import time

    import torch

    from .. import transforms as T
    from ..core._shards import ShardWriter
    from ..loader._loader import Loader
    from ..pipeline._pipeline import Pipeline
    from ..testing import encode_jpeg, synthetic_image

    steps = [T.Resize(128), T.CenterCrop(112), T.ToDtype(torch.float32, scale=True)]
    ok, reference = True, dict[str, Any]()
    old_cache = os.environ.get("GPUPIPE_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="gpupipe-doctor-") as tmp:
        os.environ["GPUPIPE_CACHE_DIR"] = os.path.join(tmp, "cache")
        try:
            with ShardWriter(os.path.join(tmp, "doctor-%d.tar"), max_count=max(1, images // 2)) as w:
                for i in range(images):
                    w.write(f"{i:06d}", {"jpg": encode_jpeg(synthetic_image(i, size=(240, 320 + 8 * (i % 5)))),
                                         "cls": i % 10})  # fmt: skip
            for backend, device in targets(env):
                try:
                    outputs, rate = {}, 0.0
                    with Loader(Pipeline(w.shards, steps), batch_size, backend=backend, device=device) as loader:
                        for epoch in range(2):  # the first epoch warms up (workers, DALI build)
                            loader.set_epoch(epoch)
                            start, n = time.perf_counter(), 0
                            for batch in loader:
                                for key, image in zip(batch.keys, batch.images.float().cpu(), strict=True):
                                    outputs[key] = image
                                n += len(batch.keys)
                            if batch.images.is_cuda:
                                torch.cuda.synchronize(batch.images.device)
                            rate = n / (time.perf_counter() - start)
                    if not reference:
                        reference = outputs
                        out(f"run          {backend}-{device}: {rate:.0f} images/s (the reference)")
                        continue
                    errors = [float((outputs[k] - reference[k]).abs().mean()) * 255 for k in reference]
                    mean, worst = sum(errors) / len(errors), max(errors)
                    agree = mean <= 1.0 and worst <= 2.5
                    ok &= agree
                    out(f"run          {backend}-{device}: {rate:.0f} images/s; vs torch-cpu: mean {mean:.2f}, worst "
                        f"{worst:.2f} (0-255){'' if agree else '  ** OUTSIDE mean 1.0 / worst 2.5 **'}")  # fmt: skip
                except Exception as e:  # report every target, then fail
                    ok = False
                    out(f"ERROR        {backend}-{device} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        finally:
            if old_cache is None:
                os.environ.pop("GPUPIPE_CACHE_DIR", None)
            else:
                os.environ["GPUPIPE_CACHE_DIR"] = old_cache
    return ok
