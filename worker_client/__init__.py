"""The worker side: ``ManagerClient.get_config(step=...)`` at the start of every training step."""

from protos.tls import TLSConfig
from worker_client.client import ConfigUnavailable, ManagerClient
from worker_client.config import Config
from worker_client.connect import connect

__all__ = ["Config", "ConfigUnavailable", "ManagerClient", "TLSConfig", "connect"]
