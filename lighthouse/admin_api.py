"""The admin API and the pages: one route table over the lighthouse's state.

Reads are open; changes need the admin token when one is set, a JSON body,
and they act through ``LighthouseState`` exactly like gRPC sees them.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lighthouse.http_messages import (
    HttpError,
    Request,
    Response,
    clean_text,
    if_match_version,
    json_response,
    parse_int,
)
from lighthouse.schema import SchemaViolation
from lighthouse.state import LighthouseState
from lighthouse.store import NotFound, Plan
from lighthouse.values import ConfigError

MAX_AUTHOR_CHARS = 64
MAX_COMMENT_CHARS = 500
DEFAULT_HISTORY_LIMIT = 100
MAX_HISTORY_LIMIT = 100_000
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
PAGES = {"/": "dashboard.html", "/config": "config.html"}
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


Handler = Callable[[Request], Response]


@dataclass(frozen=True)
class Route:
    pattern: re.Pattern[str]
    methods: dict[str, Handler]


class AdminApi:
    """Routes and their handlers, independent of the socket plumbing."""

    def __init__(
        self, state: LighthouseState, admin_token: str | None, allowed_hosts: Iterable[str] = ()
    ) -> None:
        self.state = state
        self._token = admin_token.encode() if admin_token else None
        self._allowed_hosts = {h.lower() for h in allowed_hosts} | _own_names()
        self.assets = load_assets()
        table: list[tuple[str, dict[str, Handler]]] = [
            (r"/", {"GET": self.page}),
            (r"/config", {"GET": self.page}),
            (r"/static/([A-Za-z0-9_.-]+)", {"GET": self.static}),
            (r"/healthz", {"GET": self.healthz}),
            (r"/metrics", {"GET": self.metrics}),
            (r"/api/config", {"GET": self.get_config, "PUT": self.put_config, "PATCH": self.patch_config}),
            (r"/api/config/history", {"GET": self.history}),
            (
                r"/api/config/schema",
                {"GET": self.get_schema, "PUT": self.put_schema, "DELETE": self.delete_schema},
            ),
            (r"/api/config/schema/history", {"GET": self.schema_history}),
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
        if self._token is None:
            self._check_host(req)
        if self._token is not None:
            scheme, _, presented = req.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not presented.strip():
                raise self._unauthorized("admin token required: send 'Authorization: Bearer <token>'")
            if not hmac.compare_digest(presented.strip().encode("utf-8", "replace"), self._token):
                raise self._unauthorized("wrong admin token")
        author = clean_text(req.headers.get("X-Author", ""), MAX_AUTHOR_CHARS)
        return author or ("token" if self._token is not None else "-")

    def _check_host(self, req: Request) -> None:
        """Without a token, changes are taken only under a Host this lighthouse answers to.

        A web page can make the browser of anyone who reaches the port send requests under
        its own (rebound) domain name; those name a foreign Host and are refused here.
        """
        host = _host_name(req.headers.get("Host", ""))
        if host in self._allowed_hosts or _is_ip_literal(host):
            return
        raise HttpError(
            403,
            f"changes are not accepted under Host {host[:100]!r} without an admin token (protection "
            "against DNS rebinding): use the lighthouse's address, start it with --allowed-host "
            f"{host[:100]}, or set --admin-token",
        )

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
            # Integers exactly (":g" would round counters past a million); floats as repr.
            lines.extend(f"{name}{labels} {value!r}" for labels, value in samples)

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
            [("", int(state.file_error is not None or state.schema.error is not None))],
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
        dry_run = _flag(req, "dry_run")
        body = req.json_body()
        plan = self.state.change(
            op,
            body,
            source="api",
            author=author,
            comment=comment,
            effective_step=effective_step,
            if_match=if_match,
            dry_run=dry_run,
        )
        return self._changed(plan, dry_run)

    def rollback(self, req: Request) -> Response:
        author = self.authorize(req)
        comment = self._comment(req)
        body = req.json_body()
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise HttpError(400, 'body must be {"version": <integer>}')
        if isinstance(body, dict) and isinstance(body.get("comment"), str):
            comment = comment or clean_text(str(body["comment"]), MAX_COMMENT_CHARS)
        dry_run = _flag(req, "dry_run")
        plan = self.state.rollback(version, author=author, comment=comment, dry_run=dry_run)
        return self._changed(plan, dry_run)

    def cancel(self, req: Request) -> Response:
        author = self.authorize(req)
        version = parse_int(req.params[0], "version", minimum=1)
        try:
            plan = self.state.cancel(version, author=author, comment=self._comment(req))
        except SchemaViolation:
            raise
        except ConfigError as exc:  # not scheduled, already cancelled or already in effect
            raise HttpError(409, str(exc), version=self.state.store.head) from None
        return self._changed(plan)

    # ------------------------------------------------------------ schema
    def get_schema(self, req: Request) -> Response:
        latest = self.state.store.schema()
        return json_response(latest or {"schema": None})

    def schema_history(self, req: Request) -> Response:
        limit = req.int_arg("limit", minimum=1) or DEFAULT_HISTORY_LIMIT
        return json_response({"schemas": self.state.store.schema_history(min(limit, MAX_HISTORY_LIMIT))})

    def put_schema(self, req: Request) -> Response:
        author = self.authorize(req)
        return self._set_schema(req, author, req.json_body())

    def delete_schema(self, req: Request) -> Response:
        return self._set_schema(req, self.authorize(req), None)

    def _set_schema(self, req: Request, author: str, document: Any) -> Response:
        answer = self.state.schema.set(
            document,
            source="api",
            author=author,
            comment=self._comment(req),
            force=_flag(req, "force"),
            dry_run=_flag(req, "dry_run"),
        )
        return json_response(answer)

    @staticmethod
    def _comment(req: Request) -> str:
        return clean_text(req.arg("comment") or req.headers.get("X-Change-Comment") or "", MAX_COMMENT_CHARS)

    @staticmethod
    def _changed(plan: Plan, dry_run: bool = False) -> Response:
        """The answer to a change, real or dry run alike: built from the one plan both use."""
        row = plan.row
        return json_response(
            {
                "version": row.version,
                "config": plan.live,  # this version's config at the job's step, as planned
                "changes": plan.changes(),
                "op": row.op,
                "effective_step": row.effective_step,
                "created_at": row.created_at,
                "source": row.source,
                "author": row.author,
                "comment": row.comment,
                "dry_run": dry_run,
            }
        )


def _flag(req: Request, name: str) -> bool:
    """``?name=1`` (true, yes, or a bare ``?name``); absent or 0: off.

    A bare ``?dry_run`` counts: a dry run asked for must never become a commit.
    """
    text = req.arg(name)
    if text is None:
        return False
    value = text.strip().lower()
    if value in ("0", "false", "no"):
        return False
    if value in ("", "1", "true", "yes"):
        return True
    raise HttpError(400, f"{name} must be 1 or 0, got {value[:20]!r}")


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


def _host_name(header: str) -> str:
    """The host part of a Host header (``name:port``, ``[v6]:port``), lower case."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _own_names() -> set[str]:
    """Names this machine answers to: a Host naming one of them is not a rebound domain."""
    names = {"localhost", socket.gethostname().lower()}
    with contextlib.suppress(OSError):
        names.add(socket.getfqdn().lower())
    return names
