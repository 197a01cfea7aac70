"""Rank discovery: the one place that knows rank, world size and local GPU (gpupipe.runtime._dist)."""

from __future__ import annotations

import os

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.runtime import _dist

from .support.checkers import val

ROOT = os.path.join(os.path.dirname(__file__), "..")


class TestTopology:
    def test_single_process(self, clean_env):
        assert _dist.topology() == (0, 1, "single process")

    def test_explicit_wins_over_environment(self, clean_env):
        clean_env.setenv("RANK", "1")
        clean_env.setenv("WORLD_SIZE", "4")
        assert _dist.topology(2, 3) == (2, 3, "explicit")

    def test_torchrun_environment(self, clean_env):
        clean_env.setenv("RANK", "3")
        clean_env.setenv("WORLD_SIZE", "4")
        clean_env.setenv("SLURM_PROCID", "0")
        clean_env.setenv("SLURM_NTASKS", "2")
        assert _dist.topology() == (3, 4, "RANK/WORLD_SIZE")

    def test_slurm_environment(self, clean_env):
        clean_env.setenv("SLURM_PROCID", "5")
        clean_env.setenv("SLURM_NTASKS", "8")
        assert _dist.topology() == (5, 8, "SLURM")

    @pytest.mark.parametrize(
        "rank, world, match",
        [(0, None, "both"), (3, 3, "0 <= rank"), (-1, 2, "0 <= rank"), (0, 0, "0 <= rank"), (1.0, 2, "int")],
    )
    def test_invalid_explicit(self, clean_env, rank, world, match):
        with pytest.raises(gp.ConfigError, match=match):
            _dist.topology(rank, world)

    @pytest.mark.parametrize("env", [{"SLURM_PROCID": "3"}, {"RANK": "2"}, {"WORLD_SIZE": "4"}])
    def test_half_a_pair_is_refused(self, clean_env, env):
        """A lone rank or world size says there are other processes: each taken as rank 0 of 1
        would read the whole dataset."""
        for name, value in env.items():
            clean_env.setenv(name, value)
        with pytest.raises(gp.ConfigError, match="without its pair"):
            _dist.topology()

    def test_half_a_pair_of_one_process_is_a_single_process(self, clean_env):
        clean_env.setenv("SLURM_PROCID", "0")  # an sbatch script's own step
        clean_env.setenv("RANK", "0")
        clean_env.setenv("WORLD_SIZE", "1")  # (with RANK: the pair)
        assert _dist.topology() == (0, 1, "RANK/WORLD_SIZE")
        clean_env.delenv("RANK")
        clean_env.delenv("WORLD_SIZE")
        assert _dist.topology() == (0, 1, "single process")

    def test_slurm_nprocs_is_the_task_count(self, clean_env):
        clean_env.setenv("SLURM_PROCID", "2")
        clean_env.setenv("SLURM_NPROCS", "4")
        assert _dist.topology() == (2, 4, "SLURM")

    def test_invalid_environment_names_the_variable(self, clean_env):
        clean_env.setenv("RANK", "first")
        clean_env.setenv("WORLD_SIZE", "2")
        with pytest.raises(gp.ConfigError, match="RANK='first'"):
            _dist.topology()

    def test_local_rank_picks_the_gpu(self, clean_env):
        clean_env.setattr(torch.cuda, "device_count", lambda: 4)
        clean_env.setenv("SLURM_LOCALID", "2")
        assert _dist.cuda_device() == "cuda:2"
        clean_env.setenv("LOCAL_RANK", "3")  # torchrun's variable first
        assert _dist.cuda_device() == "cuda:3"
        clean_env.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU bound per task
        assert _dist.cuda_device() == "cuda:0"
        clean_env.setattr(torch.cuda, "device_count", lambda: 2)
        with pytest.raises(gp.ConfigError, match="local rank 3"):
            _dist.cuda_device()

    def test_ranks_that_see_different_data_fail_instead_of_hanging(self, clean_env):
        class FakeDist:  # rank 1 of 2 sees one shard fewer
            def get_rank(self):
                return 0

            def get_world_size(self):
                return 2

            def get_backend(self):
                return "gloo"

            def all_gather_object(self, out, value):
                out[:] = [value, {**value, "shards": value.get("shards", 0) - 1}]

        clean_env.setattr(_dist, "_dist", lambda: FakeDist())
        topo = _dist.topology()
        assert topo == (0, 2, "torch.distributed")
        _dist.require_same(topo, "the plan", {"samples": 10})  # the same everywhere: fine
        with pytest.raises(gp.ConfigError, match=r"the plan differs between ranks \(shards: 4 here, 3 on rank 1\)"):
            _dist.require_same(topo, "the plan", {"samples": 10, "shards": 4})

    def test_random_seed_needs_torch_distributed(self, clean_env, shards):
        clean_env.setenv("RANK", "0")
        clean_env.setenv("WORLD_SIZE", "2")
        with pytest.raises(gp.ConfigError, match="pass seed=<int>"):
            gp.Loader(val(shards), 2, shuffle=True, backend="torch", device="cpu", num_workers=0)
        gp.Loader(val(shards), 2, backend="torch", device="cpu", num_workers=0)  # unshuffled: any seed will do
        random = gp.Pipeline(gp.WebDataset(shards), [T.RandomResizedCrop(8)])
        with pytest.raises(gp.ConfigError, match="random augmentation, seed=None"):  # ranks would draw apart:
            gp.Loader(random, 2, backend="torch", device="cpu", num_workers=0)  # a state resumes one rank only
        loader = gp.Loader(val(shards), 2, seed=4, backend="torch", device="cpu", num_workers=0)
        assert (loader.rank, loader.world_size, loader.seed) == (0, 2, 4)


