"""Transport security for every part: who trusts whom, certificates reloaded from disk, readable failures.

``TLSConfig`` is the client side (the CA to trust, an optional client pair),
``ServerTLS`` the server side (the pair to present, an optional CA whose
client certificates are required). ``ServerCertificates`` serves both gRPC
(grpcio's dynamic credentials ask it before every handshake) and HTTPS
(``ssl_context()`` on every accept): a stat per call, files re-read only when
they changed, so rotating a pair on disk needs no restart and open
connections keep the pair they started with. It lives in ``protos`` beside
``rpc`` because lighthouse, manager and worker_client all need it.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def _read(path: PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {os.fspath(path)}: {exc.strerror or exc}") from None


# Where a client finds the lighthouse's TLS files when no option names them (the manager's
# --lighthouse-ca/--lighthouse-cert/--lighthouse-key, and connect() in a torchrun script).
LIGHTHOUSE_TLS_ENVS = ("LIGHTHOUSE_CA", "LIGHTHOUSE_CERT", "LIGHTHOUSE_KEY")


@dataclass(frozen=True)
class TLSConfig:
    """A client's TLS: ``ca`` to trust (None: the system's roots), ``cert``/``key`` for mutual TLS.

    ``server_name`` checks the server's certificate against that name instead of
    the dialed host (gRPC only; for an address the certificate does not name).
    Files are read when a channel is made: a rotated client pair takes effect
    on the next client.
    """

    ca: PathLike | None = None
    cert: PathLike | None = None
    key: PathLike | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "CA certificate") if self.ca is not None else _system_roots()
        key = _read(self.key, "client key") if self.key is not None else None
        cert = _read(self.cert, "client certificate") if self.cert is not None else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, int | str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """A client context for HTTPS (the admin CLI): verifies the server, presents our pair if any."""
        try:
            context = ssl.create_default_context(cafile=os.fspath(self.ca) if self.ca is not None else None)
            if self.cert is not None and self.key is not None:
                context.load_cert_chain(os.fspath(self.cert), os.fspath(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS files: {exc}") from None
        return context


def _system_roots() -> bytes | None:
    """The system's CA bundle (what Python's ssl and the admin CLI trust; ``SSL_CERT_FILE`` moves
    it), so that gRPC trusts the same roots; None where there is none: gRPC's own bundled roots."""
    cafile = ssl.get_default_verify_paths().cafile
    return _read(cafile, "system CA bundle") if cafile else None


def tls_for(address: str, tls: TLSConfig | None) -> TLSConfig | None:
    """How to dial ``address``: with ``tls`` when given; an ``https://`` address speaks TLS
    trusting the system's roots; any other plaintext."""
    if tls is None and address.strip().lower().startswith("https://"):
        return TLSConfig()
    return tls


def lighthouse_tls_from_env(environ: Mapping[str, str] = os.environ) -> TLSConfig | None:
    """The lighthouse's TLS from ``LIGHTHOUSE_CA``/``LIGHTHOUSE_CERT``/``LIGHTHOUSE_KEY`` (None: unset)."""
    ca, cert, key = (environ.get(name) or None for name in LIGHTHOUSE_TLS_ENVS)
    if ca is None and cert is None and key is None:
        return None
    return TLSConfig(ca=ca, cert=cert, key=key)


@dataclass(frozen=True)
class ServerTLS:
    """A server's TLS: the pair it presents and, for mutual TLS, the CA its clients must chain to."""

    cert: PathLike
    key: PathLike
    client_ca: PathLike | None = None


@dataclass(frozen=True)
class _Loaded:
    generation: int
    key: bytes
    cert: bytes
    client_ca: bytes | None
    context: ssl.SSLContext


