"""``python -m gpupipe doctor``: the diagnosis on made-up machines (every GPU branch, without a GPU),
probing through a fake driver and fake CUDA, and the command itself on this machine."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from gpupipe.cli import _doctor as doctor
from gpupipe.cli import _doctor_run as doctor_run
from gpupipe.cli._doctor import Environment, Gpu, Level
from gpupipe.runtime._nvjpeg import Nvjpeg

ROOT = os.path.join(os.path.dirname(__file__), "..")

H100 = Gpu(0, "NVIDIA H100 80GB HBM3", (9, 0), 79.1)
PIP_NVJPEG = "/venv/site-packages/nvidia/cu13/lib/libnvjpeg.so.13"
HEALTHY = Environment(python="3.12.3", torch="2.14.1+cu130", torch_cuda=(13, 0), torchvision="0.29.1", dali="2.4.0",
                      dali_cuda=13, cupy="14.2.0", cupy_cuda=13, driver_cuda=(13, 0), gpus=(H100,) * 8,
                      torch_sees_cuda=True, nvjpeg=Nvjpeg("libnvjpeg.so.13", PIP_NVJPEG, (13, 3, 2)))  # fmt: skip
CPU_ONLY = dataclasses.replace(HEALTHY, torch_cuda=(13, 0), dali_cuda=12, cupy=None, cupy_cuda=None, driver_cuda=None,
                               gpus=(), torch_sees_cuda=False)  # fmt: skip


def levels(env):
    return [(f.level, f.message) for f in doctor.diagnose(env)]


class TestDiagnosis:
    def test_a_healthy_gpu_node(self):
        assert doctor.diagnose(HEALTHY) == []
        assert doctor.auto_choice(HEALTHY)[:2] == ("dali", "cuda")

    def test_a_cpu_machine(self):
        (finding,) = doctor.diagnose(CPU_ONLY)
        assert finding.level == Level.NOTE and "no NVIDIA GPU" in finding.message
        assert doctor.auto_choice(CPU_ONLY)[:2] == ("torch", "cpu")  # DALI's CPU operators: when named
        assert doctor.auto_choice(dataclasses.replace(CPU_ONLY, dali=None, dali_cuda=None))[:2] == ("torch", "cpu")

    def test_the_choice_is_the_backend_tables(self, monkeypatch):
        """The doctor asks ``backends.auto_choice`` about the environment it describes: the table's
        order and reasons, not a copy of the rule."""
        from gpupipe import backends

        assert doctor.auto_choice(CPU_ONLY)[2] == (
            "torch sees no usable GPU; dali runs slower on the cpu (bench/results/2026-11-26-dali-cpu-kernels.md)"
        )
        no_dali = dataclasses.replace(CPU_ONLY, dali=None, dali_cuda=None)
        assert doctor.auto_choice(no_dali)[2] == "torch sees no usable GPU; dali not available"
        assert doctor.auto_choice(HEALTHY)[2].endswith("the first available of dali, torch")
        monkeypatch.setattr(backends, "TABLE", {"torch": backends.TABLE["torch"], "dali": backends.TABLE["dali"]})
        assert doctor.auto_choice(HEALTHY)[:2] == ("torch", "cuda")  # the table's order decides

    def test_a_cuda_12_driver_with_pypis_torch(self):
        """The case of the issue: PyPI's torch is a CUDA 13 build; a CUDA 12 driver cannot run it."""
        env = dataclasses.replace(HEALTHY, driver_cuda=(12, 4), dali_cuda=12, cupy=None, torch_sees_cuda=False)
        first, *_ = doctor.diagnose(env)
        assert first.level == Level.ERROR and "built for CUDA 13.0 but the driver supports CUDA 12.4" in first.message
        assert (
            first.fix
            == f"pip install --force-reinstall torch==2.14.1 torchvision --index-url {doctor.TORCH_CUDA12_INDEX}"
        )

    def test_dali_built_for_a_newer_cuda_than_the_driver(self):
        env = dataclasses.replace(HEALTHY, torch="2.14.1+cu126", torch_cuda=(12, 6), driver_cuda=(12, 8), cupy=None)
        (finding,) = [f for f in doctor.diagnose(env) if f.level == Level.ERROR]
        assert "DALI 2.4.0 is built for CUDA 13" in finding.message
        assert finding.fix == "pip uninstall -y nvidia-dali-cuda130 && pip install 'gpupipe[cuda12]'"

    def test_two_cuda_runtimes(self):
        env = dataclasses.replace(HEALTHY, dali_cuda=12)  # works on a CUDA 13 driver, but loads both
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.WARNING and "two CUDA runtimes" in finding.message
        assert finding.fix == "pip uninstall -y nvidia-dali-cuda120 && pip install 'gpupipe[cuda13]'"

    def test_a_gpu_without_dali(self):
        env = dataclasses.replace(HEALTHY, dali=None, dali_cuda=None)
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.WARNING and finding.fix == "pip install 'gpupipe[cuda13]'"
        assert doctor.auto_choice(env)[:2] == ("torch", "cuda")

    @pytest.mark.parametrize("torch_version, torch_cuda, sees, match", [
        ("2.14.1+cpu", None, False, "CPU-only build"),
        ("2.14.1+cu130", (13, 0), False, "is_available\\(\\) is False"),
    ])  # fmt: skip
    def test_torch_cannot_use_the_gpus(self, torch_version, torch_cuda, sees, match):
        env = dataclasses.replace(HEALTHY, torch=torch_version, torch_cuda=torch_cuda, torch_sees_cuda=sees)
        assert any(level == Level.ERROR and __import__("re").search(match, m) for level, m in levels(env))

    def test_cupy_for_the_wrong_cuda(self):
        env = dataclasses.replace(HEALTHY, torch="2.14.1+cu126", torch_cuda=(12, 6), dali_cuda=12, driver_cuda=(12, 8))
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.ERROR and "CuPy 14.2.0 is built for CUDA 13" in finding.message
        assert finding.fix == "pip uninstall -y cupy-cuda13x && pip install cupy-cuda12x"

    def test_no_hardware_jpeg_decoder(self):
        env = dataclasses.replace(HEALTHY, gpus=(Gpu(0, "NVIDIA GeForce RTX 4090", (8, 9), 23.6),))
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.NOTE and "RTX 4090" in finding.message and "hw_decoder_load" in finding.message

    @pytest.mark.parametrize("name, answer", [
        ("NVIDIA A100-SXM4-80GB", "yes (nvJPEG"), ("NVIDIA H100 80GB HBM3", "yes (nvJPEG"),
        ("NVIDIA A30", "yes (nvJPEG"),
        ("NVIDIA H200", "yes (same"), ("NVIDIA GH200 480GB", "yes (same"), ("NVIDIA B200", "yes (same"),
        ("NVIDIA GeForce RTX 4090", "no"), ("Tesla V100-SXM2-32GB", "no"), ("Tesla T4", "no"),
        ("NVIDIA A10", "unknown"), ("NVIDIA L4", "unknown"), ("NVIDIA L40S", "unknown"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "depends on the MIG profile"), ("MIG 3g.40gb", "depends"),
    ])  # fmt: skip
    def test_hardware_jpeg_decoder_by_model(self, name, answer):
        assert doctor.hw_jpeg(name).startswith(answer)

    def test_unknown_models_are_said_so(self):
        env = dataclasses.replace(HEALTHY, gpus=(Gpu(0, "NVIDIA L4", (8, 9), 22.5),))
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.NOTE and "whether NVIDIA L4 has a hardware JPEG decoder" in finding.message

    @pytest.mark.parametrize(("python", "fixed"), [
        ("3.11.7", "3.11.10"), ("3.11.0", "3.11.10"), ("3.11.9", "3.11.10"), ("3.11.5+", "3.11.10"),
        ("3.11.0rc1", "3.11.10"), ("3.10.14", "3.10.15"), ("3.11.10", None), ("3.10.15", None), ("3.12.3", None),
    ])  # fmt: skip
    def test_a_python_whose_fork_can_freeze_a_worker(self, python, fixed):
        found = doctor.diagnose(dataclasses.replace(HEALTHY, python=python))
        frozen = [a for a in found if "gh-112275" in a.message]
        assert len(frozen) == (fixed is not None)
        assert all(a.level is Level.WARNING and f"use Python {fixed} or newer" in (a.fix or "") for a in frozen)

    def test_errors_come_first_and_the_report_shows_fixes(self):
        env = dataclasses.replace(HEALTHY, driver_cuda=(12, 4), torch_sees_cuda=False,
                                  gpus=(Gpu(0, "NVIDIA GeForce RTX 4090", (8, 9), 23.6),))  # fmt: skip
        findings = doctor.diagnose(env)
        severity = [[Level.ERROR, Level.WARNING, Level.NOTE, Level.OK].index(f.level) for f in findings]
        assert severity == sorted(severity) and severity[0] == 0 and len(set(severity)) > 1
        text = doctor.report(env, findings)
        assert "ERROR" in text and "fix: pip install --force-reinstall torch==2.14.1" in text
        assert "GPU 0        NVIDIA GeForce RTX 4090, compute 8.9, 23.6 GiB; hardware JPEG decoder: no" in text


