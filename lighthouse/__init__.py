"""The lighthouse: one central service that holds the live config of a training job."""

from lighthouse.client import LighthouseClient
from lighthouse.server import LighthouseServer

__all__ = ["LighthouseClient", "LighthouseServer"]
