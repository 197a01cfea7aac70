"""gpupipe loaders in Lightning: :class:`DataModule`.

    import lightning as L
    import gpupipe as gp
    from gpupipe.lightning import DataModule

    train = gp.load_pipeline("pipelines/imagenet.py:train")("data/train-{000000..001281}.tar")
    val = gp.load_pipeline("pipelines/imagenet.py:val")("data/val-{000000..000049}.tar")
    trainer = L.Trainer(max_epochs=90, strategy="ddp", devices=8)
    trainer.fit(model, datamodule=DataModule(train, val, batch_size=256))

What it takes care of: the loaders are made in Lightning's ``*_dataloader()`` hooks, after the
process group is up, so each rank plans its own share (rank and world size from
``torch.distributed``) and delivers on the strategy's device; Lightning sets the epoch through
``loader.sampler.set_epoch`` before each epoch and saves each loader's ``state_dict()`` in its
checkpoints (a gp.Loader is stateful), so ``trainer.fit(..., ckpt_path=...)`` resumes mid-epoch
exactly; the loaders are closed at ``teardown``.

In the LightningModule, mask padding (the evened-out last batch of a rank, skipped samples) out
of metrics and of the batch size you log — Lightning counts a batch's rows::

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        correct = (self(images).argmax(1) == labels)[batch.valid].sum()
        self.log("val/acc", correct / batch.valid.sum(), batch_size=int(batch.valid.sum()), sync_dist=True)

:class:`StallLogger` logs the training loader's data-stall meter to the trainer's loggers
(``trainer = L.Trainer(callbacks=[StallLogger()])``).

Lightning is not a dependency of gpupipe; this module imports it (``lightning``, else
``pytorch_lightning``).
"""

from __future__ import annotations

from typing import Any

from .core._errors import BackendUnavailableError, ConfigError
from .loader._loader import Loader
from .pipeline._pipeline import Pipeline
from .runtime import _dist

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the older package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError:
        raise BackendUnavailableError("gpupipe.lightning needs Lightning: pip install lightning") from None

__all__ = ["DataModule", "StallLogger"]


class DataModule(pl.LightningDataModule):
    """A LightningDataModule of gpupipe loaders.

    Args:
        train: the training pipeline, or ``None``.
        val: the validation pipeline, or ``None``.
        batch_size: samples per batch and rank, for training.
        val_batch_size: the same for validation (default: ``batch_size``).
        shuffle: shuffle the training epochs. Default ``True``.
        drop_last: drop the training samples that do not fill a batch on every rank. Default
            ``True``; validation never drops (its padding is masked by ``batch.valid``).
        seed: the loaders' seed; ``None`` (default) draws one on rank 0 and shares it.
        **options: the loaders' other options (``gp.LoaderConfig``): ``backend``, ``num_workers``,
            ``on_error``, ... ``device`` defaults to the strategy's (``trainer.strategy.root_device``).
    """

    def __init__(
        self,
        train: Pipeline | None = None,
        val: Pipeline | None = None,
        *,
        batch_size: int,
        val_batch_size: int | None = None,
        shuffle: bool = True,
        drop_last: bool = True,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        for name, pipeline in (("train", train), ("val", val)):
            if pipeline is not None and not isinstance(pipeline, Pipeline):
                raise ConfigError(f"DataModule: {name} must be a gp.Pipeline or None, got {type(pipeline).__name__}")
        self.pipelines = {"train": train, "val": val}
        self.batch_sizes = {"train": batch_size, "val": val_batch_size or batch_size}
        self.train_options = {"shuffle": shuffle, "drop_last": drop_last, "seed": seed, **options}
        self.val_options = {**options, "shuffle": False, "drop_last": False, "seed": seed}
        self.loaders: dict[str, Loader] = {}

    def _loader(self, name: str, options: dict[str, Any]) -> Loader:
        pipeline = self.pipelines[name]
        if pipeline is None:
            raise ConfigError(f"DataModule: no {name} pipeline was given")
        if name not in self.loaders or self.loaders[name].closed:
            trainer = getattr(self, "trainer", None)
            if trainer is not None:
                # the node's ranks share its CPUs: Lightning's own launcher sets no LOCAL_WORLD_SIZE
                _dist.assume_ranks_per_node(getattr(trainer, "num_devices", None))
            if options.get("device") is None and trainer is not None:
                options = {**options, "device": str(trainer.strategy.root_device)}
            self.loaders[name] = Loader(pipeline, self.batch_sizes[name], **options)
        return self.loaders[name]

    def train_dataloader(self) -> Loader:
        return self._loader("train", self.train_options)

    def val_dataloader(self) -> Loader | list[Any]:
        """The validation loader, or no loader (``[]``: no validation) without a val pipeline."""
        return [] if self.pipelines["val"] is None else self._loader("val", self.val_options)

    def teardown(self, stage: str) -> None:
        """Closes the loaders (their workers, threads and DALI pipelines)."""
        for loader in self.loaders.values():
            loader.close()
        self.loaders.clear()


class StallLogger(pl.Callback):
    """Logs the training loader's data-stall meter (:meth:`gpupipe.Loader.stall_metrics`) with
    the LightningModule's ``log_dict``, so to every logger of the trainer (TensorBoard, CSV, ...):
    every ``every_n_steps`` training batches, ``gpupipe/stall`` and ``gpupipe/images_per_s`` over
    the last 50 batches; at each training epoch's end, ``gpupipe/epoch_stall``,
    ``gpupipe/epoch_images_per_s`` and ``gpupipe/first_batch_s``. The loader is the
    :class:`DataModule`'s, else the trainer's ``train_dataloader`` where it is a ``gp.Loader``;
    with neither, it logs nothing.

    Args:
        every_n_steps: batches between two logs of the window. Default 50.
        prefix: the metrics' names' start. Default ``"gpupipe/"``.
    """

    def __init__(self, *, every_n_steps: int = 50, prefix: str = "gpupipe/") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ConfigError(f"StallLogger: every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self.every_n_steps, self.prefix = every_n_steps, prefix

    @staticmethod
    def _loader(trainer: Any) -> Loader | None:
        module = getattr(trainer, "datamodule", None)
        loaders = getattr(module, "loaders", None) or {}
        if isinstance(loaders.get("train"), Loader):
            return loaders["train"]
        found = getattr(trainer, "train_dataloader", None)
        return found if isinstance(found, Loader) else None

    def _log(self, trainer: Any, pl_module: Any, keys: tuple[str, ...]) -> None:
        loader = self._loader(trainer)
        if loader is None:
            return
        found = loader.stall_metrics(self.prefix)
        chosen = {k: v for k, v in found.items() if k.removeprefix(self.prefix) in keys}
        if chosen:
            per_epoch = "epoch_stall" in keys
            pl_module.log_dict(chosen, on_step=not per_epoch, on_epoch=per_epoch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.every_n_steps == 0:
            self._log(trainer, pl_module, ("stall", "images_per_s"))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer, pl_module, ("epoch_stall", "epoch_images_per_s", "first_batch_s"))
