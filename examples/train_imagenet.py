"""The standard PyTorch ImageNet recipe, fed by gpupipe or by the usual DataLoader, on 1-N GPUs (or CPU).

    # 8 GPUs, WebDataset shards, gpupipe (DALI, nvJPEG):
    torchrun --nproc_per_node=8 examples/train_imagenet.py \\
        --train 'imagenet/train-{000000..001281}.tar' --val 'imagenet/val-{000000..000049}.tar'
    # the same recipe fed the usual way (torchvision ImageFolder + DistributedSampler + DataLoader):
    torchrun --nproc_per_node=8 examples/train_imagenet.py --train /data/train --val /data/val --loader dataloader
    # progressive resizing (FFCV): train at 160 up to epoch 65, 192 from epoch 76, validate at 224:
    torchrun --nproc_per_node=8 examples/train_imagenet.py --train ... --val ... --epochs 88 \
        --min-res 160 --max-res 192 --ramp 65 76
    # torchvision's IMAGENET1K_V2 recipe (TrivialAugment, RandomErasing, MixUp/CutMix, repeated augmentation):
    torchrun --nproc_per_node=8 examples/train_imagenet.py --train ... --val ... --epochs 600 \
        --auto-augment ta_wide --random-erase 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --ra-reps 4 \
        --image-size 176 --val-resize 232 --val-size 224 --label-smoothing 0.1 --lr 0.5 --weight-decay 2e-5
    # one CPU process, a small model, a few steps:
    python examples/train_imagenet.py --train 'data/train-{000000..000007}.tar' --val 'data/train-000000.tar' \\
        --arch tiny --image-size 64 --epochs 2 --num-classes 10

Recipe: torchvision's ResNet-50 (``--arch``: any torchvision model name, or ``tiny``), SGD with
momentum 0.9 and weight decay 1e-4, learning rate 0.1 x global batch / 256 with a linear warm-up
and a cosine decay stepped per step, label smoothing 0.1, and on GPUs bf16 autocast and
channels_last. Each rank runs on ``cuda:LOCAL_RANK``.

Loaders (``--loader``):
  gpupipe     pipelines/imagenet.py (train: RandomResizedCrop + flip; val: Resize + CenterCrop) through
              gp.Loader on --backend. Every rank yields the same number of batches; validation counts
              each sample exactly once (batch.valid); a checkpoint holds each rank's loader position,
              so a resumed job continues mid-epoch.
  dataloader  WebDataset shards through the webdataset library (shards split by rank and worker), or an
              ImageFolder tree through torchvision with DistributedSampler, in a torch DataLoader.
              DistributedSampler pads validation with repeated samples: they are counted, and reported.
              A resumed job restarts the interrupted epoch from its start.

Augmentation (the reference script's flags): ``--auto-augment`` (ta_wide, ra, augmix, imagenet, cifar10, svhn),
``--random-erase P``, ``--mixup-alpha``/``--cutmix-alpha`` (one of them per batch, labels as soft targets),
``--ra-reps R`` (repeated augmentation: ``gp.Loader(repeats=R)``; gpupipe only). With gpupipe they make the
train pipeline ``pipelines/imagenet.py:train_v2``; the dataloader applies torchvision's classes of the same names.

Progressive resizing (``--min-res``, gpupipe only): the train pipeline's output size follows
``pipelines/lowres.py:resolution`` per epoch, set with ``loader.set_pipeline`` on the same loader.

Each epoch rank 0 logs the train size, the mean loss, images/s over all ranks, the data wait (the share of the
step time spent waiting for the next batch, measured on the host), and top-1/top-5 with the
number of samples they count. ``--log-json`` writes the same per epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torchvision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpupipe as gp  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
log = logging.getLogger("train_imagenet")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="shard pattern or ImageFolder directory")
    p.add_argument("--val", required=True, help="shard pattern or ImageFolder directory")
    p.add_argument("--loader", choices=("gpupipe", "dataloader"), default="gpupipe")
    p.add_argument("--backend", default="auto", help="gpupipe's backend (auto, dali, torch)")
    p.add_argument("--arch", default="resnet50", help="a torchvision model name, or 'tiny'")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--lr", type=float, default=None, help="default 0.1 x global batch / 256")
    p.add_argument("--warmup-epochs", type=float, default=0.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--image-size", type=int, default=224, help="train and val size (val only with --min-res)")
    p.add_argument("--min-res", type=int, default=None, help="progressive resizing: the first train size")
    p.add_argument("--max-res", type=int, default=None, help="progressive resizing: the last (default --image-size)")
    p.add_argument("--ramp", type=int, nargs=2, default=None, metavar=("START", "END"),
                   help="progressive resizing: the epochs the size rises between (default 74%% and 86%% of --epochs, "
                        "FFCV's 65 and 76 of 88)")  # fmt: skip
    p.add_argument("--res-step", type=int, default=32, help="progressive resizing: sizes are multiples of this")
    p.add_argument("--val-resize", type=int, default=None, help="default image size x 8/7 (256 for 224)")
    p.add_argument("--val-size", type=int, default=None, help="the val crop (default --image-size)")
    p.add_argument("--auto-augment", default=None, help="ta_wide, ra, augmix, imagenet, cifar10 or svhn")
    p.add_argument("--random-erase", type=float, default=0.0, help="RandomErasing's probability")
    p.add_argument("--mixup-alpha", type=float, default=0.0)
    p.add_argument("--cutmix-alpha", type=float, default=0.0)
    p.add_argument("--ra-reps", type=int, default=1, help="repeated augmentation (gpupipe only)")
    p.add_argument("--workers", type=int, default=None, help="decode workers per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="saved here (every --checkpoint-every steps, each epoch)")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--stop-after", type=int, default=None, help="save and stop after this many steps (tests)")
    p.add_argument("--log-json", default=None, help="rank 0 writes the per-epoch results here")
    return p.parse_args(argv)


def tiny(num_classes: int) -> torch.nn.Module:
    """A small CNN for CPU runs and tests."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, num_classes),
    )  # fmt: skip


