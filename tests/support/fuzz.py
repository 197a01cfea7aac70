"""The fuzzer of hostile shards (issue 51): generated shards and ImageFolder trees
(``fuzz_cases``) through the scan, ``gpupipe check`` (shards) and each CPU backend under
``on_error="skip"``, against five invariants:

1. nothing raises out of ``WebDataset.index``, ``Loader(...)``, its epoch or ``check``;
2. every sample the index numbers is delivered or skipped with a reason, once, on every backend
   (torch and DALI-CPU by default; ``--backends torch,dali,ray`` adds Ray's, on a local cluster);
3. each sample gets one verdict: the same kind on every backend and in ``check``;
4. memory: a case's peak resident memory stays within ``4 x max_image_bytes`` (plus the slack a
   clean case needs) of what it was before the case, with ``max_image_pixels`` a third of
   ``max_image_bytes`` as by default (a decoded image is one member's worth);
5. nothing is unpickled (an object ``.npy`` holds a canary).

Hypothesis generates and shrinks the cases: structured inputs (tar members, image headers,
fields) reach far deeper than byte flips of whole files, and a failure comes back as the smallest
case that shows it. Run as ``python -m tests.support.fuzz --seconds 60`` (``make test`` runs a
short budget through ``tests/test_fuzz.py``; ``make fuzz`` a long one, with a JSON report). A
crash (a signal) ends the process, and so does a case that blocks for ``HANG`` seconds (with
every thread's stack on stderr): the case being run is kept at ``--keep``.

``GPUPIPE_FUZZ_PLANT=image-bytes`` (or ``label-bytes``) removes that limit, to show the fuzzer
finds it.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

import gpupipe as gp
from gpupipe import transforms as T

from .fuzz_cases import CANARY, Case, Folder, cases, folders, write_case, write_folder
from .hostile import good_jpeg, good_sample, tar_of

LIMIT = 8 << 20  # max_image_bytes in the fuzzed loaders: small, so that the memory bound is tight
PIXELS = LIMIT // 3  # max_image_pixels likewise: the promise counts a decoded image (3 x pixels) as one member
FIELDS = {"image": "jpg;png;webp;bmp", "label": "cls", "meta": gp.fields.Json("json", missing="empty"),
          "text": gp.fields.Text("txt", missing="empty"), "emb": gp.fields.Array("npy", missing="empty")}  # fmt: skip
OK = "ok"
HANG = 120  # seconds: a case that takes longer has blocked (a clean one takes well under one)
GOOD = ("__good-0", "__good-1")  # the keys of the good shard read beside each case (no case's keys)


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set (Linux 4.0+)
        return True
    except OSError:
        return False


def _plant(name: str | None) -> None:
    """Removes one limit (a planted defect the fuzzer must find)."""
    if name == "image-bytes":
        from gpupipe.sources._index import Index

        Index.max_image_bytes = property(lambda self: None, lambda self, limit: None)  # type: ignore[method-assign,assignment]
    elif name == "label-bytes":
        from gpupipe.shards import _tar

        _tar.LABEL_LIMIT = 1 << 62
    elif name:
        raise SystemExit(f"GPUPIPE_FUZZ_PLANT: unknown {name!r}")


class Fuzzer:
    def __init__(self, root: str, backends: list[str], keep: str | None) -> None:
        self.root, self.backends, self.keep = root, backends, keep
        self.good = os.path.join(root, "good.tar")
        with open(self.good, "wb") as f:
            f.write(tar_of(*(good_sample(k, i) for i, k in enumerate(GOOD))))
        self.canary = os.path.join(root, "canary")
        os.environ[CANARY] = self.canary
        self.cases, self.kinds, self.peak_growth, self.slack, self.peak_rss = 0, dict[str, int](), 0, 0, 0
        self.folders = 0  # of the cases, ImageFolder trees
        self.measured = _reset_peak()

    def source(self, url: str, case: Case | Folder) -> gp.WebDataset | gp.ImageFolder:
        if isinstance(case, Folder):
            return gp.ImageFolder(url, allow_empty=True)  # (its files are judged: a class of none is drawn too)
        if case.fields:
            return gp.WebDataset([url, self.good], fields=FIELDS)
        return gp.WebDataset([url, self.good], image="jpg;png;webp;bmp")

    def verdicts(self, source: gp.WebDataset | gp.ImageFolder, backend: str) -> dict[str, str]:
        """Each numbered sample's verdict on ``backend``: ``"ok"`` (delivered) or its kind."""
        pipe = gp.Pipeline(source, [T.RandomResizedCrop(16), T.RandomHorizontalFlip()])
        per_backend: dict[str, dict[str, Any]] = {"dali": {"device": "cpu"}, "torch": {"num_workers": 0}}
        options = per_backend.get(backend, {})
        out: dict[str, str] = {}
        with gp.Loader(pipe, 3, backend=backend, on_error="skip", max_skipped=None, max_image_bytes=LIMIT,
                       max_image_pixels=PIXELS, seed=1, **options) as loader:  # fmt: skip
            for batch in loader:
                for key, valid in zip(batch.keys, batch.valid.tolist(), strict=True):
                    if valid:
                        assert key not in out, f"{backend}: {key!r} delivered twice"
                        out[key] = OK
            for s in loader.skipped:
                if s.epoch is not None:
                    assert s.key is not None and s.key not in out, f"{backend}: {s.key!r} delivered and skipped"
                    out[s.key] = str(s.kind)
        return out

    def run(self, case: Case | Folder) -> None:
        """One case through every invariant; raises AssertionError naming the one broken."""
        self.cases += 1
        self.folders += isinstance(case, Folder)
        folder = tempfile.mkdtemp(dir=self.root)
        # a case that blocks (a read that never returns) ends the process with every thread's stack
        faulthandler.dump_traceback_later(HANG, exit=True)
        try:
            url = self.write(case, os.path.join(folder, "case"))
            if self.keep:  # the case being run, for a crash (the last one, for a failure: hypothesis's shrunk case)
                shutil.rmtree(os.path.join(self.keep, "case-tree"), ignore_errors=True)
                self.write(case, os.path.join(self.keep, "case"))
            self.measured = _reset_peak()
            before = _kb("VmRSS")
            self._run(url, case)
            peak = _kb("VmHWM")
            growth = (peak - before) << 10
            self.peak_rss = max(self.peak_rss, peak << 10)
            self.peak_growth = max(self.peak_growth, growth)
            if self.measured and self.slack:
                assert growth <= 4 * LIMIT + self.slack, (
                    f"memory: the case's peak is {growth >> 20} MiB over its start, more than 4 x max_image_bytes "
                    f"({4 * LIMIT >> 20} MiB) + {self.slack >> 20} MiB"
                )
            assert not os.path.exists(self.canary), "a .npy object array was unpickled"
        finally:
            faulthandler.cancel_dump_traceback_later()
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def write(case: Case | Folder, path: str) -> str:
        """A tar case as a shard at ``path`` (``.tar``, ``.tgz``); a tree at ``path-tree``, with a
        class of good files beside its own (``GOOD``, as the good shard beside a tar case)."""
        if isinstance(case, Case):
            return write_case(case, path)
        root = write_folder(case, path + "-tree")
        os.makedirs(os.path.join(root, "__good"))
        for i, key in enumerate(GOOD):
            with open(os.path.join(root, "__good", f"{key}.jpg"), "wb") as f:
                f.write(good_jpeg(i))
        return root

    def _run(self, url: str, case: Case | Folder) -> None:
        source = self.source(url, case)
        index = source.index(on_error="skip")
        numbered = [k for s in index.shards for k in s.keys]
        index.close()
        assert len(set(numbered)) == len(numbered), f"the index numbers a key twice: {numbered}"
        seen: dict[str, dict[str, str]] = {}
        for backend in self.backends:
            got = self.verdicts(source, backend)
            assert set(got) == set(numbered), (
                f"{backend}: delivered or skipped {sorted(set(got) - set(numbered))[:5]} beyond the index, "
                f"never {sorted(set(numbered) - set(got))[:5]}"
            )
            seen[backend] = got
        if isinstance(source, gp.WebDataset):  # (check reads shards: an ImageFolder's files are judged as read)
            report = gp.check(source, workers=0, write=False, max_image_bytes=LIMIT, max_image_pixels=PIXELS)
            checked = dict.fromkeys(numbered, OK)
            checked.update({f.key: f.kind.value for f in report.findings if f.sample is not None and f.key is not None})
            seen["check"] = checked
        first = next(iter(seen))
        for name, verdicts in seen.items():
            differ = {k: (seen[first][k], v) for k, v in verdicts.items() if seen[first].get(k) != v}
            assert not differ, f"verdicts of {first} and {name} differ: {differ}"
        for verdict in seen[first].values():
            self.kinds[verdict] = self.kinds.get(verdict, 0) + 1

    def warm(self) -> None:
        """Clean cases first: every code path warm, and the slack a clean case needs."""
        self.slack = 0
        for _ in range(3):
            self.run(Case([tar_of(good_sample("c0", 3), good_sample("c1", 4))], gzipped=False, fields=False))
            self.run(Case([tar_of(good_sample("c0", 3), good_sample("c1", 4))], gzipped=False, fields=True))
        self.slack = self.peak_growth + (48 << 20)


