"""Crafted shards for the hostile-data tests and the fuzzer (issue 51): tar members written header
by header, so that a header may lie (about its size, its type, its name) as no tar writer would
let it; a good sample's members to put around them."""

from __future__ import annotations

import io
import tarfile

from gpupipe.testing import encode_jpeg, synthetic_image

__all__ = ["member", "END", "tar_of", "good_sample", "good_jpeg", "sparse_tar"]

END = b"\0" * (2 * tarfile.BLOCKSIZE)


def member(name: str, data: bytes = b"", *, type: bytes = tarfile.REGTYPE, size: int | None = None,
           fmt: int = tarfile.GNU_FORMAT) -> bytes:  # fmt: skip
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


def sparse_tar(path: str, before: bytes, name: str, size: int, after: bytes = b"") -> None:
    """Writes a plain tar at ``path``: ``before``, then a member ``name`` of ``size`` zero bytes
    that take no disk (a hole: the file is sparse), then ``after`` and the end blocks."""
    head = member(name, b"", size=size)
    with open(path, "wb") as f:
        f.write(before + head)
        f.seek(size + (-size % tarfile.BLOCKSIZE), io.SEEK_CUR)
        f.write(after + END)
