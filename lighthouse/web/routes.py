"""The admin API and the pages: one route table over every job's state.

Every per-job route exists twice: ``/api/config...`` is the job ``default``,
``/api/jobs/{job}/config...`` any job (and ``/jobs/{job}`` its pages); the
prefix is taken off before routing, so both run the same handler.
Reads are open under an allowed Host; changes need a token when one is set (see ``access``), a JSON
body, and they act through ``LighthouseState`` exactly like gRPC sees them.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from lighthouse.config.values import MAX_JSON_DEPTH
from lighthouse.jobs.guards import GuardSpec, JobGuards
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.stall import gone_after
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.timeline import DEFAULT_SEGMENTS, timeline
from lighthouse.jobs.versions import ConfigStore, HistoryPage, NotFound, Plan
from lighthouse.store.backend import SharedBackend
from lighthouse.web.access import Access, author_of
from lighthouse.web.messages import (
    HttpError,
    Request,
    Response,
    clean_text,
    if_match_version,
    json_response,
    parse_int,
)
from lighthouse.web.ofrep import FLAGS_PATH, OfrepApi
from protos.job_ids import DEFAULT_JOB, check_job_id
from protos.limits import FOREVER

MAX_COMMENT_CHARS = 500
DEFAULT_HISTORY_LIMIT = 100
MAX_HISTORY_LIMIT = 100_000
# A history answer stops before this many bytes and names the next page (a config and its change
# are at most 1 MiB each, so one version always fits).
MAX_HISTORY_BYTES = 4 * 1024 * 1024
_HISTORY_ENTRIES_BYTES = MAX_HISTORY_BYTES - 256  # the rest is the answer around the entries
MAX_METRIC_POINTS = 10_000
# Blocking history queries (?after=V&wait=S, what `config watch` follows): each holds a thread.
MAX_WAIT_SECONDS = 60.0
MAX_WAITING_REQUESTS = 64
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
PAGES = {"/": "dashboard.html", "/config": "config.html"}
JOBS_PAGE = "jobs.html"
_JOB_PREFIX = re.compile(r"/(api/)?jobs/([^/]+)(/.*)?")
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


Handler = Callable[[Request], Response]
TorchftSnapshot = Callable[[], dict[str, Any]]
"""torchft's view (``lighthouse serve --torchft``): its latest quorum and the groups heartbeating."""


TOKEN_HEADER = "X-Lighthouse-Token"  # "not-needed": a token came for a job that needs none


@dataclass(frozen=True)
class Route:
    pattern: re.Pattern[str]
    methods: dict[str, Handler]


