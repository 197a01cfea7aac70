"""The one place that knows the process's rank, world size, local GPU and share of the CPUs.

Order of precedence (first that applies):

1. explicit ``rank=`` / ``world_size=`` passed to :class:`~gpupipe.Loader`;
2. ``torch.distributed``, when it is initialized;
3. ``RANK`` / ``WORLD_SIZE`` (set by ``torchrun``);
4. ``SLURM_PROCID`` / ``SLURM_NTASKS`` (set by ``srun``);
5. a single process: rank 0 of 1.

The local rank, which picks the GPU for ``device="cuda"``, is ``LOCAL_RANK`` (torchrun), else
``SLURM_LOCALID`` (srun), else none (the current CUDA device is used).

A rank's share of the CPUs (what ``num_workers`` defaults to, up to 8) is the CPUs the process
may run on (its affinity: ``taskset``, a container's cpuset, SLURM's binding), divided among the
node's ranks (``LOCAL_WORLD_SIZE``, ``SLURM_NTASKS_PER_NODE``), unless srun bound the task to its
own ``SLURM_CPUS_PER_TASK`` CPUs.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core._errors import ConfigError
from ..core._validate import valid_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "Topology",
    "topology",
    "local_rank",
    "ranks_per_node",
    "assume_ranks_per_node",
    "cpu_cores",
    "cores_per_rank",
    "default_workers",
    "MAX_DEFAULT_WORKERS",
    "agreed",
    "cuda_device",
    "collective_device",
    "shared_seed",
    "require_same",
]


class Topology(NamedTuple):
    """Where this process stands: ``rank`` of ``world_size``, and where that came from."""

    rank: int
    world_size: int
    origin: str  # "explicit", "torch.distributed", "RANK/WORLD_SIZE", "SLURM" or "single process"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _checked(rank: int, world_size: int, origin: str) -> Topology:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} of world size {world_size} (from {origin}): need 0 <= rank < world_size")
    return Topology(rank, world_size, origin)


def topology(rank: int | None = None, world_size: int | None = None) -> Topology:
    """This process's rank and world size (see the module docstring for the order of precedence).

    Raises:
        ConfigError: only one of ``rank`` and ``world_size`` given, values out of range, or an
            environment variable that is not an integer.
    """
    if (rank is None) != (world_size is None):
        raise ConfigError(
            f"Loader: pass both rank and world_size, or neither (got rank={rank!r}, world_size={world_size!r})"
        )
    if rank is not None and world_size is not None:
        return _checked(valid_int("Loader", rank, "rank"), valid_int("Loader", world_size, "world_size"), "explicit")
    dist = _dist()
    if dist is not None:
        return _checked(dist.get_rank(), dist.get_world_size(), "torch.distributed")
    env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        return _checked(env_rank, env_world, "RANK/WORLD_SIZE")
    slurm_rank, slurm_world = _env_int("SLURM_PROCID"), _env_int("SLURM_NTASKS")
    if slurm_world is None:
        slurm_world = _env_int("SLURM_NPROCS")  # (srun's older name of the same count)
    if slurm_rank is not None and slurm_world is not None:
        return _checked(slurm_rank, slurm_world, "SLURM")
    # half a pair that says there are other processes: each would read the whole dataset as rank 0 of 1
    lone = [f"{name}={value}" for name, value, single in (("RANK", env_rank, 0), ("WORLD_SIZE", env_world, 1),
            ("SLURM_PROCID", slurm_rank, 0)) if value is not None and value != single]  # fmt: skip
    if lone:
        raise ConfigError(
            f"environment variable {', '.join(lone)} without its pair (RANK with WORLD_SIZE, SLURM_PROCID with "
            "SLURM_NTASKS): this process is one of several, but which of how many is not known; pass rank= and "
            "world_size=, or initialize torch.distributed before building the Loader"
        )
    return Topology(0, 1, "single process")


def local_rank() -> int | None:
    """``LOCAL_RANK``, else ``SLURM_LOCALID``, else ``None``."""
    value = _env_int("LOCAL_RANK")
    return _env_int("SLURM_LOCALID") if value is None else value


_assumed_ranks: int | None = None  # a trainer's word, where the launcher says nothing


def assume_ranks_per_node(ranks: int | None) -> None:
    """Records what a trainer integration knows of this node's ranks (Lightning's ``devices``),
    for launchers that set no ``LOCAL_WORLD_SIZE`` (Lightning's own); the environment still wins."""
    global _assumed_ranks
    _assumed_ranks = ranks


def ranks_per_node() -> int | None:
    """This node's number of ranks: ``LOCAL_WORLD_SIZE`` (torchrun), else
    ``SLURM_NTASKS_PER_NODE`` (srun with ``--ntasks-per-node``), else what a trainer said
    (:func:`assume_ranks_per_node`), else ``None`` (unknown)."""
    value = _env_int("LOCAL_WORLD_SIZE")
    if value is None:
        value = _env_int("SLURM_NTASKS_PER_NODE")
    return _assumed_ranks if value is None else value


MAX_DEFAULT_WORKERS = 8  # more decoder workers per rank rarely pay on the defaults' pipelines


def cpu_cores() -> int:
    """The CPUs this process may run on: its affinity (``taskset``, a container's cpuset, SLURM's
    binding), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def cores_per_rank(ranks: int | None = None) -> int:
    """This rank's share of :func:`cpu_cores`: divided among ``ranks`` (default
    :func:`ranks_per_node`, else 1) ranks that share them, as torchrun's do. Where the ranks are
    srun's tasks (no ``LOCAL_WORLD_SIZE``) and srun bound each to its own CPUs (no more of them
    than ``SLURM_CPUS_PER_TASK``), the task's CPUs are its own. At least 1. E.g.
    ``torchrun --nproc-per-node 8`` on 32 cores (also inside one ``srun -c 32`` task): 4;
    ``srun --ntasks-per-node 8 -c 4``, bound: 4. Ranks that a launcher binds without saying so
    (srun without ``-c``, NUMA binding) are divided again: pass ``num_workers`` there.
    """
    cores = cpu_cores()
    if ranks is None and _env_int("LOCAL_WORLD_SIZE") is None:
        per_task = _env_int("SLURM_CPUS_PER_TASK")
        if per_task is not None and cores <= per_task:
            return cores
    ranks = ranks_per_node() if ranks is None else ranks
    return max(1, cores // max(1, ranks or 1))


def default_workers(ranks: int | None = None) -> int:
    """``num_workers`` left unset and not tuned: one per core of :func:`cores_per_rank`, up to
    :data:`MAX_DEFAULT_WORKERS`."""
    return min(cores_per_rank(ranks), MAX_DEFAULT_WORKERS)


def cuda_device() -> str:
    """The device ``"cuda"`` means for this process: ``cuda:<local rank>`` under torchrun or srun.

    Where each process sees a single GPU (SLURM binding GPUs per task), that GPU is used whatever
    the local rank; without a local rank, the current CUDA device.
    """
    import torch

    count = torch.cuda.device_count()
    local = local_rank()
    if local is None:
        return f"cuda:{torch.cuda.current_device()}"
    if 0 <= local < count:
        return f"cuda:{local}"
    if count == 1:
        return "cuda:0"
    raise ConfigError(
        f"local rank {local} (LOCAL_RANK/SLURM_LOCALID) but this process sees {count} GPUs; "
        f"pass device='cuda:N' explicitly"
    )


def collective_device(dist: Any, device: torch.device | None = None) -> contextlib.AbstractContextManager[Any]:
    """The context gpupipe's ``torch.distributed`` object collectives run in.

    NCCL's object collectives (``broadcast_object_list``, ``all_gather_object``) put their tensors
    on ``torch.cuda.current_device()``: in a job whose ranks never called
    ``torch.cuda.set_device``, every rank would use ``cuda:0`` (NCCL then fails or hangs). So under
    NCCL they run with the loader's GPU current — or, for a CPU loader, this process's GPU
    (``LOCAL_RANK``) — whatever the caller set. Under gloo nothing changes and no GPU is touched.
    """
    import torch

    if "nccl" not in str(dist.get_backend()).lower():
        return contextlib.nullcontext()
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return torch.cuda.device(torch.device(cuda_device()))


def shared_seed(
    seed: int | None, topo: Topology, *, shuffle: bool, random_steps: bool = False, device: torch.device | None = None
) -> int:
    """``seed``, or one drawn for the run: by rank 0 and broadcast when distributed, since every
    rank must draw the same shuffled epoch plan, and a sample the same augmentation whichever rank
    yields it (a state of any rank resumes every rank; an elastic resume moves samples between
    ranks). ``random_steps``: the pipeline draws augmentation. ``device``: the loader's (see
    :func:`collective_device`)."""
    if seed is not None:
        return seed
    drawn = random.SystemRandom().randrange(2**63)
    if topo.world_size == 1:
        return drawn
    dist = _dist()
    if dist is None and not (shuffle or random_steps):  # nothing depends on the seed
        return drawn
    if dist is None:
        what = "shuffle=True" if shuffle else "random augmentation"
        raise ConfigError(
            f"Loader: {what}, seed=None with world_size={topo.world_size} ({topo.origin}) and no "
            "initialized torch.distributed to share a random seed: every rank must use the "
            "same seed, pass seed=<int>"
        )
    box = [drawn]
    with collective_device(dist, device):
        dist.broadcast_object_list(box, src=0)
    return int(box[0])


def agreed(topo: Topology, value: Any, *, device: torch.device | None = None) -> Any:
    """Rank 0's ``value`` on every rank, broadcast, when torch.distributed is initialized (a
    listing of a growing dataset, read by every rank, could differ); else this rank's own."""
    dist = _dist()
    if dist is None or topo.world_size == 1 or topo.origin != "torch.distributed":
        return value
    box = [value]
    with collective_device(dist, device):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def require_same(topo: Topology, what: str, values: dict[str, Any], *, device: torch.device | None = None) -> None:
    """Raises ConfigError on every rank if ``values`` differ between ranks (when torch.distributed
    is initialized): a dataset seen differently by two ranks would otherwise hang DDP.
    ``device``: the loader's (see :func:`collective_device`)."""
    dist = _dist()
    if dist is None or topo.world_size == 1 or topo.origin != "torch.distributed":
        return
    gathered: list[Any] = [None] * topo.world_size
    with collective_device(dist, device):
        dist.all_gather_object(gathered, values)
    for r, other in enumerate(gathered):
        diff = {k: (values[k], other.get(k)) for k in values if other.get(k) != values[k]}
        if diff:
            detail = ", ".join(f"{k}: {mine!r} here, {theirs!r} on rank {r}" for k, (mine, theirs) in diff.items())
            raise ConfigError(
                f"{what} differs between ranks ({detail}); every rank must see the same data and settings"
            )
