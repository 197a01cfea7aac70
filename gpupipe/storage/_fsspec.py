"""fsspec's side of remote shards: which protocols it serves, their drivers, a URL's identity for
caches, and the filesystem a protocol gets (with gpupipe's HTTP(S) timeouts).

fsspec and the drivers are imported only when asked for, so importing gpupipe does not need them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from ..core._errors import ConfigError

__all__ = ["canonical_url", "require_driver", "fsspec_protocol", "filesystem_for", "http_options", "HTTP_CONNECT_S",
           "HTTP_STALL_S"]  # fmt: skip


def fsspec_protocol(scheme: str) -> bool:
    """Whether fsspec knows the protocol ``scheme`` (installed or not: :func:`filesystem_for`
    says what to install)."""
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()


def require_driver(protocol: str) -> None:
    """Imports the fsspec driver of ``protocol``, or raises a ConfigError saying what to install."""
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise ConfigError(f"{protocol}:// URLs need a package fsspec uses for them: {e}") from e


# Query parameters that sign or authorize a request, not name an object: presigned S3 (X-Amz-*,
# AWSAccessKeyId, Signature, Expires), GCS (X-Goog-*, GoogleAccessId), Azure SAS (sv, ss, srt, sp,
# se, st, spr, sig, sk*), CloudFront (Policy, Key-Pair-Id), Alibaba (x-oss-*), and tokens.
_SIGNING = re.compile(
    r"x-(amz|goog|oss)-.*|awsaccesskeyid|googleaccessid|signature|expires|policy|key-pair-id|sig|sv|ss|srt|sp|se|st"
    r"|spr|sk[a-z]*|sr|sdd|(access_|id_|auth_|api_|session_)?(token|key)|auth|apikey|password|secret|credentials?",
    re.IGNORECASE,
)


def canonical_url(url: str) -> str:
    """``url``'s identity for caches: without credentials, fragment, or the query parameters that
    sign or authorize a request (:data:`_SIGNING`: a presigned URL signed again is the same
    shard). Other parameters stay: ``get?shard=0`` and ``get?shard=1`` are two shards."""
    head, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, _, query = rest.split("#", 1)[0].partition("?")
    host, slash, path = rest.partition("/")
    kept = [p for p in query.split("&") if p and not _SIGNING.fullmatch(unquote(p.partition("=")[0]))]
    return f"{head.lower()}://{host.rpartition('@')[2]}{slash}{path}" + ("?" + "&".join(kept) if kept else "")


# HTTP(S) waits (seconds): for a connection, and for the next bytes of a response (a server that
# stops sending mid-body). No bound on the whole transfer: aiohttp's default, 5 minutes for a
# request and its body, failed every try of a shard that downloads for longer (1 GB at 3 MB/s).
HTTP_CONNECT_S = 30.0
HTTP_STALL_S = 60.0


def http_options(protocol: str, storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage_options`` with gpupipe's HTTP(S) timeouts where they name none
    (``client_kwargs={"timeout": aiohttp.ClientTimeout(...)}`` replaces them): a connection waits
    :data:`HTTP_CONNECT_S`, a read :data:`HTTP_STALL_S`, and the whole transfer as long as bytes
    come. Other protocols' options as they are (their drivers have their own timeouts)."""
    options = dict(storage_options)
    if protocol not in ("http", "https"):
        return options
    client = dict(options.get("client_kwargs") or {})
    if "timeout" not in client:
        import aiohttp

        client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_CONNECT_S, sock_read=HTTP_STALL_S)
    options["client_kwargs"] = client
    return options


def filesystem_for(protocol: str, storage_options: Mapping[str, Any]) -> Any:
    """fsspec's filesystem for ``protocol`` (:func:`http_options`), or a ConfigError saying what
    to install."""
    try:
        import fsspec

        return fsspec.filesystem(protocol, **http_options(protocol, storage_options))
    except ImportError as e:
        raise ConfigError(f"{protocol}:// URLs need a package fsspec uses for them: {e}") from e
    except ValueError as e:
        raise ConfigError(f"fsspec has no filesystem for {protocol}:// URLs: {e}") from e
