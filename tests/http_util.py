"""The tests' one HTTP client for the lighthouse's dashboard and admin API (standard library only,
never through a proxy).

``call`` answers every status (4xx/5xx included) as an ``HttpResult`` instead of
raising; connection failures (refused, reset, timed out) raise ``OSError`` /
``http.client.HTTPException`` so a caller can tell "no answer" from "an answer".
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

JSON = "application/json"


@dataclass(frozen=True)
class HttpResult:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> str:
        return str(self.json["error"])


def call(
    url: str,
    method: str = "GET",
    path: str = "",
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    content_type: str | None = JSON,
    timeout: float = 10.0,
) -> HttpResult:
    """One request to ``url`` + ``path``; ``body`` is sent as JSON, ``raw`` as it is."""
    parts = urlsplit(url)
    target = (parts.path.rstrip("/") + "/" + path.lstrip("/")) if path else (parts.path or "/")
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = dict(headers or {})
        if data is not None and content_type is not None:
            hdrs.setdefault("Content-Type", content_type)
        # The server may refuse a body before reading it all; its answer is still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request(method, target, body=data, headers=hdrs)
        resp = conn.getresponse()
        payload = resp.read()
        return HttpResult(resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload)
    finally:
        conn.close()


def get_json(url: str, path: str, timeout: float = 10.0) -> Any:
    """GET ``path`` and return its JSON; AssertionError unless 200."""
    res = call(url, "GET", path, timeout=timeout)
    assert res.status == 200, f"GET {path} -> {res.status}: {res.body[:500]!r}"
    return res.json


def change(
    url: str,
    method: str,
    body: Any,
    *,
    if_match: int | None = None,
    path: str = "api/config",
    timeout: float = 10.0,
) -> HttpResult:
    """A PUT/PATCH (or rollback POST) of ``body`` as JSON, optionally with ``If-Match``."""
    headers = {} if if_match is None else {"If-Match": str(if_match)}
    return call(url, method, path, body, headers=headers, timeout=timeout)


def live(url: str) -> dict[str, Any]:
    """GET /api/config."""
    result: dict[str, Any] = get_json(url, "api/config")
    return result


def history(url: str, limit: int = 100_000) -> list[dict[str, Any]]:
    """Every stored version, newest first."""
    result: list[dict[str, Any]] = get_json(url, f"api/config/history?limit={limit}")["versions"]
    return result


def wait_healthy(url: str, timeout: float = 20.0) -> dict[str, Any]:
    """Poll ``GET /healthz`` until it answers 200 (the admin API may still be coming up)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            res = call(url, "GET", "healthz", timeout=2.0)
            if res.status == 200:
                result: dict[str, Any] = res.json
                return result
            last = res.status
        except (OSError, http.client.HTTPException) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}healthz not answering after {timeout}s (last: {last!r})")
        time.sleep(0.05)


def raw_exchange(host: str, port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh TCP connection, half-close, and read until the server closes.

    Raises AssertionError if the server neither answers nor closes within ``timeout``.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server may close (or reset) before reading it all: that is an answer
            pass
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{host}:{port} kept the connection open for {timeout}s after junk")
            sock.settimeout(remaining)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port
