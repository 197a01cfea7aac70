"""The pytorch/examples ImageNet training script (``imagenet/main.py``: the same arguments,
functions and output), migrated to gpupipe. Every line that changed is marked ``# gpupipe``;
``docs/guide/pytorch-examples.md`` lists them as a diff. What changed:

- the datasets and DataLoaders: one ``gp.Pipeline`` per split, with torchvision's transform names,
  over an ImageFolder tree (``DATA/train``, ``DATA/val``) or WebDataset shards
  (``DATA/train-*.tar``, ``DATA/val-*.tar``); ``--dummy`` reads ``gp.FakeData``;
- no ``DistributedSampler``: each rank plans its share of each epoch; ``set_epoch`` is the loader's;
- validation counts each sample once over the ranks through ``batch.valid`` (the padding that
  evens out the ranks is masked), so the auxiliary loader for the remainder goes;
- batches arrive on the GPU (``device=``): the ``.cuda()`` calls on them go; ``--backend`` picks
  gpupipe's backend (default: DALI on a GPU where installed, else torch);
- ``--image-size`` (default 224, val resizes to 256/224 of it) exists for quick runs;
- it is launched by torchrun (or as one process); the original's own launcher
  (``--multiprocessing-distributed``, ``--dist-url``, ``--world-size``, ``--rank``, ``--gpu``)
  is left out: torchrun is the launcher PyTorch recommends.

    torchrun --nproc_per_node=8 examples/imagenet_main.py -a resnet50 /data/imagenet
    python examples/imagenet_main.py --dummy -a resnet18 --epochs 1
"""

import argparse
import glob
import os
import random
import shutil
import time
import warnings
from enum import Enum

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.optim
import torch.utils.data
import torchvision.models as models
from torch.optim.lr_scheduler import StepLR

import gpupipe as gp  # gpupipe
from gpupipe import transforms  # gpupipe: torchvision's transform names and arguments

model_names = sorted(
    name for name in models.__dict__ if name.islower() and not name.startswith("__") and callable(models.__dict__[name])
)

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (gpupipe)")
parser.add_argument("data", metavar="DIR", nargs="?", default="imagenet", help="path to dataset (default: imagenet)")
parser.add_argument("-a", "--arch", metavar="ARCH", default="resnet18", choices=model_names,
                    help="model architecture: " + " | ".join(model_names) + " (default: resnet18)")  # fmt: skip
parser.add_argument("-j", "--workers", default=4, type=int, metavar="N", help="number of data loading workers")
parser.add_argument("--epochs", default=90, type=int, metavar="N", help="number of total epochs to run")
parser.add_argument("--start-epoch", default=0, type=int, metavar="N", help="manual epoch number (useful on restarts)")
parser.add_argument("-b", "--batch-size", default=256, type=int, metavar="N",
                    help="mini-batch size (default: 256), the total over the GPUs of a node")  # fmt: skip
parser.add_argument("--lr", "--learning-rate", default=0.1, type=float, metavar="LR", help="initial learning rate",
                    dest="lr")  # fmt: skip
parser.add_argument("--momentum", default=0.9, type=float, metavar="M", help="momentum")
parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, metavar="W",
                    help="weight decay (default: 1e-4)", dest="weight_decay")  # fmt: skip
parser.add_argument("-p", "--print-freq", default=10, type=int, metavar="N", help="print frequency (default: 10)")
parser.add_argument("--resume", default="", type=str, metavar="PATH", help="path to latest checkpoint (default: none)")
parser.add_argument("-e", "--evaluate", dest="evaluate", action="store_true", help="evaluate model on validation set")
parser.add_argument("--pretrained", dest="pretrained", action="store_true", help="use pre-trained model")
parser.add_argument("--seed", default=None, type=int, help="seed for initializing training.")
parser.add_argument("--dummy", action="store_true", help="use fake data to benchmark")
parser.add_argument("--backend", default="auto", help="gpupipe backend: auto, dali or torch")  # gpupipe
parser.add_argument(
    "--image-size", default=224, type=int, help="training crop (val: 256/224 of it, then it)"
)  # gpupipe

best_acc1 = 0


def main():
    args = parser.parse_args()
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        cudnn.deterministic = True
        cudnn.benchmark = False
        warnings.warn("You have chosen to seed training. This will turn on the CUDNN deterministic setting.",
                      stacklevel=1)  # fmt: skip
    # torchrun sets these (one process per GPU); without it, one process
    args.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    main_worker(int(os.environ.get("LOCAL_RANK", "0")), args)