def fuzz(seconds: float, *, seed: int = 0, backends: list[str] | None = None, keep: str | None = None,
         examples: int = 25) -> dict[str, Any]:  # fmt: skip
    """Runs rounds of ``examples`` cases (hypothesis seeds ``seed``, ``seed + 1``, ...) until
    ``seconds`` have passed; returns the report (``failure``: the first broken invariant, with
    its shrunk case, or ``None``)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as seeded

    backends = backends or [b for b in ("torch", "dali") if gp.backends.get(b).available()]
    started = time.monotonic()
    root = tempfile.mkdtemp(prefix="gpupipe-fuzz-")
    os.environ.setdefault("GPUPIPE_CACHE_DIR", os.path.join(root, "cache"))
    fuzzer = Fuzzer(root, backends, keep)
    failure, rounds = None, 0
    if "ray" in backends:  # one local Ray for every case's loader (loopback, 2 CPUs), as the tests share one
        from gpupipe.backends._ray import _cluster

        _cluster.attach(gp.RayOptions(local_cpus=2))
    try:
        fuzzer.warm()
        while time.monotonic() - started < seconds and failure is None:
            config = settings(max_examples=examples, deadline=None, database=None, print_blob=False,
                              suppress_health_check=list(HealthCheck))  # fmt: skip

            @seeded(seed + rounds)
            @config
            @given(case=cases() | folders())
            def round_(case: Case | Folder) -> None:
                fuzzer.run(case)

            rounds += 1
            try:
                round_()
            except Exception as e:  # the shrunk case's failure: hypothesis re-raises it
                zeros = functools.partial(re.sub, r"(\\x00){8,}", "<zeros>")  # a case's padding, shown short
                # several distinct failures come as a group: each one's own error, so that the report
                # (and a test reading it) sees what each was
                parts = getattr(e, "exceptions", None) or (e,)
                failure = {
                    "error": zeros("; ".join(f"{type(x).__name__}: {x}" for x in parts))[:4000],
                    "traceback": zeros(traceback.format_exc())[-6000:],
                    "seed": seed + rounds - 1,
                }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if "ray" in backends:
            _cluster.detach()
    return {
        "cases": fuzzer.cases,
        "folder_cases": fuzzer.folders,
        "rounds": rounds,
        "seconds": round(time.monotonic() - started, 1),
        "backends": backends,
        "verdicts": dict(sorted(fuzzer.kinds.items())),
        "peak_growth_mib": round(fuzzer.peak_growth / 2**20, 1),
        "slack_mib": round(fuzzer.slack / 2**20, 1),
        "peak_rss_mib": round(fuzzer.peak_rss / 2**20, 1),
        "memory_measured": fuzzer.measured,
        "plant": os.environ.get("GPUPIPE_FUZZ_PLANT"),
        "failure": failure,
    }


def _limit_data(limit: int) -> None:
    """Caps this process's data (a fuzzed case that allocates without end ran the machine out of
    memory, 24 GB, and the kernel killed the run with no report: 2026-11-29, a negative tar size)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="the budget (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the first round's hypothesis seed (default 0)")
    p.add_argument("--examples", type=int, default=25, help="cases per round (default 25)")
    p.add_argument("--backends", default=None, help="comma-separated: torch, dali, ray (default: torch and dali "
                   "where present; ray starts a local cluster)")  # fmt: skip
    p.add_argument("--keep", default=None, help="copy each case's shard here before it runs (a crash leaves it)")
    p.add_argument("--out", default=None, help="also write the report (JSON) here")
    p.add_argument("--max-data-gib", type=float, default=8.0, help="the process's data limit (RLIMIT_DATA, "
                   "default 8): a case that allocates without end fails (MemoryError), not the OOM killer")  # fmt: skip
    args = p.parse_args(argv)
    _limit_data(int(args.max_data_gib * (1 << 30)))
    _plant(os.environ.get("GPUPIPE_FUZZ_PLANT"))
    logging.getLogger("gpupipe").setLevel(logging.ERROR)  # each case's skips: counted in the report instead
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    report = fuzz(args.seconds, seed=args.seed, backends=args.backends.split(",") if args.backends else None,
                  keep=args.keep, examples=args.examples)  # fmt: skip
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print("RESULT " + json.dumps(report))
    return 1 if report["failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