class Loaders:
    """The train and val loaders of either kind, behind one interface."""

    def __init__(self, args: argparse.Namespace, device: torch.device, rank: int, world: int) -> None:
        self.args, self.device, self.rank, self.world = args, device, rank, world
        self.memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
        self.train: Any
        self.val: Any
        self.samplers: list[Any] = []
        self._train_loader: Any = None  # webdataset: a new loader per epoch
        self.mix: Any = None  # the dataloader's MixUp/CutMix (gpupipe's: the pipeline's batch transform)
        resize = args.val_resize or args.image_size * 8 // 7
        if args.min_res is not None and args.loader != "gpupipe":
            raise SystemExit("--min-res (progressive resizing) needs --loader gpupipe")
        self.recipe = dict(auto_augment=args.auto_augment, random_erase=args.random_erase,
                           mixup_alpha=args.mixup_alpha, cutmix_alpha=args.cutmix_alpha)  # fmt: skip
        augmented = any(self.recipe.values())
        if augmented and args.min_res is not None:
            raise SystemExit("--min-res (pipelines/lowres.py) does not take the --auto-augment recipe flags")
        if args.ra_reps > 1 and args.loader != "gpupipe":
            raise SystemExit("--ra-reps (repeated augmentation) needs --loader gpupipe")
        val_size = args.val_size or args.image_size
        if args.loader == "gpupipe":
            self._make_train = gp.load_pipeline(os.path.join(ROOT, "pipelines/lowres.py:train"))
            if augmented:  # torchvision's V2 recipe, with these flags
                v2_train = gp.load_pipeline(os.path.join(ROOT, "pipelines/imagenet.py:train_v2"))
                self._make_train = lambda source, size: v2_train(source, size, num_classes=args.num_classes,
                                                                 **self.recipe)  # fmt: skip
            self._resolution = gp.load_pipeline(os.path.join(ROOT, "pipelines/lowres.py:resolution"))
            train = self._make_train(_source(args.train), size=self.train_size(0))
            val = gp.load_pipeline(os.path.join(ROOT, "pipelines/imagenet.py:val"))(
                _source(args.val), size=val_size, resize=resize
            )
            options = dict(backend=args.backend, device=str(device), num_workers=args.workers,
                           memory_format=self.memory_format)  # fmt: skip
            self.train = gp.Loader(train, args.batch_size, shuffle=True, drop_last=True, seed=args.seed,
                                   repeats=args.ra_reps, **options)  # fmt: skip
            self.val = gp.Loader(val, args.batch_size, **options)
            self.val_size = len(self.val.index)
            self.steps = len(self.train)
        else:
            self._torch_loaders(resize)

    def _torch_loaders(self, resize: int) -> None:
        from torch.utils.data import DataLoader, DistributedSampler
        from torchvision.transforms import v2

        args = self.args
        policies = {"ta_wide": v2.TrivialAugmentWide, "ra": v2.RandAugment, "augmix": v2.AugMix}
        policy = [] if not args.auto_augment else [
            policies[args.auto_augment](interpolation=v2.InterpolationMode.BILINEAR) if args.auto_augment in policies
            else v2.AutoAugment(v2.AutoAugmentPolicy(args.auto_augment), interpolation=v2.InterpolationMode.BILINEAR)
        ]  # fmt: skip
        erase = [v2.RandomErasing(p=args.random_erase)] if args.random_erase else []
        train_tf = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(args.image_size, antialias=True),
                               v2.RandomHorizontalFlip(), *policy, v2.ToDtype(torch.float32, scale=True),
                               v2.Normalize(MEAN, STD), *erase])  # fmt: skip
        mixing = [cls(alpha=alpha, num_classes=args.num_classes) for cls, alpha in
                  ((v2.MixUp, args.mixup_alpha), (v2.CutMix, args.cutmix_alpha)) if alpha]  # fmt: skip
        self.mix = v2.RandomChoice(mixing) if mixing else None  # on each train batch, as the reference's collate
        crop = args.val_size or args.image_size
        val_tf = v2.Compose([v2.ToImage(), v2.Resize(resize, antialias=True), v2.CenterCrop(crop),
                             v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])  # fmt: skip
        workers = args.workers if args.workers is not None else min(8, os.cpu_count() or 1)
        # Workers start from a fork server (Python 3.14's default on Linux), not by forking this
        # process: it runs threads (DDP's, each DataLoader's queue feeders), and a child forked
        # while one of them holds an interpreter lock freezes for good on CPython before 3.11.10
        # (gh-112275; seen here as a validation worker that never answers). New workers start
        # every epoch here, so the risk comes back every epoch. The server imports the heavy
        # modules once (Python 3.11's does not preload this script's): a worker starts in about
        # 0.1 s on 2 cores, instead of 1 s importing torch again.
        context = multiprocessing.get_context("forkserver") if workers > 0 else None
        if context is not None:
            context.set_forkserver_preload(["torch", "torchvision.transforms.v2", "PIL.Image", "gpupipe", "webdataset"])
        if os.path.isdir(args.train):
            train_set = torchvision.datasets.ImageFolder(args.train, train_tf)
            val_set = torchvision.datasets.ImageFolder(args.val, val_tf)
            train_sampler: Any = DistributedSampler(train_set, self.world, self.rank, shuffle=True, seed=args.seed)
            val_sampler: Any = DistributedSampler(val_set, self.world, self.rank, shuffle=False)  # pads: repeats
            self.samplers = [train_sampler]
            self.train = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=workers,
                                    drop_last=True, pin_memory=self.device.type == "cuda",
                                    persistent_workers=workers > 0, multiprocessing_context=context)  # fmt: skip
            self.val = DataLoader(val_set, args.batch_size, sampler=val_sampler, num_workers=workers,
                                  multiprocessing_context=context)  # fmt: skip
            self.val_size, self.steps = len(val_set), len(self.train)
        else:
            import webdataset as wds  # the dev extra; pip install webdataset

            train_source = gp.WebDataset(args.train)
            size = len(train_source.index())  # (gpupipe's index cache: the sample count)
            self.steps = size // (self.world * args.batch_size)
            if len(train_source.urls) < self.world * max(1, workers):  # a rank (or worker) without shards
                raise SystemExit(f"--loader dataloader splits shards between ranks and workers: {self.world} x "
                                 f"{max(1, workers)} need at least as many shards; {args.train} has "
                                 f"{len(train_source.urls)}")  # fmt: skip
            pin = self.device.type == "cuda"

            def shards(urls: str, tf: Any, train: bool, seed: int) -> Any:
                ds = wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=100 if train else False,
                                    empty_check=False, seed=seed)  # fmt: skip
                if train:
                    ds = ds.shuffle(1000)
                ds = ds.decode("pil").to_tuple("jpg;jpeg;png", "cls").map_tuple(tf, int)
                return ds.batched(args.batch_size, partial=not train)

            def train_loader(epoch: int) -> Any:
                # a new shard order each epoch; every rank takes the same number of steps (DDP): its
                # shards are read again (with_epoch) if it has fewer samples than the others
                ds = shards(args.train, train_tf, True, args.seed + epoch)
                loader = wds.WebLoader(ds, batch_size=None, num_workers=workers, pin_memory=pin,
                                       multiprocessing_context=context)  # fmt: skip
                return loader.with_epoch(self.steps)

            self._train_loader = train_loader
            self.train = train_loader(0)
            self.val = wds.WebLoader(shards(args.val, val_tf, False, args.seed), batch_size=None,
                                     num_workers=workers, pin_memory=pin, multiprocessing_context=context)  # fmt: skip
            self.val_size = len(gp.WebDataset(args.val).index())

    def train_size(self, epoch: int) -> int:
        """The train pipeline's output size in ``epoch``: ``--image-size``, or with ``--min-res``
        ``pipelines/lowres.py:resolution``'s schedule."""
        args = self.args
        if args.min_res is None:
            return args.image_size
        start, end = args.ramp or (round(0.74 * args.epochs), round(0.86 * args.epochs))
        return self._resolution(epoch, min_res=args.min_res, max_res=args.max_res or args.image_size,
                                start_ramp=start, end_ramp=end, step=args.res_step)  # fmt: skip

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self.train, gp.Loader):
            if self.args.min_res is not None:  # the same loader; a new runner only when the size changes
                self.train.set_pipeline(self._make_train(_source(self.args.train), size=self.train_size(epoch)))
            self.train.set_epoch(epoch)
        elif self._train_loader is not None:
            self.train = self._train_loader(epoch)
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def batches(self, loader: Iterable[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """``(images, labels, valid)`` on the device; ``valid`` None where every sample counts.
        ``labels``: class indices ``[B]``, or soft targets ``[B, classes]`` after MixUp/CutMix."""
        for batch in loader:
            if isinstance(batch, gp.Batch):
                assert batch.labels is not None  # labeled data
                yield batch.images, batch.labels, batch.valid
            else:
                images, labels = batch
                images = images.to(self.device, non_blocking=True, memory_format=self.memory_format)
                labels = torch.as_tensor(labels).to(self.device, non_blocking=True)
                if self.mix is not None and loader is self.train:
                    images, labels = self.mix(images, labels)
                yield images, labels, None

    def state(self) -> dict | None:
        return self.train.state_dict() if isinstance(self.train, gp.Loader) else None

    def close(self) -> None:
        for loader in (self.train, self.val):
            if isinstance(loader, gp.Loader):
                loader.close()


def _source(path: str) -> gp.WebDataset | gp.ImageFolder:
    return gp.ImageFolder(path) if os.path.isdir(path) else gp.WebDataset(path)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    distributed = "RANK" in os.environ
    if distributed:
        if torch.cuda.is_available():  # each rank on its own GPU, before NCCL starts
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    loaders = Loaders(args, device, rank, world)
    try:
        train(args, loaders, device, rank, world, distributed)
    finally:  # an error too: the loaders' workers end, and the process group
        loaders.close()
        if distributed:
            dist.destroy_process_group()


def train(args: argparse.Namespace, loaders: Loaders, device: torch.device, rank: int, world: int,
          distributed: bool) -> None:  # fmt: skip
    """The epochs: train, evaluate, log, checkpoint."""
    model = tiny(args.num_classes) if args.arch == "tiny" else torchvision.models.get_model(
        args.arch, num_classes=args.num_classes)  # fmt: skip
    model = model.to(device).to(memory_format=loaders.memory_format)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    lr = args.lr if args.lr is not None else 0.1 * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    total, warmup = args.epochs * loaders.steps, int(args.warmup_epochs * loaders.steps)

    def factor(s: int) -> float:  # linear warm-up, then cosine decay to 0, per step
        return min(1.0, (s + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(s, total) / max(1, total)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    amp = device.type == "cuda"
    start_epoch, step, results = 0, 0, []
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        schedule.load_state_dict(ckpt["schedule"])
        start_epoch, step, results = ckpt["epoch"], ckpt["step"], ckpt["results"]
        if ckpt["loaders"][rank] is not None:  # gpupipe: this rank's position, mid-epoch
            loaders.train.load_state_dict(ckpt["loaders"][rank])
        else:  # the DataLoader restarts the interrupted epoch: so does the schedule
            step = start_epoch * loaders.steps
            schedule.last_epoch = step
            for group, base in zip(opt.param_groups, schedule.base_lrs, strict=True):
                group["lr"] = base * factor(step)
        if rank == 0:
            log.info("resumed at epoch %d, step %d", start_epoch, step)

    for epoch in range(start_epoch, args.epochs):
        loaders.set_epoch(epoch)
        ddp.train()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss x samples, samples, steps
        wait = 0.0
        started = time.perf_counter()
        batches = loaders.batches(loaders.train)
        while True:
            asked = time.perf_counter()
            try:
                images, labels, _ = next(batches)
            except StopIteration:
                break
            wait += time.perf_counter() - asked
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = criterion(ddp(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            step += 1
            sums += torch.stack([loss.detach().double() * len(labels), torch.tensor(len(labels), device=device,
                                 dtype=torch.float64), torch.ones((), device=device, dtype=torch.float64)])  # fmt: skip
            stopping = args.stop_after is not None and step >= args.stop_after
            if args.checkpoint and (stopping or step % args.checkpoint_every == 0):
                save(args.checkpoint, model, opt, schedule, loaders, epoch, step, results, distributed, rank)
            if stopping:
                if rank == 0:
                    saved = ", checkpoint saved" if args.checkpoint else ""
                    log.info("stopped after step %d (epoch %d)%s", step, epoch, saved)
                return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        if distributed:
            dist.all_reduce(sums)
        top = evaluate(model, loaders, device, amp, distributed)
        result = {
            "epoch": epoch,
            "train_size": loaders.train_size(epoch) if args.loader == "gpupipe" else args.image_size,
            "loss": sums[0].item() / max(1.0, sums[1].item()),
            "train_samples": int(sums[1].item()),
            "images_per_s": sums[1].item() / seconds,
            "data_wait_pct": 100.0 * wait / seconds,  # rank 0's
            **top,
            "val_size": loaders.val_size,
        }
        results.append(result)
        if rank == 0:
            duplicates = top["val_counted"] - loaders.val_size
            top5 = f" top-5 {100 * top['top5']:.2f}%" if top["top5"] is not None else ""
            log.info(
                "epoch %d (train at %d): loss %.4f, %.0f images/s, data wait %.1f%% of step time; top-1 %.2f%%%s "
                "on %d samples (%s)", epoch, result["train_size"], result["loss"], result["images_per_s"],
                result["data_wait_pct"], 100 * top["top1"], top5, top["val_counted"],
                "each once" if duplicates == 0 else f"{duplicates:+d} against the {loaders.val_size} of the set",
            )  # fmt: skip
        if args.checkpoint:
            save(args.checkpoint, model, opt, schedule, loaders, epoch + 1, step, results, distributed, rank)
    if rank == 0 and args.log_json:
        with open(args.log_json, "w") as f:
            json.dump({"loader": args.loader, "world_size": world, "epochs": results}, f, indent=1)


def evaluate(model: torch.nn.Module, loaders: Loaders, device: torch.device, amp: bool, distributed: bool) -> dict:
    """Top-1 and top-5 over the validation set, all ranks together, and the samples counted."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # top-1 hits, top-5 hits, counted
    with torch.no_grad():
        for images, labels, valid in loaders.batches(loaders.val):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(images)
            top5 = logits.float().topk(min(5, logits.shape[1]), dim=1).indices
            hits = top5 == labels[:, None]
            keep = valid if valid is not None else torch.ones_like(labels, dtype=torch.bool)
            counts += torch.stack([hits[:, 0][keep].sum(), hits.any(1)[keep].sum(), keep.sum()])
    if distributed:
        dist.all_reduce(counts)
    n = max(1, int(counts[2].item()))
    top5 = counts[1].item() / n if loaders.args.num_classes > 5 else None  # (with 5 classes or fewer: always hit)
    return {"top1": counts[0].item() / n, "top5": top5, "val_counted": int(counts[2].item())}


def save(path: str, model: torch.nn.Module, opt: Any, schedule: Any, loaders: Loaders, epoch: int, step: int,
         results: list, distributed: bool, rank: int) -> None:  # fmt: skip
    """Rank 0 writes the model, optimizer, schedule and every rank's loader position (gathered)."""
    states: list = [None] * (dist.get_world_size() if distributed else 1)
    if distributed:
        dist.all_gather_object(states, loaders.state())
    else:
        states[0] = loaders.state()
    if rank == 0:
        ckpt = {"model": model.state_dict(), "opt": opt.state_dict(), "schedule": schedule.state_dict(),
                "epoch": epoch, "step": step, "results": results, "loaders": states}  # fmt: skip
        torch.save(ckpt, path + ".tmp")
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
