"""The HTTP server of the lighthouse's dashboard and admin API (routes in ``routes``, statuses in ``errors``).

Built on the standard library's ``http.server``: the API is a dozen JSON routes,
and every training cluster that runs a lighthouse would otherwise carry a web
framework for routing we can write as one table. What a framework would give
for free is done here explicitly: body limits checked before reading, JSON-only
changes (no cross-site form posts), bearer-token auth, security headers, and
JSON errors for everything, including malformed requests.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from lighthouse.jobs.registry import JobRegistry
from lighthouse.web.errors import http_error
from lighthouse.web.messages import (
    MAX_BODY_BYTES,
    HttpError,
    Request,
    Response,
    error_answer,
    error_response,
)
from lighthouse.web.routes import AdminApi, TorchftSnapshot
from protos.rpc import dialable_address, parse_address
from protos.tls import ServerCertificates, ssl_failure

logger = logging.getLogger(__name__)

# How much of an unread (refused) body we swallow so the client can read our answer.
LINGER_BYTES = 4 * MAX_BODY_BYTES
LINGER_SECONDS = 2.0
# A client that connects and says nothing must not hold a thread in the TLS handshake.
HANDSHAKE_SECONDS = 10.0
_PLAINTEXT_BODY = b'{"error": "this port serves HTTPS: use an https:// URL"}'
PLAINTEXT_ANSWER = (
    b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_PLAINTEXT_BODY), _PLAINTEXT_BODY)
)

PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
API_CSP = "default-src 'none'; frame-ancestors 'none'"
COMMON_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


# A whole request (line, headers and body) must arrive within this many seconds: a client that
# sends a byte now and then must not hold its thread for as long as it likes.
REQUEST_SECONDS = 30.0
# Connections served at once, one thread each; past it a connection gets 503 and is closed.
MAX_CONNECTIONS = 128
_FULL_BODY = b'{"error": "too many connections to this lighthouse; retry later"}'
FULL_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(_FULL_BODY), _FULL_BODY)
)


class _DeadlineReader(io.RawIOBase):
    """The socket's reads, each bounded by what is left of the request's deadline."""

    def __init__(self, sock: socket.socket, write_seconds: float) -> None:
        self._sock = sock
        self._write_seconds = write_seconds
        self.deadline = float("inf")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._write_seconds)  # the answer gets its own time


class _RequestHandler(BaseHTTPRequestHandler):
    """Thin socket layer: parse, dispatch to AdminApi, write; every failure is a JSON answer."""

    server: _HttpServer
    server_version = "lighthouse-config"
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body waits for the ACK of
    # the headers, which a kept-alive client delays (40 ms on Linux): every request cost 40 ms.
    disable_nagle_algorithm = True
    timeout = REQUEST_SECONDS  # replaced per read by what is left of the request's deadline

    def version_string(self) -> str:
        return self.server_version  # not the Python version

    def setup(self) -> None:
        super().setup()
        self._reader = _DeadlineReader(self.connection, self.timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        # The deadline covers the wait for the request too: an idle keep-alive connection ends with it.
        self._reader.deadline = time.monotonic() + self.server.request_seconds
        try:
            super().handle_one_request()
        finally:
            self._reader.deadline = float("inf")

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

    def _handle(self) -> None:
        started = time.monotonic()
        parts = urlsplit(self.path)
        req = Request(self.command, parts.path, {}, self.headers, self.rfile)
        try:
            try:
                req.query = parse_qs(parts.query, keep_blank_values=True, max_num_fields=50)
            except ValueError:
                raise HttpError(400, "too many query parameters (max 50)") from None
            req.content_length()  # a malformed one is a 400 whatever the route (the framing is unknown)
            resp = self.server.api.dispatch(req)
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            return
        except Exception as exc:
            error = http_error(exc)  # a refusal (an HttpError, a domain error in the table)
            if error is not None:
                resp = error_response(error)
            else:
                logger.exception("HTTP %s %s failed", self.command, parts.path[:200])
                resp = error_answer(500, "internal error (see the lighthouse log)")
        linger = req.has_unread_body()
        if linger or resp.status >= 400:
            self.close_connection = True
        self._write(resp, req.reply_headers)
        if linger:
            self._linger()
        logger.debug(
            "%s %s -> %d (%.1f ms)",
            self.command,
            parts.path[:200],
            resp.status,
            (time.monotonic() - started) * 1e3,
        )

    def _write(self, resp: Response, extra: dict[str, str] | None = None) -> None:
        self.send_response(resp.status)
        headers = {
            **COMMON_HEADERS,
            "Content-Security-Policy": PAGE_CSP if resp.content_type.startswith("text/html") else API_CSP,
            **(extra or {}),
            **resp.headers,
        }
        for name, value in headers.items():
            self.send_header(name, value)
        if resp.status != 304:
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD" and resp.status != 304:
            self.wfile.write(resp.body)

    def _linger(self) -> None:
        """Swallow (a bounded amount of) a refused body so the client sees our error instead of a reset."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            deadline = time.monotonic() + LINGER_SECONDS
            drained = 0
            while drained < LINGER_BYTES and time.monotonic() < deadline:
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Malformed requests (bad request line, huge headers, unknown method) get JSON too."""
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        if self.command is None:
            self.command = "GET"  # the request line was junk: still send a body
        with contextlib.suppress(OSError):
            self._write(error_answer(code, text))

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        host: str,
        port: int,
        api: AdminApi,
        tls: ServerCertificates | None,
        request_seconds: float = REQUEST_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.api = api
        self.tls = tls
        self.request_seconds = request_seconds
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _RequestHandler, bind_and_activate=False)
        try:
            if self.address_family == socket.AF_INET6 and host == "::":
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # also serve IPv4
            self.server_bind()
            self.server_activate()
        except BaseException:
            self.server_close()
            raise

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves our own name (getfqdn): a DNS lookup that can hang air-gapped.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, at most ``max_connections``: past it, 503 (plaintext) and close."""
        if not self._slots.acquire(blocking=False):
            logger.warning(
                "HTTP: %d connections open, refusing one from %s", self.max_connections, client_address[0]
            )
            with contextlib.suppress(OSError):
                if self.tls is None:
                    request.setblocking(False)  # the accept loop never waits for a client
                    request.send(FULL_ANSWER)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """With TLS, the handshake runs here, in the connection's thread, with the pair on disk now."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_SECONDS)
        conn = self.tls.ssl_context().wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        try:
            try:
                conn.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                logger.info("HTTPS handshake from %s failed: %s", client_address[0], ssl_failure(exc))
                if "HTTP_REQUEST" in str(exc):  # a browser or script on http://: say what to use
                    with contextlib.suppress(OSError):
                        socket.socket.sendall(conn, PLAINTEXT_ANSWER)
                _drain(conn)
                return
            super().finish_request(conn, client_address)
        finally:
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("HTTP connection from %s failed", client_address, exc_info=True)


def _drain(conn: ssl.SSLSocket) -> None:
    """After a refused handshake, read what the client already sent before closing: closing with
    unread data resets the connection, and the reset can destroy our alert (the client's only
    clue why) before the client reads it."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(conn, socket.SHUT_WR)
        socket.socket.settimeout(conn, 0.5)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and socket.socket.recv(conn, 65536):
            pass


