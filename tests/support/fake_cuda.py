"""A fake CUDA for testing device logic on a machine without a GPU: ``torch.cuda`` reports a
number of GPUs with given names, and keeps a current device that ``set_device`` and the
``torch.cuda.device(...)`` context change. Nothing runs on a device: code that launches work on
one still needs a real GPU (``gpu``-marked tests)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch


@dataclasses.dataclass
class FakeCuda:
    names: list[str]
    capability: tuple[int, int] = (9, 0)
    driver: int = 13000  # cuDriverGetVersion's encoding: 1000 * major + 10 * minor
    current: int = 0

    def index(self, device: Any) -> int:
        if isinstance(device, int):
            return device
        dev = torch.device(device)
        assert dev.type == "cuda", dev
        return self.current if dev.index is None else dev.index

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        fake = self

        class device:  # stands in for torch.cuda.device
            def __init__(self, dev: Any) -> None:
                self.index = fake.index(dev)

            def __enter__(self) -> None:
                self.previous, fake.current = fake.current, self.index

            def __exit__(self, *exc: object) -> None:
                fake.current = self.previous

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.names))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", lambda dev: setattr(self, "current", self.index(dev)))
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: self.names[self.index(dev or 0)])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: self.capability)
        return self


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    """Four H100s, current device 0."""
    return FakeCuda(["NVIDIA H100 80GB HBM3"] * 4).install(monkeypatch)