class ServerCertificates:
    """The current pair of a ``ServerTLS``, re-read when its files change on disk.

    A change is taken only once it loads (the key matches the certificate, the
    CA parses) and the files did not move while being read: a half-written
    rotation keeps the previous pair and logs why, once.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._paths = [Path(tls.cert), Path(tls.key)]
        if tls.client_ca is not None:
            self._paths.append(Path(tls.client_ca))
        self._lock = threading.Lock()
        self._tried: object = None
        self._given_to_grpc = 0
        signature = self._signature()
        loaded = self._load(signature, 1)
        if isinstance(loaded, str):
            raise ValueError(f"TLS: {loaded}")
        self._loaded = loaded
        self._tried = signature

    @property
    def mutual(self) -> bool:
        return self.tls.client_ca is not None

    def _signature(self) -> tuple[tuple[int, int, int], ...] | None:
        try:
            return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in (os.stat(p) for p in self._paths))
        except OSError:
            return None

    def _load(self, signature: object, generation: int) -> _Loaded | str:
        """The pair on disk now, or why it cannot be used."""
        if signature is None:
            missing = [str(p) for p in self._paths if not p.exists()]
            return f"missing {', '.join(missing) or 'files'}"
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(self._paths[0], self._paths[1])
            client_ca = None
            if self.tls.client_ca is not None:
                context.load_verify_locations(cafile=self._paths[2])
                context.verify_mode = ssl.CERT_REQUIRED
                client_ca = self._paths[2].read_bytes()
            key, cert = self._paths[1].read_bytes(), self._paths[0].read_bytes()
        except (OSError, ssl.SSLError) as exc:
            return f"cannot load {', '.join(map(str, self._paths))}: {exc}"
        if self._signature() != signature:
            return "the files changed while being read"
        return _Loaded(generation, key, cert, client_ca, context)

    def current(self) -> _Loaded:
        """The pair to use for a new connection (one stat of each file when nothing changed)."""
        signature = self._signature()
        if signature == self._tried:
            return self._loaded
        with self._lock:
            if signature != self._tried:
                loaded = self._load(signature, self._loaded.generation + 1)
                self._tried = signature
                if isinstance(loaded, str):
                    logger.warning("TLS files changed but %s; keeping the previous pair", loaded)
                else:
                    self._loaded = loaded
                    logger.info("TLS certificate reloaded from %s", self.tls.cert)
            return self._loaded

    def ssl_context(self) -> ssl.SSLContext:
        """The server context for a new HTTPS connection."""
        return self.current().context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Dynamic credentials: grpcio asks before every handshake whether the pair changed."""
        with self._lock:
            loaded = self._loaded
            self._given_to_grpc = loaded.generation
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_configuration(loaded),
            self._grpc_fetch,  # type: ignore[arg-type]  # grpcio takes None as "unchanged"; stubs say no
            require_client_authentication=self.mutual,
        )

    def _grpc_fetch(self) -> grpc.ServerCertificateConfiguration | None:
        loaded = self.current()
        with self._lock:
            if loaded.generation == self._given_to_grpc:
                return None
            self._given_to_grpc = loaded.generation
        return self._grpc_configuration(loaded)

    @staticmethod
    def _grpc_configuration(loaded: _Loaded) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(loaded.key, loaded.cert)], root_certificates=loaded.client_ca
        )


def explain_rpc_error(exc: BaseException, tls: bool) -> str:
    """A gRPC failure as a line a user can act on: which TLS problem it was, when it was one."""
    if not isinstance(exc, grpc.Call):
        return type(exc).__name__
    code = exc.code().name
    reason = tls_failure(exc.details() or "", tls)
    return f"{code}: {reason}" if reason else code


def tls_failure(details: str, tls: bool) -> str | None:
    """What a connection error's text (gRPC's or Python ssl's) means for TLS; None when not about TLS."""
    if not tls:
        if "Socket closed" in details or "Connection reset" in details:
            return "the server closed the connection at once: does it require TLS? (give a CA file)"
        return None
    if "certificate has expired" in details:
        return "TLS: the server's certificate has expired"
    if "certificate is not yet valid" in details:
        return "TLS: the server's certificate is not valid yet (clock skew?)"
    if "WRONG_VERSION_NUMBER" in details:
        return "TLS: the server does not speak TLS (a plaintext port?)"
    if "mismatch" in details or "not in peer certificate" in details or "Peer name" in details:
        return "TLS: the server's certificate does not name the address dialed"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return "TLS: the server's certificate is not signed by a trusted CA (check the CA file)"
    if "CERTIFICATE_REQUIRED" in details or "certificate required" in details:
        return "TLS: the server requires a client certificate (mutual TLS)"
    # TSI_DATA_CORRUPTED: TLS 1.3 ends the handshake before the server checks our certificate, so
    # its refusal arrives as an alert that gRPC cannot decrypt (etcd with --client-cert-auth).
    closed = ("Socket closed", "Connection reset", "EOF occurred", "TSI_DATA_CORRUPTED")
    if any(text in details for text in closed):
        return (
            "TLS: the server closed the connection in the handshake: it requires a client "
            "certificate (mutual TLS) or does not trust ours"
        )
    if "handshake" in details.lower():
        return f"TLS handshake failed ({details[-200:]})"
    return None


def tls_reason(exc: BaseException) -> str:
    """A Python ``ssl`` client error (HTTPS) in a user's words."""
    return tls_failure(str(exc), True) or str(exc)


def ssl_failure(exc: BaseException) -> str:
    """Why a server-side TLS handshake (HTTPS) failed, in a user's words."""
    text = str(exc)
    if "HTTP_REQUEST" in text:
        return "a plaintext HTTP request on the HTTPS port"
    if "PEER_DID_NOT_RETURN_A_CERTIFICATE" in text or "peer did not return a certificate" in text:
        return "the client sent no certificate (mutual TLS requires one)"
    if "UNKNOWN_CA" in text or "BAD_CERTIFICATE" in text or "CERTIFICATE_EXPIRED" in text:
        return "the client does not accept this server's certificate (its CA, names or dates)"
    if "certificate has expired" in text:
        return "the client's certificate has expired"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return "the client's certificate is not signed by the client CA"
    if isinstance(exc, TimeoutError):
        return "no handshake within the time limit"
    return text or type(exc).__name__