class TestGpuDecode:
    """Whether pipelines starting with RandomResizedCrop decode regions on the GPU, from the nvJPEG
    DALI gets in the process, and what to do where they cannot."""

    def test_a_new_enough_nvjpeg(self):
        assert doctor.decode_strategy(HEALTHY).mode == "roi"
        text = doctor.report(HEALTHY, doctor.diagnose(HEALTHY))
        assert f"nvJPEG       13.3.2 ({PIP_NVJPEG})" in text
        assert "GPU decode   pipelines starting with RandomResizedCrop: roi (nvJPEG 13.3.2 decodes regions" in text

    def test_torchvisions_nvjpeg_loaded_first(self):
        shadow = Nvjpeg("libnvjpeg.so.13", "/venv/site-packages/torchvision.libs/libnvjpeg.36e11081.so.13", (13, 0, 1),
                        PIP_NVJPEG, (13, 3, 2))  # fmt: skip
        env = dataclasses.replace(HEALTHY, nvjpeg=shadow)
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.WARNING and "Import gpupipe before torchvision" in finding.message
        assert finding.fix == f"LD_PRELOAD={PIP_NVJPEG} python ..."
        assert doctor.decode_strategy(env).mode == "full"
        assert "nvidia-nvjpeg 13.3.2 (" in doctor.report(env, [finding])

    @pytest.mark.parametrize("nvjpeg", [Nvjpeg("libnvjpeg.so.13", PIP_NVJPEG, (13, 1, 0)), None])
    def test_an_old_nvjpeg_on_cuda_13(self, nvjpeg):
        (finding,) = doctor.diagnose(dataclasses.replace(HEALTHY, nvjpeg=nvjpeg))
        assert finding.level == Level.WARNING and "cannot decode a region with fancy upsampling" in finding.message
        assert finding.fix == "pip install 'nvidia-nvjpeg>=13.2'"

    @pytest.mark.parametrize("driver, fix", [((13, 0), True), ((12, 8), False)])
    def test_dali_for_cuda_12(self, driver, fix):
        env = dataclasses.replace(
            HEALTHY,
            torch="2.9.0+cu126",
            torch_cuda=(12, 6),
            dali_cuda=12,
            cupy=None,
            driver_cuda=driver,
            nvjpeg=Nvjpeg("libnvjpeg.so.12", "/x/libnvjpeg.so.12", (12, 4, 0)),
        )
        (finding,) = doctor.diagnose(env)
        assert finding.level == Level.NOTE and "DALI for CUDA 12 comes with nvJPEG 12.4.0" in finding.message
        assert finding.fix == ("pip uninstall -y nvidia-dali-cuda120 && pip install 'gpupipe[cuda13]'" if fix else None)

    def test_without_a_gpu_the_line_says_so(self):
        env = dataclasses.replace(HEALTHY, gpus=(), driver_cuda=None, torch_sees_cuda=False)
        assert "GPU decode   on a GPU (none here), pipelines starting with RandomResizedCrop: roi" in doctor.report(
            env, doctor.diagnose(env))  # fmt: skip

    @pytest.mark.parametrize("gpu, share", [(Gpu(0, "NVIDIA H200", (9, 0), 139.8), 1.0),
                                            (Gpu(0, "NVIDIA A100-SXM4-80GB", (8, 0), 79.3), 0.65)])  # fmt: skip
    def test_the_hardware_decoders_share_by_gpu_kind(self, gpu, share):
        """Every JPEG to the hardware decoder on Hopper, where it was measured; DALI's 0.65
        elsewhere. The line says which and why."""
        text = doctor.report(dataclasses.replace(HEALTHY, gpus=(gpu,)), [])
        (line,) = [x for x in text.splitlines() if x.startswith("JPEG split")]
        assert f"hw_decoder_load={share} by default on GPU 0: " in line
        assert ("Hopper GPU: 1.70x the train recipe's images/s" in line) == (share == 1.0)
        assert ("DALI's default" in line) == (share == 0.65)

    def test_no_dali_no_decode_line(self):
        env = dataclasses.replace(HEALTHY, dali=None, dali_cuda=None, nvjpeg=None)
        assert "GPU decode" not in (text := doctor.report(env, doctor.diagnose(env))) and "JPEG split" not in text


