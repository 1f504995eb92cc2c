"""How each admin API answer reads as a table: what ``lighthouse config ...`` prints without ``-o json``.

Pure functions from the API's JSON to lines, so what an operator reads is
exactly what the API said, shortened: relative times, steps with thousands
separators, and every change as a per-key diff (``~ lr: 0.1 -> 0.05``,
``+ warmup: 100``, ``- old_key: 1``).
"""

from __future__ import annotations

import json
from typing import Any

from lighthouse.config.values import apply_change, config_changes
from protos.cli_output import Cell, Styled, ago, duration, paint, steps, table

LATE_AFTER_S = 3.0  # a manager silent for longer is marked late (as on the dashboard)
INDENT = "    "


def shown(value: Any) -> str:
    """A config value as JSON text (a string quoted, so ``"true"`` and ``true`` differ)."""
    return json.dumps(value, ensure_ascii=False)


# ------------------------------------------------------------------ changes


def diff_lines(changes: dict[str, dict[str, Any]]) -> list[str]:
    """``{"lr": {"before": 0.1, "after": 0.05}}`` (the API's ``changes``) as ``~ lr: 0.1 -> 0.05`` lines."""
    lines = []
    for key, change in changes.items():
        if "before" not in change:
            lines.append(paint(Styled(f"+ {key}: {shown(change['after'])}", fg="green")))
        elif "after" not in change:
            lines.append(paint(Styled(f"- {key}: {shown(change['before'])}", fg="red")))
        else:
            text = f"~ {key}: {shown(change['before'])} -> {shown(change['after'])}"
            lines.append(paint(Styled(text, fg="yellow")))
    return lines


class Replay:
    """Diffs each version (fed oldest first) against the config live just before it.

    A history entry's ``config`` is its config once every change known then applies,
    pending scheduled ones included; an operator asks instead what a change did to
    the config in use. So the versions are replayed from a known config: a change
    made now moves it, a change scheduled at a step still ahead of ``job_step`` (or
    cancelled) is shown against it without moving it.
    """

    def __init__(self, config: dict[str, Any] | None, job_step: int = -1) -> None:
        self.config = config  # None: unknown (the version before was pruned)
        self.job_step = job_step

    def diff(self, entry: dict[str, Any]) -> list[str]:
        if entry.get("op") == "cancel":
            return [f"cancels version {entry['change'].get('version')}"]
        if self.config is None and entry["op"] != "put":
            self.config = entry["config"]
            return ["(the version before was pruned: change not shown)"]
        before = self.config or {}
        after = apply_change(before, entry["op"], entry["change"])
        step = entry.get("effective_step")
        pending = is_scheduled(entry) and (entry.get("cancelled") or (step or 0) > self.job_step)
        if not pending:
            self.config = after
        return diff_lines(config_changes(before, after)) or ["(no key changed)"]


def in_use(view: dict[str, Any]) -> dict[str, Any]:
    """What ``Replay`` holds once it replayed the versions up to a ``GET /api/config`` answer's: the
    live config with the pending changes made now applied in their order, not those scheduled."""
    config = view.get("live", view["config"])  # an older lighthouse: ``config`` is the live one
    made_now = [s for s in view.get("scheduled") or [] if not is_scheduled(s) and not s.get("cancelled")]
    for item in sorted(made_now, key=lambda s: (s["effective_step"], s["version"])):
        config = apply_change(config, item["op"], item["change"])
    return config


def is_scheduled(entry: dict[str, Any]) -> bool:
    """Asked for at a step (``--at-step``), not a change made now whose step the lighthouse chose."""
    return bool(entry.get("scheduled", entry.get("effective_step") is not None))


def when(entry: dict[str, Any]) -> str:
    step = entry.get("effective_step")
    if step is None:
        return ""
    text = f"at step {steps(step)}" if is_scheduled(entry) else f"step {steps(step)}"
    return text + (", cancelled" if entry.get("cancelled") else "")


def entry_cells(entry: dict[str, Any], now: float | None = None) -> list[Cell]:
    """One version as ``git log --oneline`` would: version, age, author, source, step, comment."""
    return [
        Styled(str(entry["version"]), fg="yellow"),
        ago(entry.get("created_at"), now),
        entry.get("author") or "-",
        entry.get("source") or "-",
        when(entry),
        entry.get("comment") or "",
    ]


