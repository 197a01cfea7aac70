"""The loader's options: one frozen object, validated once when it is made."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._errors import ConfigError
from ._validate import check_bool, check_int, check_optional_int

__all__ = ["LoaderConfig"]

_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last)


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Every option of a :class:`~gpupipe.Loader`, validated when constructed.

    ``gp.Loader(pipeline, batch_size, **options)`` builds one; ``loader.config`` returns it, and
    ``gp.Loader.from_config(pipeline, config)`` builds a loader from one (to keep a train and an
    eval loader in step: ``dataclasses.replace(train.config, shuffle=False)``).

    Args:
        batch_size: samples per batch, per rank.
        shuffle: shuffle each epoch. Default ``False``: shard order, then member order.
        drop_last: drop the samples that do not fill a whole batch on every rank. Default ``False``.
        seed: seed of the shuffle and of the augmentations; ``None`` (default) draws one (on rank
            0, broadcast to the others through ``torch.distributed``; with ``shuffle=True`` and
            several ranks but no ``torch.distributed``, pass a seed). A drawn seed is recorded by
            ``Loader.state_dict`` so that a resume is exact.
        backend: a backend's name (``"dali"``: one DALI graph, nvJPEG and GPU operators on
            ``cuda``, DALI's CPU operators on ``cpu``; ``"torch"``: torchvision kernels in worker
            processes), or ``"auto"`` (default): the first available of DALI, torch.
        device: where batches are delivered: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
            ``torch.device``; ``None`` (default) picks ``"cuda"`` when available, else ``"cpu"``.
            ``"cuda"`` means ``cuda:<LOCAL_RANK>`` under torchrun (``SLURM_LOCALID`` under srun).
        num_workers: worker processes that decode and transform (torch backend; DALI's CPU
            threads on the dali backend); ``None`` (default) uses one per CPU core, up to 8; ``0``
            runs the torch backend in the calling process.
        prefetch: batches prepared ahead (per worker on torch; DALI's queue depth). Default 2.
        shuffle_buffer: with ``shuffle=True`` on tar shards, samples are mixed within a window of
            this many samples. Default 4096.
        interleave: with ``shuffle=True`` on tar shards, each rank reads this many shards at once,
            evenly interleaved, before the buffer mixes them. Default 64.
        rank, world_size: this process's place among the data-parallel ranks; ``None`` (default)
            takes them from ``torch.distributed``, else ``RANK``/``WORLD_SIZE``, else
            ``SLURM_PROCID``/``SLURM_NTASKS``, else rank 0 of 1. Pass both or neither.
        memory_format: ``torch.contiguous_format`` (default) or ``torch.channels_last``: NHWC
            storage presented as an ``[B, C, H, W]`` tensor (DALI's layout, no extra copy there).

    Raises:
        ConfigError: an option of the wrong type or out of range; the message names it.
    """

    batch_size: int
    _: dataclasses.KW_ONLY
    shuffle: bool = False
    drop_last: bool = False
    seed: int | None = None
    backend: str = "auto"
    device: str | torch.device | None = None
    num_workers: int | None = None
    prefetch: int = 2
    shuffle_buffer: int = 4096
    interleave: int = 64
    rank: int | None = None
    world_size: int | None = None
    memory_format: torch.memory_format = torch.contiguous_format

    def __post_init__(self) -> None:
        from . import backends

        owner = "Loader"
        check_int(owner, self.batch_size, "batch_size", minimum=1)
        check_bool(owner, self.shuffle, "shuffle")
        check_bool(owner, self.drop_last, "drop_last")
        check_optional_int(owner, self.seed, "seed")
        names = ("auto", *backends.names())
        if self.backend not in names:
            raise ConfigError(f"{owner}: backend must be one of {names}, got {self.backend!r}")
        if self.device is not None:
            object.__setattr__(self, "device", _check_device(owner, self.device))
        check_optional_int(owner, self.num_workers, "num_workers", minimum=0)
        check_int(owner, self.prefetch, "prefetch", minimum=1)
        check_int(owner, self.shuffle_buffer, "shuffle_buffer", minimum=1)
        check_int(owner, self.interleave, "interleave", minimum=1)
        check_optional_int(owner, self.rank, "rank")
        check_optional_int(owner, self.world_size, "world_size")
        if self.memory_format not in _MEMORY_FORMATS:
            raise ConfigError(
                f"{owner}: memory_format must be torch.contiguous_format or torch.channels_last, "
                f"got {self.memory_format!r}"
            )

    @property
    def channels_last(self) -> bool:
        return self.memory_format == torch.channels_last


def _check_device(owner: str, device: Any) -> str:
    """``"cpu"`` or ``"cuda[:N]"`` (a string or a ``torch.device``), as a string."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{owner}: device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return str(dev)
