"""The commands of ``python -m gpupipe``, one function each (``args`` from ``_main``'s parser);
``make-shards`` is ``_make``'s."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..core._errors import ConfigError, ShardError
from ..core._validate import valid_bytes
from ..runtime._children import process_pool
from ..runtime._dist import cpu_cores, default_workers

__all__ = ["tune", "bench", "index", "check", "inspect", "doctor"]
T = TypeVar("T")


def _progress(args: argparse.Namespace, total: int | None, unit: str, desc: str) -> Any:
    """A tqdm progress bar on stderr (none with ``--quiet``)."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=bool(getattr(args, "quiet", False)), file=sys.stderr)


def _counted(items: Iterable[T], bar: Any) -> Iterator[T]:
    for item in items:
        yield item
        bar.update(1)


def _output(path: str, option: str, *, writer: str | None = None, create: bool = False) -> None:
    """ConfigError, before any work, for a file that a command writes at its end and could not:
    a folder, a file in a folder that does not exist (unless ``create``: the command makes it), or
    a file type its ``writer`` ("matplotlib", "Pillow") does not write."""
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path!r} is a folder: name the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not create and not os.path.isdir(folder):
        raise ConfigError(f"{option} {path!r}: the folder {folder!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if writer == "matplotlib":
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError as e:
            raise ConfigError(f"{option} draws with matplotlib: pip install gpupipe[plot]") from e
        known = {f".{t}" for t in FigureCanvasBase.get_supported_filetypes()}
        if ext and ext not in known:  # (no extension: matplotlib writes a PNG)
            raise ConfigError(f"{option} {path!r}: matplotlib writes no {ext!r} files (name a .png)")
    elif writer == "Pillow":
        from PIL import Image

        written = {e for e, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}  # (not read-only ones)
        if ext not in written:
            raise ConfigError(f"{option} {path!r}: Pillow writes no {ext!r} files (name a .png)")


def _list(text: str, what: str, convert: Callable[[str], T]) -> list[T]:
    from ..core._errors import ConfigError

    try:
        return [convert(part.strip()) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be a value or values separated by commas, got {text!r}") from None


def _workers(text: str) -> int | None:
    return None if text == "auto" else int(text)


def _source(data: str) -> Any:
    """A command's data argument: a shard pattern or URL as given; a directory, its tar shards
    (every ``*.tar`` file in it, in name order, dot-files left out), else an ImageFolder tree."""
    if not os.path.isdir(data):
        return data
    from ..sources import ImageFolder
    from ..sources._listing import tar_files

    tars = [os.path.join(data, f) for f in tar_files(data)]
    if tars and any(os.path.isdir(os.path.join(data, f)) for f in os.listdir(data) if not f.startswith(".")):
        print(f"note: {data} holds tar shards and folders; reading its {len(tars)} tar shards", file=sys.stderr)
    return tars or ImageFolder(data)


def _pipeline(spec: str, data: str) -> Any:
    """The pipeline ``spec``'s factory makes of ``data``; its own errors (a misspelled argument in
    the pipeline file) become one-line gpupipe errors with the file and line."""
    from ..core._errors import ConfigError, GpupipeError
    from ..core._tracebacks import raised, raised_in_gpupipe
    from ..pipeline._pipeline import load_pipeline

    factory = load_pipeline(spec)
    source = _source(data)
    try:
        return factory(source)
    except GpupipeError:
        raise
    except Exception as e:
        if raised_in_gpupipe(e):  # gpupipe's own bug: its traceback
            raise
        code = getattr(factory, "__code__", None)
        where = raised(e, code.co_filename if code is not None else None)
        raise ConfigError(f"pipeline {spec}: {where}{_did_you_mean(e)}") from e


def _did_you_mean(e: Exception) -> str:
    """For a transform given an argument it does not take: the nearest it does."""
    import dataclasses
    import difflib
    import re

    from .. import transforms

    m = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(e))
    kind = getattr(transforms, m[1], None) if m else None
    if m is None or not dataclasses.is_dataclass(kind) or "Did you mean" in str(e):  # (Python 3.13+ says it)
        return ""
    names = [f.name for f in dataclasses.fields(kind) if f.init and not f.name.startswith("_")]
    close = difflib.get_close_matches(m[2], names, n=1)
    return f"; did you mean {close[0]}=?" if close else f"; {m[1]} takes {', '.join(names)}"


def tune(args: argparse.Namespace) -> int:
    """``gpupipe tune``: measure and record the loader's throughput settings for a pipeline."""
    from ..loader._records import default_share, gpu_capability, tune_file
    from ..loader._tune import tune as run_tune

    pipeline = _pipeline(args.pipeline, args.source)
    print(f"pipeline {args.pipeline}, batch {args.batch_size}: {args.seconds:g} s per trial")

    def say(trial: dict[str, Any]) -> None:
        share = "" if trial["hw_decoder_load"] is None else f" hw_decoder_load={trial['hw_decoder_load']}"
        print(f"  num_workers={trial['num_workers']} prefetch={trial['prefetch']}{share}: "
              f"{trial['images_per_s']:.0f} images/s", flush=True)  # fmt: skip

    tuned = run_tune(pipeline, args.batch_size, seconds=args.seconds, record=not args.no_record, progress=say,
                     ranks_per_node=args.ranks_per_node, backend=args.backend, device=args.device)  # fmt: skip
    print(f"chosen: {tuned}")
    if tuned.hw_decoder_load is not None:  # DALI decoded on a GPU
        import torch

        default, why = default_share(gpu_capability(torch.device(args.device or "cuda")))
        verdict = "the default" if tuned.hw_decoder_load == default else f"not the default, {default}"
        print(f"hw_decoder_load={tuned.hw_decoder_load}: {verdict} on this GPU ({why})")
    if not args.no_record:
        print(f"recorded in {tune_file()}: loaders of this pipeline and batch size on this machine that leave "
              "num_workers, prefetch and hw_decoder_load unset use it")  # fmt: skip
    return 0


def bench(args: argparse.Namespace) -> int:
    from ._bench import BASELINE, plot, require_baseline, run_baseline, run_loader, summary, table
    from ._profile import profile_plot, profile_text

    logging_level = os.environ.get("GPUPIPE_LOG")
    if logging_level:
        import logging

        logging.basicConfig(level=logging_level.upper())
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be 1 or more, got {args.rounds}")
    if args.json:
        _output(args.json, "--json")
    if args.plot:
        _output(args.plot, "--plot", writer="matplotlib")
    if args.profile:
        _output(args.profile, "--profile", writer="matplotlib")
    backends = _list(args.backend, "--backend", str)
    sizes = _list(args.batch_size, "--batch-size", int)
    workers = _list(args.workers, "--workers", _workers)
    # before the work: a value out of range would fail its configuration after the others had run
    if any(size < 1 for size in sizes):
        raise ConfigError(f"--batch-size values must be 1 or more, got {args.batch_size!r}")
    if any(w is not None and w < 0 for w in workers):
        raise ConfigError(f"--workers values must be 0 or more (or auto), got {args.workers!r}")
    pipeline = _pipeline(args.pipeline, args.source)
    if args.baseline:
        require_baseline(pipeline)
    print(f"pipeline {args.pipeline}: output {', '.join(map(str, pipeline.output_specs))}")

    def progress(name: str) -> Callable[[int, int], Any]:
        return lambda epoch, total: _progress(args, total, "batch", f"{name} epoch {epoch}")

    from .. import backends as backend_table

    # every configuration once per round: the loader's, then the baselines'
    configs: list[Callable[[], Any]] = []
    for backend in backends:
        label = backend_table.resolve(backend, args.device, pipeline.views)[0].name  # "auto": the one it picks
        for size in sizes:
            for w in workers:
                configs.append(functools.partial(run_loader, pipeline, backend=backend, device=args.device,
                                                 batch_size=size, workers=w, epochs=args.epochs,
                                                 progress=progress(label),
                                                 profile=args.profile is not None))  # fmt: skip
    if args.baseline:
        for size in sizes:
            for w in workers:
                count = w if w is not None else default_workers()  # the Loader's default
                for decoder in _list(args.baseline_decoder, "--baseline-decoder", str):
                    configs.append(functools.partial(run_baseline, pipeline, batch_size=size, workers=count,
                                                     epochs=args.epochs, progress=progress(BASELINE),
                                                     decoder=decoder))  # fmt: skip
    runs = []
    for number in range(args.rounds):
        if args.rounds > 1:
            print(f"round {number + 1} of {args.rounds}")
        for config in configs if number % 2 == 0 else reversed(configs):  # every other round backwards
            run = dataclasses.replace(config(), round=number)
            _say(run)
            if run.profile is not None:
                print(profile_text(run.profile))
            runs.append(run)
    if len(runs) > 1:
        print(table(runs))
    if args.plot:
        title = f"{args.pipeline} on {args.source} ({cpu_cores()} cores)"
        plot(runs, args.plot, title=title)
        print(f"plot: {args.plot}")
    if args.profile:
        title = f"{args.pipeline} on {args.source} ({cpu_cores()} cores): time per batch"
        profile_plot(runs, args.profile, title=title)
        print(f"profile plot: {args.profile}")
    if args.json:
        first = runs[0]
        with open(args.json, "w") as f:
            json.dump(
                {
                    "pipeline": args.pipeline,
                    "backend": first.backend,
                    "device": first.device,
                    "batch_size": first.batch_size,
                    "workers": first.workers,
                    "epochs": first.epochs,
                    "rounds": args.rounds,
                    "runs": [r.as_dict() for r in runs],
                    "summary": summary(runs),
                },
                f,
                indent=2,
            )
    return 0


def _say(run: Any) -> None:
    auto = f" (auto: {run.auto})" if run.auto else ""
    graph = f" operators={run.operators}" if run.operators is not None else ""
    print(f"backend={run.backend} device={run.device} workers={run.workers} batch={run.batch_size}{graph}{auto}")
    for e in run.epochs:
        print(
            f"epoch {e['epoch']}: {e['images']} images in {e['seconds']:.2f} s = {e['images_per_s']:.0f} images/s"
            + (" (includes start-up)" if e["epoch"] == 0 else "")
        )


def _storage_options(text: str | None) -> dict[str, Any] | None:
    """``--storage-options``: a JSON object (parsed as data, never evaluated)."""
    if text is None:
        return None
    from ..core._errors import ConfigError

    try:
        options = json.loads(text)
    except ValueError as e:
        example = '{"endpoint_url": "http://host:8333"}'
        raise ConfigError(f"--storage-options must be a JSON object, e.g. '{example}': {e}") from e
    if not isinstance(options, dict):
        raise ConfigError(f"--storage-options must be a JSON object, got {type(options).__name__}")
    return options


def _index_one(job: tuple[str, tuple[str, ...], str | None, bool, dict[str, Any] | None, tuple[Any, ...], bool]
               ) -> tuple[int, int, int, str | None]:  # fmt: skip
    """Indexes one shard; with ``beside``, writes its index file next to it; with ``sizes``,
    records its images' sizes in the cache. Returns the samples, the index files written (0 or 1),
    the sizes recorded and what is wrong with the whole shard (missing, damaged; else ``None``)."""
    from ..shards._indexfile import write_index_file
    from ..shards._indexing import cached_scan, shard_samples
    from ..sources import storage_for

    url, image_exts, label_ext, beside, options, fields, sizes = job
    with storage_for([url], storage_options=options) as storage:
        if not beside:  # (index() refuses --beside with --fields: index files do not list fields)
            shard = cached_scan(storage, url, image_exts, label_ext, fields=fields)
            return len(shard), 0, _record_sizes(storage, shard) if sizes else 0, _shard_damage(url, shard)
        shard, samples = shard_samples(storage, url, image_exts, label_ext)
        if samples is None or shard.nbytes is None:  # missing or unreadable: nothing to describe
            return len(shard), 0, 0, _shard_damage(url, shard)
        recorded = _record_sizes(storage, shard) if sizes else 0
        write_index_file(storage, url, size=shard.nbytes, detail=samples, image_exts=image_exts,
                         label_ext=label_ext, problems=shard.problems, sizes=_recorded_sizes(shard) if sizes else None,
                         version=storage.stat(url).version if storage.remote else None)  # fmt: skip
        return len(shard), 1, recorded, _shard_damage(url, shard)


def _shard_damage(url: str, shard: Any) -> str | None:
    """The message of a shard's whole-shard damage (missing, unreadable, empty, truncated)."""
    from ..core._errors import SHARD_DAMAGE, problem_error

    found = [p for p in shard.problems if p.kind in SHARD_DAMAGE]
    return str(problem_error(url, found[0])) if found else None


def _record_sizes(storage: Any, shard: Any) -> int:
    from ..backends._dali._headers import record_shard

    return record_shard(storage, shard)


def _recorded_sizes(shard: Any) -> tuple[str, Any] | None:
    """The sizes :func:`_record_sizes` recorded beside the shard's index cache file, with their
    rules' tag, for its index file beside it (``None`` where none were)."""
    from ..backends._dali._headers import rules
    from ..shards import _indexcache

    if shard.dali_index is None:
        return None
    found = _indexcache.load_sizes(shard.dali_index, rules(), len(shard))
    return None if found is None else (rules(), found)


def _webdataset(urls: Any, args: argparse.Namespace, options: dict[str, Any] | None) -> Any:
    """The WebDataset of ``--image``, ``--label`` and ``--fields 'text=txt,meta=json'``."""
    from ..sources import WebDataset

    label = None if args.label == "none" else args.label
    if not args.fields:
        return WebDataset(urls, image=args.image, label=label, storage_options=options)
    fields: dict[str, str] = {"image": args.image}
    if label is not None:
        fields["label"] = label
    for part in args.fields.split(","):
        name, eq, exts = part.partition("=")
        if not eq or not name.strip() or not exts.strip():
            raise ConfigError(
                f"--fields: give NAME=EXTS pairs separated by ',' (e.g. 'text=txt,meta=json'), got {part!r}"
            )
        fields[name.strip()] = exts.strip()
    return WebDataset(urls, fields=fields, storage_options=options)


def index(args: argparse.Namespace) -> int:
    """Builds the index cache of every shard, in parallel: a large dataset's first Loader then
    starts from the cache on every rank (point ``GPUPIPE_CACHE_DIR`` at storage all nodes see)."""
    from ..shards import _indexcache

    options = _storage_options(args.storage_options)
    source = _webdataset(args.source, args, options)
    if args.beside and args.fields:
        raise ConfigError("gpupipe index: --beside writes index files without fields; index --fields into the cache")
    if args.sizes:
        from ..backends import get

        if not get("dali").available():
            raise ConfigError("gpupipe index --sizes checks headers as the DALI backend does: it needs NVIDIA DALI "
                              "(pip install 'gpupipe[cuda12]')")  # fmt: skip
    jobs = [(u, *source.extensions(), args.beside, options, source.field_members(), args.sizes) for u in source.urls]
    start = time.perf_counter()
    with _progress(args, len(jobs), "shard", "gpupipe index") as bar:
        if args.workers == 0:
            done = list(_counted(map(_index_one, jobs), bar))
        else:
            with process_pool(args.workers, "gpupipe index") as pool:
                done = list(_counted(pool.map(_index_one, jobs, chunksize=max(1, len(jobs) // 64)), bar))
    total, written, recorded = sum(d[0] for d in done), sum(d[1] for d in done), sum(d[2] for d in done)
    damaged = [d[3] for d in done if d[3] is not None]
    first = f" (first: {damaged[0]})" if damaged else ""
    if jobs and len(damaged) == len(jobs):  # a mistyped pattern, a wrong folder: as the loaders, an error
        raise ShardError(f"not one of the {len(jobs)} shards could be indexed{first}")
    print(
        f"{total} samples in {len(jobs)} shards, indexed in {time.perf_counter() - start:.1f} s; "
        f"cache: {_indexcache.cache_dir()}"
        + (f"; {written} index files written beside the shards" if args.beside else "")
        + (f"; {recorded} image sizes recorded" if args.sizes else "")
        + (f"; {len(damaged)} shards missing or damaged{first}: gpupipe check lists them" if damaged else "")
    )
    return 0


def check(args: argparse.Namespace) -> int:
    from ..pipeline._check import check as run_check

    options = _storage_options(args.storage_options)
    source = _webdataset(args.shards, args, options)
    limit = None if args.max_image_pixels == 0 else args.max_image_pixels
    nbytes = None if args.max_image_bytes.strip() == "0" else valid_bytes("--max-image-bytes", args.max_image_bytes,
                                                                          "the byte limit")  # fmt: skip
    report = run_check(source, workers=args.workers, write=not args.no_write, progress=not args.quiet,
                       max_image_pixels=limit, max_image_bytes=nbytes)  # fmt: skip
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=1)
        print()
    else:
        print(report.summary())
    return 0 if report.ok else 1


def inspect(args: argparse.Namespace) -> int:
    from .. import backends
    from ..core._errors import ConfigError
    from ._inspect import inspect as run_inspect

    _output(args.out, "--out", writer="Pillow", create=True)  # (inspect makes its folder)
    pipeline = _pipeline(args.pipeline, args.data)
    if args.compare:
        # every backend with kernels of its own (ray runs the torch backend's: the same images)
        names = [n for n in backends.names() if backends.get(n).auto and backends.get(n).available()]
        if len(names) < 2:
            raise ConfigError(f"--compare needs two backends; only {names} is installed (pip install gpupipe[cuda12])")
    else:
        names = [args.backend]
    lines = run_inspect(pipeline, args.out, samples=args.samples, draws=args.draws, backends=names, seed=args.seed,
                        cell=args.cell, device=args.device)  # fmt: skip
    print("\n".join(lines))
    return 0


def doctor(args: argparse.Namespace) -> int:
    from ._doctor import main as doctor_main

    return doctor_main(run=args.run, images=args.images)
