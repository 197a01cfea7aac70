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
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import BackendUnavailableError, SampleError, ShardError
from .._plan import shard_permutation
from .._sources import Index, ImageFolder, WebDataset, parse_label, split_key
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
        from nvidia.dali import Pipeline, fn

        gpu = self.device.type == "cuda"
        epoch_seed = (self.seed * 1_000_003 + epoch * 7_919) % (2**31 - 1)
        pipe = Pipeline(batch_size=self.batch_size, num_threads=self.num_threads,
                        device_id=(self.device.index or 0) if gpu else None, seed=epoch_seed,
                        prefetch_queue_depth=self.prefetch, exec_dynamic=True)
        shuffle = dict(random_shuffle=True, initial_fill=self.buffer, seed=epoch_seed) if self.shuffle else {}
        with pipe:
            if isinstance(self.source, WebDataset):
                shards = [self.index.shards[i] for i in self._shard_order(epoch)]
                ext = [self.source.image, "cls"] if self.index.labeled else [self.source.image]
                outputs = fn.readers.webdataset(
                    paths=[s.path for s in shards], index_paths=[s.dali_index for s in shards], ext=ext,
                    missing_component_behavior="error", pad_last_batch=True, name="reader", **shuffle)
                encoded, label = (outputs[0], outputs[1]) if self.index.labeled else (outputs, None)
            else:
                files, labels = self._files()
                encoded, label = fn.readers.file(files=files, labels=labels, pad_last_batch=True, name="reader",
                                                 **shuffle)
            images = lower(self.transforms, encoded, Ctx("gpu" if gpu else "cpu", epoch_seed),
                           channels_last=self.channels_last)
            # the encoded images are an output too: their source_info names shard and key
            pipe.set_outputs(images, encoded, *([label] if label is not None else []))
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
        yielded: set[str] = set()
        for b in range(num_batches):
            images, labels, keys = self._to_torch(*self._run_once(epoch, b, yielded),
                                                  keep=last if b == reader_batches - 1 else self.batch_size)
            yielded.update(keys)
            yield images, labels, keys
        if num_batches < reader_batches:  # drop_last: read the dropped batch so the reader ends its epoch
            self._run_once(epoch, num_batches, yielded)
        self._ready_epoch = epoch + 1

    def _run_once(self, epoch: int, batch: int, yielded: set[str]) -> tuple[Any, ...]:
        try:
            return self._pipe.run()
        except RuntimeError as e:
            self._ready_epoch = None  # DALI's pipeline is unusable after an error: rebuild next time
            raise self._locate_bad_sample(e, epoch, batch, yielded) from e

    def _locate_bad_sample(self, error: RuntimeError, epoch: int, batch: int, yielded: set[str]) -> Exception:
        """DALI's errors do not name the sample. The failing one is among the first
        ``(batch + 2 + prefetch) * batch_size (+ shuffle buffer)`` samples of this epoch's shard
        order (the reader only mixes samples it has read): decode those not yet yielded with
        gpupipe's own decoder and name the first that fails."""
        from .._decode import decode_rgb

        reach = (batch + 2 + self.prefetch) * self.batch_size + (self.buffer if self.shuffle else 0)
        detail = str(error).strip().splitlines()
        detail = next((line for line in reversed(detail) if "failure" in line or "rror" in line), detail[0])[:300]
        for s in self._shard_order(epoch):
            shard = self.index.shards[s]
            first = int(self.index.offsets[s])
            for i in range(len(shard)):
                if reach <= 0:
                    break
                reach -= 1
                raw = self.index.read(first + i)
                if raw.key in yielded:
                    continue
                try:
                    decode_rgb(raw.data, shard=raw.shard, key=raw.key)
                except SampleError as bad:
                    return SampleError(f"{bad} (DALI: {detail})", shard=bad.shard, key=bad.key)
        return SampleError(f"DALI failed on a sample of batch {batch} of epoch {epoch}, which gpupipe's decoder "
                           f"reads fine: {detail}")

    def _to_torch(self, images: Any, encoded: Any, aux: Any = None, *, keep: int) -> tuple[torch.Tensor, Any, list[str]]:
        batch = torch.from_dlpack(images.as_tensor())
        if self.channels_last:
            batch = batch.permute(0, 3, 1, 2)
        infos = [encoded[i].source_info() for i in range(keep)]
        keys, shards = zip(*(self._key(info) for info in infos)) if keep else ((), ())
        labels = None
        if self.index.labeled:
            if isinstance(self.source, WebDataset):
                labels = torch.tensor([parse_label(bytes(np.asarray(aux[i])), shard=shards[i], key=keys[i])
                                       for i in range(keep)], dtype=torch.int64)
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
