"""Raw gRPC calls as an attacker (or a test) makes them: credentials in metadata, the status code."""

from __future__ import annotations

from typing import Any

import grpc


def bearer(token: str) -> list[tuple[str, str]]:
    """Call metadata presenting ``token`` (a lighthouse with --manager-tokens-file)."""
    return [("authorization", f"Bearer {token}")]


def code_of(rpc: Any, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """The status code of one call (OK when it succeeded)."""
    try:
        rpc(*args, timeout=10, **kwargs)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK
