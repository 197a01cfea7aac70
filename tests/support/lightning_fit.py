"""Lightning's Trainer fitting a tiny model on gpupipe loaders (tests/test_trainers.py runs it in a
child process: Lightning's DDP relaunches this script for each rank).

    python tests/support/lightning_fit.py OUT DEVICES fit|cut-and-resume

Writes OUT/result.json (rank 0): each training epoch's keys in order (valid ones), the epoch the
loader was at in each, the validation count per epoch summed over ranks, the data-stall metrics
StallLogger logged (``fit``), and for
``cut-and-resume`` the keys trained after resuming from a mid-epoch checkpoint and the keys the
uninterrupted run trains there.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import lightning as L

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.lightning import DataModule, StallLogger

warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging; not what is tested
OUT, DEVICES, MODE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
SAMPLES, BATCH = 18, 4


def shards() -> list[str]:
    data = os.path.join(OUT, "data")
    if os.environ.get("LOCAL_RANK", "0") == "0" and not os.path.exists(os.path.join(data, "done")):
        os.makedirs(data, exist_ok=True)
        from gpupipe.testing import encode_jpeg, synthetic_image

        with gp.ShardWriter(os.path.join(data, "s-%d.tar"), max_count=8) as w:
            for i in range(SAMPLES):
                w.write(f"{i:04d}", {"jpg": encode_jpeg(synthetic_image(i, size=(24, 32))), "cls": i % 10})
        open(os.path.join(data, "done"), "w").close()
    return [os.path.join(data, f"s-{i}.tar") for i in range(3)]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3 * 8 * 8, 10)
        self.train_keys: dict[int, list[str]] = {}
        self.epochs_set: list[int] = []
        self.val_counted: list[int] = []
        self._val = 0

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loader = getattr(self.trainer, "datamodule").loaders["train"]  # noqa: B009 - untyped in Lightning
        if batch_idx == 0:
            self.epochs_set.append(loader.epoch)
        keys = [k for k, v in zip(batch.keys, batch.valid.tolist(), strict=True) if v]
        self.train_keys.setdefault(self.current_epoch, []).extend(keys)
        loss = torch.nn.functional.cross_entropy(self.net(images.flatten(1)), labels)
        return loss

    def validation_step(self, batch, batch_idx):
        self._val += int(batch.valid.sum())

    def on_validation_epoch_end(self):
        count = torch.tensor(self._val)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(count)
        self.val_counted.append(int(count))
        self._val = 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Preempted(Exception):
    pass


class Preempt(L.Callback):
    """Saves a checkpoint after ``step`` optimizer steps (ModelCheckpoint's every_n_train_steps
    does this), then kills the run, as a preemption would."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise Preempted


def datamodule() -> DataModule:
    urls = shards()
    train = gp.Pipeline(urls, [T.RandomResizedCrop(8), T.ToDtype(torch.float32, scale=True)])
    val = gp.Pipeline(urls, [T.Resize((8, 8)), T.ToDtype(torch.float32, scale=True)])
    return DataModule(train, val, batch_size=BATCH, seed=3, backend="torch", num_workers=0)


def trainer(**kw) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=DEVICES, strategy="ddp" if DEVICES > 1 else "auto", max_epochs=3,
                     num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=OUT, **kw)  # fmt: skip


def main() -> None:
    result: dict = {"samples": SAMPLES}
    if MODE == "fit":
        model = Model()
        t = trainer(enable_checkpointing=False, callbacks=[StallLogger(every_n_steps=2)])
        t.fit(model, datamodule=datamodule())
        result["stall_metrics"] = sorted(k for k in t.callback_metrics if k.startswith("gpupipe/"))
        result["train_keys"] = [model.train_keys[e] for e in sorted(model.train_keys)]
        result["epochs_set"] = model.epochs_set
        result["val_counted"] = model.val_counted
        result["ranks_per_node"] = gp.runtime._dist.ranks_per_node()  # the launcher's, else the trainer's devices
        gathered: list[Any] = [None] * DEVICES
        if DEVICES > 1:
            torch.distributed.all_gather_object(gathered, model.train_keys[0])
            result["ranks_disjoint"] = not (set(gathered[0]) & set(gathered[1]))
        if t.global_rank != 0:
            return
    else:  # a checkpoint mid-way through epoch 1, the run killed there, resumed in a new Trainer
        per_epoch = (SAMPLES // DEVICES) // BATCH
        into = 2 if per_epoch > 2 else 1  # batches of epoch 1 trained before the cut
        whole = Model()
        trainer(enable_checkpointing=False).fit(whole, datamodule=datamodule())
        path = os.path.join(OUT, "cut.ckpt")
        with contextlib.suppress(Preempted):
            trainer(enable_checkpointing=False, callbacks=[Preempt(per_epoch + into, path)]).fit(
                Model(), datamodule=datamodule()
            )
        resumed = Model()
        t = trainer(enable_checkpointing=False)
        t.fit(resumed, datamodule=datamodule(), ckpt_path=path)
        result["after_resume"] = resumed.train_keys.get(1, [])
        result["expected_after_resume"] = whole.train_keys[1][into * BATCH :]
        result["train_keys"] = [resumed.train_keys[e] for e in sorted(resumed.train_keys)]
        if DEVICES > 1:  # every rank's, gathered on rank 0 (Lightning checkpoints rank 0's loader state)
            gathered = [None] * DEVICES
            torch.distributed.all_gather_object(gathered, result)
            result = {k: [r[k] for r in gathered] for k in result}
            if t.global_rank != 0:
                return
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    try:
        main()
    finally:  # gloo's threads ended before the interpreter's exit (left running, one aborted it now and then)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
