"""The loader's throughput settings chosen by measurement: ``gpupipe tune`` / :func:`tune`.

``num_workers`` (DALI's CPU threads, or the torch backend's worker processes), ``prefetch`` and, on
a GPU, ``DaliOptions.hw_decoder_load`` (the share of JPEGs given to the hardware decoder) can move
images/s by 2x between machines, pipelines and batch sizes, and no default fits them all. As
tf.data's AUTOTUNE does inside the input pipeline, gpupipe measures — but once, ahead of
training, on the user's data and pipeline, so that a training run never spends its first minutes
(or its determinism) on trials: :func:`tune` runs the loader with candidate settings, a few
seconds each, one setting at a time (threads, then prefetch, then the hardware decoder's share),
and records the choice in ``$GPUPIPE_CACHE_DIR/tune.json`` (default ``~/.cache/gpupipe``) under a
key of the machine (CPU cores, GPU model), the backend, the device type, the batch size and the
pipeline's transforms.

A :class:`~gpupipe.Loader` whose options leave these unset (``None``, the defaults) takes the
recorded values for its key, logs that it did and shows them in its repr; an option set
explicitly is never overridden, and without a record the defaults apply (a worker per core of
the rank's share of the CPUs, up to 8; ``prefetch=2``; ``hw_decoder_load`` 1.0 on Hopper GPUs,
else DALI's 0.65: ``gpupipe.loader._records.default_share``). The
measurement runs the loader alone: a training step that shares the CPU with it (a torch step on
the CPU, heavy host-side logging) leaves it less, so tune on the machine type that trains, for
the ranks per node that train, and re-tune after changing the pipeline.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..core._config import DEFAULT_HW_DECODER_LOAD, DEFAULT_PREFETCH, DaliOptions
from ..core._errors import ConfigError
from ..core._validate import valid_optional_int
from ..runtime._dist import MAX_DEFAULT_WORKERS, cores_per_rank, default_workers
from ._records import Tuned, default_share, gpu_capability, machine, tune_key
from ._records import best as _best
from ._records import record as save_record

__all__ = ["tune", "Tuned"]

log = logging.getLogger("gpupipe")


def _candidates(cores: int, backend: str) -> list[int]:
    ladder = [1, 2, 4, 6, 8, 12, 16, 24, 32] if backend == "dali" else [1, 2, 4, 6, 8, 12, 16]
    return sorted({w for w in ladder if w <= cores} | {min(cores, MAX_DEFAULT_WORKERS)})


def tune(pipeline: Any, batch_size: int, *, seconds: float = 3.0, record: bool = True,
         progress: Callable[[dict[str, Any]], Any] | None = None, ranks_per_node: int | None = None,
         **options: Any) -> Tuned:  # fmt: skip
    """Measures ``pipeline`` through a :class:`~gpupipe.Loader` of ``batch_size`` with candidate
    settings and returns (and with ``record``, records for the loaders of this machine) the
    fastest: ``num_workers`` first (``prefetch=2``), then ``prefetch`` (1-4), then on a GPU with
    the DALI backend ``hw_decoder_load`` (0-1). Each trial builds a loader and reads shuffled
    epochs for ``seconds`` after one warm-up batch per worker; the cheaper of two settings within
    3% of each other wins. ``options``: the loader's other options (``backend``, ``device``,
    ``on_error``, ...); the tuned ones must be left unset.

    ``ranks_per_node``: the training ranks that will share this node's CPUs (default: this
    process's ``LOCAL_WORLD_SIZE`` or ``SLURM_NTASKS_PER_NODE``, else 1). The trials give one
    process a rank's share of the cores (:func:`~gpupipe.runtime._dist.cores_per_rank`), and the record
    is for loaders that have that share: tune with ``ranks_per_node=8`` for an 8-GPU node.

    Raises:
        ConfigError: a tuned option was passed, or ``seconds`` or ``ranks_per_node`` is not
            positive.
    """
    from ._loader import Loader

    for name in ("num_workers", "prefetch"):
        if options.get(name) is not None:
            raise ConfigError(f"tune: {name} is what tune chooses; leave it out")
    if seconds <= 0:
        raise ConfigError(f"tune: seconds must be positive, got {seconds!r}")
    valid_optional_int("tune", ranks_per_node, "ranks_per_node", minimum=1)
    dali_options = options.pop("dali", None) or DaliOptions()
    trials: list[dict[str, Any]] = []
    from .. import backends

    backend, device = backends.resolve(
        options.get("backend", "auto"),
        options.get("device"),
        pipeline.views,
        fields=pipeline.fields,
        images=pipeline.has_image,
        targets=pipeline.targets,
        pipeline=pipeline,
        stage=options.get("stage"),
    )
    gpu_decoder = backend.name == "dali" and device.type == "cuda"
    hw_default, _ = default_share(gpu_capability(device))  # (the share a trial without one runs)

    def trial(workers: int, prefetch: int, share: float | None) -> dict[str, Any]:
        for t in trials:
            if (t["num_workers"], t["prefetch"], t["hw_decoder_load"]) == (workers, prefetch, share):
                return t
        dali = dataclasses.replace(dali_options, hw_decoder_load=share if share is not None else hw_default)
        with Loader(pipeline, batch_size, num_workers=workers, prefetch=prefetch, dali=dali, shuffle=True,
                    drop_last=True, seed=0, **options) as loader:  # fmt: skip
            rate = _measure(loader, seconds, warmup=max(1, workers))
            found = {"num_workers": workers, "prefetch": prefetch, "hw_decoder_load": share,
                     "images_per_s": round(rate, 1)}  # fmt: skip
        trials.append(found)
        if progress is not None:
            progress(found)
        return found

    cores = cores_per_rank(ranks_per_node)
    share = hw_default if gpu_decoder else None
    default = trial(default_workers(ranks_per_node), DEFAULT_PREFETCH, share)
    workers = _best([trial(w, DEFAULT_PREFETCH, share) for w in _candidates(cores, backend.name)],
                    lambda t: t["num_workers"])["num_workers"]  # fmt: skip
    prefetch = _best([trial(workers, p, share) for p in (1, 2, 3, 4)], lambda t: t["prefetch"])["prefetch"]
    chosen = trial(workers, prefetch, share)
    if gpu_decoder:  # more to the hardware decoder costs nothing where it keeps up
        chosen = _best([trial(workers, prefetch, s) for s in (0.0, 0.5, DEFAULT_HW_DECODER_LOAD, 0.8, 1.0)],
                       lambda t: abs(t["hw_decoder_load"] - hw_default))  # the default, where as fast  # fmt: skip
    tuned = Tuned(chosen["num_workers"], chosen["prefetch"], chosen["hw_decoder_load"], chosen["images_per_s"],
                  default["images_per_s"], datetime.date.today().isoformat(), tuple(trials))  # fmt: skip
    if record:
        key = tune_key(pipeline.views, batch_size, backend.name, device, ranks=ranks_per_node)
        about = {"machine": machine(device, ranks_per_node), "backend": backend.name, "device": device.type,
                 "batch_size": batch_size, "pipeline": repr(pipeline)}  # fmt: skip
        path = save_record(key, tuned, about)
        log.info("gpupipe tune: %s; recorded in %s", tuned, path)
    return tuned


def _measure(loader: Any, seconds: float, *, warmup: int) -> float:
    """Images/s of ``loader`` over ``seconds`` of shuffled epochs, after ``warmup`` batches. The
    host cannot run more than ``prefetch`` batches ahead of the device, so the clock stops after
    one synchronization at the end."""
    seen, images, start = 0, 0, 0.0
    for epoch in range(1_000_000):
        loader.set_epoch(epoch)
        for batch in loader:
            seen += 1
            if seen == warmup:
                start = time.perf_counter()
            elif seen > warmup:
                images += len(batch.keys)
                if time.perf_counter() - start >= seconds:
                    if torch.device(loader.device).type == "cuda":
                        torch.cuda.synchronize(loader.device)
                    return images / (time.perf_counter() - start)
        if seen == 0:
            break
    raise ConfigError("tune: the loader yields no batches")