def watched(entry: dict[str, Any], replay: Replay, now: float | None = None) -> list[str]:
    """One version as ``config watch`` prints it when it lands: its line, then its change."""
    cells = [c for c in entry_cells(entry, now) if (c.text if isinstance(c, Styled) else c)]
    return [*table(None, [cells]), *(INDENT + line for line in replay.diff(entry))]


def takes_effect(answer: dict[str, Any]) -> str:
    """`` (takes effect at step 12,345 in every group)`` for an int effective step, else nothing."""
    step = answer.get("effective_step")
    return f" (takes effect at step {steps(step)} in every group)" if isinstance(step, int) else ""


def change_lines(answer: dict[str, Any]) -> list[str]:
    """The answer to a change: ``version N``; a dry run also lists what it would change."""
    if not answer.get("dry_run"):
        return [f"version {answer['version']}{takes_effect(answer)}"]
    head = f"dry run, nothing stored: would make version {answer['version']}{takes_effect(answer)}"
    return [head, *(diff_lines(answer.get("changes") or {}) or ["  no key changes"])]


def summary(op: str, change: dict[str, Any]) -> str:
    """A change in one cell: ``lr=0.5, -old_key`` (a patch) or ``all: lr=0.5`` (a put)."""
    parts = [f"-{k}" if v is None and op == "patch" else f"{k}={shown(v)}" for k, v in change.items()]
    text = ", ".join(parts) or "(empty)"
    return f"all: {text}" if op == "put" else text


# ------------------------------------------------------------------ commands


def config_table(config: dict[str, Any]) -> list[str]:
    if not config:
        return ["(empty config)"]
    return table(["KEY", "VALUE"], [[key, shown(value)] for key, value in config.items()])


def show(view: dict[str, Any], now: float | None = None) -> list[str]:
    """``config show``: the live config (KEY VALUE: what groups get at the job's step), one line
    about the latest version, one about the live version when it is another, pending changes
    (each against the live config), problems."""
    live = view.get("live", view["config"])  # an older lighthouse: ``config`` is the live one
    lines = config_table(live)
    by = f" by {view.get('author') or '-'}"
    comment = f": {view['comment']}" if view.get("comment") else ""
    lines.append("")
    lines.append(
        f"version {view['version']}, {ago(view.get('updated_at'), now)}{by} ({view.get('source') or '-'})"
        f"{comment}"
    )
    served = view.get("live_version")
    if "live" in view and served not in (None, view["version"]):
        later = view.get("from_step")
        holds = f"its config from step {steps(later)}" if later is not None else "the same config"
        lines.append(f"live: version {served} (above); version {view['version']}: {holds}")
    if view.get("current_step", -1) >= 0:
        lines.append(f"job step {steps(view['current_step'])}")
    for item in view.get("scheduled") or []:
        lines.append(
            f"scheduled: version {item['version']} at step {steps(item['effective_step'])}"
            f" by {item.get('author') or '-'}" + (f": {item['comment']}" if item.get("comment") else "")
        )
        changes = config_changes(live, apply_change(live, item["op"], item["change"]))
        lines.extend(INDENT + line for line in diff_lines(changes) or ["(no key changes)"])
    file = view.get("file") or {}
    if file.get("error"):
        lines.append(paint(Styled(f"file error: {file['error']}", fg="red")))
    if view.get("schema"):
        lines.append(f"schema: {file.get('schema_path') or 'set through the API'}")
    return lines


def history(
    entries: list[dict[str, Any]], older: dict[str, Any] | None, job_step: int, now: float | None = None
) -> list[str]:
    """``config history``: one line per version (newest first), each followed by its change.

    ``older`` is the version just before the oldest entry (None: there is none, or it was pruned).
    """
    if not entries:
        return ["(no versions)"]
    start = older["config"] if older is not None else ({} if entries[-1]["version"] == 1 else None)
    replay = Replay(start, job_step)
    diffs = [replay.diff(entry) for entry in reversed(entries)][::-1]
    lines = []
    for row, diff in zip(table(None, [entry_cells(e, now) for e in entries]), diffs, strict=True):
        lines.append(row)
        lines.extend(INDENT + line for line in diff)
    return lines


