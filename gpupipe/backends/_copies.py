"""The GPU time of a runner's host-to-device copies, per batch: two CUDA events around each
batch's copies on the consumer's stream, read once the device has passed them (``query``), never
waited on. A batch reports the copies of the latest batch whose events are done, usually the one
before it: the time lags a batch, which the averages over an epoch do not mind."""

from __future__ import annotations

import collections
from typing import Any

import torch

__all__ = ["CopyClock", "H2D"]

H2D = "h2d"  # its name in a batch's times (RawBatch.times), seconds
_PENDING = 64  # pairs kept at most: older ones are let go unread (a device that never catches up)


class CopyClock:
    """Times the copies between :meth:`start` and :meth:`stop` on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque(maxlen=_PENDING)

    def start(self) -> Any:
        """An event recorded before a batch's copies."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stop(self, started: Any) -> float | None:
        """Records the event after the batch's copies; returns the seconds of the latest copies
        the device has finished (``None``: none yet)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._pending.append((started, event))
        seconds = None
        while self._pending and self._pending[0][1].query():
            first, last = self._pending.popleft()
            seconds = first.elapsed_time(last) / 1000.0
        return seconds