class AdminApi:
    """Routes and their handlers, independent of the socket plumbing."""

    def __init__(
        self,
        jobs: JobRegistry,
        admin_token: str | None,
        allowed_hosts: Iterable[str] = (),
        job_tokens: dict[str, list[str]] | None = None,
        torchft: TorchftSnapshot | None = None,
    ) -> None:
        self.jobs = jobs
        self._torchft = torchft
        self.access = Access(admin_token, job_tokens)
        self.ofrep = OfrepApi(jobs, self.check_read)
        self._allowed_hosts = {h.lower() for h in allowed_hosts} | _own_names()
        self.assets = load_assets()
        self._waiting = threading.BoundedSemaphore(MAX_WAITING_REQUESTS)
        table: list[tuple[str, dict[str, Handler]]] = [
            (r"/api/jobs", {"GET": self.list_jobs}),
            (r"/", {"GET": self.page}),
            (r"/config", {"GET": self.page, "PUT": self.put_config_form}),
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
            (r"/api/config/timeline", {"GET": self.timeline}),
            # /api/jobs/{job}/runs[/end] arrives as /api/runs[/end]
            (r"/api(?:/config)?/runs", {"GET": self.runs}),
            (r"/api(?:/config)?/runs/end", {"POST": self.end_run}),
            (r"/api/managers", {"GET": self.managers}),
            (r"/api/torchft", {"GET": self.torchft}),
            (r"/api/metrics", {"GET": self.training_metrics}),
            (r"/api/config/guards", {"GET": self.guards}),
            (r"/api/config/guards/([^/]+)", {"DELETE": self.cancel_guard}),
            # OFREP (OpenFeature's remote evaluation): reads that POST their context (see ``ofrep``)
            (re.escape(FLAGS_PATH), {"POST": self.ofrep.evaluate_flags}),
            (re.escape(FLAGS_PATH) + "/(.+)", {"POST": self.ofrep.evaluate_flag}),
        ]
        self.routes = [Route(re.compile(p), m) for p, m in table]
        self._job_routes = [
            Route(re.compile(r"/api/jobs/([^/]+)"), {"GET": self.get_job, "DELETE": self.delete_job})
        ]
        self._job_pages = [Route(re.compile(re.escape(p)), {"GET": self.job_page}) for p in PAGES]
        self._job_pages[list(PAGES).index("/config")].methods["PUT"] = self.put_config_form

    def dispatch(self, req: Request) -> Response:
        if req.method in ("GET", "HEAD") and req.path != "/healthz":
            self.check_read(req)
        routes = self.routes
        prefixed = _JOB_PREFIX.fullmatch(req.path)
        if prefixed is not None:
            req.job = check_job_id(prefixed.group(2))  # where an HTTP request's job id is checked
            rest = prefixed.group(3) or ""
            if prefixed.group(1) is None:  # a job's pages: /jobs/{job} and /jobs/{job}/config
                req.path = rest or "/"
                if req.path not in PAGES:
                    raise HttpError(404, f"no such page: {req.path[:200]}")
                routes = self._job_pages
            elif rest in ("", "/"):
                routes = self._job_routes
            else:
                # /api/jobs/{job}/schema... is the job's /api/config/schema...
                req.path = ("/api/config" if rest.startswith("/schema") else "/api") + rest
        for route in routes:
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

    # ------------------------------------------------------------ jobs
    def state(self, req: Request) -> LighthouseState:
        """The request's job; 404 when it does not exist."""
        return self.jobs.existing(req.job)

    def state_to_change(self, req: Request) -> LighthouseState:
        """The request's job, created by this change when it does not exist yet."""
        return self.jobs.serve(req.job)

    # ------------------------------------------------------------ auth
    def authorize(self, req: Request, admin_only: bool = False) -> str:
        """The author recorded for a change to ``req.job``; raises 401/403 when not allowed."""
        if not self.access.enforced(req.job):
            self._check_host(req, "changes are not accepted without a token", ", or set --admin-token")
        token = _bearer(req)
        if token and not self.access.enforced(req.job):
            req.reply_headers[TOKEN_HEADER] = "not-needed"  # said, not silently accepted
        credential = self.access.check(req.job, token, admin_only=admin_only)
        return author_of(req.headers.get("X-Author", ""), credential)

    def check_read(self, req: Request) -> None:
        """A read: under an allowed Host, or with a token of this lighthouse (what a rebound page lacks)."""
        if not self.access.valid(_bearer(req)):
            self._check_host(req, "this lighthouse does not answer")

    def _check_host(self, req: Request, refused: str, remedy: str = "") -> None:
        """Only under a Host this lighthouse answers to (its names, IP literals, --allowed-host).

        A web page can make the browser of anyone who reaches the port send requests under
        its own (rebound) domain name, and read the answers; those name a foreign Host.
        """
        host = _host_name(req.headers.get("Host", ""))
        if host in self._allowed_hosts or _is_ip_literal(host):
            return
        raise HttpError(
            403,
            f"{refused} under Host {host[:100]!r} (protection against DNS rebinding): use the "
            f"lighthouse's address, start it with --allowed-host {host[:100]}{remedy}",
        )

    # ------------------------------------------------------------ pages
    def page(self, req: Request) -> Response:
        name = PAGES[req.path]
        if req.path == "/" and req.job == DEFAULT_JOB and self.jobs.names() != [DEFAULT_JOB]:
            name = JOBS_PAGE  # several jobs: / lists them; with only "default", / is its dashboard
        return self._asset(name, req)

    def job_page(self, req: Request) -> Response:
        """/jobs/{job} and /jobs/{job}/config: that job's dashboard and editor (also for ``default``)."""
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
        """200 while the lighthouse serves configs; ``degraded`` (still 200: reads and leases go on)
        while its store cannot take writes for lack of space. On a shared store, whether step leases
        are granted (an earlier release live on the prefix suspends them: peers.features)."""
        problem = self.jobs.backend.space_problem()
        body: dict[str, Any] = {"status": "ok", "version": self.jobs.default.store.head}
        if problem is not None:  # the healthy answer stays as it was
            body.update(status="degraded", store="full", store_problem=problem)
        if isinstance(self.jobs.backend, SharedBackend):
            gate = self.jobs.lease_gate
            body["step_leases"] = "suspended" if gate.suspended else "granted"
            body["step_leases_suspended_by"] = list(gate.suspended_by)
        return json_response(body)

    def list_jobs(self, req: Request) -> Response:
        return json_response({"jobs": self.jobs.overview()})

    def get_job(self, req: Request) -> Response:
        return json_response(self.jobs.summary(self.state(req)))

    def delete_job(self, req: Request) -> Response:
        author = self.authorize(req, admin_only=True)
        self.jobs.delete(req.job)
        return json_response({"deleted": req.job, "author": author})

    def get_config(self, req: Request) -> Response:
        return json_response(self.state(req).view())

    def history(self, req: Request) -> Response:
        """Newest first (``before=V``: older than V); with ``after=V`` the versions after V, oldest
        first (a feed), and with ``wait=S`` too, answered as soon as one exists or empty after S
        seconds (a blocking query). Pages: see ``_history_page``."""
        limit = min(req.int_arg("limit", minimum=1) or DEFAULT_HISTORY_LIMIT, MAX_HISTORY_LIMIT)
        after = req.int_arg("after")
        before = req.int_arg("before")
        wait = _seconds_arg(req, "wait", MAX_WAIT_SECONDS)
        state = self.state(req)
        if after is None:
            if wait:
                raise HttpError(400, "wait needs after=VERSION (the version you hold)")
            return _history_page(
                state.store.history_page(limit, _HISTORY_ENTRIES_BYTES, before=before), "before", state.store
            )
        if before is not None:
            raise HttpError(400, "before and after do not go together")
        if wait and state.store.head <= after:
            if not self._waiting.acquire(blocking=False):
                raise HttpError(
                    503,
                    f"{MAX_WAITING_REQUESTS} requests are waiting on this lighthouse already; retry later",
                    headers={"Retry-After": "1"},
                )
            try:
                state.wait_for_version(after, wait)
            finally:
                self._waiting.release()
        page = state.store.history_page(limit, _HISTORY_ENTRIES_BYTES, after=after)
        return _history_page(page, "after", state.store)

    def scheduled(self, req: Request) -> Response:
        return json_response({"scheduled": self.state(req).store.scheduled()})

    def at_step(self, req: Request) -> Response:
        step = parse_int(req.params[0], "step")
        store = self.state(req).store
        head = store.head
        groups: dict[str, dict[str, Any]] = {}
        for replica, version in store.served_at(step).items():
            groups[replica] = {"version": version, "config": _resolve_or_none(store, version, step)}
        return json_response(
            {"step": step, "version": head, "config": _resolve_or_none(store, head, step), "groups": groups}
        )

    def timeline(self, req: Request) -> Response:
        limit = req.int_arg("limit", minimum=1) or DEFAULT_SEGMENTS
        return json_response(timeline(self.state(req).store, min(limit, MAX_HISTORY_LIMIT)))

    def runs(self, req: Request) -> Response:
        state = self.state(req)
        return json_response({"runs": state.runs(), "current_step": state.store.current_step})

    def end_run(self, req: Request) -> Response:
        """POST runs/end: the operator (or the training script) ends the live run: its step leases
        end, a change made now applies at once, the next stepping manager begins the next run."""
        author = self.authorize(req)
        state = self.state(req)
        reason = f"ended by {author}"
        comment = self._comment(req)
        run = state.end_run(f"{reason}: {comment}" if comment else reason)
        if run is None:
            raise HttpError(409, "no run of this job is live (it ended already, or never began)")
        return json_response({"ended": run.to_json(), "runs": state.runs()})

    def managers(self, req: Request) -> Response:
        state = self.state(req)
        live, pending = state.live_and_pending()
        answer = {"managers": state.managers(), "version": state.store.head}
        return json_response({**answer, "live_version": live, "pending": pending})

    def torchft(self, req: Request) -> Response:
        """GET /api/torchft: the quorum torchft's lighthouse formed on this port (every job's
        groups: torchft's lighthouse knows no jobs); ``{"torchft": null}`` without ``--torchft``."""
        return json_response({"torchft": self._torchft() if self._torchft is not None else None})

    def training_metrics(self, req: Request) -> Response:
        """GET /api/metrics?name=loss&from_step=A&to_step=B[&max_points=N][&groups=1]: the job's
        reported metrics per step (``name`` repeatable; none: every metric)."""
        names = [n for value in req.query.get("name", []) for n in value.split(",") if n] or None
        first = req.int_arg("from_step") or 0
        last = req.int_arg("to_step")
        max_points = req.int_arg("max_points", minimum=1)
        answer = self.state(req).series.query(
            names,
            first,
            FOREVER if last is None else last,
            min(max_points, MAX_METRIC_POINTS) if max_points is not None else None,
            groups=_flag(req, "groups"),
        )
        return json_response(answer)

    def guards(self, req: Request) -> Response:
        return json_response({"guards": self.state(req).guards.list()})

    def cancel_guard(self, req: Request) -> Response:
        author = self.authorize(req)
        version = parse_int(req.params[0], "version", minimum=1)
        return json_response({"guard": self.state(req).guards.cancel(version, author)})

    def metrics(self, req: Request) -> Response:
        lines: list[str] = []
        states = self.jobs.states()

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            # Integers exactly (":g" would round counters past a million); floats as repr.
            lines.extend(f"{name}{labels} {value!r}" for labels, value in samples)

        per_job = [(f'{{job="{_label(st.job)}"}}', st) for st in states]
        local = {st.job: st.local_managers() for st in states}  # read once for both series

        def job_metric(
            name: str, kind: str, help_text: str, value: Callable[[LighthouseState], float]
        ) -> None:
            metric(name, kind, help_text, [(labels, value(st)) for labels, st in per_job])

        metric(
            "lighthouse_store_writable",
            "gauge",
            "1 while the store can take edits, 0 while it has no space for them.",
            [("", 0 if self.jobs.backend.space_problem() is not None else 1)],
        )
        job_metric("lighthouse_config_version", "gauge", "Latest config version.", lambda st: st.store.head)
        job_metric(
            "lighthouse_get_config_calls_total",
            "counter",
            "GetConfig calls served.",
            lambda st: st.get_config_calls,
        )
        job_metric(
            "lighthouse_heartbeat_calls_total",
            "counter",
            "Heartbeats received.",
            lambda st: st.heartbeat_calls,
        )
        job_metric(
            "lighthouse_watch_streams",
            "gauge",
            "Push streams (WatchConfig) of managers open now.",
            lambda st: st.open_streams,
        )
        job_metric(
            "lighthouse_watch_messages_total",
            "counter",
            "Requests received on push streams (managers' reports and step-lease renewals).",
            lambda st: st.watch_messages,
        )
        # Managers this lighthouse hears from itself: scraping every lighthouse of a shared store
        # then counts each manager once (the dashboard and /api/managers show them all).
        job_metric(
            "lighthouse_managers",
            "gauge",
            "Managers ever heard from by this lighthouse.",
            lambda st: len(local[st.job]),
        )
        wall = time.time()
        # Heard from lately: within the bound after which a job counts them gone (lighthouse.jobs.stall).
        heard = {job: [m for m in ms if wall - m["seen_at"] <= gone_after(m)] for job, ms in local.items()}
        job_metric(
            "lighthouse_managers_fallback",
            "gauge",
            "Managers heard from lately whose last report said their workers get the fallback: no "
            "config from a lighthouse, or steps past the step lease (with --serve-stale, the last good one).",
            lambda st: sum(m["fallback"] for m in heard[st.job]),
        )
        job_metric(
            "lighthouse_managers_polling",
            "gauge",
            "Managers heard from lately without an open push stream: they poll, so a change reaches "
            "them within their cache TTL, not at once.",
            lambda st: sum(m["mode"] == "poll" for m in heard[st.job]),
        )
        job_metric(
            "lighthouse_config_file_error",
            "gauge",
            "1 while the config file cannot be loaded.",
            lambda st: int(st.file_error is not None or st.schema.error is not None),
        )
        job_metric(
            "lighthouse_job_stalled",
            "gauge",
            "1 while the job is stalled: every manager gone, or no step progress (see /api/jobs for why).",
            lambda st: int(st.stall() is not None),
        )
        job_metric(
            "lighthouse_current_step",
            "gauge",
            "Highest step any manager reported.",
            lambda st: st.store.current_step,
        )
        job_metric(
            "lighthouse_run",
            "gauge",
            "Number of the job's latest run (0: none yet); it moves when a run begins.",
            lambda st: st.store.runs.number,
        )
        job_metric(
            "lighthouse_run_live",
            "gauge",
            "1 while a run of the job is live, 0 before its first and between runs (a paused job).",
            lambda st: int(st.store.runs.live is not None),
        )
        job_metric(
            "lighthouse_lease_horizon",
            "gauge",
            "Highest step the job's groups may have been promised (-1: none): changes made now apply after.",
            lambda st: st.store.leases.horizon,
        )
        job_metric(
            "lighthouse_lease_ceiling_writes_total",
            "counter",
            "Step-lease ceilings this lighthouse stored (the store writes leases cost).",
            lambda st: st.store.leases.ceiling_writes,
        )
        job_metric(
            "lighthouse_late_switches_total",
            "counter",
            "Changes a replica group took up after their effective step (it trained steps of the change "
            "on the config before), as this lighthouse heard the group's switches.",
            lambda st: st.late_switches,
        )
        job_metric(
            "lighthouse_guard_rollbacks_total",
            "counter",
            "Guards this lighthouse found regressed, each rolling its change back "
            "(`lighthouse config guards` says how it went).",
            lambda st: st.guards.rollbacks,
        )
        metric(
            "lighthouse_store_write_failures_total",
            "counter",
            "Changes the store refused to commit (nothing stored), by reason: no_space (answered 507) "
            "or unavailable (no etcd quorum, 503).",
            [
                (f'{{job="{_label(st.job)}",reason="{reason}"}}', count)
                for st in states
                for reason, count in sorted(st.store.write_failures.items())
            ],
        )
        per_manager = [
            (f'{{job="{_label(st.job)}",replica_id="{_label(m["replica_id"])}"}}', m)
            for st in states
            for m in local[st.job]
        ]
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
            [(labels, round(max(0.0, wall - m["seen_at"]), 3)) for labels, m in per_manager],
        )
        metric(
            "lighthouse_manager_steps_past_lease_total",
            "counter",
            "Steps each manager's workers asked for past its step lease that got no confirmed config "
            "(the fallback, or with --serve-stale the last good one), as the manager reports them.",
            [(labels, m["steps_past_lease"]) for labels, m in per_manager],
        )
        # What training reports: each metric at its newest step (NaN when none of its values was finite).
        last = [
            (f'{{job="{_label(st.job)}",name="{name}"}}', value)
            for st in states
            for name, value in sorted(st.series.last_values().items())
        ]
        metric(
            "lighthouse_training_metric",
            "gauge",
            "Mean across replica groups of a reported metric at its newest step.",
            [(labels, v.mean if v.mean is not None else math.nan) for labels, v in last],
        )
        metric(
            "lighthouse_training_metric_step",
            "gauge",
            "Newest step a metric was reported for.",
            [(labels, v.step) for labels, v in last],
        )
        metric(
            "lighthouse_step_leases_suspended",
            "gauge",
            "1 while a lighthouse on the store that does not honour step leases is live: none are granted.",
            [("", int(self.jobs.lease_gate.suspended))],
        )
        metric(
            "lighthouse_peers",
            "gauge",
            "Other lighthouses live on this lighthouse's etcd prefix (0 on SQLite).",
            [("", len(self.jobs.peer_lighthouses()))],
        )
        body = ("\n".join(lines) + "\n").encode()
        return Response(200, body, METRICS_TYPE, {"Cache-Control": "no-store"})

    # ------------------------------------------------------------ changes
    def put_config(self, req: Request) -> Response:
        return self._change(req, "put")

    def patch_config(self, req: Request) -> Response:
        return self._change(req, "patch")

    def put_config_form(self, req: Request) -> Response:
        """``PUT /config`` with form field ``config`` (the seed's editor page): ``PUT /api/config``'s
        rules, answered with a redirect to the editor. A cross-site page cannot send it: a form
        only GETs and POSTs, and a script's PUT needs a CORS preflight this server never grants."""
        answer = self._change(req, "put", lambda: req.form_json("config"))
        page = "/config" if req.job == DEFAULT_JOB else f"/jobs/{req.job}/config"
        return Response(303, answer.body, answer.content_type, {**answer.headers, "Location": page})

    def _change(self, req: Request, op: str, read_body: Callable[[], Any] | None = None) -> Response:
        author = self.authorize(req)
        effective_step = req.int_arg("effective_step")
        if_match = if_match_version(req.headers.get("If-Match"))
        comment = self._comment(req)
        dry_run = _flag(req, "dry_run")
        allow_type_change = _flag(req, "allow_type_change")
        spec = self._guard_spec(req)
        body = read_body() if read_body is not None else req.json_body()
        state = self.state_to_change(req)

        def change(dry_run: bool) -> Plan:
            return state.change(
                op,
                body,
                source="api",
                author=author,
                comment=comment,
                effective_step=effective_step,
                if_match=if_match,
                dry_run=dry_run,
                allow_type_change=allow_type_change,
            )

        if spec is None:
            return self._changed(req, change(dry_run), dry_run)
        JobGuards.draft(change(True), spec, author)  # refused before anything is stored
        plan = change(dry_run)
        guard = JobGuards.draft(plan, spec, author)
        if not dry_run:
            state.guards.add(guard)
        return self._changed(req, plan, dry_run, guard)

    @staticmethod
    def _guard_spec(req: Request) -> GuardSpec | None:
        """``?guard=loss:1.5[&guard_steps=200][&guard_window=10]`` (None without ``guard``)."""
        text = req.arg("guard")
        if text is None:
            if req.arg("guard_steps") is not None or req.arg("guard_window") is not None:
                raise HttpError(400, "guard_steps and guard_window go with guard=METRIC:FACTOR")
            return None
        return GuardSpec.parse(
            text, req.int_arg("guard_steps", minimum=1), req.int_arg("guard_window", minimum=1)
        )

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
        plan = self.state(req).rollback(version, author=author, comment=comment, dry_run=dry_run)
        return self._changed(req, plan, dry_run)

    def cancel(self, req: Request) -> Response:
        author = self.authorize(req)
        version = parse_int(req.params[0], "version", minimum=1)
        plan = self.state(req).cancel(version, author=author, comment=self._comment(req))
        return self._changed(req, plan)

    # ------------------------------------------------------------ schema
    def get_schema(self, req: Request) -> Response:
        latest = self.state(req).store.schema()
        return json_response(latest or {"schema": None})

    def schema_history(self, req: Request) -> Response:
        limit = req.int_arg("limit", minimum=1) or DEFAULT_HISTORY_LIMIT
        return json_response({"schemas": self.state(req).store.schema_history(min(limit, MAX_HISTORY_LIMIT))})

    def put_schema(self, req: Request) -> Response:
        author = self.authorize(req)
        return self._set_schema(req, author, req.json_body())

    def delete_schema(self, req: Request) -> Response:
        return self._set_schema(req, self.authorize(req), None)

    def _set_schema(self, req: Request, author: str, document: Any) -> Response:
        answer = self.state_to_change(req).schema.set(
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

    def _changed(
        self, req: Request, plan: Plan, dry_run: bool = False, guard: dict[str, Any] | None = None
    ) -> Response:
        """The answer to a change, real or dry run alike: built from the one plan both use."""
        row = plan.row
        served = plan.served()
        extra = {"guard": guard} if guard is not None else {}
        return json_response(
            {
                "job": req.job,
                "version": row.version,
                "config": row.config,  # this version's: every change up to it applied (its history entry's)
                "from_step": plan.from_step,  # where every group has that config (None: at the job's step)
                "live_version": served.version or None,  # what groups get at the job's step (None: pruned)
                "live": served.config,
                "changes": plan.changes(),
                "op": row.op,
                "effective_step": row.effective_step,  # where every group switches (None: at once)
                "scheduled": row.scheduled,
                "created_at": row.created_at,
                "source": row.source,
                "author": row.author,
                "comment": row.comment,
                "dry_run": dry_run,
                **extra,
            }
        )


def _history_page(page: HistoryPage, direction: str, store: ConfigStore) -> Response:
    """``next_before`` (``next_after`` for a feed) when more versions lie past this page: ask with
    it for them; ``truncated`` when the byte budget ended the page before ``limit``. ``runs``: where
    each run began (after version ``base_version``, at step ``start_step``); ``retention``: where
    the history was cut (``ConfigStore.retention``)."""
    answer: dict[str, Any] = {
        "versions": page.versions,
        "runs": store.runs.to_json(),
        "retention": store.retention(),
    }
    if page.more:
        answer[f"next_{direction}"] = page.versions[-1]["version"]
    if page.truncated:
        answer["truncated"] = True
    return json_response(answer)


def _resolve_or_none(store: ConfigStore, version: int, step: int) -> dict[str, Any] | None:
    try:
        return store.resolve(version, step)
    except NotFound:
        return None


def _seconds_arg(req: Request, name: str, maximum: float) -> float:
    """``?name=S``: non-negative seconds, at most ``maximum`` (a longer wait is shortened); 0 when absent."""
    text = req.arg(name)
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise HttpError(400, f"{name} must be a number of seconds >= 0, got {text[:20]!r}")
    return min(value, maximum)


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
    """Every file of lighthouse/web/static, in memory: a handful of small files, served without disk I/O.

    Pages get the lighthouse's nesting limit, so the dashboard's parser refuses exactly what it does."""
    assets: dict[str, tuple[bytes, str, str]] = {}
    folder = resources.files("lighthouse.web").joinpath("static")
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            data = entry.read_bytes()
            if suffix == ".html":
                data = data.replace(b"{{MAX_JSON_DEPTH}}", str(MAX_JSON_DEPTH).encode())
            etag = '"' + hashlib.sha256(data).hexdigest()[:20] + '"'
            assets[entry.name] = (data, CONTENT_TYPES[suffix], etag)
    return assets


def _bearer(req: Request) -> str:
    """The token of ``Authorization: Bearer <token>`` ("" without one)."""
    scheme, _, presented = req.headers.get("Authorization", "").strip().partition(" ")
    return presented.strip() if scheme.lower() == "bearer" else ""


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
