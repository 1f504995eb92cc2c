"""The options that reach one etcd cluster (certificates, user and password), declared once for
every command that opens the etcd store (``lighthouse serve``, ``lighthouse migrate``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from lighthouse.etcd.connection import EtcdAuth

PASSWORD_ENV = "LIGHTHOUSE_STORE_PASSWORD"

F = TypeVar("F", bound=Callable[..., Any])

ETCD_CONNECTION_OPTIONS = (
    click.option("--store-ca", default=None, help="CA bundle that signed etcd's certificates (etcds://)."),
    click.option("--store-cert", default=None, help="Client certificate for etcd (mutual TLS)."),
    click.option("--store-key", default=None, help="Key of --store-cert."),
    click.option("--store-user", default=None, help=f"etcd user to log in as (password: ${PASSWORD_ENV})."),
    click.option(
        "--store-password-file",
        default=None,
        help="File whose first line is --store-user's password (instead of the environment).",
    ),
)


def etcd_connection_options(func: F) -> F:
    """Adds ``ETCD_CONNECTION_OPTIONS`` to a click command."""
    for option in reversed(ETCD_CONNECTION_OPTIONS):
        func = option(func)
    return func


def store_auth(user: str | None, password_file: str | None) -> EtcdAuth | None:
    """``--store-user`` with its password from ``--store-password-file`` (its first line) or else
    ``$LIGHTHOUSE_STORE_PASSWORD``; never a flag value, which ``ps`` would show. ValueError when
    a password comes without a user or a user without one."""
    if user is None:
        if password_file is not None:
            raise ValueError("--store-password-file needs --store-user")
        return None
    if password_file is not None:
        with open(password_file, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    else:
        password = os.environ.get(PASSWORD_ENV, "")
    if not password:
        raise ValueError(
            f"--store-user {user}: no password (set {PASSWORD_ENV} or give --store-password-file)"
        )
    return EtcdAuth(user, password)
