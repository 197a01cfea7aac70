"""A multi-node Ray cluster on this machine's loopback address, and the ray backend on it, in a
child process of tests/test_ray.py (a process joins one Ray cluster for its life).

    python tests/support/ray_cluster.py OUT SHARDS...

A head with no CPUs and two worker nodes of one CPU each (``ray.cluster_utils.Cluster``). Writes
OUT (JSON):

- ``listening``: the addresses Ray's processes listen on (all must be loopback);
- ``nodes``: the nodes that ran the first epoch's tasks;
- ``same``: whether an epoch during which a worker node is killed (after its first batch) yields
  exactly the torch backend's batches (keys, labels, images), and ``lost_node_epoch``: its keys;
- ``timeout``: the error a loader raises when the last node with CPUs is gone (no hang).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gpupipe.backends._ray._cluster import LOOPBACK_ENV

os.environ.update(LOOPBACK_ENV)  # before Ray is imported: everything on 127.0.0.1

import psutil
import ray
from ray.cluster_utils import Cluster

import gpupipe as gp
from gpupipe import transforms as T

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def pipeline(shards: list[str]) -> gp.Pipeline:
    return gp.Pipeline(shards, [T.RandomResizedCrop(48), T.GaussianBlur(15), T.ToDtype(torch.float32)])


def epoch(loader: gp.Loader, on_first=None) -> list:
    loader.set_epoch(1)
    out = []
    for i, batch in enumerate(loader):
        assert batch.labels is not None
        out.append((batch.keys, batch.labels.tolist(), batch.images.clone()))
        if i == 0 and on_first is not None:
            on_first()
    return out


def listening() -> list[str]:
    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    return sorted({c.laddr.ip for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN
                   and c.pid in pids})  # fmt: skip


def main() -> None:
    out_path, shards = sys.argv[1], sys.argv[2:]
    result: dict = {}
    start = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, node_ip_address="127.0.0.1",
                                                                include_dashboard=False))  # fmt: skip
    workers = [cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    result["started_s"] = round(time.monotonic() - start, 1)
    try:
        result["listening"] = listening()
        with gp.Loader(pipeline(shards), 2, backend="torch", shuffle=True, seed=7, num_workers=0) as loader:
            expected = epoch(loader)
        options = gp.RayOptions(in_flight=4, timeout=60)
        with gp.Loader(pipeline(shards), 2, backend="ray", shuffle=True, seed=7, ray=options) as loader:
            nodes_before = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            got = epoch(loader, on_first=lambda: cluster.remove_node(workers[0], allow_graceful=False))
        result["nodes_before"] = len(nodes_before)
        for _ in range(300):  # Ray notices the lost node within seconds
            if sum(n["Alive"] for n in ray.nodes()) < len(nodes_before):
                break
            time.sleep(0.1)
        result["nodes_after"] = sum(n["Alive"] for n in ray.nodes())
        result["same"] = len(got) == len(expected) and all(
            k1 == k2 and l1 == l2 and torch.equal(i1, i2)
            for (k1, l1, i1), (k2, l2, i2) in zip(got, expected, strict=False)
        )
        result["lost_node_epoch"] = [k for keys, _, _ in got for k in keys]
        cluster.remove_node(workers[1], allow_graceful=False)  # no CPU left anywhere
        began = time.monotonic()
        try:
            with gp.Loader(pipeline(shards), 4, backend="ray", ray=gp.RayOptions(timeout=3)) as loader:
                next(iter(loader))
            result["timeout"] = "no error"
        except gp.WorkerError as e:
            result["timeout"] = str(e)
        result["timeout_s"] = round(time.monotonic() - began, 1)
    finally:
        ray.shutdown()
        cluster.shutdown()
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
