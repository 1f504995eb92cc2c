"""Which HTTP answer each domain error gets: one table, beside the routes, for every route alike.

``jobs/``, ``store/`` and ``config/`` raise what went wrong and know no status;
the status and the extra fields of the ``{"error"}`` body are chosen here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lighthouse.config.schema import SchemaViolation
from lighthouse.config.values import ConfigError, ConfigTooLarge, TypeChanged
from lighthouse.jobs.registry import JobBusy, TooManyJobs
from lighthouse.jobs.versions import NotCancellable, NotFound, PendingConflict, StepPromised, VersionConflict
from lighthouse.store.backend import StoreFull, StoreUnavailable
from lighthouse.web.messages import HttpError
from protos.job_ids import InvalidJobId


def _none(exc: Any) -> dict[str, Any]:
    return {}


# domain error -> (status, the body's fields beside "error"); a subclass's row wins over its base's.
STATUSES: dict[type[Exception], tuple[int, Callable[[Any], dict[str, Any]]]] = {
    ConfigError: (400, _none),  # a bad value, key, schema or body
    InvalidJobId: (400, _none),
    NotFound: (404, _none),
    VersionConflict: (409, lambda exc: {"version": exc.head}),
    # If-Match on the head, but a pending change would not stay where the editor saw it.
    PendingConflict: (
        409,
        lambda exc: {"version": exc.head, "pending": exc.pending, "earliest_step": exc.earliest},
    ),
    StepPromised: (409, lambda exc: {"earliest_step": exc.earliest}),
    NotCancellable: (409, lambda exc: {} if exc.head is None else {"version": exc.head}),
    JobBusy: (409, _none),
    ConfigTooLarge: (413, _none),
    SchemaViolation: (422, lambda exc: {"violations": exc.violations}),
    TypeChanged: (422, lambda exc: {"type_changes": exc.type_changes}),
    StoreUnavailable: (503, _none),
    StoreFull: (507, _none),  # no space for the write: nothing stored, reads and leases go on
    TooManyJobs: (507, _none),
}


def http_error(exc: Exception) -> HttpError | None:
    """The answer to ``exc`` (an HttpError as it is); None for an error no request should cause."""
    if isinstance(exc, HttpError):
        return exc
    for cls in type(exc).__mro__:
        row = STATUSES.get(cls)
        if row is not None:
            status, extra = row
            return HttpError(status, str(exc), **extra(exc))
    return None
