"""A loopback HTTP server for the remote-data tests: it serves a folder on 127.0.0.1 (a free port)
from a thread of the test process, with range requests on or off, and failures on request
(connections dropped mid-body, error statuses, a file rewritten after a GET). Tests start servers
through the ``http_server`` fixture (conftest), which shuts each down when the test ends."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import threading
from collections.abc import Callable, Iterator

import pytest


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder. The server's ``ranges`` turns range requests on (Python's handler has
    none); ``drops[name]`` counts requests for ``name`` to cut off after half their body;
    ``status[name]`` answers with that status instead; ``rewrites[name]`` counts GETs of ``name``
    after which the file is rewritten (same size, new content and ETag); every GET is counted in
    ``gets``, the bytes of the bodies sent in ``sent``; ``stalls[name]`` counts requests for
    ``name`` that send half their body, then nothing for the server's ``stall_s`` seconds;
    ``pages[name]`` answers range requests for ``name`` with ``200`` and that body (a rate
    limiter's error page); ``trickles[name]`` counts GETs that send one byte every
    ``trickle_s``; ``grows[name]`` counts GETs before which the file grows by that many bytes
    (after the client asked its size)."""

    server: HttpServer

    def log_message(self, *args: object) -> None:
        pass

    def _target(self) -> tuple[str, str] | None:
        """The requested file's name and path, or ``None`` once an error (the configured status,
        or 404) is sent."""
        name = self.path.split("?", 1)[0].rsplit("/", 1)[-1]
        if name in self.server.status:
            self.send_error(self.server.status[name])
            return None
        path = self.translate_path(self.path.split("?", 1)[0])
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        return name, path

    def do_GET(self) -> None:
        name = self.path.split("?", 1)[0].rsplit("/", 1)[-1]
        self.server.gets[name] = self.server.gets.get(name, 0) + 1
        target = self._target()
        if target is None:
            return
        name, path = target
        header = self.headers.get("Range")
        if header and name in self.server.pages:
            page = self.server.pages[name]
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return
        if self.server.grows.get(name, 0) > 0:
            with open(path, "ab") as f:
                f.write(b"\0" * self.server.grows.pop(name))
        with open(path, "rb") as f:
            data = f.read()
        start, end, code = 0, len(data), 200
        if self.server.ranges and header and header.startswith("bytes="):
            first, _, last = header[6:].partition("-")
            start, end, code = int(first or 0), min(len(data), int(last) + 1 if last else len(data)), 206
        self.send_response(code)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Last-Modified", self.date_time_string(int(os.stat(path).st_mtime)))
        self.send_header("ETag", f'"{os.stat(path).st_mtime_ns}"')
        if self.server.says_no_ranges:
            self.send_header("Accept-Ranges", "none")
        if self.server.ranges:
            self.send_header("Accept-Ranges", "bytes")
            if code == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if self.server.drops.get(name, 0) > 0:
            self.server.drops[name] -= 1
            self.wfile.write(data[start : start + (end - start) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if self.server.trickles.get(name, 0) > 0:
            self.server.trickles[name] -= 1
            for i in range(start, end):
                with contextlib.suppress(OSError):
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                if self.server.stop.wait(self.server.trickle_s):
                    return
            return
        if self.server.stalls.get(name, 0) > 0:  # half the body, then nothing for a while, then the rest
            self.server.stalls[name] -= 1
            half = start + (end - start) // 2
            self.wfile.write(data[start:half])
            self.wfile.flush()
            if self.server.stop.wait(self.server.stall_s):
                return
            with contextlib.suppress(OSError):  # the client gave up meanwhile
                self.wfile.write(data[half:end])
            return
        if self.server.rewrites.get(name, 0) > 0:  # before the body: the client's next HEAD sees it
            self.server.rewrites[name] -= 1
            st = os.stat(path)
            with open(path, "r+b") as f:
                f.write(bytes([data[0] ^ 0xFF]))  # a new version: one byte changed
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # and its ETag (mtime)
        self.wfile.write(data[start:end])
        self.server.sent[name] = self.server.sent.get(name, 0) + end - start

    def do_HEAD(self) -> None:
        target = self._target()
        if target is None:
            return
        st = os.stat(target[1])
        self.send_response(200)
        self.send_header("Content-Length", str(st.st_size))
        self.send_header("ETag", f'"{st.st_mtime_ns}"')
        if self.server.says_no_ranges:
            self.send_header("Accept-Ranges", "none")
        if self.server.ranges:
            self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


class HttpServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    ranges = True
    says_no_ranges = False  # "Accept-Ranges: none" (with ranges off)

    def __init__(self, root: str) -> None:
        super().__init__(("127.0.0.1", 0), functools.partial(Handler, directory=root))
        self.gets: dict[str, int] = {}
        self.sent: dict[str, int] = {}  # bytes of bodies sent whole, per file
        self.drops: dict[str, int] = {}
        self.status: dict[str, int] = {}
        self.rewrites: dict[str, int] = {}
        self.stalls: dict[str, int] = {}  # requests for a name to stop sending mid-body, for stall_s
        self.stall_s = 5.0
        self.pages: dict[str, bytes] = {}
        self.trickles: dict[str, int] = {}
        self.trickle_s = 0.05
        self.grows: dict[str, int] = {}
        self.stop = threading.Event()  # set at shutdown: a stalled request ends

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def shard_gets(server: HttpServer) -> dict[str, int]:
    """GET requests per shard (``.bad.json`` lists looked for beside them left out)."""
    return {n: c for n, c in server.gets.items() if n.endswith(".tar")}


@pytest.fixture
def http_server() -> Iterator[Callable[..., HttpServer]]:
    """Starts loopback HTTP servers for one test: ``http_server(root, ranges=True)`` serves the
    folder ``root`` and returns the running server; every server it started is shut down when the
    test ends."""
    servers: list[HttpServer] = []

    def start(root: str, ranges: bool = True) -> HttpServer:
        srv = HttpServer(root)
        srv.ranges = ranges
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop.set()
        srv.shutdown()
        srv.server_close()
