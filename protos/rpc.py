"""gRPC plumbing shared by every part: addresses, method paths, channel and server options.

It lives beside the generated code because it is part of the wire contract
(message limits, how an address is written), and because worker_client,
lighthouse and manager all need it while depending on nothing but protos.
"""

from __future__ import annotations

import socket
from concurrent import futures
from datetime import timedelta

import grpc

from protos.tls import TLSConfig

LIGHTHOUSE_GET_CONFIG = "/lighthouse_config.LighthouseService/GetConfig"
LIGHTHOUSE_HEARTBEAT = "/lighthouse_config.LighthouseService/Heartbeat"
MANAGER_GET_CONFIG = "/lighthouse_config.ManagerService/GetConfig"

# Requests carry ids, counters and reported metrics, which their senders keep well under this
# (a worker's call about 64 KiB, a manager's status about 108 KB); anything bigger is junk and
# refused by gRPC.
MAX_REQUEST_BYTES = 256 * 1024
# Replies carry the config (at most ~1 MiB of JSON) and, rarely, a few step segments.
MAX_REPLY_BYTES = 64 * 1024 * 1024

DEFAULT_LIGHTHOUSE_PORT = 29510
DEFAULT_DASHBOARD_PORT = 29511

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    # A restarted peer must be found again within about a second, not after
    # gRPC's default exponential backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Cluster-internal traffic: an http_proxy meant for the internet must not capture it.
    ("grpc.enable_http_proxy", 0),
]

SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", MAX_REPLY_BYTES),
    # Without this a second server could silently share the port with a live one.
    ("grpc.so_reuseport", 0),
]


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
) -> tuple[grpc.Server, int]:
    """Start a gRPC server on ``bind`` (TLS with ``credentials``) and return it with the port bound.

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
    try:
        target = format_address(host, port)
        if credentials is not None:
            bound = server.add_secure_port(target, credentials)
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError as exc:  # grpcio raises RuntimeError when binding fails
        raise OSError(f"cannot listen on {bind}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {bind}: address in use or not available")
    server.start()
    return server, bound


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
