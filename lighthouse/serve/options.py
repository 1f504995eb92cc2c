"""``LighthouseServer``'s less common settings, one dataclass per concern (``lighthouse serve`` flags).

The common ones (``bind``, ``config_path``, ``state_dir``, ``http_bind``, ``tls``, ``backend``)
stay keywords of their own; leases have ``lighthouse.jobs.leases.LeasePolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ConfigSources:
    """Where configs come from besides ``config_path`` (the job ``default``'s file), and how the
    files are watched."""

    schema_path: str | Path | None = None
    """JSON Schema of the job ``default`` (``--schema``); watched like ``config_path``."""
    config_dir: str | Path | None = None
    """Folder of ``<job>.json`` (and ``<job>.schema.json``) files, one job each (``--config-dir``)."""
    strict: bool = False
    """A missing or invalid ``config_path`` at start-up raises instead of being logged (``--strict``)."""
    watch_interval: float = 1.0
    """Seconds between two looks at the watched files."""


@dataclass(frozen=True)
class HttpOptions:
    """Who may change configs over HTTP, under which names it answers, its limits, and whether the
    dashboard speaks TLS."""

    admin_token: str | None = None
    """Bearer token that edits every job (``--admin-token``); None: anyone who passes the host check."""
    job_tokens: dict[str, list[str]] | None = None
    """Editor tokens per job, each editing only its job (``--tokens``)."""
    allowed_hosts: tuple[str, ...] = ()
    """DNS names (besides IPs, localhost, this host's names and the bound one) under which the
    dashboard answers reads, and changes without a token (``--allowed-host``)."""
    https: bool = True
    """With ``tls``, serve the dashboard over HTTPS with the gRPC pair; False keeps it plain HTTP
    (``--http-tls off``: a port only a local proxy reaches)."""
    request_seconds: float = 30.0
    """Seconds a whole request (line, headers, body) may take to arrive; then the connection is
    closed (``--http-request-timeout``)."""
    max_connections: int = 128
    """HTTP connections served at once, a thread each; more get 503 (``--http-max-connections``)."""
