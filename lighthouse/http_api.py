"""The lighthouse's dashboard and admin API over HTTP/1.1.

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
import hashlib
import hmac
import io
import json
import logging
import re
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from lighthouse.state import LighthouseState
from lighthouse.store import Change, NotFound, VersionConflict
from lighthouse.values import ConfigError, parse_json
from protos.rpc import dialable_address, parse_address

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
MAX_AUTHOR_CHARS = 64
MAX_COMMENT_CHARS = 500
DEFAULT_HISTORY_LIMIT = 100
MAX_HISTORY_LIMIT = 100_000
# How much of an unread (refused) body we swallow so the client can read our answer.
LINGER_BYTES = 4 * MAX_BODY_BYTES
LINGER_SECONDS = 2.0

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
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
PAGES = {"/": "dashboard.html", "/config": "config.html"}
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HttpError(Exception):
    """Answered as ``{"error": message, **extra}`` with ``status``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.extra = extra


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(status, body, "application/json", {"Cache-Control": "no-store", **(headers or {})})


def error_response(exc: HttpError) -> Response:
    return json_response({"error": exc.message, **exc.extra}, exc.status, exc.headers)


@dataclass
class Request:
    """One parsed request; the body is read only on demand, after its size is checked."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: Message
    rfile: io.BufferedIOBase
    params: tuple[str, ...] = ()
    body_read: bool = False

    def arg(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    def int_arg(self, name: str, minimum: int = 0) -> int | None:
        text = self.arg(name)
        if text is None:
            return None
        return parse_int(text, name, minimum)

    def json_body(self) -> Any:
        """The body as JSON: application/json, Content-Length <= 1 MiB, UTF-8."""
        ctype = self.headers.get("Content-Type", "")
        mime, _, rest = ctype.partition(";")
        charset = re.search(r"charset\s*=\s*\"?([\w-]+)", rest, re.IGNORECASE)
        if mime.strip().lower() != "application/json" or (
            charset and charset.group(1).lower() not in ("utf-8", "utf8")
        ):
            raise HttpError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "chunked bodies are not accepted: send Content-Length")
        lengths = set(self.headers.get_all("Content-Length") or [])
        if not lengths:
            raise HttpError(411, "Content-Length is required")
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,18}", next(iter(lengths)).strip()):
            raise HttpError(400, "invalid Content-Length")
        length = int(next(iter(lengths)))
        if length > MAX_BODY_BYTES:
            raise HttpError(413, f"body is {length} bytes (max {MAX_BODY_BYTES})")
        data = self.rfile.read(length)
        self.body_read = True
        if len(data) != length:
            raise HttpError(400, f"body ended after {len(data)} of {length} bytes")
        return parse_json(data, "body")

    def has_unread_body(self) -> bool:
        length = self.headers.get("Content-Length", "0").strip()
        chunked = bool(self.headers.get("Transfer-Encoding"))
        return not self.body_read and (chunked or (length.isdigit() and int(length) > 0))


def parse_int(text: str, name: str, minimum: int = 0) -> int:
    if not re.fullmatch(r"-?[0-9]{1,18}", text.strip()):
        raise HttpError(400, f"{name} must be an integer, got {text[:40]!r}")
    value = int(text)
    if value < minimum:
        raise HttpError(400, f"{name} must be >= {minimum}, got {value}")
    return value


def clean_text(text: str, limit: int) -> str:
    """Header/query text fit for the history: printable characters only, bounded."""
    with contextlib.suppress(UnicodeError):  # headers arrive decoded as latin-1; most clients send UTF-8
        text = text.encode("latin-1").decode("utf-8")
    return "".join(ch for ch in text if ch.isprintable()).strip()[:limit]


Handler = Callable[[Request], Response]


@dataclass(frozen=True)
class Route:
    pattern: re.Pattern[str]
    methods: dict[str, Handler]


class AdminApi:
    """Routes and their handlers, independent of the socket plumbing."""

    def __init__(self, state: LighthouseState, admin_token: str | None) -> None:
        self.state = state
        self._token = admin_token.encode() if admin_token else None
        self.assets = load_assets()
        table: list[tuple[str, dict[str, Handler]]] = [
            (r"/", {"GET": self.page}),
            (r"/config", {"GET": self.page}),
            (r"/static/([A-Za-z0-9_.-]+)", {"GET": self.static}),
            (r"/healthz", {"GET": self.healthz}),
            (r"/metrics", {"GET": self.metrics}),
            (r"/api/config", {"GET": self.get_config, "PUT": self.put_config, "PATCH": self.patch_config}),
            (r"/api/config/history", {"GET": self.history}),
            (r"/api/config/rollback", {"POST": self.rollback}),
            (r"/api/config/scheduled", {"GET": self.scheduled}),
            (r"/api/config/scheduled/([^/]+)", {"DELETE": self.cancel}),
            (r"/api/config/at-step/([^/]+)", {"GET": self.at_step}),
            (r"/api/managers", {"GET": self.managers}),
        ]
        self.routes = [Route(re.compile(p), m) for p, m in table]

    def dispatch(self, req: Request) -> Response:
        for route in self.routes:
            match = route.pattern.fullmatch(req.path)
            if match is None:
                continue
            method = "GET" if req.method == "HEAD" else req.method
            handler = route.methods.get(method)
            if handler is None:
                allow = sorted({*route.methods, *(["HEAD"] if "GET" in route.methods else [])})
                raise HttpError(
                    405, f"{req.method} is not allowed on {req.path}", headers={"Allow": ", ".join(allow)}
                )
            req.params = match.groups()
            return handler(req)
        raise HttpError(404, f"no such path: {req.path[:200]}")

    # ------------------------------------------------------------ auth
    def authorize(self, req: Request) -> str:
        """The author recorded for a change; raises 401 when a token is set and not presented."""
        if self._token is not None:
            scheme, _, presented = req.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not presented.strip():
                raise self._unauthorized("admin token required: send 'Authorization: Bearer <token>'")
            if not hmac.compare_digest(presented.strip().encode("utf-8", "replace"), self._token):
                raise self._unauthorized("wrong admin token")
        author = clean_text(req.headers.get("X-Author", ""), MAX_AUTHOR_CHARS)
        return author or ("token" if self._token is not None else "-")

    @staticmethod
    def _unauthorized(message: str) -> HttpError:
        return HttpError(401, message, headers={"WWW-Authenticate": 'Bearer realm="lighthouse"'})

    # ------------------------------------------------------------ pages
    def page(self, req: Request) -> Response:
        return self._asset(PAGES[req.path], req)

    def static(self, req: Request) -> Response:
        return self._asset(req.params[0], req)

    def _asset(self, name: str, req: Request) -> Response:
        asset = self.assets.get(name)
        if asset is None:
            raise HttpError(404, f"no such file: {name}")
        body, ctype, etag = asset
        headers = {"Cache-Control": "no-cache", "ETag": etag}
        if req.headers.get("If-None-Match") == etag:
            return Response(304, b"", ctype, headers)
        return Response(200, body, ctype, headers)

    # ------------------------------------------------------------ reads
    def healthz(self, req: Request) -> Response:
        return json_response({"status": "ok", "version": self.state.store.head})

    def get_config(self, req: Request) -> Response:
        return json_response(self.state.view())

    def history(self, req: Request) -> Response:
        limit = req.int_arg("limit", minimum=1) or DEFAULT_HISTORY_LIMIT
        return json_response({"versions": self.state.store.history(min(limit, MAX_HISTORY_LIMIT))})

    def scheduled(self, req: Request) -> Response:
        return json_response({"scheduled": self.state.store.scheduled()})

    def at_step(self, req: Request) -> Response:
        step = parse_int(req.params[0], "step")
        store = self.state.store
        head = store.head
        groups: dict[str, dict[str, Any]] = {}
        for replica, version in store.served_at(step).items():
            groups[replica] = {"version": version, "config": self._resolve_or_none(version, step)}
        return json_response(
            {"step": step, "version": head, "config": self._resolve_or_none(head, step), "groups": groups}
        )

    def _resolve_or_none(self, version: int, step: int) -> dict[str, Any] | None:
        try:
            return self.state.store.resolve(version, step)
        except NotFound:
            return None

    def managers(self, req: Request) -> Response:
        return json_response({"managers": self.state.managers(), "version": self.state.store.head})

    def metrics(self, req: Request) -> Response:
        state = self.state
        managers = state.managers()
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        metric("lighthouse_config_version", "gauge", "Latest config version.", [("", state.store.head)])
        metric(
            "lighthouse_get_config_calls_total",
            "counter",
            "GetConfig calls served.",
            [("", state.get_config_calls)],
        )
        metric(
            "lighthouse_heartbeat_calls_total",
            "counter",
            "Heartbeats received.",
            [("", state.heartbeat_calls)],
        )
        metric("lighthouse_managers", "gauge", "Managers ever heard from.", [("", len(managers))])
        metric(
            "lighthouse_config_file_error",
            "gauge",
            "1 while the config file cannot be loaded.",
            [("", int(state.file_error is not None))],
        )
        metric(
            "lighthouse_current_step",
            "gauge",
            "Highest step any manager reported.",
            [("", state.store.current_step)],
        )
        per_manager = [(f'{{replica_id="{_label(m["replica_id"])}"}}', m) for m in managers]
        metric(
            "lighthouse_manager_version",
            "gauge",
            "Version each manager serves.",
            [(labels, m["version"]) for labels, m in per_manager],
        )
        metric(
            "lighthouse_manager_last_seen_seconds",
            "gauge",
            "Seconds since each manager was last heard from.",
            [(labels, m["last_seen_s"]) for labels, m in per_manager],
        )
        body = ("\n".join(lines) + "\n").encode()
        return Response(200, body, METRICS_TYPE, {"Cache-Control": "no-store"})

    # ------------------------------------------------------------ changes
    def put_config(self, req: Request) -> Response:
        return self._change(req, "put")

    def patch_config(self, req: Request) -> Response:
        return self._change(req, "patch")

    def _change(self, req: Request, op: str) -> Response:
        author = self.authorize(req)
        effective_step = req.int_arg("effective_step")
        if_match = if_match_version(req.headers.get("If-Match"))
        comment = self._comment(req)
        body = req.json_body()
        row = self.state.change(
            op,
            body,
            source="api",
            author=author,
            comment=comment,
            effective_step=effective_step,
            if_match=if_match,
        )
        return self._changed(row)

    def rollback(self, req: Request) -> Response:
        author = self.authorize(req)
        comment = self._comment(req)
        body = req.json_body()
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise HttpError(400, 'body must be {"version": <integer>}')
        if isinstance(body, dict) and isinstance(body.get("comment"), str):
            comment = comment or clean_text(str(body["comment"]), MAX_COMMENT_CHARS)
        return self._changed(self.state.rollback(version, author=author, comment=comment))

    def cancel(self, req: Request) -> Response:
        author = self.authorize(req)
        version = parse_int(req.params[0], "version", minimum=1)
        try:
            row = self.state.cancel(version, author=author, comment=self._comment(req))
        except ConfigError as exc:  # not scheduled, already cancelled or already in effect
            raise HttpError(409, str(exc), version=self.state.store.head) from None
        return self._changed(row)

    @staticmethod
    def _comment(req: Request) -> str:
        return clean_text(req.arg("comment") or req.headers.get("X-Change-Comment") or "", MAX_COMMENT_CHARS)

    def _changed(self, row: Change) -> Response:
        store = self.state.store
        try:  # this version's config, even if later changes already landed
            config = store.resolve(row.version, store.current_step)
        except NotFound:  # pruned by a later change already
            config = row.config
        return json_response(
            {
                "version": row.version,
                "config": config,
                "op": row.op,
                "effective_step": row.effective_step,
                "created_at": row.created_at,
                "source": row.source,
                "author": row.author,
                "comment": row.comment,
            }
        )


def if_match_version(header: str | None) -> int | None:
    """``If-Match: 5`` or ``"5"`` (or ``W/"5"``); ``*`` or no header: no precondition."""
    if header is None or header.strip() in ("", "*"):
        return None
    text = header.strip().removeprefix("W/").strip('"')
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise HttpError(400, f"If-Match must be a version number, got {header[:40]!r}")
    return int(text)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def load_assets() -> dict[str, tuple[bytes, str, str]]:
    """Every file of lighthouse/static, in memory: a handful of small files, served without disk I/O."""
    assets: dict[str, tuple[bytes, str, str]] = {}
    folder = resources.files("lighthouse").joinpath("static")
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            data = entry.read_bytes()
            etag = '"' + hashlib.sha256(data).hexdigest()[:20] + '"'
            assets[entry.name] = (data, CONTENT_TYPES[suffix], etag)
    return assets


def error_answer(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


class _RequestHandler(BaseHTTPRequestHandler):
    """Thin socket layer: parse, dispatch to AdminApi, write; every failure is a JSON answer."""

    server: _HttpServer
    server_version = "lighthouse-config"
    protocol_version = "HTTP/1.1"
    timeout = 30  # an idle or stalled keep-alive connection frees its thread

    def version_string(self) -> str:
        return self.server_version  # not the Python version

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
            resp = self.server.api.dispatch(req)
        except HttpError as exc:
            resp = error_response(exc)
        except VersionConflict as exc:
            resp = error_response(HttpError(409, str(exc), version=exc.head))
        except NotFound as exc:
            resp = error_response(HttpError(404, str(exc)))
        except ConfigError as exc:
            resp = error_response(HttpError(400, str(exc)))
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            return
        except Exception:
            logger.exception("HTTP %s %s failed", self.command, parts.path[:200])
            resp = error_answer(500, "internal error (see the lighthouse log)")
        linger = req.has_unread_body()
        if linger or resp.status >= 400:
            self.close_connection = True
        self._write(resp)
        if linger:
            self._linger()
        logger.debug(
            "%s %s -> %d (%.1f ms)",
            self.command,
            parts.path[:200],
            resp.status,
            (time.monotonic() - started) * 1e3,
        )

    def _write(self, resp: Response) -> None:
        self.send_response(resp.status)
        headers = {
            **COMMON_HEADERS,
            "Content-Security-Policy": PAGE_CSP if resp.content_type.startswith("text/html") else API_CSP,
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

    def __init__(self, host: str, port: int, api: AdminApi) -> None:
        self.api = api
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

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("HTTP connection from %s failed", client_address, exc_info=True)


class DashboardServer:
    """Serves the dashboard and admin API from construction on, in a background thread.

    ``bind`` is ``host:port`` or ``[v6]:port``; port 0 picks a free port and
    ``url`` says which. ``[::]`` serves IPv6 and IPv4 (IPv4 only where the host
    has no IPv6).
    """

    def __init__(self, state: LighthouseState, bind: str, admin_token: str | None = None) -> None:
        host, port = parse_address(bind)
        if host in ("*", "[::]"):
            host = "::"
        api = AdminApi(state, admin_token)
        try:
            self._server = _HttpServer(host, port, api)
        except OSError as exc:
            if host != "::" or exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise OSError(f"cannot listen on {bind} (HTTP): {exc.strerror or exc}") from None
            logger.info("no IPv6 on this host (%s): dashboard on 0.0.0.0", exc)
            self._server = _HttpServer("0.0.0.0", port, api)
        bound_port = int(self._server.server_address[1])
        self.url = f"http://{dialable_address(bind, bound_port)}/"
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
