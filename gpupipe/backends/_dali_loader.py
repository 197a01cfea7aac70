"""Runs a compiled pipeline with DALI and hands batches to torch through DLPack.

Readers: ``fn.readers.webdataset`` with gpupipe's cached index files, ``fn.readers.file`` for
ImageFolder. Each epoch reads every sample once (``pad_last_batch``; the padding of the last
batch is cut off here). With ``shuffle=True`` the shard order is permuted per epoch by gpupipe's
planner (the same permutation as the torch backend) and DALI's reader mixes samples in a buffer of
``shuffle_buffer`` samples, seeded from ``(seed, epoch)``.

Hand-off: the pipeline runs with DALI's dynamic executor, whose output buffers are reference
counted; ``torch.from_dlpack`` takes a reference, so a batch the user holds is never overwritten
by later iterations, and nothing is copied on the host. On the GPU the DLPack exchange makes the
consumer's current CUDA stream wait for DALI's work.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import BackendUnavailableError, SampleError, ShardError
from .._plan import shard_permutation
from .._sources import Index, ImageFolder, WebDataset, split_key
from ..transforms import Transform
from ._dali import Ctx, check_pipeline, lower

__all__ = ["DaliRunner", "dali_available"]

log = logging.getLogger("gpupipe")


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


class DaliRunner:
    def __init__(self, index: Index, source: Any, transforms: Sequence[Transform], *, seed: int, device: str,
                 batch_size: int, num_threads: int, prefetch: int, shuffle: bool, shuffle_buffer: int,
                 channels_last: bool = False) -> None:
        if not dali_available():
            raise BackendUnavailableError("backend='dali' needs NVIDIA DALI: pip install 'gpupipe[cuda12]' "
                                          "(or [cuda13])")
        check_pipeline(transforms)
        if isinstance(source, WebDataset):
            missing = [s.path for s in index.shards if s.dali_index is None]
            if missing:
                raise ShardError(f"no DALI index for shard {missing[0]!r} (see the warning logged when it was "
                                 "indexed); use backend='torch'", shard=missing[0])
        elif not isinstance(source, ImageFolder):
            raise BackendUnavailableError(f"the dali backend cannot read a {type(source).__name__}")
        self.index, self.source, self.transforms = index, source, tuple(transforms)
        self.seed, self.batch_size, self.shuffle, self.buffer = seed, batch_size, shuffle, shuffle_buffer
        self.num_threads, self.prefetch, self.channels_last = max(1, num_threads), prefetch, channels_last
        self.device = torch.device(device)
        self._pipe: Any = None
        self._ready_epoch: int | None = None  # the epoch the pipeline's reader stands at the start of
        self._build(0)  # fail early: a graph that DALI rejects is reported when the loader is built

    # -------------------------------------------------------------------- graph --
    def _build(self, epoch: int) -> None:
        from nvidia.dali import Pipeline, fn, types

        gpu = self.device.type == "cuda"
        epoch_seed = (self.seed * 1_000_003 + epoch * 7_919) % (2**31 - 1)
        pipe = Pipeline(batch_size=self.batch_size, num_threads=self.num_threads,
                        device_id=(self.device.index or 0) if gpu else None, seed=epoch_seed,
                        prefetch_queue_depth=self.prefetch, exec_dynamic=True)
        shuffle = dict(random_shuffle=True, initial_fill=self.buffer, seed=epoch_seed) if self.shuffle else {}
        with pipe:
            if isinstance(self.source, WebDataset):
                order = self._shard_order(epoch)
                shards = [self.index.shards[i] for i in order]
                encoded, label = fn.readers.webdataset(
                    paths=[s.path for s in shards], index_paths=[s.dali_index for s in shards],
                    ext=[self.source.image, "cls"] if self.index.labeled else [self.source.image],
                    missing_component_behavior="error", pad_last_batch=True, name="reader",
                    **shuffle) if self.index.labeled else (fn.readers.webdataset(
                        paths=[s.path for s in shards], index_paths=[s.dali_index for s in shards],
                        ext=[self.source.image], missing_component_behavior="error", pad_last_batch=True,
                        name="reader", **shuffle), None)
            else:
                files, labels = self._files()
                encoded, label = fn.readers.file(files=files, labels=labels, pad_last_batch=True, name="reader",
                                                 **shuffle)
            images = lower(self.transforms, encoded, Ctx("gpu" if gpu else "cpu", epoch_seed),
                           channels_last=self.channels_last)
            pipe.set_outputs(images, label) if label is not None else pipe.set_outputs(images, encoded)
        pipe.build()
        self._pipe, self._ready_epoch = pipe, epoch

    def _shard_order(self, epoch: int) -> np.ndarray:
        n = len(self.index.shards)
        return shard_permutation(n, seed=self.seed, epoch=epoch) if self.shuffle else np.arange(n)

    def _files(self) -> tuple[list[str], list[int]]:
        files, labels = [], []
        for shard in self.index.shards:
            files += [os.path.join(shard.path, k) for k in shard.keys]
            labels += [int(x) for x in shard.labels]
        return files, labels

    # --------------------------------------------------------------------- run --
    def run(self, order: np.ndarray, num_batches: int, epoch: int) -> Iterator[tuple[torch.Tensor, Any, list[str]]]:
        """Yields ``num_batches`` batches of epoch ``epoch``. ``order`` is the torch backend's exact
        sample order; DALI's reader follows the same shard order and its own sample buffer."""
        # Without shuffling every epoch reads the same order, so a pipeline left at an epoch
        # boundary is reused; with shuffling each epoch gets its own shard order and seed.
        if self._ready_epoch is None or (self.shuffle and self._ready_epoch != epoch):
            self._build(epoch)
        self._ready_epoch = None  # an epoch left half-read leaves the reader mid-epoch
        reader_batches = -(-len(order) // self.batch_size)
        last = len(order) - (reader_batches - 1) * self.batch_size
        for b in range(num_batches):
            images, aux = self._run_once()
            yield self._to_torch(images, aux, last if b == reader_batches - 1 else self.batch_size)
        if num_batches < reader_batches:  # drop_last: read the dropped batch so the reader ends its epoch
            self._run_once()
        self._ready_epoch = epoch + 1

    def _run_once(self) -> tuple[Any, Any]:
        try:
            return self._pipe.run()
        except RuntimeError as e:
            raise _data_error(e, self.index) from e

    def _to_torch(self, images: Any, aux: Any, keep: int) -> tuple[torch.Tensor, Any, list[str]]:
        batch = torch.from_dlpack(images.as_tensor())
        if self.channels_last:
            batch = batch.permute(0, 3, 1, 2)
        infos = [aux[i].source_info() for i in range(keep)]
        keys, shards = zip(*(self._key(info) for info in infos)) if keep else ((), ())
        labels = None
        if self.index.labeled:
            if isinstance(self.source, WebDataset):
                labels = torch.tensor([_parse_label(np.asarray(aux[i]), shards[i], keys[i]) for i in range(keep)],
                                      dtype=torch.int64)
            else:
                labels = torch.from_numpy(np.asarray(aux.as_tensor())[:keep, 0].astype(np.int64))
            if self.device.type == "cuda":
                labels = labels.to(self.device, non_blocking=True)
        return batch[:keep], labels, list(keys)

    def _key(self, info: str) -> tuple[str, str]:
        if isinstance(self.source, WebDataset):  # "<shard path>:<offset>:<member name>"
            shard, _, name = info.rsplit(":", 2)
            return split_key(name)[0], shard
        return os.path.relpath(info, self.source.root).replace(os.sep, "/"), self.source.root


def _parse_label(raw: np.ndarray, shard: str, key: str) -> int:
    try:
        return int(bytes(raw).decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise SampleError(f"label of sample {key!r} in shard {shard!r} is not an ASCII integer: {bytes(raw)[:40]!r}",
                          shard=shard, key=key) from None


def _data_error(error: RuntimeError, index: Index) -> Exception:
    """DALI's error names the failing member as ``<shard>:<offset>:<name>``; re-raise it naming
    the shard and the key."""
    message = str(error)
    for shard in index.shards:
        m = re.search(re.escape(shard.path) + r":\d+:([^\s\]\)'\"]+)", message)
        if m:
            key = split_key(m.group(1))[0]
            return SampleError(f"sample {key!r} in shard {shard.path!r}: DALI failed: "
                               f"{message.strip().splitlines()[0][:500]}", shard=shard.path, key=key)
        if shard.labels is not None:
            m = re.search(re.escape(os.path.join(shard.path, "")) + r"([^\s\]\)'\"]+)", message)
            if m:
                return SampleError(f"sample {m.group(1)!r} in {shard.path!r}: DALI failed: "
                                   f"{message.strip().splitlines()[0][:500]}", shard=shard.path, key=m.group(1))
    return error
