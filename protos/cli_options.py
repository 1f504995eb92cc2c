"""Options every CLI shares (``lighthouse``, ``manager``, the admin commands), as click decorators.

``--job`` names the training job; the TLS decorators add their options and hand
the command one ``tls`` object (``ServerTLS``/``TLSConfig``, or None when no
option was given), so every command spells and checks them the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from protos.job_ids import DEFAULT_JOB, JOB_ENV
from protos.tls import ServerTLS, TLSConfig

F = TypeVar("F", bound=Callable[..., Any])


def job_option(what: str) -> Callable[[F], F]:
    """``--job NAME`` (env LIGHTHOUSE_JOB, default ``default``); ``what`` completes its help."""
    return click.option(
        "--job", envvar=JOB_ENV, default=DEFAULT_JOB, show_default=True, help=f"{what} (env {JOB_ENV})."
    )


_FILE = click.Path(dir_okay=False, path_type=Path)


def server_tls_options(func: F) -> F:
    """``--tls-cert/--tls-key [--tls-client-ca]`` -> ``tls: ServerTLS | None``."""

    @click.option(
        "--tls-cert",
        type=_FILE,
        default=None,
        help="PEM certificate (chain) to serve TLS with; reloaded when the file changes.",
    )
    @click.option("--tls-key", type=_FILE, default=None, help="The PEM key of --tls-cert.")
    @click.option(
        "--tls-client-ca",
        type=_FILE,
        default=None,
        help="Mutual TLS: require client certificates signed by this PEM CA.",
    )
    @functools.wraps(func)
    def wrapper(
        tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None, **kwargs: Any
    ) -> Any:
        if (tls_cert is None) != (tls_key is None):
            raise click.UsageError("--tls-cert and --tls-key go together")
        if tls_client_ca is not None and tls_cert is None:
            raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
        tls = ServerTLS(tls_cert, tls_key, tls_client_ca) if tls_cert and tls_key else None
        return func(tls=tls, **kwargs)

    return wrapper  # type: ignore[return-value]


def client_tls_options(
    ca: str = "--cacert",
    cert: str = "--cert",
    key: str = "--key",
    dest: str = "tls",
    peer: str = "server",
    envvars: tuple[str, str, str] | None = None,
) -> Callable[[F], F]:
    """``CA [CERT KEY]`` options -> ``dest: TLSConfig | None`` (TLS as soon as one is given);
    ``envvars`` name the variables each option defaults to."""

    def decorate(func: F) -> F:
        names = [name.lstrip("-").replace("-", "_") for name in (ca, cert, key)]
        env = envvars or (None, None, None)

        def helped(text: str, index: int) -> str:
            return f"{text} (env {env[index]})." if env[index] else f"{text}."

        @click.option(
            ca,
            names[0],
            type=_FILE,
            default=None,
            envvar=env[0],
            help=helped(f"PEM CA that signed the {peer}'s certificate, instead of the system's roots", 0),
        )
        @click.option(
            cert,
            names[1],
            type=_FILE,
            default=None,
            envvar=env[1],
            help=helped("PEM client certificate (mutual TLS)", 1),
        )
        @click.option(
            key, names[2], type=_FILE, default=None, envvar=env[2], help=helped(f"The PEM key of {cert}", 2)
        )
        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            ca_file, cert_file, key_file = (kwargs.pop(name) for name in names)
            if (cert_file is None) != (key_file is None):
                raise click.UsageError(f"{cert} and {key} go together")
            tls = None
            if ca_file or cert_file:
                tls = TLSConfig(ca=ca_file, cert=cert_file, key=key_file)
            return func(**{dest: tls}, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
