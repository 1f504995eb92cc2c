"""A small client for the lighthouse admin API (stdlib urllib: nothing to install on a login node).

It is what the ``lighthouse config`` commands use, and what a controller (a
process that reads a job's metrics and changes its config: see
``examples/adaptive_sync.py``) uses too::

    from lighthouse.admin.client import AdminClient

    admin = AdminClient("http://lh-host:29511", token=TOKEN, job="llama-70b", author="my-controller")
    loss = admin.metrics("loss", from_step=1000)["metrics"]["loss"]   # [{"step", "mean", ...}, ...]
    admin.patch({"lr": 2e-4}, comment="controller: loss plateaued", guard="loss:1.5", guard_steps=200)
    admin.guards()["guards"]                                          # active, passed, triggered, lapsed

Every method returns the decoded JSON answer and raises ``AdminError`` (with the
HTTP status, 0 when the lighthouse cannot be reached) on a refusal. Given several
lighthouses (``"http://A:29511,http://B:29511"``, lighthouses on one store), it uses
the first that answers and stays with it.
"""

from __future__ import annotations

import copy
import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from protos.job_ids import DEFAULT_JOB, check_job_id
from protos.rpc import DEFAULT_DASHBOARD_PORT, DEFAULT_LIGHTHOUSE_PORT
from protos.tls import TLSConfig, tls_reason

DEFAULT_URL = f"http://localhost:{DEFAULT_DASHBOARD_PORT}"
WATCH_WAIT_SECONDS = 30.0  # one blocking query of follow(); the lighthouse caps it at 60 s
BUSY_RETRY_SECONDS = 1.0  # the Retry-After of a lighthouse whose waiting slots are all taken


