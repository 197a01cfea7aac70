"""The torch backend's batch buffers: shared memory that a worker process reuses once the training
process has let go of the batch it held.

A worker writes each batch (its images, its stacked arrays) into shared memory, so that the batch
crosses to the training process without a copy. Fresh shared memory costs the kernel a zeroed page
per 4 KB: on the 2-core development machine a batch copied into fresh shared memory moved at
1.2 GB/s, into memory written before at 10 GB/s (``bench/results/2026-11-26-arrays-cpu.md``). So
each worker keeps a few buffers (*slots*), and a shared table of flags says which of them the
training process still holds:

- In a worker, :meth:`Slots.arena` takes a free slot (flag 0 → 1), grown to the largest batch
  seen, and the batch's tensors are carved from it (:meth:`Arena.empty`). With none free (the
  training process keeps batches, e.g. ``list(loader)``) the batch gets fresh memory, as before.
- The batch carries a :class:`Ticket`. Unpickled in the training process (in DataLoader's
  pin-memory thread, or where the batch is received, or dropped unseen at an epoch's end), it
  moves the batch's tensors onto one storage whose last user, when it goes — the batch, a view of
  it, a NumPy array of it — sets the flag back to 0 (``weakref.finalize``).

Nothing waits for a slot, and a slot whose batch never reached the training process (a worker
that died with it) stays taken: the worker allocates as before.
"""

from __future__ import annotations

import os
import uuid
import weakref
from typing import Any

import torch

__all__ = ["Slots", "Arena", "Ticket"]

ALIGN = 64  # bytes: every tensor carved from a slot starts at a multiple (any dtype's alignment)

_POOLS: dict[str, Slots] = {}  # this process's pools by id (a forked worker inherits the table)


class Slots:
    """``per_worker`` reusable batch buffers for each of ``workers`` worker processes. Made in the
    training process before the workers fork; the flags are shared memory, the buffers each
    worker's own."""

    def __init__(self, workers: int, per_worker: int) -> None:
        self.id = uuid.uuid4().hex
        self.flags = torch.zeros((workers, per_worker), dtype=torch.int8).share_memory_()
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}  # in a worker: (worker, slot) -> uint8 [N]
        self._need = 0  # in a worker: the bytes of its largest batch yet
        _POOLS[self.id] = self

    def arena(self, worker: int) -> Arena:
        """A free slot of ``worker`` (the flag set: taken), big enough for the largest batch yet;
        an arena without a slot (fresh memory) when none is free."""
        flags = self.flags[worker].numpy()
        for k in range(len(flags)):
            if flags[k] == 0:
                buffer = self._buffers.get((worker, k))
                if buffer is None or buffer.numel() < self._need:
                    buffer = self._buffers[worker, k] = torch.empty(max(self._need, ALIGN), dtype=torch.uint8)
                    buffer.share_memory_()
                flags[k] = 1
                return Arena(self, worker, k, buffer)
        return Arena(self, worker, None, None)

    def release(self, worker: int, slot: int) -> None:
        """The training process let go of the slot's batch: the worker may write it again."""
        self.flags[worker, slot] = 0

    def close(self) -> None:
        _POOLS.pop(self.id, None)


class Arena:
    """One batch's tensors, carved from a slot in order (fresh shared memory past its end)."""

    def __init__(self, slots: Slots | None, worker: int, slot: int | None, buffer: torch.Tensor | None) -> None:
        self.slots, self.worker, self.slot, self.buffer = slots, worker, slot, buffer
        self.used = 0
        self.tensors: list[torch.Tensor] = []

    @classmethod
    def fresh(cls) -> Arena:
        """An arena of fresh shared memory only (no pool)."""
        return cls(None, 0, None, None)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, *, channels_last: bool = False) -> torch.Tensor:
        """An uninitialised ``shape`` tensor of ``dtype`` in shared memory (channels-last: a
        ``[B, C, H, W]`` shape laid out as ``[B, H, W, C]``)."""
        shape = tuple(int(n) for n in shape)
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        start = -(-self.used // ALIGN) * ALIGN
        self.used = start + nbytes
        if self.buffer is None or self.used > self.buffer.numel():
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            return torch.empty(shape, dtype=dtype, memory_format=fmt).share_memory_()
        flat = self.buffer[start : start + nbytes].view(dtype)
        if channels_last:
            b, c, h, w = shape
            out = flat.view(b, h, w, c).permute(0, 3, 1, 2)
        else:
            out = flat.view(shape)
        self.tensors.append(out)
        return out

    def ticket(self) -> Ticket | None:
        """What the batch carries to the training process (``None``: no slot, or nothing in it);
        the slot is sized to this batch from now on if it was short."""
        if self.slots is not None:
            self.slots._need = max(self.slots._need, self.used)
        if self.slots is None or self.slot is None or self.buffer is None:
            return None
        if not self.tensors:
            self.slots.release(self.worker, self.slot)
            return None
        return Ticket(self.slots.id, self.worker, self.slot, self.buffer, tuple(self.tensors))


class Ticket:
    """A batch's claim on its slot. Pickled in the worker with the slot's buffer and the batch's
    tensors in it (the same objects the batch holds: pickle sends each once); rebuilt in the
    training process by :func:`_adopt`, which moves those tensors onto a storage watched for its
    last user."""

    def __init__(self, pool: str, worker: int, slot: int, buffer: torch.Tensor,
                 tensors: tuple[torch.Tensor, ...]) -> None:  # fmt: skip
        self.pool, self.worker, self.slot, self.buffer, self.tensors = pool, worker, slot, buffer, tensors

    def __reduce__(self) -> tuple[Any, ...]:
        return _adopt, (self.pool, self.worker, self.slot, self.buffer, self.tensors)


def _adopt(pool: str, worker: int, slot: int, buffer: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> None:
    """In the training process: the batch's tensors moved (in place, ``set_``) onto a storage
    that holds a NumPy view of the slot's buffer; when that view goes (every tensor and view of
    the batch gone), the slot is released. Unpickled by a process without the pool: nothing."""
    slots = _POOLS.get(pool)
    if slots is None:
        return None
    array = buffer.numpy()
    storage = torch.from_numpy(array).untyped_storage()
    for t in tensors:
        t.set_(storage, t.storage_offset(), t.size(), t.stride())
    done = weakref.finalize(array, _release, slots, os.getpid(), worker, slot)
    done.atexit = False  # at exit the slots go with the workers
    return None


def _release(slots: Slots, pid: int, worker: int, slot: int) -> None:
    """The batch's last user went; in a process forked from the training process (which
    inherits the batch, and may drop it), nothing: the training process may still hold it."""
    if os.getpid() == pid:
        slots.release(worker, slot)