class RecordingDist:
    """torch.distributed as NCCL would see it: records the current CUDA device of each object
    collective (NCCL puts the collective's tensors there)."""

    def __init__(self, rank: int, world: int, backend: str = "nccl") -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.devices: list[tuple[str, int]] = []

    def get_backend(self):
        return self.backend

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world

    def broadcast_object_list(self, box, src=0):
        self.devices.append(("broadcast", torch.cuda.current_device()))
        box[0] = 12345

    def all_gather_object(self, out, value):
        self.devices.append(("all_gather", torch.cuda.current_device()))
        out[:] = [value] * self.world


class TestCollectivesDevice:
    """gpupipe's object collectives run on the loader's GPU whatever the caller set: under NCCL,
    a job that never called torch.cuda.set_device would otherwise run every rank's on cuda:0."""

    def test_on_the_loaders_gpu(self, clean_env, fake_cuda):
        dist = RecordingDist(rank=2, world=4)
        clean_env.setattr(_dist, "_dist", lambda: dist)
        topo = _dist.topology()
        assert _dist.shared_seed(None, topo, shuffle=True, device=torch.device("cuda:2")) == 12345
        _dist.require_same(topo, "the plan", {"samples": 10}, device=torch.device("cuda:2"))
        assert dist.devices == [("broadcast", 2), ("all_gather", 2)]
        assert fake_cuda.current == 0  # the caller's current device is left as it was

    def test_a_cpu_loader_uses_this_ranks_gpu(self, clean_env, fake_cuda, shards):
        clean_env.setenv("LOCAL_RANK", "3")
        dist = RecordingDist(rank=3, world=4)
        clean_env.setattr(_dist, "_dist", lambda: dist)
        loader = gp.Loader(val(shards), 2, shuffle=True, backend="torch", device="cpu", num_workers=0)
        assert loader.seed == 12345 and (loader.rank, loader.world_size) == (3, 4)
        assert dist.devices == [("broadcast", 3), ("all_gather", 3)]

    def test_under_gloo_no_gpu_is_touched(self, clean_env, fake_cuda, shards):
        """A CPU loader in a gloo job, on a node where LOCAL_RANK is no GPU index (CPU workers)."""
        clean_env.setenv("LOCAL_RANK", "7")
        dist = RecordingDist(rank=7, world=8, backend="gloo")
        clean_env.setattr(_dist, "_dist", lambda: dist)
        loader = gp.Loader(val(shards), 2, shuffle=True, backend="torch", device="cpu", num_workers=0)
        assert loader.seed == 12345 and dist.devices == [("broadcast", 0), ("all_gather", 0)]  # as the caller left it

    def test_without_cuda_nothing_changes(self, clean_env):
        """Under gloo, for a CPU loader (or none named), the context does nothing: it yields
        nothing and makes no call into torch.cuda (each would fail on a machine without CUDA)."""
        touched: list[str] = []

        def refuse(name):
            def call(*args, **kwargs):
                touched.append(name)
                raise AssertionError(f"torch.cuda.{name} called")

            return call

        for name in ("device", "set_device", "current_device", "device_count", "is_available", "init"):
            clean_env.setattr(torch.cuda, name, refuse(name))
        clean_env.setenv("LOCAL_RANK", "1")
        dist = RecordingDist(0, 2, backend="gloo")
        for device in (torch.device("cpu"), None):
            ran = []
            with _dist.collective_device(dist, device) as entered:
                ran.append(device)
            assert entered is None and ran == [device]
        assert touched == []


