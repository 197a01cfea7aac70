"""Elastic resume (``Loader.load_state_dict`` on another world size or batch size): an epoch
interrupted at ``W`` ranks and finished at ``W'`` yields every sample of the epoch exactly once
over the two runs, each with the image an uninterrupted run gives it, in equal batch counts on
the new ranks; on every backend, over tar shards and an ImageFolder tree.

Ranks are simulated in one process (``rank=``, ``world_size=``, an explicit seed); the plan
arithmetic is tested alone in tests/test_plan.py::TestElastic.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

PAIRS = [(old, new) for old, new in itertools.product((1, 2, 3, 4), repeat=2) if old != new]
EPOCH = 1


def pipeline(source) -> gp.Pipeline:
    return gp.Pipeline(source, [T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)])


@pytest.fixture(params=["tar", "folder"])
def source(request, uneven_shards, image_folder):
    return gp.WebDataset(uneven_shards) if request.param == "tar" else gp.ImageFolder(image_folder)


def loaders(backend, source, world: int, batch_size: int, **options) -> list[gp.Loader]:
    return [
        backend.loader(pipeline(source), batch_size, shuffle=True, seed=5, rank=r, world_size=world, num_workers=0,
                       **options)
        for r in range(world)
    ]  # fmt: skip


def take_batches(batches) -> dict[str, torch.Tensor]:
    """``{key: image}`` of the valid samples of ``batches``."""
    out: dict[str, torch.Tensor] = {}
    for batch in batches:
        for key, ok, image in zip(batch.keys, batch.valid.tolist(), batch.images, strict=True):
            if ok:
                assert key not in out, f"{key} twice on one rank"
                out[key] = image.cpu()
    return out


def take(loader: gp.Loader, batches: int | None = None) -> dict[str, torch.Tensor]:
    """``{key: image}`` of the valid samples of the next ``batches`` batches (all: ``None``)."""
    iteration = iter(loader)
    try:
        return take_batches(list(itertools.islice(iteration, batches)))
    finally:
        iteration.close()


def reference(backend, source, **options) -> dict[str, torch.Tensor]:
    (whole,) = loaders(backend, source, 1, 4, **options)
    with whole:
        whole.set_epoch(EPOCH)
        return take(whole)


class TestElasticResume:
    @pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{o}to{n}" for o, n in PAIRS])
    def test_every_sample_once_with_its_image(self, backend, source, clean_env, old, new):
        expected = reference(backend, source)
        before: dict[str, torch.Tensor] = {}
        first = loaders(backend, source, old, 2)
        for loader in first:
            loader.set_epoch(EPOCH)
            part = take(loader, 1)  # one step, on every rank: a job stopped after its first step
            assert not part.keys() & before.keys()
            before.update(part)
        states = [loader.state_dict() for loader in first]
        for loader in first:
            loader.close()
        after: dict[str, torch.Tensor] = {}
        second = loaders(backend, source, new, 3)
        whole_len = {len(loader) for loader in second}
        resumed_len, yielded = set(), set()
        for r, loader in enumerate(second):
            with loader:
                loader.load_state_dict(states[r % old])  # any rank's state says where all were
                loader.set_epoch(EPOCH)
                resumed_len.add(len(loader))
                batches = list(loader)
                yielded.add(len(batches))
                part = take_batches(batches)
                assert not part.keys() & after.keys() and not part.keys() & before.keys()
                after.update(part)
                loader.set_epoch(EPOCH + 1)  # the next epoch is whole again
                whole_len.add(len(loader))
        assert sorted([*before, *after]) == sorted(expected)
        for key, image in {**before, **after}.items():
            torch.testing.assert_close(image, expected[key], rtol=0, atol=0, msg=key)
        # equal batch counts on the new ranks, numbered on from the one step taken before (as a trainer
        # restarting its batch counter from the checkpoint counts): len(loader) is 1 + those left
        assert len(yielded) == 1 and resumed_len == {1 + n for n in yielded}
        assert len(whole_len) == 1

    def test_twice_interrupted_and_under_drop_last(self, backend, uneven_shards, clean_env):
        """3 ranks -> 2 ranks (interrupted again) -> 4 ranks, with drop_last: the epoch's samples
        (those a 3-rank run with drop_last yields) once, every batch full."""
        source = gp.WebDataset(uneven_shards)
        expected: list[str] = []
        for whole in loaders(backend, source, 3, 2, drop_last=True):
            with whole:
                whole.set_epoch(EPOCH)
                expected += list(take(whole))
        first = loaders(backend, source, 3, 2, drop_last=True)
        got: list[str] = []
        for loader in first:
            loader.set_epoch(EPOCH)
            got += list(take(loader, 1))
        state = first[0].state_dict()
        for loader in first:
            loader.close()
        second = loaders(backend, source, 2, 3, drop_last=True)
        for loader in second:
            loader.load_state_dict(state)
            loader.set_epoch(EPOCH)
            assert loader.state_dict()["batches_yielded"] == 1  # the step taken at 3 ranks
            got += list(take(loader, 1))
        state = second[1].state_dict()
        assert state["layout"] is not None and state["batches_yielded"] == 2
        for loader in second:
            loader.close()
        for loader in loaders(backend, source, 4, 2, drop_last=True):
            with loader:
                loader.load_state_dict(state)
                loader.set_epoch(EPOCH)
                batches = list(loader)
                assert all(len(b.keys) == 2 for b in batches)
                got += [k for b in batches for k, ok in zip(b.keys, b.valid.tolist(), strict=True) if ok]
        assert sorted(got) == sorted(expected) and len(got) == len(set(got))

    def test_a_resumed_epoch_iterated_again_starts_at_its_first_batch(self, backend, uneven_shards, clean_env):
        """A loop broken off and restarted (no set_epoch) runs the epoch again from where the
        resume left it, as a whole epoch restarts from its batch 0 (not from batch -offset)."""
        old = loaders(backend, gp.WebDataset(uneven_shards), 2, 2)
        for loader in old:
            next(iter(loader))
        new = backend.loader(pipeline(gp.WebDataset(uneven_shards)), 3, rank=0, world_size=3, shuffle=True, seed=5,
                             num_workers=0)  # fmt: skip
        new.load_state_dict(old[0].state_dict())
        first = next(iter(new)).keys  # (the iteration broken off)
        whole = [b.keys for b in new]
        assert whole[0] == first and len(whole) == len(new) - 1 == 2

    def test_rank_0s_state_resumes_every_rank_exactly(self, backend, uneven_shards, clean_env):
        """What Lightning does (it checkpoints rank 0's state): on the same world size, each rank
        loading rank 0's state yields exactly what it would have yielded next."""
        source = gp.WebDataset(uneven_shards)
        first, whole, second = (
            loaders(backend, source, 2, 2),
            loaders(backend, source, 2, 2),
            loaders(backend, source, 2, 2),
        )
        for a in first:
            a.set_epoch(EPOCH)
            take(a, 1)
        state = first[0].state_dict()
        for w, b in zip(whole, second, strict=True):
            w.set_epoch(EPOCH)
            b.load_state_dict(state)
            b.set_epoch(EPOCH)
            assert len(b) == len(w) and list(take(b)) == list(take(w))[2:]  # batch 0 was taken: 2 samples
        for loader in (*first, *whole, *second):
            loader.close()

    def test_other_settings_are_still_refused(self, backend, uneven_shards, clean_env):
        source = gp.WebDataset(uneven_shards)
        (a,) = loaders(backend, source, 1, 2)
        b = backend.loader(pipeline(source), 2, shuffle=True, seed=5, rank=0, world_size=2, num_workers=0,
                           drop_last=True)  # fmt: skip
        with a, b, pytest.raises(gp.ConfigError, match="drop_last"):
            b.load_state_dict(a.state_dict())

    def test_a_damaged_layout_is_refused(self, backend, uneven_shards, clean_env):
        source = gp.WebDataset(uneven_shards)
        a, b = loaders(backend, source, 2, 2)
        c = backend.loader(pipeline(source), 2, shuffle=True, seed=5, rank=0, world_size=3, num_workers=0)
        with a, b, c:
            a.set_epoch(EPOCH)
            next(iter(a))
            c.load_state_dict(a.state_dict())
            state = c.state_dict()
            for layout in ({**state["layout"], "ranges": [[0, 1000]]}, {**state["layout"], "first": {"x": 1}}):
                with pytest.raises(gp.ConfigError, match="damaged loader state"):
                    b.load_state_dict({**state, "layout": layout})
