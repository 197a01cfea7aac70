"""A directory's tar shards, and what to pass instead of a directory where a source is expected
(``gp.Pipeline`` given a directory; ``gpupipe`` commands given one)."""

from __future__ import annotations

import os

__all__ = ["tar_files", "directory_hint"]


def tar_files(path: str) -> list[str]:
    """The names of the tar shards in directory ``path``, sorted: files named ``*.tar``, dot-files
    (macOS's ``._x.tar``) left out."""
    return sorted(
        f for f in os.listdir(path)
        if f.endswith(".tar") and not f.startswith(".") and os.path.isfile(os.path.join(path, f))
    )  # fmt: skip


def directory_hint(path: str) -> str:
    """What to pass instead of the directory ``path``: its tar shards as a brace pattern (or a
    list), else an ImageFolder."""
    import re

    tars = tar_files(path)
    if not tars:
        return "use gp.ImageFolder(root) for an ImageFolder tree, or a shard pattern for WebDataset shards"
    parts = [m.groups() for f in tars if (m := re.fullmatch(r"(.*?)(\d+)\.tar", f))]
    if len(parts) == len(tars) and len({(prefix, len(n)) for prefix, n in parts}) == 1:
        prefix, width, numbers = parts[0][0], len(parts[0][1]), [int(n) for _, n in parts]
        if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
            pattern = f"{prefix}{{{numbers[0]:0{width}d}..{numbers[-1]:0{width}d}}}.tar"
            return f"it holds {len(tars)} tar shards: give them as a pattern, {os.path.join(path, pattern)!r}"
    return f"it holds {len(tars)} tar shards: give them as a list of paths or a brace pattern"