class TestCoresPerRank:
    """A rank's share of the CPUs: what num_workers and tune's trials default to."""

    @pytest.fixture
    def cores(self, clean_env):
        def set_cores(n):
            clean_env.setattr(_dist.os, "sched_getaffinity", lambda pid: set(range(n)))

        return set_cores

    def test_a_single_process_has_its_affinity(self, clean_env, cores):
        cores(12)
        assert (_dist.cpu_cores(), _dist.cores_per_rank(), _dist.default_workers()) == (12, 12, 8)
        cores(3)
        assert (_dist.cores_per_rank(), _dist.default_workers()) == (3, 3)

    def test_torchrun_ranks_share_the_cores(self, clean_env, cores):
        cores(32)
        clean_env.setenv("LOCAL_WORLD_SIZE", "8")
        assert (_dist.cores_per_rank(), _dist.default_workers()) == (4, 4)
        assert _dist.cores_per_rank(ranks=2) == 16  # explicit, as gpupipe tune --ranks-per-node
        cores(4)
        assert _dist.default_workers() == 1  # never none

    def test_srun_ranks_bound_to_their_cpus_keep_them(self, clean_env, cores):
        clean_env.setenv("SLURM_NTASKS_PER_NODE", "8")
        clean_env.setenv("SLURM_CPUS_PER_TASK", "6")
        cores(6)  # srun bound this task to its 6
        assert _dist.cores_per_rank() == 6
        cores(48)  # not bound: the 8 tasks share the node's 48
        assert _dist.cores_per_rank() == 6
        cores(64)
        assert _dist.cores_per_rank() == 8

    def test_torchrun_inside_one_srun_task_divides_the_task(self, clean_env, cores):
        """sbatch -c 32 (or srun -c 32) then torchrun --nproc-per-node 8: torchrun's ranks share the
        task's 32 CPUs, and an explicit count (gpupipe tune --ranks-per-node) divides too."""
        clean_env.setenv("SLURM_CPUS_PER_TASK", "32")
        clean_env.setenv("SLURM_NTASKS_PER_NODE", "1")
        cores(32)
        assert _dist.cores_per_rank() == 32  # the one srun task, alone
        assert _dist.cores_per_rank(ranks=8) == 4
        clean_env.setenv("LOCAL_WORLD_SIZE", "8")
        assert (_dist.ranks_per_node(), _dist.cores_per_rank()) == (8, 4)

    def test_a_trainers_word_where_the_launcher_says_nothing(self, clean_env, cores):
        """Lightning's own launcher sets LOCAL_RANK and WORLD_SIZE, not LOCAL_WORLD_SIZE: the
        DataModule tells gpupipe its trainer's devices; the environment still wins."""
        clean_env.setattr(_dist, "_assumed_ranks", None)
        cores(16)
        _dist.assume_ranks_per_node(4)
        assert (_dist.ranks_per_node(), _dist.cores_per_rank()) == (4, 4)
        clean_env.setenv("LOCAL_WORLD_SIZE", "2")
        assert _dist.cores_per_rank() == 8

    def test_the_loader_defaults_to_its_share(self, clean_env, cores, shards):
        cores(16)
        clean_env.setenv("LOCAL_WORLD_SIZE", "4")
        with gp.Loader(val(shards), 2, backend="torch", device="cpu") as loader:
            assert loader.num_workers == 4
        with gp.Loader(val(shards), 2, backend="torch", device="cpu", num_workers=1) as loader:
            assert loader.num_workers == 1


