"""The ray backend (``backend="ray"``) beyond the contract suite it runs with every backend
(conftest's ``backend`` fixture, on one local Ray for the session): its options, the same batches
as the torch backend, a local Ray started and ended with its loader, and a multi-node cluster on
the loopback address that loses a node mid-epoch (tests/support/ray_cluster.py, in a child
process: a process joins one Ray cluster for its life)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import gpupipe as gp
from gpupipe import backends
from gpupipe import transforms as T

from .support.checkers import check_invalid
from .support.data import write_webdataset_shards

pytest.importorskip("ray")

ROOT = os.path.join(os.path.dirname(__file__), "..")


class TestRayOptions:
    def test_validated(self):
        check_invalid(lambda: gp.RayOptions(address=""), "address must be")
        check_invalid(lambda: gp.RayOptions(num_cpus=0), "num_cpus must be")
        check_invalid(lambda: gp.RayOptions(in_flight=0), "in_flight must be")
        check_invalid(lambda: gp.RayOptions(timeout=-1), "timeout must be")
        check_invalid(lambda: gp.RayOptions(max_retries=-1), "max_retries must be")
        check_invalid(lambda: gp.RayOptions(normalize_on_rank=1), "normalize_on_rank must be")  # type: ignore[arg-type]
        check_invalid(lambda: gp.LoaderConfig(4, ray={"address": "auto"}), "ray must be a gp.RayOptions")  # type: ignore[arg-type]
        assert gp.LoaderConfig(4).ray == gp.RayOptions()

    def test_in_flight_is_not_a_ranks_share_of_this_node(self, shards, ray_session, clean_env):
        """The tasks run on the cluster: 4 ranks on a 16-CPU node keep 16 batches in flight each,
        not twice their 4-CPU share; a num_workers given is the measure."""
        clean_env.setattr("gpupipe.runtime._dist.cpu_cores", lambda: 16)
        clean_env.setenv("LOCAL_WORLD_SIZE", "4")
        with gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 2, backend="ray") as loader:
            assert (loader.num_workers, loader._runner.in_flight) == (4, 16)  # type: ignore[attr-defined]
        with gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 2, backend="ray", num_workers=1) as loader:
            assert loader._runner.in_flight == 2  # type: ignore[attr-defined]

    def test_a_task_larger_than_the_local_ray_is_refused(self, shards, ray_session, clean_env):
        """A task asking more CPUs than the local Ray has never ran: the first batch waited
        ``RayOptions.timeout`` (300 s) before failing (review, 2026-11-29)."""
        with pytest.raises(gp.ConfigError, match=r"num_cpus=3 per task is more than the 2 CPUs of the local Ray"):
            gp.Loader(gp.Pipeline(shards, [T.CenterCrop(8)]), 2, backend="ray", ray=gp.RayOptions(num_cpus=3))

    def test_auto_never_picks_ray(self):
        assert backends.resolve("auto", "cpu")[0].name != "ray"
        assert backends.get("ray").auto is False


class TestSameAsTorch:
    def test_views_skips_and_labels(self, shards, tmp_path, ray_session, clean_env):
        """Bit-identical to the torch backend: two views, a damaged sample skipped and counted."""
        from .support.data import truncated_jpeg

        damaged = write_webdataset_shards(str(tmp_path), (5, 4), patch={3: {"jpg": truncated_jpeg(3)}})
        views = [[T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)],
                 [T.RandomResizedCrop(8), T.ColorJitter(0.4, 0.4, 0.4, 0.1)]]  # fmt: skip
        got: dict[str, list] = {}
        for name in ("torch", "ray"):
            with gp.Loader(gp.Pipeline(damaged, views=views), 3, backend=name, shuffle=True, seed=4, num_workers=2,
                           on_error="skip", max_skipped=None) as loader:  # fmt: skip
                loader.set_epoch(2)
                got[name] = [(b.keys, b.labels.clone(), b.valid, b.images) for b in loader if b.labels is not None]
                got[name + "-skipped"] = [(s.key, s.shard) for s in loader.skipped]
        assert got["torch-skipped"] == got["ray-skipped"] and len(got["ray-skipped"]) == 1
        for a, b in zip(got["torch"], got["ray"], strict=True):
            assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
            assert all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))

    def test_channels_last_is_a_view_of_the_object_store(self, shards, ray_session, clean_env):
        pipe = gp.Pipeline(shards, [T.CenterCrop(16)])
        with gp.Loader(pipe, 4, backend="ray", memory_format=torch.channels_last) as loader:
            images = next(iter(loader)).images
        assert images.shape == (4, 3, 16, 16) and images.is_contiguous(memory_format=torch.channels_last)


class TestNormalizeOnRank:
    """Each view's closing ToDtype / Normalize run on the rank: uint8 through the object store,
    the same values as the torch backend."""

    NORM = (T.ToDtype(torch.float32, scale=True), T.Normalize(mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4)))

    def test_split(self):
        from gpupipe.backends._ray._runner import split_finish

        crop, jitter = T.RandomResizedCrop(8), T.ColorJitter(0.4)
        tasks, finish = split_finish(((crop, *self.NORM), (crop,), (crop, T.ToDtype(torch.float32), jitter)), False)
        assert tasks == ((crop,), (crop,), (crop, T.ToDtype(torch.float32), jitter))  # jitter draws: it stays
        assert finish == (self.NORM, (), ())
        float_then_norm = (crop, T.ToDtype(torch.float32, scale=True), jitter, self.NORM[1])  # not uint8 at the cut
        assert split_finish((float_then_norm,), False) == ((float_then_norm,), ((),))
        assert split_finish(((crop, T.ToDtype(torch.uint8)),), False)[1] == ((),)  # nothing gained
        assert split_finish(((crop, *self.NORM), (crop, *self.NORM)), True) == (((crop,), (crop,)), (self.NORM,) * 2)
        unlike = ((crop, *self.NORM), (crop, self.NORM[0]))  # per_source lists closing differently: none moved
        assert split_finish(unlike, True) == (unlike, ((), ()))

    @pytest.mark.gpu
    def test_on_a_gpu_within_float_rounding_of_torch(self, shards, ray_session, clean_env):
        pipe = gp.Pipeline(shards, [T.RandomResizedCrop(16), *self.NORM])
        got = {}
        for name in ("torch", "ray"):
            with gp.Loader(pipe, 4, backend=name, device="cuda", seed=3, num_workers=2) as loader:
                got[name] = [b.images for b in loader]
                if name == "ray":
                    assert "Normalize, ToDtype" in repr(loader)  # the default on a GPU
        for a, b in zip(got["torch"], got["ray"], strict=True):
            assert a.is_cuda and b.is_cuda and torch.allclose(a, b, atol=1e-5)

    def test_by_default_on_a_gpu_only(self):
        from gpupipe.backends._ray._runner import normalizes_on_rank

        assert normalizes_on_rank(None, torch.device("cuda", 1)) and not normalizes_on_rank(None, torch.device("cpu"))
        assert normalizes_on_rank(True, torch.device("cpu")) and not normalizes_on_rank(False, torch.device("cuda"))

    @pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
    def test_same_values_as_torch_and_as_in_the_task(self, shards, tmp_path, ray_session, clean_env, memory_format):
        """Bit-identical to the torch backend and to the ray backend without the option, a batch
        of only damaged samples included (zeros, as on torch)."""
        from .support.data import truncated_jpeg

        bad = {n: {"jpg": truncated_jpeg(n)} for n in range(4)}
        damaged = write_webdataset_shards(str(tmp_path), (4, 3), patch=bad, prefix="allbad")
        views = [[T.RandomResizedCrop(16), *self.NORM], [T.CenterCrop(8), T.ToDtype(torch.float32, scale=True)]]
        got, on_rank = {}, gp.RayOptions(normalize_on_rank=True)
        for name, options in (("torch", {}), ("ray", {"ray": on_rank}), ("ray-in-task", {})):
            with gp.Loader(gp.Pipeline(damaged, views=views), 4, backend=name.split("-")[0], num_workers=2, seed=1,
                           on_error="skip", max_skipped=None, memory_format=memory_format,
                           **options) as loader:  # fmt: skip
                got[name] = [b.views for b in loader]
                if name == "ray":
                    assert "on_rank" in repr(loader) and "Normalize, ToDtype" in repr(loader)
        assert not got["torch"][0][0].any()  # the first batch: every sample damaged
        for other in ("ray", "ray-in-task"):
            for a, b in zip(got["torch"], got[other], strict=True):
                assert all(torch.equal(x, y) and x.stride() == y.stride() for x, y in zip(a, b, strict=True))


def test_a_local_ray_starts_with_its_loader_and_ends_with_it(shards, clean_env):
    """In a process without Ray: the loader starts one (loopback only) and its close() ends it."""
    code = f"""
