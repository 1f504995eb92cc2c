"""The lighthouse: one central service that holds the live config of a training job."""

from lighthouse.client import LighthouseClient
from lighthouse.server import LighthouseServer
from protos.tls import ServerTLS, TLSConfig

__all__ = ["LighthouseClient", "LighthouseServer", "ServerTLS", "TLSConfig"]