class AdminError(Exception):
    """The API refused a request (``status`` is the HTTP status) or could not be reached (``status`` 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/]`` -> ``http://host:port``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def split_urls(urls: str) -> list[str]:
    """``"A,B"`` -> ``["http://A", "http://B"]``; ValueError when none is given."""
    items = [normalize_url(u) for u in urls.split(",") if u.strip()]
    if not items:
        raise ValueError(f"no lighthouse URL in {urls!r}")
    return items


class _NotSent(Exception):
    """The request never reached this lighthouse (refused, unreachable, TLS): safe to send elsewhere."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NoAnswer(Exception):
    """The request was sent but no answer came (timeout, connection dropped)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AdminClient:
    """One method per admin endpoint; every method returns the decoded JSON answer.

    ``url`` may list several lighthouses (comma-separated): a call goes to the one
    that answered last and moves on to the next when it is unreachable (a read also
    when it does not answer in time; a change only when it was never sent, so it is
    never applied twice). An ``https://`` URL verifies the lighthouse against
    ``tls.ca`` (the system's roots without one) and presents ``tls.cert`` when
    mutual TLS asks for it. ``author`` names who makes the changes in the history
    (a controller's name).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        timeout: float = 10.0,
        *,
        tls: TLSConfig | None = None,
        job: str = DEFAULT_JOB,
        author: str | None = None,
    ) -> None:
        self.urls = split_urls(url)
        self._current = 0
        self.author = author  # recorded with every change (X-Author), e.g. the controller's name
        self.job = check_job_id(job)
        # The job default keeps the unprefixed routes: they work on every lighthouse release.
        self._api = "/api" if self.job == DEFAULT_JOB else f"/api/jobs/{self.job}"
        self.token = token
        self.token_not_needed = False  # set when a lighthouse answered that this job needs no token
        self.timeout = timeout
        # Admin traffic stays inside the cluster: an http_proxy meant for the internet must not capture it.
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if tls is not None:
            handlers.append(urllib.request.HTTPSHandler(context=tls.ssl_context()))
        self._opener = urllib.request.build_opener(*handlers)

    @property
    def url(self) -> str:
        """The lighthouse calls go to first (the one that answered last)."""
        return self.urls[self._current]

    # ------------------------------------------------------------ reads
    def show(self) -> dict[str, Any]:
        return self._call("GET", f"{self._api}/config")

    def history(self, limit: int = 100) -> dict[str, Any]:
        """The newest ``limit`` versions, newest first: as many pages as that takes (a page
        stops at the lighthouse's byte budget and names the next with ``next_before``)."""
        versions: list[dict[str, Any]] = []
        query: dict[str, Any] = {"limit": limit}
        while True:
            answer = self._call("GET", f"{self._api}/config/history", query=query)
            versions.extend(answer["versions"])
            following = answer.get("next_before")
            if following is None or len(versions) >= limit:
                page = {"versions": versions[:limit], "runs": answer.get("runs", [])}
                if "retention" in answer:  # where the history was cut (a lighthouse before it: none)
                    page["retention"] = answer["retention"]
                return page
            query = {"limit": limit - len(versions), "before": following}

    def versions_after(self, version: int, limit: int = 100, wait: float = 0.0) -> list[dict[str, Any]]:
        """The versions after ``version``, oldest first; with ``wait``, a blocking query: answered as
        soon as one exists, or empty after ``wait`` seconds."""
        query = {"after": version, "limit": limit, "wait": f"{wait:g}" if wait else None}
        answer = self._call("GET", f"{self._api}/config/history", query=query, extra_time=wait)
        versions: list[dict[str, Any]] = answer["versions"]
        return versions

    def version(self, version: int) -> dict[str, Any]:
        """One version's history entry; AdminError 404 when it was pruned or never existed."""
        found = self.versions_after(version - 1, limit=1)
        if not found or found[0]["version"] != version:
            raise AdminError(404, f"version {version} is not in the history (never made, or pruned)")
        return found[0]

    def follow(self, after: int, wait: float = WATCH_WAIT_SECONDS) -> Iterator[dict[str, Any]]:
        """Every version after ``after`` as it lands, in order, none missed, forever (blocking
        queries: no polling). Raises AdminError when no listed lighthouse answers any more; a
        lighthouse with every waiting slot taken (503) is asked again a second later."""
        while True:
            try:
                versions = self.versions_after(after, wait=wait)
            except AdminError as exc:
                if exc.status != 503:
                    raise
                time.sleep(BUSY_RETRY_SECONDS)
                continue
            for entry in versions:
                after = max(after, int(entry["version"]))
                yield entry

    def scheduled(self) -> dict[str, Any]:
        return self._call("GET", f"{self._api}/config/scheduled")

    def at_step(self, step: int) -> dict[str, Any]:
        return self._call("GET", f"{self._api}/config/at-step/{int(step)}")

    def managers(self) -> dict[str, Any]:
        return self._call("GET", f"{self._api}/managers")

    def jobs(self) -> dict[str, Any]:
        return self._call("GET", "/api/jobs")

    def job_info(self) -> dict[str, Any]:
        """This client's job as ``lighthouse jobs`` lists it; AdminError 404 when it does not exist."""
        return self._call("GET", f"/api/jobs/{self.job}")

    def for_job(self, job: str) -> AdminClient:
        """The same lighthouses, credentials and connection settings, for another job."""
        other = copy.copy(self)
        other.job = check_job_id(job)
        other._api = "/api" if other.job == DEFAULT_JOB else f"/api/jobs/{other.job}"
        return other

    def delete_job(self) -> dict[str, Any]:
        """Remove this client's job and its history (admin token)."""
        return self._call("DELETE", f"/api/jobs/{self.job}")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")

    def metrics(
        self,
        *names: str,
        from_step: int | None = None,
        to_step: int | None = None,
        max_points: int | None = None,
        groups: bool = False,
    ) -> dict[str, Any]:
        """The job's reported metrics (``names``, or every one) per step:
        ``{"metrics": {"loss": [{"step", "mean", "min", "max", "count", "nonfinite"}, ...]}}``.

        Older steps come as buckets (``to_step`` says up to where); ``max_points`` merges
        neighbours down to that many points; ``groups`` adds each group's recent steps.
        """
        query: dict[str, Any] = {
            "name": ",".join(names) or None,
            "from_step": from_step,
            "to_step": to_step,
            "max_points": max_points,
            "groups": 1 if groups else None,
        }
        return self._call("GET", f"{self._api}/metrics", query=query)

    def guards(self) -> dict[str, Any]:
        """The job's guarded changes, newest first, each with its status: active, passed,
        triggered (with the rollback version and the reason), lapsed (not judged, with the reason)
        or cancelled."""
        return self._call("GET", f"{self._api}/config/guards")

    def cancel_guard(self, version: int) -> dict[str, Any]:
        """Stop guarding version ``version``: its change stays, nothing rolls it back."""
        return self._call("DELETE", f"{self._api}/config/guards/{int(version)}")

    def schema(self) -> dict[str, Any]:
        return self._call("GET", f"{self._api}/config/schema")

    def schema_history(self, limit: int = 100) -> dict[str, Any]:
        return self._call("GET", f"{self._api}/config/schema/history", query={"limit": limit})

    def put_schema(
        self, schema: Any, force: bool = False, dry_run: bool = False, comment: str | None = None
    ) -> dict[str, Any]:
        """Replace the job's JSON Schema; refused (422) while the config violates it, unless ``force``."""
        query = {"force": 1 if force else None, "dry_run": 1 if dry_run else None, "comment": comment}
        return self._call("PUT", f"{self._api}/config/schema", body=schema, query=query)

    # ------------------------------------------------------------ changes
    def put(
        self,
        config: dict[str, Any],
        if_match: int | None = None,
        effective_step: int | None = None,
        comment: str | None = None,
        dry_run: bool = False,
        *,
        guard: str | None = None,
        guard_steps: int | None = None,
        guard_window: int | None = None,
        allow_type_change: bool = False,
    ) -> dict[str, Any]:
        """Replace the whole config (at ``effective_step`` if given); ``dry_run`` stores nothing.

        ``guard="loss:1.5"`` makes it a guarded change: the lighthouse rolls it back if, in the
        ``guard_steps`` steps (default 200) after it takes effect, the loss smoothed over
        ``guard_window`` steps (default 10) exceeds 1.5 times its mean before, or is not finite
        (see ``lighthouse.jobs.guards``). The answer's ``guard`` describes it. A key whose JSON
        type the change alters is refused (422) unless ``allow_type_change``.
        """
        query = _change_query(guard, guard_steps, guard_window, allow_type_change)
        return self._change("PUT", config, if_match, effective_step, comment, dry_run, query)

    def patch(
        self,
        changes: dict[str, Any],
        if_match: int | None = None,
        effective_step: int | None = None,
        comment: str | None = None,
        dry_run: bool = False,
        *,
        guard: str | None = None,
        guard_steps: int | None = None,
        guard_window: int | None = None,
        allow_type_change: bool = False,
    ) -> dict[str, Any]:
        """Merge ``changes`` into the config; a ``None`` value deletes the key. ``guard``: as ``put``."""
        query = _change_query(guard, guard_steps, guard_window, allow_type_change)
        return self._change("PATCH", changes, if_match, effective_step, comment, dry_run, query)

    def rollback(self, version: int, comment: str | None = None, dry_run: bool = False) -> dict[str, Any]:
        query = {"comment": comment, "dry_run": 1 if dry_run else None}
        return self._call("POST", f"{self._api}/config/rollback", body={"version": version}, query=query)

    def runs(self) -> dict[str, Any]:
        """The job's runs, oldest first (``lighthouse runs``)."""
        return self._call("GET", f"{self._api}/config/runs")

    def end_run(self, comment: str | None = None) -> dict[str, Any]:
        """End the job's live run (AdminError 409 when none is live)."""
        return self._call("POST", f"{self._api}/config/runs/end", query={"comment": comment})

    def cancel(self, version: int) -> dict[str, Any]:
        return self._call("DELETE", f"{self._api}/config/scheduled/{int(version)}")

    # ------------------------------------------------------------ plumbing
    def _change(
        self,
        method: str,
        body: dict[str, Any],
        if_match: int | None,
        effective_step: int | None,
        comment: str | None,
        dry_run: bool,
        guard: dict[str, Any],
    ) -> dict[str, Any]:
        headers = {"If-Match": str(if_match)} if if_match is not None else {}
        query = {"effective_step": effective_step, "comment": comment, "dry_run": 1 if dry_run else None}
        return self._call(method, f"{self._api}/config", body=body, query={**query, **guard}, headers=headers)

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        extra_time: float = 0.0,
    ) -> dict[str, Any]:
        """Send to the current lighthouse, then to each other one once (see the class docstring)."""
        params = {k: str(v) for k, v in (query or {}).items() if v is not None and v != ""}
        target = path + ("?" + urllib.parse.urlencode(params) if params else "")
        failures: list[str] = []
        count = len(self.urls)
        for k in range(count):
            index = (self._current + k) % count
            base = self.urls[index]
            try:
                answer = self._send(base, method, target, body, headers, self.timeout + extra_time)
            except _NotSent as exc:
                failures.append(f"{base}: {exc.reason}")
                continue
            except _NoAnswer as exc:
                if method != "GET":  # it may have been applied: never send a change twice
                    raise AdminError(
                        0,
                        f"no answer from the lighthouse at {base}: {exc.reason} (the change may or may "
                        "not have been applied: check `lighthouse config history`)",
                    ) from None
                failures.append(f"{base}: {exc.reason}")
                continue
            self._current = index
            return answer
        if count == 1:
            raise AdminError(0, f"cannot reach the lighthouse at {failures[0]}")
        raise AdminError(0, "cannot reach any lighthouse: " + "; ".join(failures))

    def _send(
        self, base: str, method: str, target: str, body: Any, headers: dict[str, str] | None, timeout: float
    ) -> dict[str, Any]:
        url = base + target
        sent = {"Accept": "application/json", **(headers or {})}
        data = None
        if body is not None:
            data = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
            sent["Content-Type"] = "application/json"
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        if self.author and method != "GET":
            sent["X-Author"] = self.author
        request = urllib.request.Request(url, data=data, method=method, headers=sent)
        try:
            with self._opener.open(request, timeout=timeout) as response:
                if response.headers.get("X-Lighthouse-Token") == "not-needed":
                    self.token_not_needed = True
                return _decode(response.read(), response.status)
        except urllib.error.HTTPError as exc:
            raise AdminError(exc.code, _error_text(exc)) from None
        except http.client.HTTPException as exc:
            if isinstance(exc, http.client.RemoteDisconnected):
                raise _NoAnswer(_closed_without_answer(base)) from None
            # Sent, but not to an HTTP/1.1 server: nothing there applied it, so the next one may be asked.
            raise _NotSent(
                f"it does not answer HTTP/1.1 (is it a gRPC port? the lighthouse's gRPC port is "
                f"{DEFAULT_LIGHTHOUSE_PORT} by default; --url takes its dashboard port, "
                f"{DEFAULT_DASHBOARD_PORT} by default)"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            # urllib wraps what fails before the request is sent (connect, TLS, send) in URLError;
            # what fails while waiting for the answer comes as it is.
            not_sent = isinstance(exc, urllib.error.URLError)
            reason = exc if isinstance(exc, ssl.SSLError) else getattr(exc, "reason", exc)
            if isinstance(reason, socket.timeout | TimeoutError):
                reason = f"no answer within {timeout:g} s"
            elif isinstance(reason, ssl.SSLError):
                reason = tls_reason(reason)
            elif isinstance(reason, ConnectionRefusedError):
                port = DEFAULT_DASHBOARD_PORT
                reason = (
                    f"{reason} (is the lighthouse running? --url takes its dashboard port, {port} by default)"
                )
            elif isinstance(reason, ConnectionError):
                reason = _closed_without_answer(base)
            raise (_NotSent if not_sent else _NoAnswer)(str(reason)) from None


def _change_query(
    guard: str | None, guard_steps: int | None, guard_window: int | None, allow_type_change: bool
) -> dict[str, Any]:
    """The query parameters PUT and PATCH share: the guard and the explicit type change."""
    return {
        "guard": guard,
        "guard_steps": guard_steps,
        "guard_window": guard_window,
        "allow_type_change": 1 if allow_type_change else None,
    }


def _closed_without_answer(base: str) -> str:
    """A connection that opened, then closed with no HTTP answer: on http://, most likely TLS."""
    hint = " (does the lighthouse serve HTTPS? try an https:// URL)" if base.startswith("http://") else ""
    return f"the connection was closed without an answer{hint}"


def _decode(raw: bytes, status: int) -> dict[str, Any]:
    try:
        answer = json.loads(raw)
    except ValueError:
        raise AdminError(
            status, "the server's answer is not JSON (is the URL a lighthouse dashboard?)"
        ) from None
    if not isinstance(answer, dict):
        raise AdminError(status, "the server's answer is not a JSON object")
    return answer


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        answer = json.loads(exc.read(64 * 1024))
    except (ValueError, OSError):
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return str(answer["error"])
    return f"HTTP {exc.code} {exc.reason}"