class FakeDriver(doctor.CudaDriver):
    def __init__(self, version, gpus):
        self._version, self._gpus = version, gpus

    def version(self):
        return self._version

    def gpus(self):
        return self._gpus


def test_probe_reads_the_builds_and_the_driver(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    env = doctor.probe(FakeDriver((12, 8), (H100, dataclasses.replace(H100, index=1))))
    assert env.driver_cuda == (12, 8) and len(env.gpus) == 2 and env.torch_sees_cuda
    assert env.torch_cuda == (12, 6) and env.torch == torch.__version__
    import importlib.metadata

    assert env.dali == importlib.metadata.version("nvidia-dali-cuda120") and env.dali_cuda == 12
    assert env.python and env.torchvision


def test_the_driver_is_read_without_torch():
    driver = doctor.CudaDriver()
    if driver.lib is None:  # this machine: no libcuda
        assert driver.version() is None and driver.gpus() == ()
    else:  # pragma: no cover - a GPU machine
        assert driver.version() is not None


class TestCommand:
    def test_this_machine(self):
        proc = subprocess.run([sys.executable, "-m", "gpupipe", "doctor"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "torch        2.14.1" in proc.stdout and "auto         backend=" in proc.stdout

    def test_run_pushes_batches_through_every_backend(self, capsys):
        env = doctor.probe()
        assert doctor_run.run_check(env, images=12, batch_size=4, out=print)
        out = capsys.readouterr().out
        assert "torch-cpu:" in out and "images/s (the reference)" in out
        if env.dali:
            assert "dali-cpu:" in out and "vs torch-cpu: mean" in out

    def test_broken_means_exit_1(self, monkeypatch, capsys):
        broken = dataclasses.replace(HEALTHY, driver_cuda=(12, 4), torch_sees_cuda=False)
        monkeypatch.setattr(doctor, "probe", lambda: broken)
        assert doctor.main() == 1
        assert "ERROR" in capsys.readouterr().out
        monkeypatch.setattr(doctor, "probe", lambda: CPU_ONLY)
        assert doctor.main() == 0

    def test_a_failing_backend_fails_the_run(self, monkeypatch, capsys):
        env = dataclasses.replace(CPU_ONLY, dali=None, dali_cuda=None)
        monkeypatch.setattr(doctor_run, "targets", lambda env: [("torch", "cpu"), ("torch", "cuda")])  # no CUDA here
        assert not doctor_run.run_check(env, images=4, batch_size=2, out=print)
        assert "ERROR        torch-cuda failed: BackendUnavailableError" in capsys.readouterr().out
