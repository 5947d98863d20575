"""A real S3-compatible server for the tests: `moto_server` on a free loopback port (session
fixture :func:`s3_endpoint`), and :class:`CountingProxy`, a TCP relay in front of it that counts
the bytes the server sends back — what a client really fetched, read-ahead included — and
:class:`FolderS3`, a minimal S3 server of a folder whose answers a test can bend (a 200 with the
whole object to a Range request, a 503 forever), counting the requests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, server: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A `moto_server` subprocess on a free loopback port; AWS_* point boto3 and s3fs at it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # s3fs caches its filesystems by constructor arguments, not by the endpoint they read from the environment:
    # one made while another test module's server was in AWS_ENDPOINT_URL (a module may import this fixture, so
    # a worker can hold two) would keep reading that server — a bucket just made here then "does not exist"
    _forget_s3_filesystems()
    try:
        wait_for_port(port, server, "moto_server")
        yield env["AWS_ENDPOINT_URL"]
    finally:
        server.terminate()
        server.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _forget_s3_filesystems()


def _forget_s3_filesystems() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


class CountingProxy:
    """A TCP relay on a free loopback port to ``target`` (an ``http://host:port``) counting the bytes
    sent back to clients (:attr:`down`: response headers and bodies, everything a client fetched)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.down = 0
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.down = 0

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if count:
                    with self.lock:
                        self.down += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()


class FolderS3:
    """A minimal S3-compatible server in a thread: ``HEAD``/``GET /BUCKET/KEY`` answered from
    ``folder/KEY`` (any bucket), ``Range`` honoured with a 206 and ``Content-Range`` — unless
    :attr:`answer` says otherwise. ``answer(method, key, range_header)`` returns ``None`` (behave) or
    what to do instead: ``"ignore-range"`` (200 with the whole object, as a server or proxy that drops
    ``Range`` does) or an HTTP status (the S3 error body of that status; 503 is ``SlowDown``). Every
    request is recorded in :attr:`requests` as ``(method, key, range_header)``. Use as a context
    manager: AWS_* point s3fs at it while it runs."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        import http.server
        from pathlib import Path

        self.folder = Path(folder)
        self.requests: list[tuple[str, str, str | None]] = []
        self.answer: Callable[[str, str, str | None], str | int | None] = lambda method, key, rng: None
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                owner._serve(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                owner._serve(self, head=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._saved: dict[str, str | None] = {}

    def _serve(self, handler: Any, *, head: bool) -> None:
        import re
        from urllib.parse import unquote, urlsplit

        path = unquote(urlsplit(handler.path).path).lstrip("/")
        key = path.split("/", 1)[1] if "/" in path else ""
        rng = handler.headers.get("Range")
        method = "HEAD" if head else "GET"
        self.requests.append((method, key, rng))
        what = self.answer(method, key, rng)
        target = self.folder / key
        if isinstance(what, int) or not key or not target.is_file():
            status = what if isinstance(what, int) else 404
            code, message = {503: ("SlowDown", "Please reduce your request rate."),
                             404: ("NoSuchKey", "The specified key does not exist.")}.get(
                status, ("InternalError", "We encountered an internal error. Please try again."))
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                    f"<Key>{key}</Key><RequestId>stub</RequestId></Error>").encode()
            handler.send_response(status)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(0 if head else len(body)))
            handler.end_headers()
            if not head:
                handler.wfile.write(body)
            return
        data = target.read_bytes()
        status, headers = 200, {"Accept-Ranges": "bytes"}
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if match and what != "ignore-range":
            start = int(match[1])
            end = min(int(match[2]) + 1 if match[2] else len(data), len(data))
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data, status = data[start:end], 206
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("ETag", '"stub"')
        handler.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
        handler.end_headers()
        if not head:
            handler.wfile.write(data)

    def __enter__(self) -> FolderS3:
        import s3fs

        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
               "AWS_DEFAULT_REGION": "us-east-1"}
        self._saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        s3fs.S3FileSystem.clear_instance_cache()
        return self

    def __exit__(self, *exc: object) -> None:
        import s3fs

        self.server.shutdown()
        self.server.server_close()
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()
