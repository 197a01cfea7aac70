"""Two torchrun ranks as drivers of one Ray cluster (on loopback), in a child process of
tests/test_ray.py.

    python tests/support/ray_torchrun.py OUT SHARDS...

Starts a cluster (a head without CPUs, one worker node of 2 CPUs), then ``torchrun
--nproc_per_node=2`` of this script in rank mode with ``RAY_ADDRESS`` set: each rank joins the
cluster, iterates one epoch of ``backend="ray"`` (gloo for torch.distributed) and writes its valid
keys to ``OUT.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gpupipe.backends._ray._cluster import LOOPBACK_ENV

os.environ.update(LOOPBACK_ENV)


def rank(out: str, shards: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import gpupipe as gp
    from gpupipe import transforms as T

    dist.init_process_group("gloo")
    pipe = gp.Pipeline(shards, [T.RandomResizedCrop(16), T.ToDtype(torch.float32)])
    with gp.Loader(pipe, 3, backend="ray", shuffle=True, seed=2) as loader:
        loader.set_epoch(1)
        keys = [k for b in loader for k, ok in zip(b.keys, b.valid.tolist(), strict=True) if ok]
        batches = len(loader)
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump({"keys": keys, "batches": batches, "address": os.environ.get("RAY_ADDRESS")}, f)
    dist.destroy_process_group()


def main() -> None:
    out, shards = sys.argv[1], sys.argv[2:]
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, node_ip_address="127.0.0.1",
                                                                include_dashboard=False))  # fmt: skip
    cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
    try:
        env = {**os.environ, "RAY_ADDRESS": cluster.address}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                "--rank", out, *shards]  # fmt: skip
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(proc.returncode)
    finally:
        del ray
        cluster.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank(sys.argv[2], sys.argv[3:])
    else:
        main()