class DashboardServer:
    """Serves the dashboard and admin API from construction on, in a background thread.

    ``bind`` is ``host:port`` or ``[v6]:port``; port 0 picks a free port and
    ``url`` says which. ``[::]`` serves IPv6 and IPv4 (IPv4 only where the host
    has no IPv6).
    """

    def __init__(
        self,
        jobs: JobRegistry,
        bind: str,
        admin_token: str | None = None,
        allowed_hosts: Iterable[str] = (),
        job_tokens: dict[str, list[str]] | None = None,
        tls: ServerCertificates | None = None,
        request_seconds: float = REQUEST_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
        torchft: TorchftSnapshot | None = None,
    ) -> None:
        host, port = parse_address(bind)
        if host in ("*", "[::]"):
            host = "::"
        # allowed: the name it bound too
        api = AdminApi(jobs, admin_token, [*allowed_hosts, host], job_tokens, torchft)
        try:
            self._server = _HttpServer(host, port, api, tls, request_seconds, max_connections)
        except OSError as exc:
            if host != "::" or exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise OSError(f"cannot listen on {bind} (HTTP): {exc.strerror or exc}") from None
            logger.info("no IPv6 on this host (%s): dashboard on 0.0.0.0", exc)
            self._server = _HttpServer("0.0.0.0", port, api, tls, request_seconds, max_connections)
        bound_port = int(self._server.server_address[1])
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{dialable_address(bind, bound_port)}/"
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="dashboard", daemon=True
        )
        self._thread.start()
        logger.info("dashboard on %s", self.url)

    def shutdown(self) -> None:
        """Stop accepting and close the socket; safe to call twice."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
