"""``--store`` URLs: ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (``etcds://`` for TLS).

One parser for every command that opens an etcd store, so ``serve`` and
``migrate`` accept the same spelling.
"""

from __future__ import annotations

from protos.rpc import parse_address

DEFAULT_PREFIX = "/lighthouse-config"
SCHEMES = {"etcd": False, "etcds": True}  # scheme -> TLS


def parse_store_url(url: str) -> tuple[list[str], str, bool]:
    """(endpoints as ``host:port``, key prefix without a trailing slash, TLS); ValueError when malformed."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"store URL {url!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX]")
    hosts, slash, path = rest.partition("/")
    endpoints = [item.strip() for item in hosts.split(",") if item.strip()]
    if not endpoints:
        raise ValueError(f"store URL {url!r} names no etcd endpoint")
    for endpoint in endpoints:
        parse_address(endpoint)  # ValueError naming the bad one
    prefix = ("/" + path).rstrip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    return endpoints, prefix, SCHEMES[scheme.lower()]
