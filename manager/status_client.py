"""What operators' tools ask a running manager (``manager get``, ``manager status``), and what to
say when the address is not one.

The usual mistake is the address: a lighthouse's gRPC port (it speaks gRPC but
has no ManagerService: gRPC's own answer is ``UNIMPLEMENTED: Method not found!``),
a dashboard port (HTTP/1.1, not gRPC) or nothing at all. Each failure becomes
one line (``NotAManager``) that says what is there and what to run instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from protos import lighthouse_config_pb2 as pb
from protos.rpc import LIGHTHOUSE_GET_CONFIG, MANAGER_GET_CONFIG, MANAGER_GET_STATUS, make_channel
from protos.tls import TLSConfig, explain_rpc_error

M = TypeVar("M", bound=Message)

PROBE_SECONDS = 2.0  # the extra call that finds out what answered instead of a manager


class NotAManager(Exception):
    """No manager answered at the address; the message says what is there instead."""


def peek_config(
    addr: str, step: int | None, timeout: float, tls: TLSConfig | None = None
) -> pb.ManagerConfigResponse:
    """The config a worker would get (for ``step``), looking only: pins nothing, moves no step."""
    request = pb.ManagerConfigRequest(peek=True)
    if step is not None:
        request.step = step
    return _ask(addr, MANAGER_GET_CONFIG, request, pb.ManagerConfigResponse, timeout, tls)


def manager_info(addr: str, timeout: float, tls: TLSConfig | None = None) -> pb.ManagerInfo:
    """What the manager serves and why (its source, version, cache age, lighthouse, pinned steps)."""
    return _ask(addr, MANAGER_GET_STATUS, pb.ManagerInfoRequest(), pb.ManagerInfo, timeout, tls)


def _ask(
    addr: str, method: str, request: Message, reply: type[M], timeout: float, tls: TLSConfig | None
) -> M:
    try:
        channel = make_channel(addr, tls)
    except ValueError as exc:  # not HOST:PORT
        raise NotAManager(str(exc)) from None
    try:
        call = _stub(channel, method, reply)
        try:
            answer: M = call(request, timeout=timeout)
            return answer
        except grpc.RpcError as exc:
            raise NotAManager(_explain(addr, method, exc, channel, timeout, tls)) from None
    finally:
        channel.close()


def _stub(channel: grpc.Channel, method: str, reply: type[M]) -> Callable[..., Any]:
    return channel.unary_unary(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=reply.FromString
    )


def _explain(
    addr: str, method: str, exc: grpc.RpcError, channel: grpc.Channel, timeout: float, tls: TLSConfig | None
) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return _what_answered(addr, method, channel, tls)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {addr} within {timeout:g} s (a hung manager, or packets dropped on the way)"
    if "Failed parsing HTTP/2" in details:
        return (
            f"{addr} speaks HTTP/1.1, not gRPC (a lighthouse dashboard?): give the address "
            "`manager serve` printed"
        )
    if "Connection refused" in details:
        return f"no manager at {addr}: connection refused (is `manager serve` running there?)"
    if "resolving" in details or "lookup" in details:
        return f"no manager at {addr}: the host name does not resolve"
    return f"no manager at {addr}: {explain_rpc_error(exc, tls is not None)} ({details[-200:]})"


def _what_answered(addr: str, method: str, channel: grpc.Channel, tls: TLSConfig | None) -> str:
    """A gRPC server without the method: a lighthouse, or a manager older than GetStatus?"""
    if method == MANAGER_GET_STATUS:
        try:
            _stub(channel, MANAGER_GET_CONFIG, pb.ManagerConfigResponse)(
                pb.ManagerConfigRequest(peek=True), timeout=PROBE_SECONDS
            )
        except grpc.RpcError:
            pass
        else:
            return (
                f"the manager at {addr} is older than `manager status` (no GetStatus): "
                f"upgrade it, or use `manager get --addr {addr}`"
            )
    try:
        reply = _stub(channel, LIGHTHOUSE_GET_CONFIG, pb.LighthouseConfigResponse)(
            pb.LighthouseConfigRequest(), timeout=PROBE_SECONDS
        )
    except grpc.RpcError:
        return f"{addr} answers gRPC but is not a manager (it has no {method.rsplit('/', 1)[-1]})"
    scheme = "https" if tls is not None else "http"
    return (
        f"{addr} is a lighthouse's gRPC port (config version {reply.version}), not a manager: give the "
        "address `manager serve` printed, or read the lighthouse with "
        f"`lighthouse config show --url {scheme}://HOST:PORT` (its dashboard port, 29511 by default)"
    )
