"""The loader's recorded throughput settings: :class:`Tuned` records in
``$GPUPIPE_CACHE_DIR/tune.json`` (``gpupipe tune`` writes them, ``gpupipe.loader._tune``) and how a loader
takes them for the options it leaves unset (:func:`resolve`). A leaf: the loader imports it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core._config import DEFAULT_HW_DECODER_LOAD, DEFAULT_PREFETCH, LoaderConfig
from ..core._paths import cache_root
from ..runtime._dist import cores_per_rank

__all__ = ["Tuned", "lookup", "record", "resolve", "tune_key", "tune_file", "machine", "default_share",
           "gpu_capability", "best", "recorded_share", "NEAR"]  # fmt: skip

NEAR = 0.97  # a setting within 3% of the best is as good: the cheaper one wins (fewer threads, less memory)

# Every JPEG to the hardware decoder on Hopper: nvJPEG's CUDA decoder does the Huffman decoding of
# images under a megapixel on the CPU, and at DALI's 0.65 that third of the JPEGs set the pace.
HOPPER_HW_DECODER_LOAD = 1.0
_HOPPER_EVIDENCE = ("1.70x the train recipe's images/s at 8 threads, 0.14 against 0.63 CPU-s per 1,000 images "
                    "(H200, 2026-11-28; an H100 tuned to 1.0, 2026-11-26)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A tuning's result: the settings chosen, their images/s and the defaults', the date, and
    every trial as ``{"num_workers", "prefetch", "hw_decoder_load", "images_per_s"}``."""

    num_workers: int
    prefetch: int
    hw_decoder_load: float | None  # None: not tuned (no GPU decoder)
    images_per_s: float
    default_images_per_s: float
    date: str
    trials: tuple[dict[str, Any], ...] = dataclasses.field(default=(), compare=False)  # (not what it chose)

    @property
    def speedup(self) -> float:
        return self.images_per_s / self.default_images_per_s if self.default_images_per_s else 1.0

    def __str__(self) -> str:
        share = "" if self.hw_decoder_load is None else f", hw_decoder_load={self.hw_decoder_load}"
        return (f"num_workers={self.num_workers}, prefetch={self.prefetch}{share}: {self.images_per_s:.0f} images/s, "
                f"{self.speedup:.2f}x the defaults (tuned {self.date})")  # fmt: skip


def tune_file() -> str:
    root = cache_root()
    return os.path.join(root, "tune.json")


def machine(device: torch.device, ranks: int | None = None) -> str:
    """What the record's key knows of the machine: the cores a rank has (of ``ranks`` per node,
    default :func:`~gpupipe.runtime._dist.ranks_per_node`) and the GPU model."""
    cores = cores_per_rank(ranks)
    gpu = "no GPU"
    if device.type == "cuda":
        try:
            gpu = torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError, ValueError):  # no CUDA after all (a fake one in tests)
            gpu = "a GPU"
    return f"{cores} cores, {gpu}"


def gpu_capability(device: torch.device) -> tuple[int, int] | None:
    """``device``'s CUDA compute capability; ``None`` for a CPU (or a CUDA device torch cannot
    query)."""
    if device.type != "cuda":
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError, ValueError):  # no CUDA after all (a fake one in tests)
        return None
    return int(major), int(minor)


def default_share(capability: tuple[int, int] | None) -> tuple[float, str]:
    """``DaliOptions.hw_decoder_load`` where neither the option nor a ``gpupipe tune`` record sets
    it, on a GPU of compute ``capability``, and why: 1.0 on Hopper (compute 9.x: H100, H200,
    H800, H20, GH200), where it was measured; DALI's 0.65 on every other GPU, where it was not
    (an A100 has one JPEG engine to an H100's seven; a Blackwell GPU is unmeasured)."""
    if capability is not None and capability[0] == 9:
        return HOPPER_HW_DECODER_LOAD, f"every JPEG to the hardware decoder on a Hopper GPU: {_HOPPER_EVIDENCE}"
    return DEFAULT_HW_DECODER_LOAD, "DALI's default (every JPEG to the hardware decoder measured faster on Hopper only)"


