"""Crafted shards for the hostile-data tests and the fuzzer (issue 51): tar members written header
by header, so that a header may lie (about its size, its type, its name) as no tar writer would
let it; a good sample's members to put around them."""

from __future__ import annotations

import io
import tarfile
from typing import Any, Literal

from gpupipe.testing import encode_jpeg, synthetic_image

__all__ = ["member", "END", "tar_of", "good_sample", "good_jpeg", "sparse_tar", "hostile_folder", "folder_verdicts"]

END = b"\0" * (2 * tarfile.BLOCKSIZE)


def member(name: str, data: bytes = b"", *, type: bytes = tarfile.REGTYPE, size: int | None = None,
           fmt: Literal[0, 1, 2] = tarfile.GNU_FORMAT) -> bytes:  # fmt: skip
    """One tar member: its header (``size``: what the header claims, default ``len(data)``;
    claims over 8 GiB are written in GNU's base-256) and ``data`` padded to whole blocks."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mtime, info.mode = type, len(data) if size is None else size, 0, 0o644
    head = info.tobuf(format=fmt, encoding="utf-8", errors="surrogateescape")
    return head + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def tar_of(*members: bytes, end: bool = True) -> bytes:
    return b"".join(members) + (END if end else b"")


def good_jpeg(n: int = 0) -> bytes:
    return encode_jpeg(synthetic_image(n, label=n % 5, size=(40, 48)), quality=85)


def good_sample(key: str, n: int = 0) -> bytes:
    """A sample's ``.jpg`` and ``.cls`` members."""
    return member(f"{key}.jpg", good_jpeg(n)) + member(f"{key}.cls", str(n % 5).encode())


def sparse_tar(path: str, *pieces: bytes | tuple[str, int]) -> None:
    """Writes a plain tar at ``path`` of ``pieces``: bytes written as they are (members), or
    ``(name, size)``: a member of ``size`` zero bytes that take no disk (a hole: the file is
    sparse); then the end blocks."""
    with open(path, "wb") as f:
        for piece in pieces:
            if isinstance(piece, bytes):
                f.write(piece)
                continue
            name, size = piece
            f.write(member(name, b"", size=size))
            f.seek(size + (-size % tarfile.BLOCKSIZE), io.SEEK_CUR)
        f.write(END)


def hostile_shards(root: str) -> tuple[list[str], list[str], int, int]:
    """Clean shards and hostile ones of the same good samples, in ``root``; returns
    ``(clean, hostile, samples the clean ones deliver, samples the hostile ones deliver)``: the
    hostile ``.tgz`` is refused whole (its 3 good samples with it), the PNG with a text chunk
    delivered. The hostile ones hold every kind of input that
    claims memory: a 2 GiB image member and a 1 GiB label member (holes: no disk), images whose
    headers declare 30000x30000 pixels, a PNG whose text chunk inflates to 200 MB, a pax record
    claiming 2**62 bytes, and a ``.tgz`` that inflates a thousandfold."""
    import gzip
    import os

    from .corpus import _patched_sof, _photo, _png_bomb, _save, png_text_bomb

    png = _save(_photo(5, size=(48, 64)), "PNG")
    goods = [good_sample(f"g{i}", i) for i in range(6)]
    png_sample = member("p.png", png) + member("p.cls", b"1")
    clean = [os.path.join(root, "clean-0.tar"), os.path.join(root, "clean-1.tgz")]
    with open(clean[0], "wb") as f:
        f.write(tar_of(*goods[:3], png_sample))
    with open(clean[1], "wb") as f:
        f.write(gzip.compress(tar_of(*goods[3:]), 6))
    hostile = [os.path.join(root, f"hostile-{i}.tar") for i in range(3)] + [os.path.join(root, "hostile-3.tgz")]
    sparse_tar(hostile[0], goods[0], ("big.jpg", 2 << 30), member("big.cls", b"1"),
               member("lab.jpg", good_jpeg(9)), ("lab.cls", 1 << 30), goods[1])  # fmt: skip
    with open(hostile[1], "wb") as f:
        f.write(tar_of(member("z.png", png_text_bomb()), member("z.cls", b"1"),
                       member("jb.jpg", _patched_sof(size=(30000, 30000))), member("jb.cls", b"1"),
                       member("pb.png", _png_bomb()), member("pb.cls", b"1"), goods[2], png_sample))  # fmt: skip
    with open(hostile[2], "wb") as f:
        f.write(tar_of(member("x", b"y", type=tarfile.XHDTYPE, size=1 << 62), b"\0" * 15_000, end=False))
    with open(hostile[3], "wb") as f:
        f.write(gzip.compress(tar_of(goods[3], member("g3.bin", b"\0" * (64 << 20)), *goods[4:]), 9))
    return clean, hostile, 7, 5


