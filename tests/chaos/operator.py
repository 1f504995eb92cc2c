"""The chaos operator: every kind of change an operator (or a program) makes, through any lighthouse.

Each change carries a unique ``mark`` (``op<N>``) so the checker can tell which change a served
config came from. Every attempt is logged with what was asked, when, and the answer: 200 is an
acknowledgement the product must keep; no answer (a lighthouse killed or stopped) is
indeterminate, as in Jepsen: the change may or may not have happened.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

from tests.chaos.cluster import Cluster
from tests.chaos.schedule import Event
from tests.http_util import HttpResult, call

TIMEOUT = 5.0
GUARD = "guard=loss:1.5&guard_steps=150&guard_window=5"
GUARD_REGRESSES = 3.0


class Operator:
    def __init__(self, cluster: Cluster, log: Path) -> None:
        self.cluster = cluster
        self.log = log.open("a", buffering=1)

    def _call(self, url: str, method: str, path: str, body: Any = None, **kw: Any) -> HttpResult | None:
        try:
            return call(url, method, path, body, timeout=TIMEOUT, **kw)
        except (OSError, http.client.HTTPException):
            return None

    def _read(self, url: str, path: str) -> Any:
        res = self._call(url, "GET", path)
        return res.json if res is not None and res.status == 200 else None

    def do(self, event: Event) -> dict[str, Any]:
        """Make the change ``event`` asks for; its log entry (also appended to the log)."""
        p = event.params
        url = self.cluster.url(p["lighthouse"])
        mark = f"op{p['n']}"
        entry: dict[str, Any] = {"n": p["n"], "kind": event.kind, "lighthouse": p["lighthouse"], "mark": mark}
        request: dict[str, Any] = {}
        res: HttpResult | None = None
        sent = time.time()
        kind = event.kind
        if kind == "patch":
            request = {"method": "PATCH", "body": {"lr": p["lr"], "mark": mark}}
        elif kind == "put":
            request = {"method": "PUT", "body": {"lr": p["lr"], "sync_every": p["sync_every"], "mark": mark}}
        elif kind == "patch_if_match":
            view = self._read(url, "api/config")
            if view is not None:
                request = {
                    "method": "PATCH",
                    "body": {"sync_every": p["sync_every"], "mark": mark},
                    "if_match": view["version"],
                }
        elif kind == "scheduled":
            view = self._read(url, "api/config")
            if view is not None:
                at = max(view["current_step"], view["lease_horizon"]) + p["ahead"]
                request = {"method": "PATCH", "body": {"lr": p["lr"], "mark": mark}, "effective_step": at}
        elif kind == "cancel":
            listed = self._read(url, "api/config/scheduled")
            pending = [
                s for s in (listed or {}).get("scheduled", []) if s["status"] == "pending" and s["scheduled"]
            ]
            if pending:
                target = pending[int(p["pick"] * len(pending))]["version"]
                request = {"method": "DELETE", "path": f"api/config/scheduled/{target}", "target": target}
        elif kind == "rollback":
            listed = self._read(url, "api/config/history?limit=20")
            versions = [v["version"] for v in (listed or {}).get("versions", []) if v["op"] != "cancel"]
            if versions:
                target = versions[int(p["pick"] * len(versions))]
                request = {"method": "POST", "path": "api/config/rollback", "body": {"version": target}}
        elif kind == "file_reload":
            body = {"lr": p["lr"], "sync_every": p["sync_every"], "mark": mark}
            tmp = self.cluster.config_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            tmp.replace(self.cluster.config_file)
            request = {"method": "FILE", "body": body}
        elif kind == "guard":
            # A change made now, guarded by the loss it sets: 3x the baseline regresses (the guard
            # must roll it back, a change made now of its own), 1x passes.
            scale = GUARD_REGRESSES if p["pick"] < 0.75 else 1.0
            request = {"method": "PATCH", "body": {"loss_scale": scale, "mark": mark}, "guard": GUARD}
        elif kind == "run_end":
            request = {"method": "POST", "path": "api/config/runs/end"}
        if request and request["method"] != "FILE":
            query = [f"effective_step={request['effective_step']}"] if "effective_step" in request else []
            query += [request["guard"]] if "guard" in request else []
            path = request.get("path", "api/config") + ("?" + "&".join(query) if query else "")
            headers = {"If-Match": str(request["if_match"])} if "if_match" in request else None
            sent = time.time()
            res = self._call(url, request["method"], path, request.get("body"), headers=headers)
        entry.update({"request": request, "sent": sent, "answered": time.time()})
        if not request:
            entry["status"] = "skipped"  # nothing to cancel, or the read before it got no answer
        elif request["method"] == "FILE":
            entry["status"] = "file"  # the lighthouse commits it when it sees the file: no answer
        elif res is None:
            entry["status"] = None  # indeterminate
        else:
            entry["status"] = res.status
            try:
                entry["answer"] = res.json
            except ValueError:
                entry["answer"] = res.body[:300].decode(errors="replace")
        self.log.write(json.dumps(entry, sort_keys=True) + "\n")
        return entry

    def close(self) -> None:
        self.log.close()
