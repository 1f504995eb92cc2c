"""Who may call the lighthouse's gRPC side for which job: a manager's token or its certificate.

Two credentials, bound to jobs the same way (``{"job": [...]}`` files):

- ``--manager-tokens-file``: a token in the call's ``authorization: Bearer <token>`` metadata
  (the editor tokens of ``--tokens`` count for their job, the admin token for every job);
- ``--manager-identities-file`` (mutual TLS): the client certificate's subject common name or one
  of its subject alternative names, spelled as openssl spells them (``CN=g0``, ``DNS:g0.example``,
  ``URI:spiffe://train/g0``, ``email:g0@example``). The handshake proved the certificate (signed by
  ``--tls-client-ca``); this file says which jobs it may read and report for.

Without either file every call is served, as before. With one, a call with no credential gets
UNAUTHENTICATED; a credential of other jobs (or a proven certificate bound to no job)
PERMISSION_DENIED.
"""

from __future__ import annotations

import hmac
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import grpc

from lighthouse.web.access import load_job_tokens
from protos.job_ids import JobId

# How a certificate's names are written in --manager-identities-file, and the property of grpc's
# auth context that holds them (TLS only: a plaintext call has none).
CERTIFICATE_NAMES = (
    ("CN=", "x509_common_name"),
    ("DNS:", "peer_dns"),
    ("URI:", "peer_uri"),
    ("email:", "peer_email"),
)


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Caller(Protocol):
    """What a call tells about its caller (a ``grpc.aio.ServicerContext``)."""

    def invocation_metadata(self) -> Any: ...

    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...


def load_job_identities(path: Path, flag: str = "--manager-identities-file") -> dict[str, list[str]]:
    """Read a ``{"job": ["CN=...", "DNS:...", ...]}`` file; raises ValueError naming what is wrong."""
    identities = load_job_tokens(path, flag, what="certificate name")
    prefixes = tuple(prefix for prefix, _ in CERTIFICATE_NAMES)
    for job, names in identities.items():
        for name in names:
            if not name.startswith(prefixes) or name in prefixes:
                raise ValueError(
                    f"{flag} {path}: job {job!r}: {name!r} is no certificate name: write "
                    f"{', '.join(p + '...' for p in prefixes)} (e.g. CN=g0, URI:spiffe://train/g0)"
                )
    return identities


def certificate_names(auth: Mapping[str, Iterable[bytes]]) -> list[str]:
    """The client certificate's names as the identities file spells them (none without one)."""
    return [
        prefix + value.decode("utf-8", "replace")
        for prefix, prop in CERTIFICATE_NAMES
        for value in auth.get(prop, ())
    ]


class ManagerAccess:
    """Checks a gRPC call's credential against the job it names (see the module's docstring)."""

    def __init__(
        self,
        manager_tokens: dict[str, list[str]] | None,
        job_tokens: dict[str, list[str]] | None = None,
        admin_token: str | None = None,
        manager_identities: dict[str, list[str]] | None = None,
    ) -> None:
        self.enforced = manager_tokens is not None or manager_identities is not None
        self._tokens = manager_tokens is not None
        self._admin = admin_token.encode() if admin_token else None
        self._jobs: dict[str, list[bytes]] = defaultdict(list)
        for tokens in (manager_tokens or {}, job_tokens or {}):
            for job, listed in tokens.items():
                self._jobs[job] += [t.encode() for t in listed]
        self._bound: dict[str, set[str]] | None = None  # certificate name -> its jobs
        if manager_identities is not None:
            self._bound = defaultdict(set)
            for job, names in manager_identities.items():
                for name in names:
                    self._bound[name].add(job)

    @property
    def describe(self) -> str:
        """What a manager must present, for the log line at start."""
        needs = ["a token of its job (--manager-tokens-file)"] if self._tokens else []
        if self._bound is not None:
            needs.append("a client certificate bound to its job (--manager-identities-file)")
        return " or ".join(needs)

    def identify(self, job: JobId, call: Caller) -> str:
        """The credential a call for ``job`` made ("" on an open lighthouse): ``certificate CN=g0``,
        ``token of job A``, ``admin token``; raises Denied (UNAUTHENTICATED: none or an unknown
        token; PERMISSION_DENIED: a credential of other jobs, a certificate bound to no job)."""
        if not self.enforced:
            return ""
        names: list[str] = []
        if self._bound is not None:
            names = certificate_names(call.auth_context())
            for name in names:
                if job in self._bound.get(name, ()):
                    return f"certificate {name}"
        token = bearer_token(call.invocation_metadata())
        if token:
            return self._token_identity(job, token)
        if names:
            assert self._bound is not None  # names are read only when certificates are bound
            owners = sorted({j for name in names for j in self._bound.get(name, ())})
            subject = next((n for n in names if n.startswith("CN=")), names[0])
            bound = f"job {', '.join(owners)} only" if owners else "no job (--manager-identities-file)"
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"certificate {subject} is bound to {bound}: it cannot read or report for job {job!r}",
            )
        token_way = (
            "send 'authorization: Bearer <token>' (manager serve --lighthouse-token-file, or "
            "LIGHTHOUSE_TOKEN)"
        )
        if self._bound is None:
            raise Denied(
                grpc.StatusCode.UNAUTHENTICATED, f"this lighthouse needs a manager token: {token_way}"
            )
        raise Denied(
            grpc.StatusCode.UNAUTHENTICATED,
            "this lighthouse needs a client certificate bound to the job (manager serve "
            f"--lighthouse-cert/--lighthouse-key) or a manager token: {token_way}",
        )

    def _token_identity(self, job: JobId, token: str) -> str:
        presented = token.encode("utf-8", "replace")
        if self._admin is not None and hmac.compare_digest(presented, self._admin):
            return "admin token"
        owners = sorted(
            j for j, ts in self._jobs.items() if any(hmac.compare_digest(presented, t) for t in ts)
        )
        if job in owners:
            return f"token of job {job}"
        if owners:
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this token is for job {', '.join(owners)} only: it cannot read or report for job {job!r}",
            )
        raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unknown manager token")


def bearer_token(metadata: object) -> str:
    """The token of an ``authorization: Bearer <token>`` metadata entry ("" without one)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return ""