def tune_key(views: Sequence[Sequence[Any]], batch_size: int, backend: str, device: torch.device, *,
             ranks: int | None = None) -> str:  # fmt: skip
    """The record's key: this machine (a rank's share of it, of ``ranks`` per node), the backend,
    the device type, the batch size and the pipeline's transforms (not its source: tune on a
    sample of the data that trains)."""
    what = [machine(device, ranks), backend, device.type, batch_size, [[repr(t) for t in view] for view in views]]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def _records() -> dict[str, Any]:
    path = tune_file()
    try:
        with open(path) as f:
            records = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"gpupipe: ignoring the tuning records in {path}: {e}", stacklevel=3)
        return {}
    return records if isinstance(records, dict) else {}


def lookup(key: str) -> Tuned | None:
    """The recorded settings for ``key``, or ``None``."""
    record = _records().get(key)
    if not isinstance(record, dict):
        return None
    try:
        found = Tuned(**{k: record[k] for k in ("num_workers", "prefetch", "hw_decoder_load", "images_per_s",
                                                "default_images_per_s", "date")})  # fmt: skip
    except (KeyError, TypeError):
        return None
    trials = record.get("trials")
    if isinstance(trials, list) and all(isinstance(t, dict) for t in trials):
        found = dataclasses.replace(found, trials=tuple(trials))
    return found


def best(trials: Sequence[dict[str, Any]], cost: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """The cheapest trial within :data:`NEAR` of the fastest."""
    top = max(t["images_per_s"] for t in trials)
    return min((t for t in trials if t["images_per_s"] >= NEAR * top), key=cost)


def recorded_share(tuned: Tuned, default: float) -> float | None:
    """The record's hardware-decoder share, chosen again among its trials of shares (at its
    threads and prefetch) for ``default``, today's: of the shares within 3% of the fastest, the
    nearest the default. A record made when the default was another (0.65 before 2026-11-28 on
    Hopper) then follows the new one where its trials found them as fast."""
    trials = [t for t in tuned.trials if isinstance(t.get("hw_decoder_load"), (int, float))
              and (t.get("num_workers"), t.get("prefetch")) == (tuned.num_workers, tuned.prefetch)
              and isinstance(t.get("images_per_s"), (int, float))]  # fmt: skip
    if not trials:
        return tuned.hw_decoder_load
    return float(best(trials, lambda t: abs(t["hw_decoder_load"] - default))["hw_decoder_load"])


def record(key: str, tuned: Tuned, about: dict[str, Any]) -> str:
    path = tune_file()
    records = _records()
    records[key] = {**dataclasses.asdict(tuned), "trials": list(tuned.trials), **about}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1)
    os.replace(tmp, path)  # atomic: a loader reading it sees the old records or the new ones
    return path


def resolve(config: LoaderConfig, key: str, *,
            hw_default: float = DEFAULT_HW_DECODER_LOAD) -> tuple[LoaderConfig, int | None, Tuned | None]:  # fmt: skip
    """``(config, num_workers, tuned)`` with the options left unset taken from the record for
    ``key`` where there is one, else their defaults (``num_workers`` ``None``: the loader's;
    ``hw_default``: the hardware decoder's share, :func:`default_share`); ``tuned`` is the record
    where one of its values is used."""
    unset = config.num_workers is None or config.prefetch is None or config.dali.hw_decoder_load is None
    tuned = lookup(key) if unset else None
    workers = config.num_workers if config.num_workers is not None or tuned is None else tuned.num_workers
    prefetch = config.prefetch if config.prefetch is not None else tuned.prefetch if tuned else DEFAULT_PREFETCH
    share = config.dali.hw_decoder_load
    if share is None:
        share = hw_default
        if tuned is not None and tuned.hw_decoder_load is not None:
            share = recorded_share(tuned, hw_default)
    dali = dataclasses.replace(config.dali, hw_decoder_load=share)
    used = tuned is not None and (
        config.num_workers is None
        or config.prefetch is None
        or (config.dali.hw_decoder_load is None and tuned.hw_decoder_load is not None)
    )
    return dataclasses.replace(config, prefetch=prefetch, dali=dali), workers, tuned if used else None
