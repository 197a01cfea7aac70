"""The ray backend against the torch backend on one machine, and scaled out over Ray nodes.

    python bench/scale_out.py                  # 512 synthetic photos (~500x375), both parts
    python bench/scale_out.py --images 256 --epochs 1

1. **One node, the same CPUs**: the ImageNet train recipe (batches of 32, and of 8 where a
   batch's fixed cost weighs most) and DINO through ``backend="torch"`` (its ``--cpus`` worker
   processes) and through ``backend="ray"`` (a local Ray of ``--cpus`` CPUs): images/s, their
   ratio (the Ray path's overhead: a task per batch, the batch through the object store). The ray
   rows run twice: as the backend does it (a Ray task per batch) and with a pool of ``--cpus``
   Ray actors taking the batches in turn (the alternative the backend's design weighed).
2. **Scaling out**: the DINO recipe (2 global + 8 local crops, blur and color jitter: CPU-heavy)
   through ``backend="ray"`` on a ``ray.cluster_utils.Cluster`` on this machine's loopback
   address — a head without CPUs and 1, then 2 worker nodes of 1 CPU each: images/s and the
   speed-up; and 2 nodes with ``normalize_on_rank=False`` (float32 batches through the object
   store instead of uint8).

Each configuration runs in a child process (a process joins one Ray for its life); each is
measured over ``--epochs`` epochs after a warm-up one. The report adds the CPU-seconds per image of
each recipe (CPUs / images/s) and what they mean for a GPU node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _data import synthetic_shards
from _report import publish

H100_STEP = 3760  # images/s a ResNet-50 bf16 step takes on one H100 (bench/results/2026-11-22-data-stall-gpu.md)


def child(config: dict) -> dict:
    """One configuration, in this (child) process."""
    import torch

    if config["backend"] == "ray":
        from gpupipe.backends._ray._cluster import LOOPBACK_ENV

        os.environ.update(LOOPBACK_ENV)
        import ray

        if config.get("nodes"):
            from ray.cluster_utils import Cluster

            cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, node_ip_address="127.0.0.1",
                                                                        include_dashboard=False))  # fmt: skip
            for _ in range(config["nodes"]):
                cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            ray.init(address=cluster.address, log_to_driver=False)
    import gpupipe as gp

    make = gp.load_pipeline(config["pipeline"])
    kwargs = {"size": 128} if config["pipeline"].endswith("imagenet.py:train") else {}
    pipe = make(config["shards"], **kwargs)
    options = dict(backend=config["backend"], shuffle=True, seed=0, num_workers=config["cpus"])
    if config["backend"] == "ray":
        options["ray"] = gp.RayOptions(local_cpus=config["cpus"], in_flight=2 * config["cpus"] + 2,
                                       normalize_on_rank=config.get("on_rank"),
                                       num_cpus=config.get("task_cpus", 1.0))  # fmt: skip
        if config.get("actors"):
            use_actors(config["cpus"])
    with gp.Loader(pipe, config["batch_size"], **options) as loader:
        rates = []
        for epoch in range(config["epochs"] + 1):  # the first: warm-up
            loader.set_epoch(epoch)
            start, n = time.perf_counter(), 0
            for batch in loader:
                n += int(batch.valid.sum())
            if epoch:
                rates.append(n / (time.perf_counter() - start))
    del torch
    return {"images_s": sum(rates) / len(rates)}


def use_actors(n: int) -> None:
    """The ray backend with a pool of ``n`` actors instead of a task per batch: each batch goes to
    the next actor in turn, which runs the backend's own ``run_batch`` (the same job cache)."""
    import ray

    from gpupipe.backends._ray import _runner

    @ray.remote(num_cpus=1)
    class BatchActor:
        def run(self, *args):
            return _runner.run_batch(*args)

    class Pool:
        def __init__(self) -> None:
            self.actors, self.turn = [BatchActor.remote() for _ in range(n)], 0  # type: ignore[attr-defined]

        def remote(self, *args):
            self.turn += 1
            return self.actors[self.turn % n].run.remote(*args)

    init = _runner.RayRunner.__init__

    def with_pool(self, spec):
        init(self, spec)
        self._task = Pool()

    _runner.RayRunner.__init__ = with_pool  # type: ignore[method-assign]


