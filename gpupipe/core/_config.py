"""The loader's options: one frozen object, validated once when it is made."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from ._errors import ConfigError
from ._imageinfo import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS
from ._validate import (
    is_int,
    is_number,
    valid_bool,
    valid_bytes,
    valid_enum,
    valid_int,
    valid_optional_int,
    valid_probability,
)

__all__ = ["LoaderConfig", "DaliOptions", "RayOptions", "OnError", "DecodeMode", "valid_options"]


class OnError(str, enum.Enum):
    """What a loader does with a sample it cannot use (``Loader(on_error=...)``).

    ``RAISE`` (``"raise"``): raise the error, naming the shard, the key and what is wrong.
    ``SKIP`` (``"skip"``): leave the sample out: its place in the batch is marked invalid
    (``batch.valid``), it is counted, logged once and listed in ``loader.skipped``.
    """

    RAISE = "raise"
    SKIP = "skip"


class DecodeMode(str, enum.Enum):
    """How the DALI backend decodes on the GPU an image whose pipeline starts with a
    ``RandomResizedCrop`` (``DaliOptions(decode=...)``).

    ``ROI`` (``"roi"``): region-of-interest decoding — nvJPEG decodes only the crop window
    (``decoders.image_slice``), the fastest where the GPU decoders can do it. ``FULL``
    (``"full"``): the whole image is decoded on the GPU and the window cut there (``decoders.image``
    then ``slice``). ``AUTO`` (``"auto"``, the default): ``ROI`` where the installed nvJPEG decodes
    a region on the GPU with the requested chroma upsampling, else ``FULL`` — a region nvJPEG
    declines is decoded by libjpeg-turbo on the CPU, several times slower (``gpupipe doctor``
    says which applies, and why). The pixels are the same either way; DALI's CPU graph always
    decodes the region (libjpeg-turbo).
    """

    AUTO = "auto"
    ROI = "roi"
    FULL = "full"


_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last)
DEFAULT_PREFETCH = 2  # batches ahead where neither the option nor `gpupipe tune` says
DEFAULT_HW_DECODER_LOAD = 0.65  # DALI's


@dataclasses.dataclass(frozen=True)
class DaliOptions:
    """The DALI backend's options: its GPU JPEG decoder (nvJPEG, DALI's ``mixed`` decoders), with
    DALI's argument names, used with ``device="cuda"`` only (DALI's CPU decoder ignores them), and
    its ColorJitter kernel. The torch backend ignores them all.
    ``gp.Loader(..., dali=gp.DaliOptions(hw_decoder_load=0.8))``.

    Args:
        jpeg_fancy_upsampling: upsample chroma as libjpeg-turbo does, so that GPU-decoded images
            match the CPU decoders' (and the torch backend's). Default ``True``; DALI's own
            default is ``False``: a little faster, chroma a few levels off.
        hw_decoder_load: the share of JPEG data sent to the GPU's hardware JPEG decoder (A100,
            H100 and other data-center GPUs that have one), the rest to nvJPEG's CUDA decoder.
            ``None`` (default): the value ``gpupipe tune`` recorded for this machine, pipeline and
            batch size, else 1.0 on Hopper GPUs (H100, H200: 1.70x the train recipe's images/s at
            a fifth of the CPU time, measured) and 0.65 (DALI's) on the others; the best value
            depends on the decoder threads and the training step's use of the GPU.
        device_memory_padding: bytes of nvJPEG device buffer preallocated per decoder thread.
            Default 16 MiB (DALI's).
        host_memory_padding: bytes of each of the two pinned host buffers nvJPEG preallocates per
            decoder thread. Default 8 MiB (DALI's). Both paddings avoid reallocations when a
            larger image comes; DALI's older ImageNet recipe used 211025920 and 140544512, which
            cost that much per thread (pinned host memory times 2, times the ranks on a node).
        preallocate_width_hint: the image width the hardware decoder preallocates for, for a
            whole batch of such images. Default 0 (DALI's): it allocates as images come. DALI's
            ResNet-50 recipe sets 5980 x 6430, ImageNet's largest image: that preallocates
            ``batch_size`` images of 38 Mpx, up to many GB of GPU memory at batch 256.
        preallocate_height_hint: the height of that image. Default 0.
        affine: tie each decoder thread to a CPU core. ``None`` (default): ``True`` with one rank
            per node, ``False`` with several (``LOCAL_WORLD_SIZE`` or ``SLURM_NTASKS_PER_NODE``
            above 1), whose threads would otherwise be tied to the same cores.
        color_twist: run ``ColorJitter`` as DALI's one ``color_twist`` operator instead of
            torchvision's kernels: 3.4x faster on DALI's CPU operators (``bench/color_jitter.py``,
            2 cores, 2026-11-22; not measured on a GPU yet), but contrast pivots on mid-grey
            rather than the image's mean, hue rotates in YIQ space rather than HSV (about 10 grey
            levels apart at hue 0.1), and it rounds where torchvision truncates. Default
            ``False``: the same kernels as the torch backend. Only where DALI's graph runs
            ``ColorJitter``: before a crop or resize, or with ``Loader(stage=False)``; in a view's
            last steps the stage runs it by default (torchvision's kernels, faster on both
            devices: ``bench/results/2026-11-29-stage-dali-colour-cpu.md``).
        decode: how a pipeline's leading ``RandomResizedCrop`` is decoded on the GPU, a
            :class:`DecodeMode`: ``"auto"`` (default), ``"roi"`` or ``"full"``.
    """

    _: dataclasses.KW_ONLY
    jpeg_fancy_upsampling: bool = True
    hw_decoder_load: float | None = None
    device_memory_padding: int = 16 * 2**20
    host_memory_padding: int = 8 * 2**20
    preallocate_width_hint: int = 0
    preallocate_height_hint: int = 0
    affine: bool | None = None
    color_twist: bool = False
    decode: DecodeMode | str = DecodeMode.AUTO  # stored as a DecodeMode

    def __post_init__(self) -> None:
        owner = "DaliOptions"
        object.__setattr__(self, "decode", valid_enum(owner, self.decode, "decode", DecodeMode))
        valid_bool(owner, self.jpeg_fancy_upsampling, "jpeg_fancy_upsampling")
        if self.hw_decoder_load is not None:
            share = valid_probability(owner, self.hw_decoder_load, "hw_decoder_load")
            object.__setattr__(self, "hw_decoder_load", share)
        for name in (
            "device_memory_padding",
            "host_memory_padding",
            "preallocate_width_hint",
            "preallocate_height_hint",
        ):
            valid_int(owner, getattr(self, name), name, minimum=0)
        if self.affine is not None:
            valid_bool(owner, self.affine, "affine")
        valid_bool(owner, self.color_twist, "color_twist")

    def decoder_args(self, *, ranks_per_node: int | None) -> dict[str, Any]:
        """The arguments of DALI's ``mixed`` decoders, for a job with ``ranks_per_node`` local
        ranks (``None``: unknown, taken as one)."""
        args = dataclasses.asdict(self)
        del args["color_twist"], args["decode"]  # the compiler's options, not the decoders'
        if self.affine is None:
            args["affine"] = (ranks_per_node or 1) == 1
        if self.hw_decoder_load is None:  # not resolved by a loader (which knows the GPU): DALI's
            args["hw_decoder_load"] = DEFAULT_HW_DECODER_LOAD
        return args


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """The Ray backend's options (``backend="ray"``): where its tasks run and how many are in
    flight. ``gp.Loader(..., backend="ray", ray=gp.RayOptions(address="auto"))``. Other backends
    ignore them.

    Args:
        address: the Ray cluster to join, as ``ray.init(address=...)`` takes it (``"auto"``,
            ``"10.0.0.1:6379"``, ``"ray://head:10001"``). ``None`` (default): ``RAY_ADDRESS``
            where set; else the Ray this process already joined (``ray.init`` called before);
            else a local Ray started on demand on this machine's loopback address and shut down
            when the last loader using it is closed.
        num_cpus: CPUs each batch's task reserves on the cluster. Default 1.
        in_flight: batches submitted ahead per rank (backpressure: at most this many batches
            in the cluster or its object store for one loader, besides the one the training
            loop holds). ``None`` (default): twice the
            loader's ``num_workers`` where it is given, else twice this process's CPUs up to 8
            (not a rank's share: the tasks run on the cluster), at least 2.
        timeout: seconds a rank waits for one batch before a :class:`~gpupipe.WorkerError`
            (a cluster without free CPUs, a lost node whose tasks cannot be placed). Default 300.
        max_retries: times a batch's task is run again after its worker or node died (Ray's
            ``max_retries``). Default 3.
        local_cpus: CPUs of the local Ray this loader may start. ``None`` (default): those
            this process may run on (its CPU affinity).
        normalize_on_rank: run each view's closing ``ToDtype`` / ``Normalize`` steps on the
            rank, on its device, after the batch arrives, instead of in the task: the object
            store and the network then carry uint8 images, a quarter of float32's bytes (DINO's
            10 views: 0.52 MB an image instead of 2.1 MB). The values are the same on the CPU
            (bit for bit) and within float rounding on a GPU. ``None`` (default): on the rank
            when its device is a GPU (where the steps cost next to nothing), in the task on a
            CPU device (where they would take the training process's CPU time).
    """

    _: dataclasses.KW_ONLY
    address: str | None = None
    num_cpus: float = 1.0
    in_flight: int | None = None
    timeout: float = 300.0
    max_retries: int = 3
    local_cpus: int | None = None
    normalize_on_rank: bool | None = None

    def __post_init__(self) -> None:
        owner = "RayOptions"
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise ConfigError(f"{owner}: address must be a Ray address or None, got {self.address!r}")
        if not (is_number(self.num_cpus) and self.num_cpus > 0):
            raise ConfigError(f"{owner}: num_cpus must be a number > 0, got {self.num_cpus!r}")
        valid_optional_int(owner, self.in_flight, "in_flight", minimum=1)
        if not (is_number(self.timeout) and self.timeout > 0):
            raise ConfigError(f"{owner}: timeout must be a number of seconds > 0, got {self.timeout!r}")
        valid_int(owner, self.max_retries, "max_retries", minimum=0)
        valid_optional_int(owner, self.local_cpus, "local_cpus", minimum=1)
        if self.normalize_on_rank is not None and not isinstance(self.normalize_on_rank, bool):
            raise ConfigError(f"{owner}: normalize_on_rank must be True, False or None, got {self.normalize_on_rank!r}")


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
            0, broadcast to the others through ``torch.distributed``; with ``shuffle=True`` or
            random augmentation and several ranks but no ``torch.distributed``, pass a seed). A
            drawn seed is recorded by ``Loader.state_dict`` so that a resume is exact.
        backend: a backend's name (``"dali"``: one DALI graph, nvJPEG and GPU operators on
            ``cuda``, DALI's CPU operators on ``cpu``; ``"torch"``: torchvision kernels in worker
            processes; ``"ray"``: the torch backend's kernels in Ray tasks, on a cluster's CPUs),
            or ``"auto"`` (default): the first available of DALI, torch (never Ray) that runs every
            step of the pipeline (a step DALI does not take, such as
            ``RandomRotation(expand=True)``, makes it torch; the loader's ``chosen`` says so)
            and is not measured slower there for one of them (on the CPU, DALI for the
            augmentation policies, ``TrivialAugmentWide`` to ``AugMix``: torch).
            The name is checked against the backend table when a loader is made.
        device: where batches are delivered: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
            ``torch.device``; ``None`` (default) picks ``"cuda"`` when available, else ``"cpu"``.
            ``"cuda"`` means ``cuda:<LOCAL_RANK>`` under torchrun (``SLURM_LOCALID`` under srun).
        num_workers: worker processes that decode and transform (torch backend; DALI's CPU
            threads on the dali backend); ``None`` (default): the number ``gpupipe tune`` recorded
            for this machine, pipeline, batch size, backend and device, else one per CPU core of
            this rank's share, up to 8 (the CPUs the process may use, divided among the node's
            ranks: ``LOCAL_WORLD_SIZE`` under torchrun, ``SLURM_NTASKS_PER_NODE`` under srun
            unless it bound each task to its ``--cpus-per-task``); ``0`` runs the torch
            backend in the calling process.
        prefetch: batches prepared ahead (per worker on torch; DALI's queue depth). ``None``
            (default): ``gpupipe tune``'s value, else 2.
        shuffle_buffer: with ``shuffle=True`` on tar shards, samples are mixed within a window of
            this many samples. Default 4096.
        interleave: with ``shuffle=True`` on tar shards, each rank reads this many shards at once,
            evenly interleaved, before the buffer mixes them. Default 64.
        repeats: repeated augmentation (torchvision's ``--ra-reps``, timm's ``RepeatAugSampler``):
            each epoch takes ``1 / repeats`` of the samples, each ``repeats`` times, its copies on
            neighbouring ranks in the same step (one rank: side by side in a batch), each copy
            with its own augmentation draws. The epoch keeps its length (``len(loader)`` is
            unchanged) and resumes exactly, elastic resume included. Default 1: none. Not with
            a :class:`~gpupipe.Mix` (which repeats by its own counts).
        shards_ahead: remote shards only: how many shards beyond those the epoch has reached are
            downloaded ahead into the node's shard cache (each process keeps the shards it
            reads at once, plus these, plus one, at hand). ``None`` (default): ``interleave`` with ``shuffle=True``
            (the whole next group of shards read at once), else 4; ``0``: none ahead.
        rank: this process's place among the data-parallel ranks; ``None`` (default) takes it
            from ``torch.distributed``, else ``RANK``, else ``SLURM_PROCID``, else 0. Pass
            ``rank`` and ``world_size`` both or neither.
        world_size: the number of data-parallel ranks; ``None`` (default): from
            ``torch.distributed``, else ``WORLD_SIZE``, else ``SLURM_NTASKS``, else 1.
        memory_format: ``torch.contiguous_format`` (default) or ``torch.channels_last``: NHWC
            storage presented as an ``[B, C, H, W]`` tensor (DALI's layout, no extra copy there).
        dali: the DALI backend's GPU decoder settings, a :class:`DaliOptions`. Default
            ``DaliOptions()``.
        ray: the Ray backend's settings (its cluster, tasks in flight), a :class:`RayOptions`.
            Default ``RayOptions()``.
        on_error: ``"raise"`` (default) or ``"skip"`` (an :class:`OnError`): what to do with a
            sample that cannot be used (undecodable or empty image, bad label, a shard truncated
            or unreadable at that sample, too small for a transform). ``"raise"`` raises a
            :class:`~gpupipe.DataError` naming the shard and the key. ``"skip"`` leaves it out
            of the epoch: every rank still yields the same number of batches of the same size —
            the sample's place holds a copy of another sample of the batch, marked ``False`` in
            ``batch.valid`` like padding — and it is logged once and listed in
            ``loader.skipped`` (kept in ``state_dict``). The same on every backend.
        max_skipped: with ``on_error="skip"``, the most samples one rank may skip in an epoch
            before a :class:`~gpupipe.DataError` stops it: a fraction of the rank's samples
            (a float in ``(0, 1)``) or a count (an int ``>= 0``); ``None``: no limit. Default
            ``0.01``: a dataset rotting beyond 1 % fails loudly. Damage known when the loader
            is made counts against the whole dataset, under either policy for samples listed
            by ``gpupipe check``: a lost shard (missing, unreadable, empty) as many samples as
            an intact shard holds on average, a truncated one as those it lacks of that.
        max_image_pixels: the most pixels (height x width) an image's header may declare; a
            larger image is a :class:`~gpupipe.SampleError` of kind ``"too-large"`` (raised, or
            skipped under ``on_error="skip"``) before any decoder allocates it. Default
            89,478,485, Pillow's ``Image.MAX_IMAGE_PIXELS``; ``None``: no limit. Read from the
            JPEG, PNG, GIF and WebP headers (other formats of an ImageFolder: from Pillow's).
        max_image_bytes: the largest image member (or ImageFolder file) read, in bytes or as
            ``"512MiB"``; a larger one is a :class:`~gpupipe.SampleError` of kind ``"too-large"``
            found from its size in the tar header before any of it is read, so that a 2 GB member
            never reaches memory. Default 256 MiB (268,435,456: the pixel limit's image as raw
            RGB); ``None``: no limit. A loader's memory is bounded by its buffers plus a multiple
            of it (docs/guide/errors.md, "Limits").
        apply_exif_orientation: turn images upright by their EXIF orientation tag. Default
            ``False``: the pixels as stored, as torchvision's and Pillow's decoders give them
            (DALI's decoders apply the tag by default; gpupipe turns that off). ``True`` applies
            it on every backend (torchvision's ``apply_exif_orientation``, DALI's
            ``adjust_orientation``).
        worker_timeout: seconds the torch backend may go without a batch from its worker
            processes before they are taken as stuck (a worker frozen in ``fork``, a decoder
            that never returns): their Python stacks are logged, the sample that hangs (found by
            running the samples in flight again in a sandbox) is refused from then on, and new
            workers go on with the epoch. Default 600; ``None``: wait forever.
        stage: where each view's per-sample steps after decode and geometry run (its tail of
            augmentation policies, ``AugMix``, colour steps (``ColorJitter`` on uint8,
            ``RandomGrayscale``, ``RandomSolarize``, ``GaussianBlur``, ``RandomApply`` and
            ``RandomChoice`` of them), ``ToDtype``, ``Normalize``, ``RandomErasing``):
            ``True``, in the stage: batched torch kernels over the delivered batch on the
            loader's device, each sample with its own draws, exact to torchvision's kernels (the
            backend stops the view where the tail starts and hands over uint8 images);
            ``False``, in the backend (the torch backend's workers, sample by sample, or DALI's
            graph; DALI runs the augmentation policies in the stage only, and refuses
            ``False`` for a pipeline with one). ``None`` (default): the stage on a GPU, the
            backend on the CPU, where the backends' workers or threads run a tail faster than the stage
            (``bench/results/2026-11-28-stage-cpu.md``), except where a backend measured the
            stage faster (``Backend.stage_pays``: DALI on the CPU with the policies, 1.14-1.47x,
            and the colour and tone steps, 1.11-2.54x, ``bench/results/2026-11-29-stage-dali-*``). On the CPU
            the torch backend runs the stage in its workers. The stage's values are
            torchvision's on every backend; DALI's colour graph differs from them slightly
            (``docs/guide/transforms.md``).

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
    prefetch: int | None = None
    shuffle_buffer: int = 4096
    interleave: int = 64
    repeats: int = 1
    shards_ahead: int | None = None
    rank: int | None = None
    world_size: int | None = None
    memory_format: torch.memory_format = torch.contiguous_format
    dali: DaliOptions = DaliOptions()
    ray: RayOptions = RayOptions()
    on_error: OnError | str = OnError.RAISE
    max_skipped: int | float | None = 0.01
    max_image_pixels: int | None = MAX_IMAGE_PIXELS
    max_image_bytes: int | str | None = MAX_IMAGE_BYTES
    apply_exif_orientation: bool = False
    worker_timeout: float | None = 600.0
    stage: bool | None = None

    def __post_init__(self) -> None:
        owner = "Loader"
        valid_int(owner, self.batch_size, "batch_size", minimum=1)
        valid_bool(owner, self.shuffle, "shuffle")
        valid_bool(owner, self.drop_last, "drop_last")
        valid_optional_int(owner, self.seed, "seed")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # (plans take it modulo 2**64)
            raise ConfigError(f"{owner}: seed must be an int64 (-2**63 <= seed < 2**63), got {self.seed!r}")
        if not isinstance(self.backend, str) or not self.backend:
            # the name is checked against the backend table by gpupipe.backends, which knows it
            raise ConfigError(f"{owner}: backend must be a backend's name or 'auto', got {self.backend!r}")
        if self.device is not None:
            object.__setattr__(self, "device", _check_device(owner, self.device))
        valid_optional_int(owner, self.num_workers, "num_workers", minimum=0)
        valid_optional_int(owner, self.prefetch, "prefetch", minimum=1)
        valid_int(owner, self.shuffle_buffer, "shuffle_buffer", minimum=1)
        valid_int(owner, self.interleave, "interleave", minimum=1)
        valid_int(owner, self.repeats, "repeats", minimum=1)
        valid_optional_int(owner, self.shards_ahead, "shards_ahead", minimum=0)
        valid_optional_int(owner, self.rank, "rank")
        valid_optional_int(owner, self.world_size, "world_size")
        if self.memory_format not in _MEMORY_FORMATS:
            raise ConfigError(
                f"{owner}: memory_format must be torch.contiguous_format or torch.channels_last, "
                f"got {self.memory_format!r}"
            )
        if not isinstance(self.dali, DaliOptions):
            raise ConfigError(f"{owner}: dali must be a gp.DaliOptions, got {self.dali!r}")
        if not isinstance(self.ray, RayOptions):
            raise ConfigError(f"{owner}: ray must be a gp.RayOptions, got {self.ray!r}")
        object.__setattr__(self, "on_error", valid_enum(owner, self.on_error, "on_error", OnError))
        valid_optional_int(owner, self.max_image_pixels, "max_image_pixels", minimum=1)
        object.__setattr__(self, "max_image_bytes", valid_bytes(owner, self.max_image_bytes, "max_image_bytes"))
        valid_bool(owner, self.apply_exif_orientation, "apply_exif_orientation")
        if self.stage is not None:
            valid_bool(owner, self.stage, "stage")
        if self.worker_timeout is not None and not (is_number(self.worker_timeout) and self.worker_timeout > 0):
            raise ConfigError(f"{owner}: worker_timeout must be None or a number of seconds > 0, got "
                              f"{self.worker_timeout!r}")  # fmt: skip
        cap = self.max_skipped
        if not (cap is None or (is_int(cap) and cap >= 0) or (is_number(cap) and not is_int(cap) and 0 < cap < 1)):
            raise ConfigError(
                f"{owner}: max_skipped must be a count (an int >= 0), a fraction (a float in (0, 1)) or None, "
                f"got {cap!r}"
            )

    def skip_limit(self, samples: int) -> int | None:
        """The most samples an epoch of ``samples`` samples may skip (``None``: no limit)."""
        cap = self.max_skipped
        if cap is None:
            return None
        return int(cap) if is_int(cap) else int(cap * samples)

    def remote_ahead(self) -> int:
        """Remote shards downloaded ahead of those the epoch has needed: ``shards_ahead``, by
        default a whole next interleave group when shuffling (a rank reads ``interleave`` shards
        at once), else a few."""
        if self.shards_ahead is not None:
            return self.shards_ahead
        return self.interleave if self.shuffle else 4

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


# torch DataLoader arguments a gp.Loader does not take, and what to do instead.
DATALOADER_ONLY = {
    "dataset": "pass a gp.Pipeline as the first argument (gp.Pipeline(gp.WebDataset(urls), transforms))",
    "sampler": "drop it: every rank plans its own share of each epoch (shuffle=, seed=; rank and world size from "
    "torch.distributed or torchrun); call loader.set_epoch(epoch) each epoch, as with DistributedSampler",
    "batch_sampler": "drop it: batch_size= and drop_last= set the batches; every rank plans its share itself",
    "collate_fn": "drop it: the backend stacks each batch into [B, C, H, W]; put per-sample work in the pipeline's "
    "transforms (gp.transforms, or a transforms.ArrayFunction)",
    "pin_memory": "drop it: with device='cuda' batches arrive on the GPU, copied from pinned memory",
    "pin_memory_device": "drop it: device= says where batches arrive",
    "persistent_workers": "drop it: a loader's workers (or DALI's threads) live until close()",
    "prefetch_factor": "use prefetch= (batches prepared ahead)",
    "worker_init_fn": "drop it: workers run the pipeline's transforms; seed augmentations with seed=",
    "generator": "use seed= (the shuffle's and the augmentations' seed; drawn on rank 0 when None)",
    "timeout": "use worker_timeout= (seconds without a batch before the torch backend's workers count as stuck)",
    "multiprocessing_context": "drop it: the torch backend forks its workers (and they end with the loader)",
    "in_order": "drop it: batches always come in the epoch plan's order",
}


def valid_options(owner: str, options: dict[str, Any]) -> None:
    """Refuses options ``LoaderConfig`` does not have, one line each: a torch DataLoader argument
    says what to do instead, a misspelling the nearest option."""
    import difflib

    known = {f.name for f in dataclasses.fields(LoaderConfig)} - {"_"}
    for name in options:
        if name in known:
            continue
        if name in DATALOADER_ONLY:
            raise ConfigError(f"{owner}: {name}= is a torch DataLoader argument; {DATALOADER_ONLY[name]}")
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {near[0]}=?" if near else f"; the options are {', '.join(sorted(known))}"
        raise ConfigError(f"{owner}: unknown option {name}={options[name]!r}{hint}")