# The child a memory run happens in: an epoch of clean shards (twice: every code path warm), then
# one of hostile shards; each epoch's peak resident memory (ru_maxrss, KiB).
MEMORY_RUN = """
import json, resource, sys
import gpupipe as gp
from gpupipe import transforms as T

backend, limit, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
clean, hostile = sys.argv[4].split(","), sys.argv[5].split(",")

def epoch(urls):
    source = gp.WebDataset(urls, image="jpg;png", cache_dir=cache)
    pipe = gp.Pipeline(source, [T.RandomResizedCrop(32), T.RandomHorizontalFlip()])
    options = {"device": "cpu"} if backend == "dali" else {"num_workers": 0}
    with gp.Loader(pipe, 4, backend=backend, on_error="skip", max_skipped=None, max_image_bytes=limit, seed=1,
                   **options) as loader:
        good = sum(int(b.valid.sum()) for b in loader)
        skipped = sorted(str(s.kind) for s in loader.skipped)
    return good, skipped, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

runs = [epoch(clean), epoch(clean), epoch(hostile)]
print("RESULT " + json.dumps(runs))
"""


def hostile_folder(root: str) -> dict[str, str]:
    """An ImageFolder tree at ``root`` holding what a tree may hold and a tar cannot, among good
    files; returns each sample key's expected verdict (``"ok"`` or its kind). A link that loops
    back to a folder holding it is not followed, so its files are not listed again."""
    import os
    import socket

    for cls in ("a", "b"):
        os.makedirs(os.path.join(root, cls))
        for i in range(2):
            with open(os.path.join(root, cls, f"g{i}.jpg"), "wb") as f:
                f.write(good_jpeg(i))
    os.mkfifo(os.path.join(root, "a", "fifo.jpg"))  # no writer: an open() would block forever
    os.symlink("/dev/zero", os.path.join(root, "a", "zero.jpg"))  # a read would never end
    os.symlink(os.path.join(root, "nowhere.jpg"), os.path.join(root, "a", "dangling.jpg"))
    os.symlink("..", os.path.join(root, "b", "up"))  # root: b again is a loop, a is listed again
    with open(os.fsencode(os.path.join(root, "b")) + b"/\xff\xfe.jpg", "wb") as f:  # not UTF-8
        f.write(good_jpeg(3))
    os.makedirs(os.path.join(root, "b", "dir.jpg"))  # a folder named like an image: not a sample
    os.symlink("loop", os.path.join(root, "loop"))  # a link to itself beside the classes: not a class
    with socket.socket(socket.AF_UNIX) as s:  # a socket refuses any open (ENXIO), as no file does
        s.bind(os.path.join(root, "a", "sock.jpg"))
    bad = {f"a/{n}.jpg": "no-image" for n in ("fifo", "zero", "dangling", "sock")}
    keys = ["a/g0.jpg", "a/g1.jpg", *bad, "b/g0.jpg", "b/g1.jpg", os.fsdecode(b"b/\xff\xfe.jpg"),
            *(f"b/up/{k}" for k in ("a/g0.jpg", "a/g1.jpg", *bad))]  # fmt: skip
    return {k: bad.get(k.removeprefix("b/up/"), "ok") for k in keys}


def folder_verdicts(root: str, backend: str) -> dict[str, str]:
    """Each sample's verdict from a loader over ImageFolder ``root`` on ``backend`` (CPU), under
    ``on_error="skip"``: ``"ok"`` (delivered) or its kind."""
    import gpupipe as gp
    from gpupipe import transforms as T

    per_backend: dict[str, dict[str, Any]] = {"dali": {"device": "cpu"}, "torch": {"num_workers": 0}}
    options = per_backend[backend]
    out: dict[str, str] = {}
    pipe = gp.Pipeline(gp.ImageFolder(root), [T.RandomResizedCrop(16)])
    with gp.Loader(pipe, 3, backend=backend, on_error="skip", max_skipped=None, seed=1, **options) as loader:
        for batch in loader:
            out.update((k, "ok") for k, valid in zip(batch.keys, batch.valid.tolist(), strict=True) if valid)
        out.update((str(s.key), str(s.kind)) for s in loader.skipped if s.epoch is not None)
    return out
