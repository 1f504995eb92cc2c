"""One change committed through ``ConfigStore.apply``, the path every production edit takes, for
the tests that drive a store directly."""

from __future__ import annotations

from typing import Any

from lighthouse.jobs.versions import Change, ConfigStore, Edit


def commit(
    store: ConfigStore,
    op: str,
    change: dict[str, Any],
    *,
    source: str,
    author: str = "-",
    comment: str = "",
    effective_step: int | None = None,
    if_match: int | None = None,
) -> Change:
    """Store one change durably and return its row; raises what ``apply`` raises."""
    edit = Edit(op, change, source, author, comment, effective_step)
    return store.apply([edit], if_match=if_match).row
