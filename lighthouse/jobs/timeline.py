"""A job's timeline for the dashboard picture: which version held from which step, the scheduled
changes ahead, and the groups that switched late.

A change holds from the step the job had reached when it was made (a scheduled
change: from its step) until the next change in apply order; several changes
made at the same step leave all but the last with an empty range. The page
draws this; computing it here keeps the apply order in one place (the store).
"""

from __future__ import annotations

from typing import Any

from lighthouse.jobs.versions import ConfigStore, first_segment
from lighthouse.store.backend import Change

DEFAULT_SEGMENTS = 50


def live_version(store: ConfigStore, held: list[Change], current_step: int) -> int:
    """The version whose config is served at the job's step: the one its segment names, as a
    worker at that step gets it (the card, the timeline, the managers table and ``cfg.version``
    all name this one); when only pruned versions made it, the last held change in apply order
    that is not pending."""
    segments = store.segments()
    named = segments[first_segment(segments, max(current_step, 0))].version
    if named:
        return named
    live = [row.version for row in held if not store.pending(row)]
    return live[-1] if live else 0


def timeline(store: ConfigStore, limit: int = DEFAULT_SEGMENTS) -> dict[str, Any]:
    """GET /api/config/timeline: the last ``limit`` segments (pending ones included) and late groups."""
    with store.lock:  # one instant: rows, step and schedule agree
        held = store.held_changes()
        current = store.current_step
        head = store.head
        scheduled = store.scheduled()
    segments = []
    for row, following in zip(held, [*held[1:], None], strict=False):  # the last is followed by nothing
        segments.append(
            {
                "version": row.version,
                "from_step": max(row.order_step, 0),
                "to_step": None if following is None else max(following.order_step, 0),
                "scheduled": row.scheduled,
                "made_now": row.made_now,
                "pending": store.pending(row),
                "created_at": row.created_at,
                "source": row.source,
                "author": row.author,
                "comment": row.comment,
                "op": row.op,  # with the change: what the version did (the charts' markers say it)
                "change": row.change,
            }
        )
    late = [
        {"version": s["version"], "effective_step": s["effective_step"], **group}
        for s in scheduled
        for group in s["late_groups"]
    ]
    return {
        "job": store.job,
        "version": head,
        "live_version": live_version(store, held, current),
        "current_step": current,
        # Where each run began and at which step (the picture marks them).
        "runs": store.runs.to_json(),
        "segments": segments[-limit:],
        "earlier": max(0, len(segments) - limit),
        "late_groups": late,
    }
