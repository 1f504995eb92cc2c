"""The job id: which training job a config, a manager or a request belongs to (part of the wire contract).

Shared by every part (lighthouse, manager, worker_client) because each must
refuse the same ids with the same message. A ``JobId`` is an id that passed the
check: code past the point where a request enters takes one and checks nothing.
"""

from __future__ import annotations

import re
from typing import NewType

JobId = NewType("JobId", str)

DEFAULT_JOB = JobId("default")
JOB_ENV = "LIGHTHOUSE_JOB"
JOB_ID_RULE = "a job id is 1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class InvalidJobId(ValueError):
    pass


def check_job_id(job: str | None) -> JobId:
    """The job a request or a user names: empty or None is ``default`` (here only); a bad id raises
    InvalidJobId naming the rule."""
    return check_job_name(job) if job else DEFAULT_JOB


def check_job_name(name: str) -> JobId:
    """``name`` as a job id with no default: a file name, a store or peer key, a tokens file's key
    (an empty one is refused, not taken for ``default``)."""
    if _JOB_ID.fullmatch(name) is None or name in (".", ".."):
        raise InvalidJobId(f"invalid job id {name[:80]!r}: {JOB_ID_RULE}")
    return JobId(name)