def jobs(answer: dict[str, Any], now: float | None = None) -> list[str]:
    """``lighthouse jobs``."""
    rows: list[list[Cell]] = []
    for job in answer["jobs"]:
        counts = f"{job['managers_live']}/{job['managers_behind']}/{job['late_groups']}"
        trouble = job["managers_behind"] or job["late_groups"]
        error = job.get("file_error")
        stall = job.get("stall_reason")
        rows.append(
            [
                job["job"],
                str(job["version"]),
                ago(job.get("updated_at"), now),
                Styled(counts, fg="yellow") if trouble else counts,
                steps(job.get("current_step")),
                _run_cell(job),
                str(job["scheduled"]),
                Styled(error, fg="red") if error else "-",
                Styled(f"stalled: {stall}", fg="red") if stall else "ok",
            ]
        )
    headers = [
        "JOB",
        "VERSION",
        "CHANGED",
        "MANAGERS (live/behind/late)",
        "STEP",
        "RUN",
        "SCHEDULED",
        "FILE ERROR",
        "STATUS",
    ]
    return table(headers, rows)


def _run_cell(job: dict[str, Any]) -> Cell:
    """The job's latest run: its number and first step while live, "ended" between runs (a lighthouse
    older than runs answers no ``run``: "-")."""
    number = job.get("run") or 0
    if not number:
        return "-"
    if job.get("run_live"):
        return f"{number} from {steps(job.get('run_start_step'))}"
    return Styled(f"{number} ended", fg="yellow")


def runs(answer: dict[str, Any], now: float | None = None) -> list[str]:
    """``lighthouse runs``: one line per run, oldest first."""
    items = answer["runs"]
    if not items:
        return ["(no run yet: no manager reported a step)"]
    rows: list[list[Cell]] = []
    for run in items:
        live = run["ended_at"] is None
        rows.append(
            [
                str(run["number"]),
                steps(run["start_step"]),
                f"after v{run['base_version']}",
                ago(run.get("started_at"), now),
                Styled("live", fg="green") if live else f"ended {ago(run['ended_at'], now)}",
                "-" if live else steps(run["end_step"]),
                run.get("end_reason") or "-",
                run.get("run_id") or "-",
            ]
        )
    return table(["RUN", "FROM STEP", "BEGAN", "STARTED", "STATE", "LAST STEP", "ENDED BY", "RUN ID"], rows)


def scheduled(answer: dict[str, Any], now: float | None = None) -> list[str]:
    """``config scheduled``: every change scheduled at a step, and the groups that switched late."""
    items = answer["scheduled"]
    if not items:
        return ["(nothing scheduled)"]
    colours = {"pending": "yellow", "in_effect": "green", "cancelled": None}
    rows: list[list[Cell]] = []
    for item in items:
        late = ", ".join(
            f"{g['replica_id']} at {steps(g['switched_at_step'])} (+{g['late_by_steps']:,})"
            for g in item.get("late_groups") or []
        )
        rows.append(
            [
                str(item["version"]),
                steps(item["effective_step"]),
                Styled(item["status"], fg=colours.get(item["status"]), dim=item["status"] == "cancelled"),
                summary(item["op"], item["change"]),
                item.get("author") or "-",
                ago(item.get("created_at"), now),
                late or "-",
            ]
        )
    return table(["VERSION", "AT STEP", "STATUS", "CHANGE", "AUTHOR", "CREATED", "LATE GROUPS"], rows)


def managers(answer: dict[str, Any]) -> list[str]:
    """``config managers``: who serves which version (with which credential, when the lighthouse
    asks for one); behind and late ones marked."""
    head = answer.get("version", 0)
    items = answer["managers"]
    with_lighthouse = any("lighthouse" in m for m in items)
    with_mode = any("mode" in m for m in items)
    with_lease = any("lease_through_step" in m for m in items)
    with_identity = any(m.get("identity") for m in items)  # an open lighthouse: no credential to show
    with_pending = any(m.get("pending_version") is not None for m in items)
    headers = ["REPLICA", "ADDRESS", *["IDENTITY"] * with_identity, "VERSION", "LAST SEEN", "STEP"]
    headers += ["REQUESTS", "CACHE HITS"]
    headers += ["LIGHTHOUSE"] * with_lighthouse + ["MODE"] * with_mode + ["LEASE"] * with_lease
    headers += ["PENDING"] * with_pending + ["STATE"]
    rows: list[list[Cell]] = []
    for m in items:
        behind = m.get("behind_versions", head - m["version"])
        problems = [
            *([f"behind {behind}" if behind > 1 else "behind"] if m["version"] < head else []),
            *(["late"] if m["last_seen_s"] > LATE_AFTER_S else []),
            *(["past lease"] if m.get("past_lease") else []),
        ]
        hits = f"{m['cache_hits'] / m['requests']:.0%}" if m["requests"] else "-"
        row: list[Cell] = [
            m["replica_id"],
            m.get("address") or "-",
            *([m.get("identity") or "-"] if with_identity else []),
            str(m.get("live_version") or m["version"]),  # what its workers get at its step
            f"{duration(m['last_seen_s'])} ago",
            steps(m.get("step")),
            f"{m['requests']:,}",
            hits,
        ]
        if with_lighthouse:
            row.append(m.get("lighthouse") or "-")
        if with_mode:
            row.append(m.get("mode") or "-")
        if with_lease:
            row.append(steps(m.get("lease_through_step")))
        if with_pending:
            version, at = m.get("pending_version"), m.get("pending_step")
            row.append("-" if version is None or at is None else f"v{version} at step {steps(at)}")
        row.append(Styled(", ".join(problems), fg="yellow") if problems else Styled("current", fg="green"))
        rows.append(row)
    footer = f"live version {answer.get('live_version') or head}"
    pending = answer.get("pending")
    if pending:
        footer += f", v{pending['version']} pending from step {steps(pending['effective_step'])}"
    return [*table(headers, rows), "", footer] if rows else ["(no managers)", "", footer]


def at_step(answer: dict[str, Any]) -> list[str]:
    """``config at-step``: the job's config at the step, then what each group served there."""
    lines = [f"step {steps(answer['step'])}, version {answer['version']}", ""]
    config = answer.get("config")
    lines += config_table(config) if config is not None else ["(pruned from the history)"]
    groups = answer.get("groups") or {}
    if groups:
        rows: list[list[Cell]] = []
        for replica, served in sorted(groups.items()):
            theirs = served.get("config")
            if theirs is None or config is None:
                same: Cell = "(pruned)"
            elif theirs == config:
                same = "same"
            else:
                keys = ", ".join(config_changes(config, theirs))
                same = Styled(f"differs: {keys}", fg="yellow")
            rows.append([replica, str(served["version"]), same])
        lines += ["", *table(["GROUP", "VERSION", "CONFIG"], rows)]
    return lines


def schema(answer: dict[str, Any], now: float | None = None) -> list[str]:
    """``config schema show``: who set it, then the document."""
    document = answer.get("schema")
    if document is None:
        return ["no schema"]
    comment = f": {answer['comment']}" if answer.get("comment") else ""
    head = f"set {ago(answer.get('created_at'), now)} by {answer.get('author') or '-'}"
    return [f"{head} ({answer.get('source') or '-'}){comment}", json.dumps(document, indent=2)]


def schema_history(answer: dict[str, Any], now: float | None = None) -> list[str]:
    """``config schema history``: one line per schema change, newest first."""
    rows: list[list[Cell]] = []
    for item in answer["schemas"]:
        document = item.get("schema")
        what: Cell = Styled("removed", fg="red") if document is None else "set"
        rows.append(
            [
                str(item.get("id", "-")),
                ago(item.get("created_at"), now),
                item.get("author") or "-",
                item.get("source") or "-",
                what,
                item.get("comment") or "",
            ]
        )
    if not rows:
        return ["(no schema changes)"]
    return table(["ID", "CHANGED", "AUTHOR", "SOURCE", "SCHEMA", "COMMENT"], rows)


def diff(older: dict[str, Any], newer: dict[str, Any], live: bool) -> list[str]:
    """``config diff V1 [V2]``: the per-key diff from V1's config to V2's (or the live one)."""
    target = f"version {newer['version']}" + (" (live)" if live else "")
    head = f"version {older['version']} -> {target}"
    return [head, *(diff_lines(config_changes(older["config"], newer["config"])) or ["(no differences)"])]
