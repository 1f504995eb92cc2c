"""The job id: which training job a config, a manager or a request belongs to (part of the wire contract).

Shared by every part (lighthouse, manager, worker_client) because each must
refuse the same ids with the same message.
"""

from __future__ import annotations

import re

DEFAULT_JOB = "default"
JOB_ENV = "LIGHTHOUSE_JOB"
JOB_ID_RULE = "a job id is 1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class InvalidJobId(ValueError):
    pass


def check_job_id(job: str | None) -> str:
    """The job id to use (empty or None: ``default``); a bad id raises InvalidJobId naming the rule."""
    if not job:
        return DEFAULT_JOB
    if _JOB_ID.fullmatch(job) is None or job in (".", ".."):
        raise InvalidJobId(f"invalid job id {job[:80]!r}: {JOB_ID_RULE}")
    return job
