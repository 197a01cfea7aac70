"""Issue 11: damage found before the first epoch, on every backend under both policies.

Damage the index finds (missing, empty, unreadable or truncated shards; samples without image or
label; repeated keys) raises under ``on_error="raise"`` (from the index cache too) and is left out
under ``"skip"``; samples listed as bad by ``gpupipe check`` (``<shard>.bad.json``) are left out
under both. Either way the plan is drawn over the good samples without renumbering: every good
sample is yielded exactly once per epoch across ranks, batches stay equal, and resume is exact.
"""

from __future__ import annotations

import os
import tarfile

import pytest
import torch

import gpupipe as gp
from gpupipe import transforms as T
from gpupipe.core._errors import Problem
from gpupipe.shards import _indexing
from gpupipe.shards._mask import write_mask

from .support.checkers import check_exact_resume
from .support.data import write_webdataset_shards


def key(n: int) -> str:
    return f"img/{n // 6:02d}/{n:06d}"


NO_IMAGE, NO_LABEL, DUPLICATE = 1, 3, 9  # in shards 0 and 1
PATCH = {NO_IMAGE: {"jpg": None, "txt": b"x"}, NO_LABEL: {"cls": None}, DUPLICATE: {"__key__": key(7)}}
CUT = 15  # shard 2 (samples 12..17) ends inside this sample's image
GOOD = [n for n in range(12) if n not in PATCH] + [12, 13, 14]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """Three shards of 6 with damaged samples (``PATCH``), the third truncated inside sample 15,
    a zero-byte shard and a missing one."""
    root = str(tmp_path_factory.mktemp("damaged-index"))
    urls = write_webdataset_shards(root, (6, 6, 6), prefix="part", patch=PATCH)
    with tarfile.open(urls[2]) as tar:
        member = next(m for m in tar if m.name == f"{key(CUT)}.jpg")
    os.truncate(urls[2], member.offset_data + member.size // 2)
    empty = os.path.join(root, "part-000003.tar")
    open(empty, "wb").close()
    return [*urls, empty, os.path.join(root, "part-000004.tar")]


def pipeline(urls):
    return gp.Pipeline(urls, [T.RandomResizedCrop(16), T.RandomHorizontalFlip()])


def delivered(loader) -> list[str]:
    return [k for b in loader for k, v in zip(b.keys, b.valid.tolist(), strict=True) if v]


class TestRaise:
    def test_the_first_damage_raises_naming_shard_and_key_also_from_the_cache(self, backend, corpus, monkeypatch):
        for _attempt in range(2):  # the second from the index cache: no shard is scanned again
            with pytest.raises(gp.SampleError, match="no image") as info:
                backend.loader(pipeline(corpus), 4, num_workers=0)
            assert (info.value.key, info.value.shard, info.value.kind) == (key(NO_IMAGE), corpus[0], gp.Damage.NO_IMAGE)
            assert "5 more problems" in str(info.value) and "gpupipe check" in str(info.value)
            monkeypatch.setattr(_indexing, "scan_tar", lambda *a, **k: pytest.fail("a cached shard was scanned"))

    @pytest.mark.parametrize(
        "which, kind, match",
        [
            (2, gp.Damage.TRUNCATED_SHARD, "is truncated: it ends inside member.*3 complete samples"),
            (3, gp.Damage.EMPTY_SHARD, "is empty"),
            (4, gp.Damage.MISSING_SHARD, "does not exist"),
        ],
    )
    def test_a_damaged_shard_is_named(self, backend, corpus, which, kind, match):
        with pytest.raises(gp.ShardError, match=match) as info:
            backend.loader(pipeline([corpus[which]]), 4, num_workers=0)
        assert (info.value.shard, info.value.key, info.value.kind) == (corpus[which], None, kind)


class TestSkip:
    def test_every_good_sample_once_and_the_damage_listed(self, backend, corpus, caplog):
        with (
            caplog.at_level("WARNING", logger="gpupipe"),
            backend.loader(pipeline(corpus), 4, num_workers=1, on_error="skip", max_skipped=None) as loader,
        ):
            assert loader.num_samples == len(GOOD) and len(loader) == 3
            got = delivered(loader)
            skipped = {(s.shard, s.key): s for s in loader.skipped}
        assert sorted(got) == sorted(key(n) for n in GOOD)
        kinds = {where: s.kind for where, s in skipped.items()}
        assert kinds == {
            (corpus[0], key(NO_IMAGE)): "no-image",
            (corpus[0], key(NO_LABEL)): "no-label",
            (corpus[1], key(7)): "duplicate-key",
            (corpus[2], None): "truncated-shard",
            (corpus[3], None): "empty-shard",
            (corpus[4], None): "missing-shard",
        }
        assert all(s.epoch is None for s in skipped.values())
        assert sum("leaving out 6 damaged" in r.getMessage() for r in caplog.records) == 1

    def test_the_ranks_share_the_good_samples_exactly(self, backend, corpus):
        keys, lengths = [], set()
        for rank in range(2):
            with backend.loader(pipeline(corpus), 2, num_workers=0, on_error="skip", max_skipped=None, shuffle=True,
                                seed=3, rank=rank, world_size=2) as loader:  # fmt: skip
                keys += delivered(loader)
                lengths.add(len(loader))
        assert sorted(keys) == sorted(key(n) for n in GOOD) and len(lengths) == 1

    def test_the_cap_counts_the_damage_known_before_the_epoch(self, backend, corpus):
        """A lost shard counts as an intact shard's samples on average (4.5 here), a truncated one
        as those it lacks (1.5): 3 samples + about 10 in shards."""
        with pytest.raises(gp.DataError, match=r"3 damaged samples and 3 damaged shards \(about 10 samples\) known "
                           r"before the first epoch, more than max_skipped=12 allows \(12\)"):  # fmt: skip
            backend.loader(pipeline(corpus), 4, num_workers=0, on_error="skip", max_skipped=12)
        backend.loader(pipeline(corpus), 4, num_workers=0, on_error="skip", max_skipped=13).close()

    def test_lost_shards_count_by_their_samples(self, backend, tmp_path):
        """5 of 20 shards missing is a quarter of the data, not 5 samples: over the default 1%."""
        urls = write_webdataset_shards(str(tmp_path), (6,) * 15, prefix="part")
        urls += [str(tmp_path / f"gone-{i}.tar") for i in range(5)]
        with pytest.raises(gp.DataError, match=r"0 damaged samples and 5 damaged shards \(about 30 samples\)"):
            backend.loader(pipeline(urls), 4, num_workers=0, on_error="skip")
        with backend.loader(pipeline(urls), 4, num_workers=0, on_error="skip", max_skipped=0.3) as loader:
            assert loader.num_samples == 90

    def test_an_empty_tar_and_a_file_that_is_not_a_tar(self, backend, corpus, tmp_path):
        members = tmp_path / "none.tar"
        with tarfile.open(members, "w"):
            pass
        junk = tmp_path / "junk.tar"
        junk.write_bytes(b"not a tar file" * 100)
        urls = [corpus[0], str(members), str(junk)]
        with backend.loader(pipeline(urls), 4, num_workers=0, on_error="skip", max_skipped=None) as loader:
            assert sorted(delivered(loader)) == sorted(key(n) for n in range(6) if n not in PATCH)
            kinds = {s.shard: s.kind for s in loader.skipped if s.key is None}
        assert kinds == {str(members): "empty-shard", str(junk): "unreadable-shard"}


def listed(shard: str, bad: dict[int, str]) -> None:
    """Writes the bad-sample list ``gpupipe check`` would write for ``shard``."""
    index = gp.WebDataset(shard).index()
    problems = [(n, Problem(gp.Damage.UNDECODABLE, index.key(n), why)) for n, why in bad.items()]
    write_mask(shard, shard, size=os.path.getsize(shard), samples=len(index), image_exts=("jpg", "jpeg", "png"),
               label_ext="cls", bad=problems)  # fmt: skip


@pytest.fixture
def clean(tmp_path) -> list[str]:
    return write_webdataset_shards(str(tmp_path), (6, 6), prefix="clean")


class TestCheckedList:
    @pytest.mark.parametrize("on_error", ["raise", "skip"])
    def test_listed_samples_are_left_out_under_both_policies(self, backend, clean, on_error):
        listed(clean[1], {1: "corrupt", 4: "corrupt"})  # samples 7 and 10
        with backend.loader(pipeline(clean), 4, num_workers=0, on_error=on_error, max_skipped=None) as loader:
            assert loader.num_samples == 10 and len(loader) == 3
            got = delivered(loader)
            assert {s.key for s in loader.skipped} == {key(7), key(10)}
            assert all("gpupipe check" in s.reason and s.kind == "undecodable" for s in loader.skipped)
        assert sorted(got) == sorted(key(n) for n in range(12) if n not in (7, 10))

    @pytest.mark.parametrize("on_error", ["raise", "skip"])
    def test_the_cap_holds_for_listed_samples_under_both_policies(self, backend, clean, on_error):
        listed(clean[1], {1: "corrupt", 4: "corrupt"})
        with pytest.raises(gp.DataError, match=r"2 damaged samples known before the first epoch, more than "
                           r"max_skipped=1 allows \(1\)"):  # fmt: skip
            backend.loader(pipeline(clean), 4, num_workers=0, on_error=on_error, max_skipped=1)

    def test_a_list_for_another_version_of_the_shard_is_ignored(self, backend, clean, caplog):
        listed(clean[0], {0: "corrupt"})
        with open(clean[0], "ab") as f:
            f.write(b"\0" * 1024)  # the shard changed after the check
        with caplog.at_level("WARNING", logger="gpupipe"), backend.loader(pipeline(clean), 4, num_workers=0) as loader:
            assert loader.num_samples == 12 and not loader.skipped
        assert any("another version of its shard" in r.getMessage() for r in caplog.records)

    def test_resume_is_exact_and_a_changed_list_is_refused(self, backend, clean):
        listed(clean[0], {2: "corrupt"})

        def make():
            return backend.loader(pipeline(clean), 4, num_workers=0, shuffle=True, seed=1, max_skipped=None)

        states, _ = check_exact_resume(make, epoch=2)
        assert states[0]["plan"]["mask"].startswith("1:")
        listed(clean[0], {2: "corrupt", 3: "corrupt"})
        with make() as changed, pytest.raises(gp.ConfigError, match="mask="):
            changed.load_state_dict(states[0])


def test_a_plan_without_the_excluded_samples_keeps_their_numbers():
    from gpupipe.plan._plan import PlanSpec, rank_plan

    sizes, excluded = [5, 4, 6], [1, 5, 6, 7, 8, 14]  # the whole second shard among them
    spec = PlanSpec(15 - 6, 2, 2, False, True, 4, 2)
    got = []
    for rank in range(2):
        plan = rank_plan(torch.tensor(sizes).numpy(), spec, sequential=True, seed=0, epoch=1, rank=rank,
                         excluded=torch.tensor(excluded).numpy())  # fmt: skip
        got += plan.samples[plan.valid].tolist()
    assert sorted(got) == [n for n in range(15) if n not in excluded]
