"""The torch backend's reused batch buffers (``gpupipe/backends/_slots.py``): a worker writes a
batch into shared memory it wrote before only once the training process let go of the batch that
was there — whoever still holds a batch, a view of it or a NumPy array of it keeps its memory."""

from __future__ import annotations

import gc
import io
import pickle

import numpy as np
import pytest
import torch
import webdataset as wds

import gpupipe as gp
from gpupipe.backends._slots import Arena, Slots

from .support.data import write_webdataset_shards


def _flags(loader) -> list[list[int]]:
    return loader._runner._slots.flags.tolist()


@pytest.fixture(scope="module")
def urls(tmp_path_factory) -> list[str]:
    return write_webdataset_shards(str(tmp_path_factory.mktemp("slots")), (12, 12), prefix="slots")


def _loader(urls, **options):
    pipe = gp.Pipeline(urls, [gp.transforms.RandomResizedCrop(24), gp.transforms.ToDtype(torch.float32, scale=True)])
    return gp.Loader(pipe, 4, backend="torch", num_workers=2, shuffle=True, seed=5, **options)


class TestHeldBatchesKeepTheirMemory:
    def test_batches_kept_across_epochs_are_never_overwritten(self, urls):
        """Every batch of three epochs kept (more than the slots): each still holds what it was
        delivered with, while the workers go on writing."""
        with _loader(urls) as loader:
            kept = []
            for epoch in range(3):
                loader.set_epoch(epoch)
                for batch in loader:
                    kept.append((batch, batch.images.clone(), batch.labels.clone()))
            assert sum(f for row in _flags(loader) for f in row) > 0  # some are in slots, held
            for batch, images, labels in kept:
                assert torch.equal(batch.images, images) and torch.equal(batch.labels, labels)

    def test_a_released_slot_is_written_again_and_a_view_holds_it(self, urls):
        with _loader(urls) as loader:
            for epoch in range(2):  # the first batch of each worker sizes its slots
                loader.set_epoch(epoch)
                for _last in loader:
                    pass
            del _last
            gc.collect()
            assert _flags(loader) == [[0] * 4, [0] * 4]  # all let go: every slot free
            loader.set_epoch(2)
            iterator = iter(loader)
            batch = next(iterator)
            row, expected = batch.images[1], batch.images[1].clone()
            as_numpy = batch.images.numpy()
            del batch
            gc.collect()
            held = sum(f for r in _flags(loader) for f in r)
            assert held >= 1  # the view and the array keep it
            for _last in iterator:
                pass
            del _last
            assert torch.equal(row, expected) and np.array_equal(as_numpy[1], expected.numpy())
            del row, as_numpy
            gc.collect()
            assert _flags(loader) == [[0] * 4, [0] * 4]

    def test_a_forked_child_dropping_a_batch_releases_nothing(self, urls):
        """A process forked from the training process inherits its batches; dropping them there
        (or exiting) must not free the training process's slot."""
        import os

        with _loader(urls) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                batches = list(loader)
            held = _flags(loader)
            pid = os.fork()
            if pid == 0:  # the child: drop every batch, collect, exit as Python does
                del batches
                gc.collect()
                os._exit(0 if _flags(loader) == held else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0 and _flags(loader) == held
            assert sum(f for row in held for f in row) > 0
            del batches

    @pytest.mark.gpu
    def test_on_the_gpu_path_the_pinned_copy_releases_it(self, urls):
        """``device="cuda"``: DataLoader's pin-memory thread copies the batch out of the slot, so
        the slot is free as soon as the batch is delivered."""
        with _loader(urls, device="cuda") as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                batches = list(loader)
            gc.collect()
            assert len(batches) == 6 and _flags(loader) == [[0] * 4, [0] * 4]


class TestArrays:
    def test_stacked_arrays_share_the_slot_with_nothing_overwritten(self, tmp_path):
        path = str(tmp_path / "arrays-000000.tar")
        with wds.TarWriter(path) as sink:
            for i in range(24):
                buffer = io.BytesIO()
                np.save(buffer, np.full((8, 16), i, np.float32))
                sink.write({"__key__": f"k{i:03d}", "npy": buffer.getvalue(), "cls": str(i).encode()})
        source = gp.WebDataset(path, fields={"x": "npy", "label": "cls"})
        with gp.Loader(gp.Pipeline(source), 4, backend="torch", num_workers=2, shuffle=True, seed=1) as loader:
            kept = []
            for epoch in range(3):
                loader.set_epoch(epoch)
                kept += list(loader)
        for batch in kept:
            assert batch.images is None and batch.labels is not None
            assert torch.equal(batch["x"][:, 0, 0], batch.labels.to(torch.float32))  # each row its own sample's
            assert bool((batch["x"] == batch["x"][:, :1, :1]).all())


class TestArena:
    def test_layouts_alignment_and_overflow(self):
        slots = Slots(1, 2)
        try:
            slots._need = 1000
            arena = slots.arena(0)
            a = arena.empty((2, 3, 4, 5), torch.float32, channels_last=True)
            b = arena.empty((3,), torch.int64)
            assert a.is_contiguous(memory_format=torch.channels_last) and b.data_ptr() % 64 == 0
            c = arena.empty((1000,), torch.uint8)  # past the slot's end: fresh shared memory
            assert arena.buffer is not None and c.is_shared()
            assert c.untyped_storage().data_ptr() != arena.buffer.untyped_storage().data_ptr()
            assert slots.flags.tolist() == [[1, 0]]
            ticket = arena.ticket()
            assert ticket is not None and len(ticket.tensors) == 2 and slots._need >= 1000 + 64
            assert slots.arena(0).slot == 1 and slots.arena(0).slot is None  # all taken: fresh memory
        finally:
            slots.close()

    def test_unpickled_where_the_pool_is_not_it_is_nothing(self):
        slots = Slots(1, 1)
        arena = slots.arena(0)
        arena.empty((4,), torch.float32)
        data = pickle.dumps(arena.ticket())
        slots.close()  # as in a process without the pool
        assert pickle.loads(data) is None

    def test_fresh_arena(self):
        arena = Arena.fresh()
        t = arena.empty((2, 2), torch.float32)
        assert t.is_shared() and arena.ticket() is None
