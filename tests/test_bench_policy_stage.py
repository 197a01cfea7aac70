"""bench/policy_stage.py: its batched TrivialAugmentWide kernels equal the torch backend's
(torchvision's kernels, sample by sample) at every operation, bin and sign, so that its GPU
timing is of the same arithmetic; and its quick form runs on DALI's CPU operators. Performance is
never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpupipe import transforms as T
from gpupipe.testing import synthetic_image
from gpupipe.transforms._policies import OPS

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))


@pytest.mark.parametrize("size", [(40, 48), (36, 36)])  # square: rotate's quarter turns are transposes
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
def test_the_batched_kernels_are_torchvisions_at_every_bin(size, interpolation):
    import policy_stage

    t = T.TrivialAugmentWide(interpolation=T.InterpolationMode(interpolation))
    rows = [(code, b, sign) for code in range(len(OPS[:14])) for b in range(31) for sign in (-1, 1)]
    factors = np.array(rows, dtype=np.float64)
    images = torch.stack([torch.from_numpy(np.ascontiguousarray(synthetic_image(i % 17, size=size))).permute(2, 0, 1)
                          for i in range(len(rows))])  # fmt: skip
    codes, mags = t.magnitudes(size[0], size[1], factors)
    got = policy_stage.batched_policy(images, codes[:, 0], mags[:, 0], interpolation)
    want = policy_stage.per_sample(t, images, factors)
    apart = [(OPS[rows[i][0]], rows[i][1:]) for i in range(len(rows)) if not torch.equal(got[i], want[i])]
    assert not apart, apart[:5]


def test_the_quick_run_writes_its_report(tmp_path):
    pytest.importorskip("nvidia.dali")
    argv = [sys.executable, os.path.join(ROOT, "bench", "policy_stage.py"), "--device", "cpu", "--quick", "--out",
            str(tmp_path)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = tmp_path.glob("*-policy-stage-*-quick.md")
    result = json.loads(report.with_suffix(".json").read_text())
    by_impl = {r["impl"]: r for r in result["results"]}
    assert set(by_impl) == {"torch, batched", "DALI, gpupipe's graph", "torch backend, per sample"}
    assert by_impl["torch, batched"]["apart"] == 0 and by_impl["torch backend, per sample"]["apart"] == 0
    assert f"wrote {report}" in proc.stdout