class TestDevicePerRank:
    """Which GPU a loader uses, decided once (_dist / backends.resolve) and used by every backend."""

    def test_cuda_means_this_ranks_gpu(self, clean_env, fake_cuda):
        from gpupipe import backends

        clean_env.setenv("LOCAL_RANK", "2")
        for name in ("torch", "dali"):
            assert backends.resolve(name, "cuda")[1] == torch.device("cuda:2")
            assert backends.resolve(name, None)[1] == torch.device("cuda:2")  # None: CUDA present, so cuda
            assert backends.resolve(name, "cuda:1")[1] == torch.device("cuda:1")  # explicit wins
        clean_env.delenv("LOCAL_RANK")
        fake_cuda.current = 3  # no local rank: the current device, as torch would use
        assert backends.resolve("torch", "cuda")[1] == torch.device("cuda:3")

    def test_each_loader_builds_its_dali_pipeline_on_its_gpu(self, clean_env, fake_cuda, shards, monkeypatch):
        """Several loaders in one process (train and val), on this rank's GPU or another: each DALI
        pipeline is built for its loader's device, whatever the current device."""
        pytest.importorskip("nvidia.dali")
        from gpupipe.backends._dali import _graph, _runner
        from gpupipe.backends._dali._context import Lowered

        built = []

        def define(views, **kw):
            built.append((kw["gpu"], kw["device_id"], kw["decoder_args"]["affine"]))
            return _graph.Defined(FakePipe(), Lowered(()))

        monkeypatch.setattr(_runner, "define_graph", define)
        clean_env.setenv("LOCAL_RANK", "1")
        clean_env.setenv("LOCAL_WORLD_SIZE", "4")
        train = gp.Loader(val(shards), 2, shuffle=True, seed=0, backend="dali", device="cuda")
        evaluation = gp.Loader(val(shards), 2, backend="dali", device="cuda:3")
        assert (train.device, evaluation.device) == ("cuda:1", "cuda:3")
        assert built == [(True, 1, False), (True, 3, False)]  # 4 ranks per node: threads not pinned
        assert fake_cuda.current == 0


class FakePipe:
    """A DALI pipeline that is never built on a device (no GPU here)."""

    def build(self) -> None:
        pass

    def serialize(self) -> bytes:
        return b""


@pytest.mark.parametrize(
    "nvjpeg, options, decode",
    [
        ((13, 3, 2), gp.DaliOptions(), "roi"),
        ((13, 0, 1), gp.DaliOptions(), "full"),  # torchvision's, or an old CUDA 13: regions would go to the CPU
        ((12, 4, 0), gp.DaliOptions(), "full"),
        (None, gp.DaliOptions(), "full"),
        ((12, 4, 0), gp.DaliOptions(jpeg_fancy_upsampling=False), "roi"),
        ((12, 4, 0), gp.DaliOptions(decode="roi"), "roi"),
        ((13, 3, 2), gp.DaliOptions(decode="full"), "full"),
    ],
)
def test_the_gpu_graph_decodes_as_the_nvjpeg_in_the_process_allows(monkeypatch, fake_cuda, shards, nvjpeg, options,
                                                                    decode):  # fmt: skip
    """The GPU runner picks the decode strategy from the nvJPEG DALI will use (faked here), and says
    which in the loader's repr; the CPU runner always decodes the region."""
    pytest.importorskip("nvidia.dali")
    from gpupipe.backends._dali import _graph, _runner
    from gpupipe.backends._dali._context import Lowered

    asked = []

    def define(views, **kw):
        asked.append(kw["decode"])
        return _graph.Defined(FakePipe(), Lowered((), decode=kw["decode"]))

    monkeypatch.setattr(_runner, "define_graph", define)
    monkeypatch.setattr(_runner, "nvjpeg_version", lambda: nvjpeg)
    train = gp.load_pipeline(os.path.join(ROOT, "pipelines", "imagenet.py:train"))(shards)
    with gp.Loader(train, 2, backend="dali", device="cuda", dali=options) as loader:
        assert asked == [decode] and f"'decode': '{decode} (" in str(loader._runner.describe()).replace('"', "'")
        assert f"decode='{decode} (" in repr(loader)


def test_batches_are_handed_over_on_the_consumers_stream(monkeypatch, fake_cuda):
    from gpupipe.backends._dali._runner import consumer_stream

    streams: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.setdefault(str(device), object()))
    assert consumer_stream(torch.device("cpu")) is None  # a CPU pipeline: host data
    stream = consumer_stream(torch.device("cuda:2"))
    assert stream is streams["cuda:2"]  # torch's current stream on the loader's GPU, in this thread
    from gpupipe.backends._dali._runner import on_device

    with on_device(torch.device("cuda:2")):  # the loader's GPU current while DALI takes the stream
        assert torch.cuda.current_device() == 2
    assert torch.cuda.current_device() == 0
