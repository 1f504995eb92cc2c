"""One lighthouse for torchft: torchft's own lighthouse in-process, its RPCs forwarded unchanged.

``lighthouse serve --torchft`` starts torchft's (Rust) lighthouse on a localhost port and serves
every ``torchft.LighthouseService`` method but the seed's GetConfig on our gRPC port by passing
the raw request bytes, the caller's deadline and metadata to it, and its raw reply or status back.
torchft's lighthouse decides every quorum: nothing here parses its messages.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import grpc

from protos.torchft_seed import SEED_GET_CONFIG, SEED_SERVICE, HeartbeatRequest, QuorumResponse

logger = logging.getLogger(__name__)

INSTALL = "pip install 'lighthouse-config[torchft]'"
QUORUM = f"/{SEED_SERVICE}/Quorum"
HEARTBEAT = f"/{SEED_SERVICE}/Heartbeat"
UNARY = frozenset({QUORUM, HEARTBEAT})
"""torchft 0.2.0's methods, forwarded as unary calls; any other (a newer torchft's streams) as a stream."""
_NOT_FORWARDED = ("content-type", "user-agent", "te")  # HTTP/2 headers grpc sets itself
MAX_HEARTBEATING = 1024  # replica groups the view remembers (the least recent goes first)


class TorchftMissing(ImportError):
    """``--torchft`` without the torchft package."""


class TorchftLighthouse:
    """torchft's lighthouse, running in this process on a localhost port (its defaults for ``None``)."""

    def __init__(
        self,
        min_replicas: int,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
    ) -> None:
        try:
            compiled = load_compiled()
        except ImportError as exc:
            raise TorchftMissing(f"--torchft needs the torchft package ({exc}): {INSTALL}") from None
        self._server: Any = compiled.LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        port = urlsplit(self._server.address()).port  # it names the host, not the bound 127.0.0.1
        self.target = f"127.0.0.1:{port}"
        self.dashboard_url = f"http://{self.target}/"
        """torchft's own page (quorum, members, their steps), served on its port."""

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


COMPILED = "torchft._torchft"


def load_compiled() -> ModuleType:
    """torchft's compiled module (its Rust lighthouse), without running ``torchft/__init__.py``.

    The package's ``__init__`` imports torch (seconds of start-up, hundreds of MB); the lighthouse
    lives in the extension module alone, which needs no torch. Registered under its own name, so a
    later ``import torchft`` in this process reuses it (an extension is initialized once).
    """
    if COMPILED in sys.modules:
        return sys.modules[COMPILED]
    package = importlib.util.find_spec("torchft")  # locates the package, runs none of it
    folders = package.submodule_search_locations if package is not None else None
    if not folders:
        raise ModuleNotFoundError("No module named 'torchft'", name="torchft")
    for folder in folders:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"_torchft{suffix}"
            spec = importlib.util.spec_from_file_location(COMPILED, path) if path.is_file() else None
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[COMPILED] = module
                return module
    raise ModuleNotFoundError(f"No module named {COMPILED!r} in {list(folders)}", name=COMPILED)


class TorchftView:
    """What torchft's lighthouse answered through our port, for the dashboard (``snapshot``).

    The forward only keeps bytes (the last quorum reply, each group's heartbeat request and when it
    came); they are parsed when the dashboard asks, off the gRPC path. torchft's own page shows the
    same, but loads its script from the internet and listens on localhost only.
    """

    def __init__(self, page_url: str) -> None:
        self.page_url = page_url
        self._lock = threading.Lock()
        self._quorum: tuple[bytes, float] | None = None
        self._heartbeats: dict[bytes, float] = {}

    def saw(self, method: str, request: bytes, response: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            if method == QUORUM:
                self._quorum = (response, now)
            elif method == HEARTBEAT:
                self._heartbeats.pop(request, None)  # re-inserted last: the dict is in recency order
                self._heartbeats[request] = now
                if len(self._heartbeats) > MAX_HEARTBEATING:
                    del self._heartbeats[next(iter(self._heartbeats))]

    def snapshot(self) -> dict[str, Any]:
        """The latest quorum (its id, its step: the highest of its members', the members) and the
        replica groups heartbeating, with seconds since each was seen."""
        with self._lock:
            quorum, heartbeats = self._quorum, dict(self._heartbeats)
        now = time.monotonic()
        seen: dict[str, float] = {}
        for raw, at in heartbeats.items():  # torchft parsed each (a call it refused is not kept)
            request: Any = HeartbeatRequest.FromString(raw)
            seen[request.replica_id] = round(now - at, 3)
        view: dict[str, Any] = {"page": self.page_url, "quorum": None}
        if quorum is not None:
            reply: Any = QuorumResponse.FromString(quorum[0])
            reply = reply.quorum
            members = [
                {
                    "replica_id": m.replica_id,
                    "step": m.step,
                    "world_size": m.world_size,
                    "address": m.address,
                    "heartbeat_s": seen.get(m.replica_id),
                }
                for m in reply.participants
            ]
            view["quorum"] = {
                "id": reply.quorum_id,
                "step": max((m.step for m in reply.participants), default=0),
                "members": members,
                "seconds_ago": round(now - quorum[1], 3),
            }
        view["heartbeats"] = [{"replica_id": r, "seconds_ago": s} for r, s in sorted(seen.items())]
        return view


def _metadata(pairs: Any) -> tuple[tuple[str, str | bytes], ...]:
    return tuple(
        (key, value)
        for key, value in pairs or ()
        if not key.startswith((":", "grpc-")) and key not in _NOT_FORWARDED
    )


class ForwardHandler(grpc.GenericRpcHandler):
    """``torchft.LighthouseService/*`` but GetConfig, to ``target`` as raw bytes (grpc.aio handlers)."""

    def __init__(self, target: str, view: TorchftView | None = None) -> None:
        self._target = target
        self._view = view
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        # Made on the server's event loop, at the first call (an aio channel belongs to its loop).
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self._target)
        return self._channel

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(f"/{SEED_SERVICE}/") or method == SEED_GET_CONFIG:
            return None
        if method in UNARY:
            return grpc.unary_unary_rpc_method_handler(functools.partial(self._unary, method))
        return grpc.stream_stream_rpc_method_handler(functools.partial(self._stream, method))

    async def _unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = self._open().unary_unary(method, None, None)(
            request, timeout=context.time_remaining(), metadata=_metadata(context.invocation_metadata())
        )
        try:
            response: bytes = await call
        except grpc.aio.AioRpcError as exc:
            await _abort(context, exc)
            raise  # not reached: abort raises
        await _pass_metadata(call, context)
        if self._view is not None:
            self._view.saw(method, request, response)
        return response

    async def _stream(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        call = self._open().stream_stream(method, None, None)(
            requests, timeout=context.time_remaining(), metadata=_metadata(context.invocation_metadata())
        )
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            await _abort(context, exc)
        await _pass_metadata(call, context)


async def _pass_metadata(call: Any, context: grpc.aio.ServicerContext) -> None:
    trailing = _metadata(await call.trailing_metadata())
    if trailing:
        context.set_trailing_metadata(trailing)


async def _abort(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    """torchft's status, unchanged (code, details, trailing metadata)."""
    await context.abort(exc.code(), exc.details() or "", _metadata(exc.trailing_metadata()))
