"""The manager: one config relay per replica group, between its workers and the lighthouse."""

from manager.server import ManagerServer

__all__ = ["ManagerServer"]
