"""gRPC plumbing shared by every part: addresses, method paths, channel and server options.

It lives beside the generated code because it is part of the wire contract
(message limits, how an address is written), and because worker_client,
lighthouse and manager all need it while depending on nothing but protos.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent import futures
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import grpc

from protos.tls import TLSConfig

if TYPE_CHECKING:  # only servers load the probes' packages, never a worker
    from protos.probes import Probes

LIGHTHOUSE_SERVICE = "lighthouse_config.LighthouseService"
MANAGER_SERVICE = "lighthouse_config.ManagerService"
# A gRPC health name of the lighthouse's alone (no service answers under it): whether its store can
# take writes now. For alerts and dashboards, never for routing (``lighthouse.server``).
LIGHTHOUSE_STORE_HEALTH = "lighthouse.store"
LIGHTHOUSE_GET_CONFIG = f"/{LIGHTHOUSE_SERVICE}/GetConfig"
LIGHTHOUSE_HEARTBEAT = f"/{LIGHTHOUSE_SERVICE}/Heartbeat"
LIGHTHOUSE_WATCH = f"/{LIGHTHOUSE_SERVICE}/WatchConfig"
MANAGER_GET_CONFIG = f"/{MANAGER_SERVICE}/GetConfig"
MANAGER_GET_STATUS = f"/{MANAGER_SERVICE}/GetStatus"

# Requests carry ids, counters and reported metrics, which their senders keep well under this
# (a worker's call about 64 KiB, a manager's status about 108 KB); anything bigger is junk and
# refused by gRPC.
MAX_REQUEST_BYTES = 256 * 1024
# Replies carry the config (at most ~1 MiB of JSON) and, rarely, a few step segments.
MAX_REPLY_BYTES = 64 * 1024 * 1024

DEFAULT_LIGHTHOUSE_PORT = 29510
# A manager's token for a lighthouse with --manager-tokens-file: the token itself, or a file holding it.
LIGHTHOUSE_TOKEN_ENV = "LIGHTHOUSE_TOKEN"
LIGHTHOUSE_TOKEN_FILE_ENV = "LIGHTHOUSE_TOKEN_FILE"
DEFAULT_DASHBOARD_PORT = 29511

# A peer that died or was cut off (a frozen host, a path that drops packets) leaves a connection
# that looks open: without keepalive TCP notices only after minutes of retransmissions. Every
# channel pings its peer after KEEPALIVE_TIME_MS without traffic and drops the connection when
# the ack has not come within KEEPALIVE_TIMEOUT_MS: a dead peer is noticed within 15 s, open
# streams fail (and are retried elsewhere) instead of waiting for ever.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

# How long one connection attempt may take to get the peer's HTTP/2 SETTINGS (TCP, TLS and the
# first frames): gRPC names it min_reconnect_backoff_ms, but it is the attempt's timeout, not a
# pause. It was 100 ms once, and a peer across a link of 200 ms each way, or a host too busy to
# answer within 100 ms, was never reached by a first call ("connection attempt timed out before
# receiving SETTINGS frame", however long the call's deadline). A call's deadline bounds the
# wait; an attempt across a partition completes when it heals.
CONNECT_TIMEOUT_MS = 5_000

# A restarted peer must be found again within about a second, not after gRPC's default
# exponential backoff of up to two minutes: a refused attempt is retried after 100 ms, growing
# to 1 s.
RECONNECT_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
]

# Both ends of every connection (our channels and servers, and the lighthouse's etcd channels).
KEEPALIVE_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # grpcio (1.85) waits for a ping's ack as long as this says, one minute by default, whatever
    # keepalive_timeout_ms says: without it a black-holed peer is noticed after 70 s, not 15.
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Keep pinging however long no data flows (gRPC's default stops after two pings without data).
    ("grpc.http2.max_pings_without_data", 0),
]

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    *RECONNECT_OPTIONS,
    *KEEPALIVE_OPTIONS,
    # Ping idle channels too (a manager between two fetches, a worker between two steps), so the
    # next call finds a dead peer already noticed. Our servers permit it (SERVER_OPTIONS).
    ("grpc.keepalive_permit_without_calls", 1),
    # Cluster-internal traffic: an http_proxy meant for the internet must not capture it.
    ("grpc.enable_http_proxy", 0),
]

SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
    # Without this a second server could silently share the port with a live one.
    ("grpc.so_reuseport", 0),
    # Our clients ping every KEEPALIVE_TIME_MS, with or without calls. gRPC servers by default
    # allow a ping only every 5 minutes and without calls not at all, and answer more with a
    # GOAWAY (too_many_pings) that drops the connection: permit our rate, with room for timer skew.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    # The server pings its clients as they ping it, so a dead client's connection (and its open
    # streams, e.g. a health Watch) is released within seconds.
    *KEEPALIVE_OPTIONS,
]


# A peer drops a connection whose keep-alive ping went unanswered, e.g. while this process stood
# still (SIGSTOP, a paused VM, a long swap); one restarted drops it too. Woken, the process sends
# its next call before gRPC has switched to a new connection, and the call fails at once,
# UNAVAILABLE "Stream removed" (the next one too, for a moment); or gRPC was connecting again when
# the process froze, the peer closed that half-made connection too, and the call fails with it
# ("failed to connect ...: Socket closed") until the next attempt, about 100 ms later
# (RECONNECT_OPTIONS). The call is asked again after each of these pauses, within its deadline,
# until it goes out on a new connection; a peer that is down refuses a new connection, and that
# failure stands.
DROPPED_RETRY_PAUSES = (0.0, 0.005, 0.02, 0.1, 0.25)
_T = TypeVar("_T")


def connection_dropped(exc: BaseException) -> bool:
    """The call was sent on a connection that closed under it (gRPC: "Stream removed"), or on one
    being made that the peer accepted and closed ("Socket closed", "Connection reset")."""
    if not isinstance(exc, grpc.Call) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = exc.details() or ""
    return details.startswith("Stream removed") or (
        details.startswith("failed to connect")
        and ("Socket closed" in details or "Connection reset" in details)
    )


def call_again_if_dropped(call: Callable[[float], _T], failure: BaseException, deadline: float) -> _T:
    """``call(timeout)`` again while it fails on a dropped connection (``DROPPED_RETRY_PAUSES``),
    within the monotonic ``deadline``; any other failure, or the last, is raised."""
    for pause in DROPPED_RETRY_PAUSES:
        if not connection_dropped(failure) or deadline - time.monotonic() <= pause:
            break
        time.sleep(pause)
        try:
            return call(deadline - time.monotonic())
        except grpc.RpcError as again:
            failure = again
    raise failure


def varint_field(number: int, value: int) -> bytes:
    """A serialized int64 protobuf field, to append to an already serialized message (protobuf
    keeps the last value of a scalar field): a per-call value without re-serializing the rest."""
    if value < 0:
        value += 1 << 64  # int64: ten bytes of two's complement
    out = bytearray([number << 3])  # wire type 0 (varint)
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port``, ``[v6]:port`` or torchft's ``http://host:port`` into (host, port).

    Raises ValueError with a message a user can act on.
    """
    text = address.strip()
    for scheme in ("http://", "https://", "grpc://", "dns:///", "ipv4:", "ipv6:"):
        if text.lower().startswith(scheme):
            text = text[len(scheme) :]
            break
    text = text.rstrip("/")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"invalid address {address!r}: expected [IPv6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"invalid address {address!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT)")
    if not host:
        host = "::"  # ":PORT" means every interface, as in DESIGN.md's ":29511"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"invalid address {address!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"invalid address {address!r}: port {port} out of range")
    return host, port


