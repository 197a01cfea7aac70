"""Counting the image headers the DALI runner's reader threads check (``backends/_dali/_headers``):
the keys of the samples whose header was read, in the order read."""

from __future__ import annotations

from typing import Any


def header_reads(monkeypatch: Any) -> list[str]:
    """A list that collects the key of every header ``_headers.read_header`` reads from now on
    (until ``monkeypatch`` undoes it)."""
    from gpupipe.backends._dali import _headers

    keys: list[str] = []
    real = _headers.read_header

    def counted(view: Any, *args: Any, key: str, **kwargs: Any) -> Any:
        keys.append(key)
        return real(view, *args, key=key, **kwargs)

    monkeypatch.setattr(_headers, "read_header", counted)
    return keys