def main_worker(gpu, args):
    global best_acc1
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{gpu}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(gpu)
    if args.distributed:
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        args.batch_size = args.batch_size // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.pretrained:
        print(f"=> using pre-trained model '{args.arch}'")
        model = models.__dict__[args.arch](pretrained=True)
    else:
        print(f"=> creating model '{args.arch}'")
        model = models.__dict__[args.arch]()
    model = model.to(device)
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[gpu] if use_cuda else None)

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=30, gamma=0.1)  # decays the learning rate by 10 every 30 epochs

    # Data loading: one gpupipe Pipeline per split and a Loader per rank  # gpupipe
    size = args.image_size  # gpupipe
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    to_float = transforms.ToDtype(torch.float32, scale=True)  # gpupipe: ToTensor() as a transform of uint8 images
    train_steps = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(), to_float, normalize]
    val_steps = [transforms.Resize(size * 256 // 224), transforms.CenterCrop(size), to_float, normalize]
    if args.dummy:
        print("=> Dummy data is used!")
        train_source = gp.FakeData(1281167, image_size=(3, 224, 224), num_classes=1000)  # gpupipe
        val_source = gp.FakeData(50000, image_size=(3, 224, 224), num_classes=1000)  # gpupipe
    else:
        train_source, val_source = source(args.data, "train"), source(args.data, "val")  # gpupipe
    options = dict(num_workers=args.workers, device=str(device), backend=args.backend, seed=args.seed)  # gpupipe
    train_loader = gp.Loader(
        gp.Pipeline(train_source, train_steps), args.batch_size, shuffle=True, **options
    )  # gpupipe
    val_loader = gp.Loader(gp.Pipeline(val_source, val_steps), args.batch_size, **options)  # gpupipe
    print(f"=> loaders: {train_loader!r}")  # gpupipe: what backend="auto" chose, and why

    if args.resume:
        if os.path.isfile(args.resume):
            print(f"=> loading checkpoint '{args.resume}'")
            checkpoint = torch.load(args.resume, map_location=device, weights_only=False)
            args.start_epoch = checkpoint["epoch"]
            best_acc1 = checkpoint["best_acc1"]
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
        else:
            print(f"=> no checkpoint found at '{args.resume}'")

    if args.evaluate:
        validate(val_loader, model, criterion, args, device)
        return

    for epoch in range(args.start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # gpupipe: the loader's, where DistributedSampler's was
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        acc1 = validate(val_loader, model, criterion, args, device)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if not args.distributed or dist.get_rank() == 0:
            save_checkpoint(
                {
                    "epoch": epoch + 1,
                    "arch": args.arch,
                    "state_dict": model.state_dict(),
                    "best_acc1": best_acc1,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                },
                is_best,
            )
    train_loader.close()  # gpupipe: ends the workers, threads and DALI pipeline
    val_loader.close()  # gpupipe
    if args.distributed:
        dist.destroy_process_group()


def source(root, split):  # gpupipe: tar shards where there are, else an ImageFolder tree
    shards = sorted(glob.glob(os.path.join(root, f"{split}-*.tar")))
    return gp.WebDataset(shards) if shards else gp.ImageFolder(os.path.join(root, split))


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    batch_time = AverageMeter("Time", ":6.3f")
    data_time = AverageMeter("Data", ":6.3f")
    losses = AverageMeter("Loss", ":.4e")
    top1 = AverageMeter("Acc@1", ":6.2f")
    top5 = AverageMeter("Acc@5", ":6.2f")
    progress = ProgressMeter(len(train_loader), [batch_time, data_time, losses, top1, top5],
                             prefix=f"Epoch: [{epoch}]")  # fmt: skip
    model.train()
    end = time.time()
    for i, (images, target) in enumerate(train_loader):  # gpupipe: on the device already (no .cuda())
        data_time.update(time.time() - end)
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch_time.update(time.time() - end)
        end = time.time()
        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args, device):
    batch_time = AverageMeter("Time", ":6.3f", Summary.NONE)
    losses = AverageMeter("Loss", ":.4e", Summary.NONE)
    top1 = AverageMeter("Acc@1", ":6.2f", Summary.AVERAGE)
    top5 = AverageMeter("Acc@5", ":6.2f", Summary.AVERAGE)
    progress = ProgressMeter(len(val_loader), [batch_time, losses, top1, top5], prefix="Test: ")
    model.eval()
    with torch.no_grad():
        end = time.time()
        for i, batch in enumerate(val_loader):  # gpupipe
            images, target, valid = batch.images, batch.labels, batch.valid  # gpupipe: padding is masked out
            output = model(images)[valid]  # gpupipe
            target = target[valid]  # gpupipe
            if len(target) == 0:  # gpupipe: a batch of padding only
                continue  # gpupipe
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses.update(loss.item(), target.size(0))  # gpupipe: the valid samples' count
            top1.update(acc1[0], target.size(0))  # gpupipe
            top5.update(acc5[0], target.size(0))  # gpupipe
            batch_time.update(time.time() - end)
            end = time.time()
            if i % args.print_freq == 0:
                progress.display(i + 1)
    if args.distributed:
        top1.all_reduce(device)
        top5.all_reduce(device)
    # gpupipe: no auxiliary loader for the remainder: every sample was counted once over the ranks
    progress.display_summary()
    print(f" * counted {int(top1.count)} validation samples", flush=True)  # gpupipe
    return top1.avg


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, "model_best.pth.tar")


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self, name, fmt=":f", summary_type=Summary.AVERAGE):
        self.name, self.fmt, self.summary_type = name, fmt, summary_type
        self.reset()

    def reset(self):
        self.val, self.avg, self.sum, self.count = 0.0, 0.0, 0.0, 0.0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self, device):
        total = torch.tensor([float(self.sum), float(self.count)], dtype=torch.float64, device=device)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)

    def summary(self):
        if self.summary_type is Summary.NONE:
            return ""
        if self.summary_type is Summary.AVERAGE:
            return f"{self.name} {self.avg:.3f}"
        if self.summary_type is Summary.SUM:
            return f"{self.name} {self.sum:.3f}"
        return f"{self.name} {self.count:.3f}"


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        fmt = "{:" + str(len(str(num_batches // 1))) + "d}"
        self.batch_fmtstr = "[" + fmt + "/" + fmt.format(num_batches) + "]"
        self.meters, self.prefix = meters, prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)] + [str(meter) for meter in self.meters]
        print("\t".join(entries), flush=True)

    def display_summary(self):
        entries = [" *"] + [meter.summary() for meter in self.meters]
        print(" ".join(entries), flush=True)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = min(max(topk), output.size(1))
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[: min(k, maxk)].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size)
                for k in topk]  # fmt: skip


if __name__ == "__main__":
    main()
