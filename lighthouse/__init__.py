"""The lighthouse: one central service that holds the live config of every training job.

``LighthouseServer`` is imported on first use: a manager or a tool that only needs
``LighthouseClient`` does not load the server side (store, HTTP, schema).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lighthouse.client import LighthouseClient
from protos.tls import ServerTLS, TLSConfig

if TYPE_CHECKING:
    from lighthouse.server import LighthouseServer

__all__ = ["LighthouseClient", "LighthouseServer", "ServerTLS", "TLSConfig"]


def __getattr__(name: str) -> Any:
    if name == "LighthouseServer":
        from lighthouse.server import LighthouseServer

        return LighthouseServer
    raise AttributeError(f"module 'lighthouse' has no attribute {name!r}")
