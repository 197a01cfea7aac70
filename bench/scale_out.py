"""The ray backend against the torch backend on one machine, and scaled out over Ray nodes.

    python bench/scale_out.py                  # 512 synthetic photos (~500x375), both parts
    python bench/scale_out.py --images 256 --epochs 1

1. **One node, the same CPUs**: the ImageNet train recipe through ``backend="torch"`` (its
   ``--cpus`` worker processes) and through ``backend="ray"`` (a local Ray of ``--cpus`` CPUs):
   images/s, their ratio (the Ray path's overhead: a task per batch, the batch through the
   object store).
2. **Scaling out**: the DINO recipe (2 global + 8 local crops, blur and color jitter: CPU-heavy)
   through ``backend="ray"`` on a ``ray.cluster_utils.Cluster`` on this machine's loopback
   address — a head without CPUs and 1, then 2 worker nodes of 1 CPU each: images/s and the
   speed-up.

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
        options["ray"] = gp.RayOptions(local_cpus=config["cpus"], in_flight=2 * config["cpus"] + 2)
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


def run(config: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{config}: failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of part 1, on both backends (default 2)")
    parser.add_argument("--data", default=os.path.join(ROOT, ".bench-data", "ray"))
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    shards = synthetic_shards(args.data, args.images)
    base = dict(shards=shards, epochs=args.epochs)
    imagenet, dino = "pipelines/imagenet.py:train", "pipelines/ssl.py:dino"
    rows, got = [], {}
    for name, config in [
        ("torch, imagenet train", dict(base, backend="torch", pipeline=imagenet, cpus=args.cpus, batch_size=32)),
        ("ray, imagenet train", dict(base, backend="ray", pipeline=imagenet, cpus=args.cpus, batch_size=32)),
        ("torch, dino", dict(base, backend="torch", pipeline=dino, cpus=args.cpus, batch_size=16)),
        ("ray, dino", dict(base, backend="ray", pipeline=dino, cpus=args.cpus, batch_size=16)),
        ("ray, dino, 1 worker node", dict(base, backend="ray", pipeline=dino, cpus=1, nodes=1, batch_size=16)),
        ("ray, dino, 2 worker nodes", dict(base, backend="ray", pipeline=dino, cpus=2, nodes=2, batch_size=16)),
    ]:
        got[name] = run(config)["images_s"]
        print(f"{name}: {got[name]:.1f} images/s", flush=True)
    ratio_imagenet = got["ray, imagenet train"] / got["torch, imagenet train"]
    ratio_dino = got["ray, dino"] / got["torch, dino"]
    scale = got["ray, dino, 2 worker nodes"] / got["ray, dino, 1 worker node"]
    for name, rate in got.items():
        rows.append([name, f"{rate:.1f}"])
    rows += [
        ["ray / torch, imagenet train (same CPUs)", f"{ratio_imagenet:.2f}x"],
        ["ray / torch, dino (same CPUs)", f"{ratio_dino:.2f}x"],
        ["2 worker nodes / 1, dino", f"{scale:.2f}x"],
    ]
    per_cpu = {
        "imagenet train (128 px here)": args.cpus / got["torch, imagenet train"],
        "dino (2 x 224 + 8 x 96 px)": args.cpus / got["torch, dino"],
    }
    plan = "; ".join(
        f"{recipe}: {s * 1000:.1f} CPU-ms per image, so {H100_STEP} images/s (one H100's ResNet-50 step) take "
        f"{s * H100_STEP:.0f} CPUs"
        for recipe, s in per_cpu.items()
    )
    publish(
        args.out,
        "scale-out",
        f"Ray backend, {os.cpu_count()}-core CPU",
        f"`python bench/scale_out.py --images {args.images} --epochs {args.epochs} --cpus {args.cpus}`: "
        f"synthetic photos (~500x375 JPEG); each configuration in its own process, images/s averaged over "
        f"{args.epochs} epochs after a warm-up epoch. One node: the torch backend's worker processes against a "
        "local Ray of as many CPUs. Scaling out: a ray.cluster_utils.Cluster on 127.0.0.1, a head without CPUs "
        "and 1 or 2 worker nodes of 1 CPU each (their processes share this machine's "
        f"{os.cpu_count()} cores with the training process). Targets: ray >= 0.85x torch, 2 nodes >= 1.7x 1. "
        f"Paper plan, from the torch backend's CPU time: {plan}.",
        ["configuration", "images/s"],
        rows,
    )


if __name__ == "__main__":
    main()
