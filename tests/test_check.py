"""``gpupipe check`` (Python and CLI): every kind of damage found, summarized, listed beside the
shards, and left out by every loader under both policies."""

from __future__ import annotations

import json
import os
import tarfile
from typing import Any

import pytest

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.cli._main import main

from .support.data import bomb_jpeg, truncated_jpeg, write_webdataset_shards

BAD = {  # sample number -> (members, the damage check reports)
    1: ({"jpg": truncated_jpeg(1)}, "undecodable"),
    2: ({"jpg": b""}, "empty-image"),
    5: ({"jpg": b"not an image at all"}, "undecodable"),
    7: ({"cls": b"seven"}, "bad-label"),
    8: ({"jpg": bomb_jpeg()}, "too-large"),
}


def key(n: int) -> str:
    return f"img/{n // 6:02d}/{n:06d}"


@pytest.fixture
def damaged(tmp_path) -> list[str]:
    """Two shards of 6 with the samples of ``BAD`` damaged."""
    return write_webdataset_shards(str(tmp_path), (6, 6), prefix="chk", patch={n: m for n, (m, _) in BAD.items()})


class TestCheck:
    def test_every_kind_is_found_and_listed_beside_its_shard(self, damaged):
        report = gp.check(damaged, workers=0)
        assert not report.ok and report.shards == 2 and report.samples == 12
        assert {(f.key, f.kind.value) for f in report.findings} == {(key(n), kind) for n, (_, kind) in BAD.items()}
        assert report.counts() == {"undecodable": 2, "empty-image": 1, "bad-label": 1, "too-large": 1}
        assert all(f.shard == damaged[int(str(f.key)[-6:]) // 6] for f in report.findings)
        assert report.written == tuple(u + ".bad.json" for u in damaged)
        with open(damaged[1] + ".bad.json") as f:
            listed = json.load(f)
        assert [(r["sample"], r["key"], r["kind"]) for r in listed["bad"]] == [
            (1, key(7), "bad-label"),
            (2, key(8), "too-large"),
        ]
        summary = report.summary()
        assert "checked 12 samples in 2 shards: 5 problems" in summary and "too-large: 1" in summary

    @pytest.mark.parametrize("on_error", ["raise", "skip"])
    def test_loaders_leave_the_listed_samples_out(self, backend, damaged, on_error):
        gp.check(damaged, workers=0)
        pipeline = gp.Pipeline(damaged, [T.RandomResizedCrop(16)])
        with backend.loader(pipeline, 4, num_workers=0, on_error=on_error, max_skipped=None) as loader:
            got = [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]
            assert {s.key for s in loader.skipped} == {key(n) for n in BAD}
        assert sorted(got) == [key(n) for n in range(12) if n not in BAD]

    def test_structural_damage_is_reported_but_not_listed(self, tmp_path):
        urls = write_webdataset_shards(str(tmp_path), (6,), prefix="st", patch={3: {"jpg": None}})
        cut = str(tmp_path / "cut.tar")
        with open(urls[0], "rb") as src, open(cut, "wb") as dst:
            dst.write(src.read()[:3000])
        report = gp.check([*urls, cut, str(tmp_path / "gone.tar")], workers=0)
        assert report.counts() == {"no-image": 1, "truncated-shard": 1, "missing-shard": 1}
        assert all(f.sample is None for f in report.findings) and not report.written
        assert "3 problems: 0 of them numbered samples" in report.summary()
        assert "3 not listable" in report.summary() and "on_error='raise' refuse the dataset" in report.summary()
        assert "in 1 shard: " in report.summary()

    def test_in_parallel_the_same_report(self, damaged):
        serial = gp.check(damaged, workers=0, write=False)
        parallel = gp.check(damaged, workers=2, write=False)
        assert parallel.findings == serial.findings and not parallel.written

    def test_a_sound_shard_loses_its_stale_list(self, damaged):
        gp.check(damaged, workers=0)
        write_webdataset_shards(os.path.dirname(damaged[0]), (6, 6), prefix="chk")  # repaired
        report = gp.check(damaged, workers=0)
        assert report.ok and report.removed == tuple(u + ".bad.json" for u in damaged)
        assert not any(os.path.exists(u + ".bad.json") for u in damaged)

    @pytest.mark.parametrize("option", ["max_image_pixels", "max_image_bytes", "workers"])
    def test_a_limit_out_of_range_is_refused_before_any_list_is_written(self, damaged, option):
        """As the loaders' options: a negative pixel limit was taken, every image found too large
        and a bad-sample list written for every shard (every loader then left them all out)."""
        with pytest.raises(gp.ConfigError, match=f"check: {option} must be None or an int >= "):
            options: dict[str, Any] = {"workers": 0, option: -5}
            gp.check(damaged, **options)
        assert not any(os.path.exists(u + ".bad.json") for u in damaged)

    def test_the_pixel_limit_is_configurable(self, damaged):
        report = gp.check(damaged, workers=0, write=False, max_image_pixels=None)
        assert "too-large" not in report.counts()  # then the decoder judges it: a bomb with little data
        assert report.counts().get("undecodable", 0) >= 2


class TestCommand:
    def test_exit_code_summary_and_json(self, damaged, capsys):
        assert main(["check", *damaged, "--workers", "0", "--quiet"]) == 1
        out = capsys.readouterr().out
        assert "5 problems" in out and "bad-label: 1" in out and key(7) in out and ".bad.json" in out
        assert main(["check", *damaged, "--workers", "0", "--json", "--no-write"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["ok"] is False and doc["counts"]["undecodable"] == 2 and len(doc["findings"]) == 5
        assert doc["written"] == []

    def test_a_clean_dataset_exits_0_with_a_progress_bar(self, tmp_path, capsys):
        urls = write_webdataset_shards(str(tmp_path), (3, 3), prefix="ok")
        pattern = str(tmp_path / "ok-{000000..000001}.tar")
        assert main(["check", pattern, "--workers", "0"]) == 0
        captured = capsys.readouterr()
        assert "checked 6 samples in 2 shards: all good" in captured.out and "gpupipe check" in captured.err
        assert not any(os.path.exists(u + ".bad.json") for u in urls)


def test_a_tar_member_named_jpg_that_is_a_tar(tmp_path):
    """Non-image bytes that start like nothing known: undecodable, named."""
    inner = tmp_path / "inner.tar"
    with tarfile.open(inner, "w"):
        pass
    urls = write_webdataset_shards(str(tmp_path), (2,), prefix="t", patch={0: {"jpg": inner.read_bytes()}})
    report = gp.check(urls, workers=0, write=False)
    assert [(f.key, f.kind.value) for f in report.findings] == [(key(0), "undecodable")]


def test_a_decoders_message_without_its_source_location():
    """torchvision's errors carry 'decode_jpeg, /__w/vision/.../decode_jpeg.cpp:171, ': left out."""
    from gpupipe.runtime._decode import decode_rgb

    with pytest.raises(gp.SampleError) as e:
        decode_rgb(truncated_jpeg(1), shard="s.tar", key="k")
    assert e.value.kind is gp.Damage.UNDECODABLE and ".cpp" not in str(e.value) and "__w" not in str(e.value)
    assert str(e.value).startswith("cannot decode the image of sample 'k' in shard 's.tar': ")