def run(config: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{config}: failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512, help="images of the DINO rows (default 512)")
    parser.add_argument("--imagenet-images", type=int, help="images of the ImageNet rows (default: 4 x --images, so "
                        "that an epoch lasts about a second and its start and end weigh little)")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of part 1, on both backends (default 2)")
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data", "ray"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--scaling-only", action="store_true",
                        help="only part 2, the worker-node rows (a lent machine's short command)")  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    shards = synthetic_shards(args.data, args.images)
    imagenet_images = args.imagenet_images or 4 * args.images
    large = shards if args.scaling_only else synthetic_shards(f"{args.data}-{imagenet_images}", imagenet_images)
    base = dict(shards=shards, epochs=args.epochs)
    imagenet, dino = "pipelines/imagenet.py:train", "pipelines/ssl.py:dino"
    rows, got = [], {}
    one_node = dict(base, cpus=args.cpus)
    recipes = [("imagenet train", dict(pipeline=imagenet, batch_size=32, shards=large)),
               ("imagenet train, batch 8", dict(pipeline=imagenet, batch_size=8, shards=large)),
               ("dino", dict(pipeline=dino, batch_size=16))]  # fmt: skip
    configs = []
    for recipe, config in recipes:
        configs += [(f"torch, {recipe}", dict(one_node, backend="torch", **config)),
                    (f"ray, {recipe}", dict(one_node, backend="ray", **config)),
                    (f"ray actors, {recipe}", dict(one_node, backend="ray", actors=True, **config))]  # fmt: skip
    if args.scaling_only:
        recipes, configs = [], []
    cluster = dict(base, backend="ray", pipeline=dino, batch_size=16)
    configs += [
        ("ray, dino, 1 worker node", dict(cluster, cpus=1, nodes=1, on_rank=True)),
        ("ray, dino, 2 worker nodes", dict(cluster, cpus=2, nodes=2, on_rank=True)),
        ("ray, dino, 2 worker nodes, float32 moved", dict(cluster, cpus=2, nodes=2, on_rank=False)),
    ]
    for name, config in configs:
        got[name] = run(config)["images_s"]
        print(f"{name}: {got[name]:.1f} images/s", flush=True)
    for name, rate in got.items():
        rows.append([name, f"{rate:.1f}"])
    for recipe, _ in recipes:
        ratio = got[f"ray, {recipe}"] / got[f"torch, {recipe}"]
        rows.append([f"ray / torch, {recipe} (same CPUs)", f"{ratio:.2f}x"])
        actors = got[f"ray actors, {recipe}"] / got[f"ray, {recipe}"]
        rows.append([f"ray actors / ray tasks, {recipe}", f"{actors:.2f}x"])
    scale = got["ray, dino, 2 worker nodes"] / got["ray, dino, 1 worker node"]
    rows.append(["2 worker nodes / 1, dino", f"{scale:.2f}x"])
    on_rank = got["ray, dino, 2 worker nodes"] / got["ray, dino, 2 worker nodes, float32 moved"]
    rows.append(["normalize_on_rank True / False, dino, 2 worker nodes", f"{on_rank:.2f}x"])
    per_cpu = {
        "imagenet train (128 px here)": args.cpus / got["torch, imagenet train"],
        "dino (2 x 224 + 8 x 96 px)": args.cpus / got["torch, dino"],
    } if recipes else {}  # fmt: skip
    plan = "; ".join(
        f"{recipe}: {s * 1000:.1f} CPU-ms per image, so {H100_STEP} images/s (one H100's ResNet-50 step) take "
        f"{s * H100_STEP:.0f} CPUs"
        for recipe, s in per_cpu.items()
    )
    publish(
        args.out,
        "scale-out",
        f"Ray backend, {os.cpu_count()}-core CPU",
        f"`python bench/scale_out.py --images {args.images} --epochs {args.epochs} --cpus {args.cpus}"
        f"{' --scaling-only' if args.scaling_only else ''}`: "
        f"synthetic photos (~500x375 JPEG), {imagenet_images} for the ImageNet rows, {args.images} for DINO's; "
        "each configuration in its own process, images/s averaged over "
        f"{args.epochs} epochs after a warm-up epoch. One node: the torch backend's worker processes against a "
        "local Ray of as many CPUs. Scaling out: a ray.cluster_utils.Cluster on 127.0.0.1, a head without CPUs "
        "and 1 or 2 worker nodes of 1 CPU each (their processes share this machine's "
        f"{os.cpu_count()} cores with the training process). Targets: ray >= 0.85x torch, 2 nodes >= 1.7x 1. "
        f"Paper plan, from the torch backend's CPU time: {plan}."
        if plan
        else "",
        ["configuration", "images/s"],
        rows,
    )


if __name__ == "__main__":
    main()
