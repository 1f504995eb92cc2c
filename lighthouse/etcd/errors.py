"""What an etcd call raises: a refusal (EtcdError) or an outage (EtcdUnavailable). The store maps
the outage to its own StoreUnavailable; the peers, which call etcd directly, catch these."""

from __future__ import annotations

import grpc


class EtcdUnavailable(Exception):
    """etcd has no quorum or none of its endpoints can be reached within the deadline."""


class EtcdError(Exception):
    """etcd refused a request (bad argument, unknown lease, compacted revision, too large...)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"etcd: {details} ({code.name})")
        self.code = code
        self.details = details


class EtcdAuthFailed(EtcdError):
    """etcd refused the user name or password (``Auth.Authenticate``)."""