def format_address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grpc_target(address: str) -> str:
    """The target string grpc.insecure_channel wants for a user-written address."""
    return format_address(*parse_address(address))


def dialable_address(bind: str, port: int) -> str:
    """The address a client should dial for a server bound at ``bind`` (wildcards -> this host)."""
    host, _ = parse_address(bind)
    if host in ("::", "0.0.0.0", "*"):
        host = _reachable_hostname()
    return format_address(host, port)


def _reachable_hostname() -> str:
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        return "localhost"
    return name


def make_channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    if tls is not None:
        options = CHANNEL_OPTIONS + tls.channel_options()
        return grpc.secure_channel(grpc_target(address), tls.channel_credentials(), options=options)
    return grpc.insecure_channel(grpc_target(address), options=CHANNEL_OPTIONS)


def start_server(
    bind: str,
    handlers: list[grpc.GenericRpcHandler],
    max_workers: int,
    credentials: grpc.ServerCredentials | None = None,
    probes: Probes | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server on ``bind`` (TLS with ``credentials``) and return it with the port bound.

    ``probes`` adds the standard health and reflection services beside ``handlers``.

    Raises OSError when the address cannot be bound (in use, bad host).
    """
    host, port = parse_address(bind)
    if port != 0:
        _check_bindable(host, port)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        handlers=handlers,
        options=SERVER_OPTIONS,
    )
    if probes is not None:
        probes.register(server)
    bound = add_port(server, bind, credentials)
    server.start()
    return server, bound


def add_port(
    server: grpc.Server | grpc.aio.Server, bind: str, credentials: grpc.ServerCredentials | None
) -> int:
    """Listen on ``bind`` (TLS with ``credentials``); the port bound. OSError when it cannot."""
    target = format_address(*parse_address(bind))
    try:
        if credentials is not None:
            bound = server.add_secure_port(target, credentials)
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError as exc:  # grpcio raises RuntimeError when binding fails
        raise OSError(f"cannot listen on {bind}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {bind}: address in use or not available")
    return bound


def check_bindable(bind: str) -> None:
    """Fail with a plain message ("address already in use") before gRPC logs its own cryptic one."""
    host, port = parse_address(bind)
    if port != 0:
        _check_bindable(host, port)


def _check_bindable(host: str, port: int) -> None:
    """Fail with a plain message ("address already in use") before gRPC logs its own cryptic one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise OSError(f"cannot listen on {format_address(host, port)}: {exc.strerror or exc}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise OSError(f"cannot listen on {format_address(host, port)}: {exc.strerror or exc}") from None


def seconds(value: timedelta | float | None, default: float) -> float:
    """Accept timedelta or float seconds on the API, as DESIGN.md says."""
    if value is None:
        return default
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def split_addresses(addresses: str, what: str = "address") -> list[str]:
    """``"A,B,C"`` -> ``["A", "B", "C"]`` (each checked); raises ValueError for an empty or bad list
    (``what`` names the missing thing: "no etcd endpoint in ...")."""
    items = [a.strip() for a in addresses.split(",") if a.strip()]
    if not items:
        raise ValueError(f"no {what} in {addresses!r}")
    for item in items:
        parse_address(item)
    return items
