"""``LighthouseClient``: the gRPC client of the lighthouse, as torchft names it.

Training code normally goes through its group's manager; this client is for
direct use (tools, tests, single-process jobs) and for the manager itself.
"""

from __future__ import annotations

from datetime import timedelta

import grpc

from protos import lighthouse_config_pb2 as pb
from protos.rpc import LIGHTHOUSE_GET_CONFIG, LIGHTHOUSE_HEARTBEAT, make_channel, seconds
from protos.tls import TLSConfig


class LighthouseClient:
    """One reusable channel to a lighthouse; thread-safe.

    ``addr`` accepts ``host:port``, ``[v6]:port`` and ``http://host:port``.
    Calls raise ``grpc.RpcError`` when the lighthouse does not answer in time.
    ``tls`` dials a lighthouse serving TLS (``protos.tls.explain_rpc_error`` says what failed).
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta | float | None = None,
        *,
        tls: TLSConfig | None = None,
    ) -> None:
        self.addr = addr
        self.tls = tls
        self._channel = make_channel(addr, tls)
        self._get_config = self._channel.unary_unary(
            LIGHTHOUSE_GET_CONFIG,
            request_serializer=pb.LighthouseConfigRequest.SerializeToString,
            response_deserializer=pb.LighthouseConfigResponse.FromString,
        )
        self._heartbeat = self._channel.unary_unary(
            LIGHTHOUSE_HEARTBEAT,
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )
        if connect_timeout is not None:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=seconds(connect_timeout, 0))
            except grpc.FutureTimeoutError:
                self._channel.close()
                raise TimeoutError(f"lighthouse {addr} not reachable within {connect_timeout}") from None

    def get_config(self, timeout: timedelta | float = timedelta(seconds=5)) -> dict[str, str]:
        """The live config, encoded as ``dict[str, str]`` (torchft's config-sharing signature)."""
        reply = self.fetch(timeout=timeout)
        return dict(reply.config_data)

    def fetch(
        self,
        *,
        timeout: timedelta | float,
        known_version: int = 0,
        known_state_id: str = "",
        status: pb.ManagerStatus | None = None,
        replica_id: str = "",
    ) -> pb.LighthouseConfigResponse:
        """The full reply: version, per-step segments, and not_modified when ``known_version`` is current."""
        request = pb.LighthouseConfigRequest(
            replica_id=replica_id or (status.replica_id if status is not None else ""),
            known_version=known_version,
            known_state_id=known_state_id,
            status=status,
        )
        reply: pb.LighthouseConfigResponse = self._get_config(request, timeout=seconds(timeout, 5.0))
        return reply

    def heartbeat(
        self, status: pb.ManagerStatus, timeout: timedelta | float = 1.0
    ) -> pb.LighthouseHeartbeatResponse:
        reply: pb.LighthouseHeartbeatResponse = self._heartbeat(
            pb.LighthouseHeartbeatRequest(status=status), timeout=seconds(timeout, 1.0)
        )
        return reply

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