import json, psutil, ray, torch, gpupipe as gp
from gpupipe import transforms as T
pipe = gp.Pipeline({shards!r}, [T.CenterCrop(16)])
with gp.Loader(pipe, 4, backend="ray", ray=gp.RayOptions(local_cpus=1)) as loader:
    assert ray.is_initialized()
    n = sum(len(b.keys) for b in loader)
    ips = {{c.laddr.ip for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN
           and c.pid in {{p.pid for p in psutil.Process().children(recursive=True)}}}}
assert not ray.is_initialized()
print(json.dumps([n, sorted(ips)]))
"""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    n, ips = json.loads(out.stdout.strip().splitlines()[-1])
    assert n == 16 and set(ips) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def test_close_from_another_thread_while_waiting_for_a_batch(shards, clean_env):
    """The local Ray a loader started: its close() from another thread, while the training thread
    waits for a batch, raises ClosedError there (as on the torch backend), never Ray's SystemExit(0)
    of a ray.shutdown() under a ray.get (the process ended silently, with status 0)."""
    code = f"""
import dataclasses, threading, time, ray, torch, gpupipe as gp
from gpupipe import transforms as T

@dataclasses.dataclass(frozen=True)
class Slow(T.ArrayFunction):
    def apply(self, image, xp):
        time.sleep(0.5)
        return image.copy()

