"""Who may change which job: the cluster admin token (every job) and per-job editor tokens.

``--admin-token`` edits every job; ``--tokens FILE`` (``{"job": ["token", ...]}``)
gives a job's editors tokens that change that job only. A job covered by
neither is open, as a lighthouse without tokens always was. Reads are open (under an allowed Host).
The history names the credential next to the claimed author: ``alice (token of job B)``.
"""

from __future__ import annotations

import hmac
import json
from pathlib import Path

from lighthouse.web.messages import HttpError, clean_text
from protos.job_ids import InvalidJobId, JobId, check_job_name


class Access:
    def __init__(self, admin_token: str | None, job_tokens: dict[str, list[str]] | None = None) -> None:
        self._admin = admin_token.encode() if admin_token else None
        self._jobs = {job: [t.encode() for t in tokens] for job, tokens in (job_tokens or {}).items()}

    def enforced(self, job: JobId) -> bool:
        """Whether changes to ``job`` need a token."""
        return self._admin is not None or bool(self._jobs.get(job))

    def valid(self, token: str) -> bool:
        """Whether ``token`` is one of this lighthouse's (the admin's or any job's)."""
        if not token:
            return False
        presented = token.encode("utf-8", "replace")
        every = [self._admin] if self._admin is not None else []
        every += [t for tokens in self._jobs.values() for t in tokens]
        return any(hmac.compare_digest(presented, t) for t in every)

    def check(self, job: JobId, token: str, admin_only: bool = False) -> str:
        """The credential changing ``job`` ("admin token", "token of job J", or "" where none is
        needed); raises 401 (no or wrong token) or 403 (a token of another job)."""
        if admin_only and self._admin is None:
            if not self._jobs:
                return ""  # an open lighthouse: no admin to ask
            raise HttpError(403, "only the admin token may do this, and this lighthouse has no --admin-token")
        if not admin_only and not self.enforced(job):
            return ""
        what = (
            "admin token"
            if admin_only or not self._jobs.get(job)
            else f"token of job {job} (or the admin token)"
        )
        if not token:
            raise _unauthorized(f"{what} required: send 'Authorization: Bearer <token>'")
        presented = token.encode("utf-8", "replace")
        if self._admin is not None and hmac.compare_digest(presented, self._admin):
            return "admin token"
        owners = [
            j for j, tokens in self._jobs.items() if any(hmac.compare_digest(presented, t) for t in tokens)
        ]
        if job in owners and not admin_only:
            return f"token of job {job}"
        if owners:
            what = "this needs the admin token" if admin_only else f"it cannot change job {job!r}"
            raise HttpError(403, f"this token edits job {', '.join(sorted(owners))} only: {what}")
        raise _unauthorized(f"wrong {what.split(' (')[0]}")


# Authors the lighthouse writes itself (guards, file reloads, the credential alone, none): a change
# over HTTP cannot claim them, nor a credential in parentheses.
RESERVED_AUTHORS = frozenset({"guard", "file", "token", "admin token", "-", "api", "rollback", "lighthouse"})
MAX_AUTHOR_CHARS = 64


def author_of(claimed: str, credential: str) -> str:
    """The history's author: ``alice (token of job B)``, the credential alone, ``alice`` on an open
    lighthouse, ``-`` with neither; 400 for a reserved name or one with parentheses."""
    name = clean_text(claimed, MAX_AUTHOR_CHARS)
    if name.lower() in RESERVED_AUTHORS or "(" in name or ")" in name:
        raise HttpError(
            400,
            f"X-Author {name!r} is not accepted: the lighthouse writes {', '.join(sorted(RESERVED_AUTHORS))} "
            "and the credential in parentheses itself",
        )
    if name and credential:
        return f"{name} ({credential})"
    return name or credential or "-"


def _unauthorized(message: str) -> HttpError:
    return HttpError(401, message, headers={"WWW-Authenticate": 'Bearer realm="lighthouse"'})


def load_job_tokens(path: Path, flag: str = "--tokens", what: str = "token") -> dict[str, list[str]]:
    """Read a ``--tokens`` (or ``flag``) file of ``what`` strings per job; raises ValueError naming
    what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f'{flag} {path}: expected a JSON object {{"job": ["{what}", ...]}}')
    out: dict[str, list[str]] = {}
    for name, tokens in data.items():
        try:
            job = check_job_name(name)  # an empty name is no job, not "default"
        except InvalidJobId as exc:
            raise ValueError(f"{flag} {path}: {exc}") from None
        if isinstance(tokens, str):
            tokens = [tokens]
        if not isinstance(tokens, list) or not all(isinstance(t, str) and t.strip() for t in tokens):
            raise ValueError(f"{flag} {path}: job {job!r} must map to a list of non-empty {what} strings")
        out[job] = [t.strip() for t in tokens]
    return out
