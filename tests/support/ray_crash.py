"""The ray backend meeting a file that crashes its decoder (SIGSEGV) and one that hangs it, in a
child process of tests/test_ray.py: a local Ray whose every worker process gets the crashing
decoder of ``checkers.make_decoders_crash`` (Ray's ``worker_process_setup_hook``), and so does
this process (for the sandbox that probes the batch).

    python tests/support/ray_crash.py OUT SHARDS...

Writes OUT (JSON): under ``on_error="skip"`` the valid keys of two epochs and the skipped samples
(key, kind, reason); under ``on_error="raise"`` the error's type, key and message; ``hung``: the
samples skipped from a shard (written next to OUT) whose sample 2 hangs the decoder.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from gpupipe.backends._ray._cluster import LOOPBACK_ENV

os.environ.update(LOOPBACK_ENV)  # before Ray is imported: everything on 127.0.0.1

import ray
import torch

import gpupipe as gp
from gpupipe import transforms as T

HANG_MARK = b"\xff\xd8\xff\xfe\x00\x08HANG!!"  # a JPEG comment segment, as checkers.CRASH_MARK


def crashing_decoder() -> None:
    """Installs the crashing decoder in this process (defined here, in ``__main__``, so that Ray
    sends it to its workers by value)."""
    import signal

    from gpupipe.backends._torch import _persample

    mark, real = b"\xff\xd8\xff\xfe\x00\x08CRASH!", _persample.decode_rgb

    def decode(data, **kwargs):
        if bytes(data).startswith(mark):
            os.kill(os.getpid(), signal.SIGSEGV)
        if bytes(data).startswith(HANG_MARK):
            time.sleep(3600)
        return real(data, **kwargs)

    _persample.decode_rgb = decode


def main(out: str, shards: list[str]) -> None:
    from tests.support.checkers import CRASH_MARK

    assert CRASH_MARK == b"\xff\xd8\xff\xfe\x00\x08CRASH!"
    crashing_decoder()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False, runtime_env={"worker_process_setup_hook": crashing_decoder})  # fmt: skip
    pipe = gp.Pipeline(shards, [T.Resize((16, 16)), T.ToDtype(torch.float32)])
    result: dict = {}
    options = dict(backend="ray", device="cpu", ray=gp.RayOptions(max_retries=1, in_flight=3))
    with gp.Loader(pipe, 4, on_error="skip", max_skipped=None, **options) as loader:
        result["epochs"] = []
        for epoch in range(2):  # the second epoch knows it: no crash
            loader.set_epoch(epoch)
            result["epochs"].append([k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v])
        result["skipped"] = [(s.key, s.kind, s.reason) for s in loader.skipped]
    with gp.Loader(pipe, 4, **options) as loader:
        try:
            list(loader)
        except gp.SampleError as e:
            result["raised"] = [type(e).__name__, e.key, str(e)]
    from gpupipe.testing import encode_jpeg, synthetic_image
    from tests.support.data import write_webdataset_shards

    hanger = HANG_MARK + encode_jpeg(synthetic_image(5, size=(24, 32)))[2:]
    hangs = write_webdataset_shards(os.path.dirname(out), (6,), prefix="hang", patch={2: {"jpg": hanger}})
    options["ray"] = gp.RayOptions(max_retries=0, timeout=3)
    with gp.Loader(gp.Pipeline(hangs, pipe.transforms), 3, on_error="skip", max_skipped=None, **options) as loader:
        result["hung_keys"] = sorted(k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v)
        result["hung"] = [(s.key, s.kind, s.reason) for s in loader.skipped]
    ray.shutdown()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
