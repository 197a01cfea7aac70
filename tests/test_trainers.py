"""A gp.Loader inside the trainers people use (issue 25): the batch survives their collection
functions whole (keys and the validity mask included), Lightning advances the epoch itself through
``loader.sampler`` and resumes mid-epoch from its own checkpoint (the loader is stateful), a loader
iterated again without ``set_epoch`` goes on with the next epoch instead of replaying one, and
DataLoader-only arguments say what to do instead. Lightning and Accelerate are test dependencies."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T

from .support.checkers import val

ROOT = os.path.join(os.path.dirname(__file__), "..")


def batch() -> gp.Batch:
    return gp.Batch(
        torch.zeros(3, 3, 4, 4), torch.tensor([1, 2, 3]), ["a", "b", "c"], torch.tensor([True, True, False])
    )


def same(a: gp.Batch, b: gp.Batch) -> bool:
    return (
        isinstance(b, gp.Batch)
        and a.keys == b.keys
        and torch.equal(a.valid, b.valid)
        and torch.equal(a.images, b.images)
        and torch.equal(torch.as_tensor(a.labels), torch.as_tensor(b.labels))
    )


class TestBatch:
    def test_unpacks_as_images_and_labels(self):
        b = batch()
        images, labels = b
        assert images is b.images and labels is b.labels and b[1] is b.labels and len(b) == 2

    def test_copy_pickle_and_pytree_keep_it_whole(self):
        from torch.utils import _pytree

        b = batch()
        assert same(b, copy.copy(b)) and same(b, copy.deepcopy(b)) and same(b, pickle.loads(pickle.dumps(b)))
        doubled = _pytree.tree_map(lambda x: x * 2 if x.dtype != torch.bool else x, b)
        assert isinstance(doubled, gp.Batch) and doubled.keys == b.keys and torch.equal(doubled[1], b[1] * 2)

    def test_the_trainers_collection_functions_keep_it_whole(self):
        from accelerate.utils import send_to_device
        from lightning.pytorch.utilities import move_data_to_device
        from lightning_utilities.core.apply_func import apply_to_collection

        b = batch()
        assert same(b, move_data_to_device(b, torch.device("cpu")))  # Lightning's batch_to_device
        assert same(b, send_to_device(b, "cpu"))  # Accelerate's
        plus = apply_to_collection(b, torch.Tensor, lambda x: x + 0)
        assert same(b, plus)
        assert same(b, b.to("cpu", non_blocking=True))

    def test_fields_by_name_travel_with_it(self):
        """``batch["name"]`` reads a field; copies, pickles, pytree maps, the trainers' collection
        functions and ``to`` keep the fields, tensors moved and lists as they are."""
        from accelerate.utils import send_to_device
        from lightning.pytorch.utilities import move_data_to_device
        from torch.utils import _pytree

        b = batch()
        b.fields.update(text=["x", "y", "z"], depth=torch.ones(3, 2))
        assert (
            b["text"] == ["x", "y", "z"] and b["depth"] is b.fields["depth"] and "fields=['text', 'depth']" in repr(b)
        )
        with pytest.raises(KeyError, match=r"no field 'mask'; its fields: 'text', 'depth'"):
            b["mask"]
        with pytest.raises(KeyError, match="the source gives none"):
            batch()["text"]
        for other in (copy.deepcopy(b), pickle.loads(pickle.dumps(b)), move_data_to_device(b, torch.device("cpu")),
                      send_to_device(b, "cpu"), b.to("cpu"), _pytree.tree_map(lambda x: x, b)):  # fmt: skip
            assert same(b, other) and other["text"] == b["text"] and torch.equal(other["depth"], b["depth"])
        doubled = _pytree.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) and x.dtype != torch.bool else x, b)
        assert torch.equal(doubled["depth"], b["depth"] * 2)


class TestEpochs:
    def test_iterating_again_goes_on_with_the_next_epoch_and_warns_once(self, backend, shards):
        pipe = gp.Pipeline(shards, [T.RandomResizedCrop(8), T.ToDtype(torch.float32)])
        with backend.loader(pipe, 4, shuffle=True, seed=1, num_workers=0) as loader:
            first = [k for b in loader for k in b.keys]
            with pytest.warns(UserWarning, match="goes on with epoch 1") as caught:
                second = [k for b in loader for k in b.keys]
            assert loader.epoch == 1 and len(caught) == 1 and first != second
            third = [k for b in loader for k in b.keys]  # no second warning (warnings are errors here)
            assert loader.epoch == 2
            loader.set_epoch(0)  # explicit: exact, no warning
            assert [k for b in loader for k in b.keys] == first
            loader.set_epoch(2)
            assert [k for b in loader for k in b.keys] == third

    def test_a_broken_off_epoch_is_not_advanced(self, backend, shards):
        with backend.loader(val(shards), 4, num_workers=0) as loader:
            for _ in loader:
                break
            list(loader)  # the same epoch again (a loop broken off, then restarted)
            assert loader.epoch == 0

    def test_sampler_and_dataset_as_trainers_read_them(self, backend, shards):
        with backend.loader(val(shards), 3, world_size=3, rank=1, num_workers=0) as loader:
            assert len(loader.dataset) == loader.num_samples == 16
            assert len(loader.sampler) == len(loader.plan().samples) == 6  # 16 over 3 ranks, padded to 6 each
            loader.sampler.set_epoch(4)
            assert loader.epoch == 4 and loader.batch_size == 3 and loader.drop_last is False
            with pytest.raises(TypeError, match="not iterated"):
                iter(loader.sampler)


class TestMigration:
    @pytest.mark.parametrize(
        "name, advice",
        [
            ("pin_memory", "with device='cuda' batches arrive on the GPU"),
            ("sampler", "call loader.set_epoch"),
            ("collate_fn", "the backend stacks each batch"),
            ("persistent_workers", "live until close"),
            ("prefetch_factor", "use prefetch="),
            ("timeout", "use worker_timeout="),
        ],
    )
    def test_dataloader_arguments_say_what_to_do(self, shards, name, advice):
        with pytest.raises(gp.ConfigError, match=f"Loader: {name}= is a torch DataLoader argument; .*{advice}"):
            gp.Loader(val(shards), 4, **{name: None})

    def test_a_misspelled_option_names_the_nearest(self, shards):
        with pytest.raises(gp.ConfigError, match="unknown option shufle=True; did you mean shuffle="):
            gp.Loader(val(shards), 4, shufle=True)


class TestAccelerate:
    def _epochs(self, accelerator, loader, model, optimizer, epochs, *, stop=None):
        """Trains ``epochs``; returns each epoch's keys; ``stop=(epoch, step)`` saves the state there
        and returns (a preemption)."""
        orders: list[list[str]] = []
        for epoch in range(loader.epoch if stop is None else 0, epochs):
            loader.set_epoch(epoch)
            keys = []
            for step, batch in enumerate(loader):
                images, labels = batch
                loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                keys += batch.keys
                if stop == (epoch, step):
                    return orders, keys
            orders.append(keys)
        return orders, []

    def test_three_epochs_and_resume_from_accelerates_own_state(self, shards, tmp_path):
        """``accelerator.save_state`` saves the loader registered with it (it is stateful), and
        ``load_state`` puts a new one mid-epoch where the old one was."""
        from accelerate import Accelerator

        def setup():
            accelerator = Accelerator(cpu=True)
            model = torch.nn.Linear(3 * 8 * 8, 10)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            pipe = gp.Pipeline(shards, [T.RandomResizedCrop(8), T.ToDtype(torch.float32, scale=True)])
            loader = gp.Loader(pipe, 4, shuffle=True, seed=5, device=str(accelerator.device), backend="torch",
                               num_workers=0)  # fmt: skip
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            accelerator.register_for_checkpointing(loader)
            return accelerator, loader, model, optimizer

        accelerator, loader, model, optimizer = setup()
        whole, _ = self._epochs(accelerator, loader, model, optimizer, 3)
        assert len({tuple(o) for o in whole}) == 3  # a new order each epoch
        accelerator, loader, model, optimizer = setup()
        _, before = self._epochs(accelerator, loader, model, optimizer, 3, stop=(1, 1))
        accelerator.save_state(str(tmp_path / "state"))
        accelerator, loader, model, optimizer = setup()
        accelerator.load_state(str(tmp_path / "state"))
        after = [k for batch in loader for k in batch.keys]  # the rest of epoch 1
        assert before + after == whole[1]

    def test_the_data_stall_in_accelerates_trackers(self, shards, tmp_path):
        """``accelerator.log(loader.stall_metrics(), step=step)`` hands the meter's figures to
        every tracker (issue 54): here a tracker of accelerate's own interface that keeps them."""
        from accelerate import Accelerator
        from accelerate.tracking import GeneralTracker

        class Kept(GeneralTracker):
            name, requires_logging_directory, main_process_only = "kept", False, True

            def __init__(self) -> None:
                super().__init__()
                self.rows: list[tuple[int | None, dict]] = []

            @property
            def tracker(self):
                return self.rows

            def store_init_configuration(self, values):
                pass

            def log(self, values, step=None, **kwargs):
                self.rows.append((step, dict(values)))

        kept = Kept()
        accelerator = Accelerator(cpu=True, log_with=[kept])
        accelerator.init_trackers("gpupipe")
        pipe = gp.Pipeline(shards, [T.RandomResizedCrop(8)])
        loader = accelerator.prepare(gp.Loader(pipe, 2, shuffle=True, device=str(accelerator.device), backend="torch",
                                               num_workers=0))  # fmt: skip
        for step, _ in enumerate(loader):
            if step % 3 == 2:
                accelerator.log(loader.stall_metrics(), step=step)
        accelerator.end_training()
        assert [step for step, _ in kept.rows] == [2, 5]
        last = kept.rows[-1][1]
        assert {"gpupipe/stall", "gpupipe/images_per_s", "gpupipe/epoch_stall", "gpupipe/first_batch_s"} <= set(last)
        assert 0 <= last["gpupipe/stall"] <= 1 and last["gpupipe/images_per_s"] > 0
        loader.close()

    def test_validation_counts_each_sample_once(self, shards):
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        val_loader = accelerator.prepare(gp.Loader(val(shards), 5, device=str(accelerator.device), num_workers=0))
        counted = 0
        for epoch in range(3):
            val_loader.set_epoch(epoch)
            counted += sum(int(b.valid.sum()) for b in val_loader)
        assert counted == 3 * 16 and len(val_loader) * 5 == 20  # 16 samples in 4 batches of 5: 4 padded
        val_loader.close()

    def test_gradient_accumulation_steps_at_each_epochs_last_batch(self, shards):
        """accelerate's ``accumulate`` steps at an epoch's last batch (``sync_with_dataloader``), as
        with its own DataLoaders: the loader tells its GradientState where the epoch ends."""
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
        model = torch.nn.Linear(3 * 16 * 16, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = gp.Loader(val(shards), 4, device=str(accelerator.device), backend="torch", num_workers=0)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        synced = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            for images, labels in loader:  # 16 samples: 4 batches an epoch
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.cross_entropy(model(images.flatten(1)), labels))
                    synced.append(accelerator.sync_gradients)
                    optimizer.step()
                    optimizer.zero_grad()
            assert not accelerator.gradient_state.in_dataloader  # unregistered at the epoch's end
        assert synced == [False, False, True, True] * 2
        for _ in loader:
            break
        loader.close()
        assert not accelerator.gradient_state.in_dataloader  # and when broken off

    def test_prepare_leaves_the_loader_as_it_is(self, shards):
        """``accelerator.prepare`` re-shards DataLoaders only: a gp.Loader (already sharded per
        rank) comes back as it is, delivering on the loader's device (pass accelerator.device)."""
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(3 * 16 * 16, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = gp.Loader(val(shards), 4, device=str(accelerator.device), backend="torch", num_workers=0)
        model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
        assert prepared is loader
        seen = 0
        for epoch in range(2):
            loader.set_epoch(epoch)
            for images, labels in prepared:
                loss = torch.nn.functional.cross_entropy(model(images.flatten(1)), labels)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                seen += len(labels)
        assert seen == 2 * 16
        loader.close()


LIGHTNING = os.path.join(os.path.dirname(__file__), "support", "lightning_fit.py")


def _fit(tmp_path, *args: str, devices: int = 1) -> dict:
    import json

    out = subprocess.run([sys.executable, LIGHTNING, str(tmp_path), str(devices), *args], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    with open(tmp_path / "result.json") as f:
        return json.load(f)


class TestLightning:
    """Lightning's own Trainer on the CPU, in a child process (Lightning's DDP relaunches the script)."""

    def test_three_epochs_differ_and_validation_counts_each_sample_once(self, tmp_path):
        got = _fit(tmp_path, "fit")
        orders = got["train_keys"]
        assert len(orders) == 3 and len({tuple(o) for o in orders}) == 3  # Lightning set the epoch: new orders
        assert all(len(set(o)) == len(o) == 16 for o in orders)  # 18 samples, batch 4, drop_last: 16 each
        assert got["epochs_set"] == [0, 1, 2]
        assert got["val_counted"] == [got["samples"]] * 3  # padding masked: each sample once
        logged = ("stall", "images_per_s", "epoch_stall", "epoch_images_per_s", "first_batch_s")
        assert got["stall_metrics"] == sorted(f"gpupipe/{k}" for k in logged)  # StallLogger's

    def test_resume_mid_epoch_from_lightnings_checkpoint(self, tmp_path):
        whole = _fit(tmp_path / "whole", "fit")
        resumed = _fit(tmp_path / "cut", "cut-and-resume")
        assert resumed["after_resume"] == resumed["expected_after_resume"]
        assert resumed["train_keys"][-1] == whole["train_keys"][-1]  # the last epoch as the uninterrupted one

    @pytest.mark.slow
    def test_ddp_resume_mid_epoch_on_every_rank(self, tmp_path):
        """Lightning checkpoints rank 0's loader state alone; every rank resumes from it exactly."""
        got = _fit(tmp_path, "cut-and-resume", devices=2)
        assert got["after_resume"] == got["expected_after_resume"] and all(got["after_resume"])
        assert not set(got["after_resume"][0]) & set(got["after_resume"][1])

    @pytest.mark.slow
    def test_ddp_on_two_processes(self, tmp_path):
        got = _fit(tmp_path, "fit", devices=2)
        assert got["val_counted"] == [got["samples"]] * 3  # over both ranks, each sample once
        assert got["ranks_disjoint"]
        assert got["ranks_per_node"] == 2  # Lightning's launcher sets no LOCAL_WORLD_SIZE: the DataModule says