loader = gp.Loader(gp.Pipeline({shards!r}, [Slow(), T.CenterCrop(16)]), 1, backend="ray",
                   ray=gp.RayOptions(local_cpus=1, in_flight=1))
batches = iter(loader)
next(batches)  # the next batch's task runs for 0.5 s: the close below comes during its wait
closer = threading.Timer(0.2, loader.close)
closer.start()
try:
    next(batches)
    next(batches)
except gp.ClosedError:
    print("closed")
closer.join()
assert not ray.is_initialized()
"""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == ["closed"], out.stderr[-3000:]


@pytest.mark.slow
def test_a_cluster_on_loopback_loses_a_node_mid_epoch(tmp_path):
    """A head and two worker nodes (1 CPU each) on 127.0.0.1: nothing listens elsewhere; a worker
    node killed after the epoch's first batch: the epoch completes with exactly the torch
    backend's batches (its tasks run again on the other node); with no node left, a clear
    WorkerError after RayOptions.timeout instead of a hang."""
    shards = write_webdataset_shards(str(tmp_path), (16, 16, 16))
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "ray_cluster.py"), str(out),
                           *shards], capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["listening"]) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, result["listening"]
    assert result["nodes_before"] == 3 and result["nodes_after"] == 2, result
    assert result["same"] and len(result["lost_node_epoch"]) == 48
    assert result["timeout"].startswith("ray backend: no batch in 3 s") and result["timeout_s"] < 30, result


@pytest.mark.slow
def test_a_file_that_crashes_the_decoder_gets_the_torch_backends_verdict(tmp_path):
    """A task whose decoder crashes (SIGSEGV) on a file, on every try: the batch's samples are
    probed alone in a sandbox, the file is refused as undecodable (skipped and counted, or raised
    naming it), the batch is run again, and the next epoch skips it without a crash — the verdict
    the torch backend gives the same file (tests/test_processes.py). A task that hangs on a file
    past RayOptions.timeout: the same, the file refused as hung."""
    from .support.checkers import crasher

    shards = write_webdataset_shards(str(tmp_path), (16,), prefix="crash", patch={5: {"jpg": crasher()}})
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "ray_crash.py"), str(out),
                           *shards], capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    expected = sorted(f"img/00/{n:06d}" for n in range(16) if n != 5)
    assert [sorted(keys) for keys in result["epochs"]] == [expected, expected]
    ((key, kind, reason),) = result["skipped"]
    assert key == "img/00/000005" and kind == "undecodable"
    assert "cannot be decoded: it killed the process decoding it" in reason and "SIGSEGV" in reason
    name, key, message = result["raised"]
    assert name == "SampleError" and key == "img/00/000005" and "killed the process decoding it" in message
    assert result["hung_keys"] == [f"img/00/{n:06d}" for n in (0, 1, 3, 4, 5)]  # a hung task: probed the same way
    ((key, kind, reason),) = result["hung"]
    assert key == "img/00/000002" and kind == "undecodable" and "did not finish in 3 s" in reason


@pytest.mark.slow
def test_the_scale_out_benchmark_runs(tmp_path):
    """bench/scale_out.py, small: every configuration (torch, a local Ray, clusters of 1 and 2
    worker nodes) runs and the report is written."""
    argv = [sys.executable, os.path.join(ROOT, "bench", "scale_out.py"), "--images", "32", "--epochs", "1",
            "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (report,) = (tmp_path / "out").iterdir()
    text = report.read_text()
    assert "2 worker nodes / 1, dino" in text and "ray / torch, imagenet train" in text


@pytest.mark.slow
def test_torchrun_ranks_share_one_cluster(tmp_path, shards):
    """Two torchrun ranks (gloo), each a driver of one loopback cluster given by RAY_ADDRESS: each
    yields its own share of the epoch, every sample once over both, in equal batch counts."""
    out = str(tmp_path / "keys")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "ray_torchrun.py"), out, *shards],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"keys.rank{r}.json").read_text()) for r in range(2)]
    assert all(r["address"] and r["address"].startswith("127.0.0.1:") for r in ranks)
    assert ranks[0]["batches"] == ranks[1]["batches"]
    keys = ranks[0]["keys"] + ranks[1]["keys"]
    assert len(keys) == len(set(keys)) == 16


class TestFields:
    """``WebDataset(fields=)`` on the ray backend: the torch backend's decoders and batching in the
    tasks, the same values through the object store; a source of fields alone too."""

    def test_the_same_fields_as_torch_with_a_skipped_sample(self, tmp_path, ray_session, clean_env):
        import io

        import numpy as np
        import webdataset as wds

        from gpupipe.testing import encode_jpeg, synthetic_image

        from .support.data import truncated_jpeg

        path = str(tmp_path / "fields-000000.tar")
        with wds.TarWriter(path) as sink:
            for i in range(7):
                boxes = io.BytesIO()
                np.save(boxes, np.full((i % 3 + 1, 4), i, np.float32))
                jpeg = truncated_jpeg(i) if i == 4 else encode_jpeg(synthetic_image(i, size=(20, 24)))
                sink.write({"__key__": f"k{i}", "jpg": jpeg, "cls": i % 2, "txt": f"caption {i}",
                            "json": {"i": i}, "npy": boxes.getvalue()})  # fmt: skip
        fields = {"image": "jpg", "label": "cls", "text": "txt", "meta": "json",
                  "boxes": gp.fields.Array("npy", pad=-1)}  # fmt: skip
        got = {}
        for name in ("torch", "ray"):
            pipe = gp.Pipeline(gp.WebDataset(path, fields=fields), [T.CenterCrop(16)])
            with gp.Loader(pipe, 3, backend=name, num_workers=2, shuffle=True, seed=2, on_error="skip",
                           max_skipped=None) as loader:  # fmt: skip
                got[name] = list(loader)
                assert [s.key for s in loader.skipped] == ["k4"]
        for a, b in zip(got["torch"], got["ray"], strict=True):
            assert a.keys == b.keys and a["text"] == b["text"] and a["meta"] == b["meta"]
            assert torch.equal(a["boxes"].data, b["boxes"].data) and torch.equal(a["boxes"].lengths, b["boxes"].lengths)
            assert torch.equal(a.images, b.images) and torch.equal(a.valid, b.valid)

    def test_a_source_of_arrays_alone(self, tmp_path, ray_session, clean_env):
        import io

        import numpy as np
        import webdataset as wds

        path = str(tmp_path / "arrays-000000.tar")
        with wds.TarWriter(path) as sink:
            for i in range(6):
                x = io.BytesIO()
                np.save(x, np.full((2, 3), i, np.float32))
                sink.write({"__key__": f"a{i}", "npy": x.getvalue(), "cls": i})
        source = gp.WebDataset(path, fields={"x": "npy", "label": "cls"})
        with gp.Loader(gp.Pipeline(source), 3, backend="ray", shuffle=False) as loader:
            batches = list(loader)
        assert all(b.images is None for b in batches)
        assert torch.cat([b["x"][:, 0, 0] for b in batches]).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        labels = [b.labels for b in batches]
        assert all(t is not None for t in labels) and torch.cat(labels).tolist() == [0, 1, 2, 3, 4, 5]  # type: ignore[arg-type]

    def test_masks_and_boxes_as_torch_moves_them(self, tmp_path, ray_session, clean_env):
        import numpy as np

        from gpupipe.testing import encode_jpeg, encode_png, synthetic_image

        mask = encode_png((np.arange(40 * 48).reshape(40, 48) % 11).astype(np.uint8))
        with gp.ShardWriter(str(tmp_path / "t-%06d.tar")) as w:
            for i in range(6):
                w.write(f"k{i}", {"jpg": encode_jpeg(synthetic_image(i, size=(40, 48))), "seg.png": mask,
                                  "boxes.npy": np.array([[4, 4, 30, 20], [1, 30, 6, 38]], np.float32)})  # fmt: skip
        source = gp.WebDataset(w.shards, fields={"image": "jpg", "mask": gp.fields.Mask("seg.png"),
                                                 "boxes": gp.fields.Boxes("boxes.npy")})  # fmt: skip
        steps = [T.RandomResizedCrop(24, scale=(0.3, 1.0)), T.RandomHorizontalFlip(), T.RandomRotation(10)]
        got = {}
        for name in ("torch", "ray"):
            with gp.Loader(gp.Pipeline(source, steps), 3, backend=name, shuffle=True, seed=1, num_workers=2) as loader:
                got[name] = list(loader)
        for a, b in zip(got["torch"], got["ray"], strict=True):
            assert a.keys == b.keys and torch.equal(a["mask"], b["mask"]) and torch.equal(a.images, b.images)
            assert torch.equal(a["boxes"].data, b["boxes"].data) and torch.equal(a["boxes"].lengths, b["boxes"].lengths)


class TestQueue:
    """How full the runner's queue of tasks in flight ran when the loop asked (``queue_ready`` of
    ``queue_depth``, the tasks in flight), as the torch and DALI runners report theirs."""

    def test_a_slow_step_runs_it_full_and_a_fast_loop_empty(self, shards, ray_session, clean_env):
        import time

        pipe = gp.Pipeline(shards, [T.CenterCrop(16)])
        got = {}
        for step in (0.1, 0.0):
            with gp.Loader(pipe, 2, backend="ray", num_workers=1) as loader:
                for epoch in range(2):
                    loader.set_epoch(epoch)
                    for _ in loader:
                        time.sleep(step)
                got[step] = loader.stats()["times"]
        slow, fast = got[0.1], got[0.0]
        assert slow["queue_depth"] == fast["queue_depth"] == 2  # in flight: 2 x num_workers
        assert slow["queue_ready"] >= 1.5  # the tasks were done before the loop asked
        assert fast["queue_ready"] < slow["queue_ready"]
