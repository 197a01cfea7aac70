"""The stage ahead of the step: on a GPU, batch ``b + 1``'s tail is launched on a stream of its
own before batch ``b`` is handed to the training loop, so that the GPU runs it beside the step of
batch ``b`` rather than before the step of ``b + 1``.

:func:`ahead` is the order of it (any device; tested on the CPU with a stand-in stream);
:class:`SideStream` the CUDA part, the usual pattern of a prefetcher on its own stream:

- the side stream waits for the consumer's (the batch's copies and DALI's hand-over are queued
  there), runs the tail, and records an event;
- the consumer's stream waits for that event before the batch is handed over, and each output
  tensor, made by the caching allocator on the side stream, is marked used on the consumer's
  (``record_stream``), so that its memory is not given to the side stream again while the step
  reads it.

The inputs need no marking: a runner's batch is kept alive by the loader until the tail that
reads it is handed over (DALI takes its memory back only after the tensor is freed and a
device-wide synchronization; the torch backend's batch is the caching allocator's, on the
consumer's stream, which the side stream waited for).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import torch

__all__ = ["ahead", "SideStream"]

In = TypeVar("In")
Out = TypeVar("Out")


def ahead(items: Iterator[In], launch: Callable[[In], Out], finish: Callable[[Out], Any], *,
          depth: int) -> Iterator[Any]:  # fmt: skip
    """``finish(launch(item))`` for each of ``items``, in order, with ``depth`` items launched
    before the one being finished is yielded (``0``: each launched and finished in turn). An
    exception from ``items`` or ``launch`` is raised where that item would have been yielded,
    after the items before it."""
    pending: collections.deque[Out] = collections.deque()
    iterator = iter(items)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            break
        except Exception:  # the batches before it first, as without the lookahead
            while pending:
                yield finish(pending.popleft())
            raise
        try:  # (apart: a StopIteration out of launch is an error, not the end of the items)
            launched = launch(item)
        except Exception:
            while pending:
                yield finish(pending.popleft())
            raise
        pending.append(launched)
        while len(pending) > depth:
            yield finish(pending.popleft())
    while pending:
        yield finish(pending.popleft())


class SideStream(Generic[Out]):
    """Launches a batch's stage on a stream of its own on ``device`` and hands its outputs (a
    tensor, or tuples of tensors and ``None``) to the consumer's stream (torch's current one, in
    the iterating thread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def launch(self, run: Callable[[], Out], uses: Any = ()) -> tuple[Out, Any]:
        """``run()`` on the side stream, after the consumer's queued work. ``uses``: its inputs
        (tensors, or tuples of them), marked used on the side stream: the stage writes into some
        (MixUp, in place), and a batch dropped unfinished (an epoch left early) must not have its
        memory handed to the consumer's stream while the side stream's work on it is queued.
        (Memory not from torch's caching allocator, DALI's, is left as it is: DALI takes it back
        only after a device-wide synchronization.)"""
        consumer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(consumer)
        for tensor in _tensors(uses):
            tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = run()
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def finish(self, launched: tuple[Out, Any]) -> Out:
        out, event = launched
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for tensor in _tensors(out):
            tensor.record_stream(consumer)
        return out


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``out``: a tensor, or tuples of them (``None`` left out)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, tuple):
        for item in out:
            yield from _tensors(item)
