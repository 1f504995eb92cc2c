"""The operator's side: ``AdminClient`` (the admin API from Python), the ``lighthouse config``,
``jobs``, ``metrics`` commands and their tables. Imports only ``lighthouse.config`` and protos,
never server code: a login node runs it without loading the store, HTTP server or gRPC service."""

from lighthouse.admin.client import AdminClient, AdminError

__all__ = ["AdminClient", "AdminError"]
