"""``connect()``: two lines in a torchrun script give every rank a ``ManagerClient`` to its group's manager.

As torchft's ``Manager`` does with its own server, group rank 0 hosts the
group's manager and publishes its address in torchrun's store (a ``TCPStore``
client at ``MASTER_ADDR:MASTER_PORT``); every rank, rank 0 too, reads it. The
manager runs as a child process of rank 0 (``python -m manager serve``; started
with ``subprocess``, never forked: grpcio is not fork-safe), in rank 0's process
group so that torchrun's shutdown of the rank stops it too, and with
``--parent-pid`` so that it also stops when rank 0 is SIGKILLed.

The store key holds the replica id and torchrun's restart count, so a group
restarted by torchrun never dials the manager of its previous life.

torch is imported here only, and only when no ``store`` is given: it is an
optional extra of this package.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from protos.job_ids import JOB_ENV, check_job_id
from protos.rpc import LIGHTHOUSE_TOKEN_ENV, LIGHTHOUSE_TOKEN_FILE_ENV, seconds, split_addresses
from protos.tls import LIGHTHOUSE_TLS_ENVS, TLSConfig, lighthouse_tls_from_env
from worker_client.changes import ConfigChange
from worker_client.client import DEFAULT_TIMEOUT, ConfigUnavailable, ManagerClient

logger = logging.getLogger(__name__)

ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
ENV_REPLICA_ID = "REPLICA_GROUP_ID"
ENV_RANK = "RANK"
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)  # the child imports the same code as we do
_managers: list[subprocess.Popen[bytes]] = []  # started by this process, stopped at exit


def connect(
    *,
    lighthouse: str | None = None,
    replica_id: str | None = None,
    job: str | None = None,
    store: Any = None,
    timeout: timedelta | float = timedelta(seconds=DEFAULT_TIMEOUT),
    prefetch: bool = False,
    cache_ttl: float | None = None,
    push_lease_seconds: float | None = None,
    strict: bool = False,
    tls: TLSConfig | None = None,
    on_change: Callable[[ConfigChange], object] | None = None,
    lighthouse_token: str | None = None,
    run_id: str | int | None = None,
) -> ManagerClient:
    """A ``ManagerClient`` to this replica group's manager, started by group rank 0.

    Reads ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``LIGHTHOUSE_JOB`` (optional),
    ``RANK``, ``TORCHELASTIC_RESTART_COUNT`` and, without ``store``,
    ``MASTER_ADDR``/``MASTER_PORT``; a missing one is a ``ValueError`` naming it.
    ``timeout`` bounds the wait for the manager's address (``ConfigUnavailable``
    after it) and is the client's per-call deadline. ``store`` is anything with
    torch's ``Store`` ``set``/``get``/``wait``. ``strict`` makes every call raise
    ``ConfigUnavailable`` rather than return a config the lighthouse did not confirm
    (what a torchft job wants: see the README's "Step consistency"). ``tls`` is how
    the manager dials a TLS lighthouse (its CA, and a client pair for mutual TLS);
    without it, ``LIGHTHOUSE_CA``, ``LIGHTHOUSE_CERT`` and ``LIGHTHOUSE_KEY`` name the files.
    ``on_change`` is ``ManagerClient``'s (a tracker adapter from ``worker_client.trackers``).
    ``lighthouse_token`` is the manager's token for a lighthouse with ``--manager-tokens-file``;
    without it the manager reads ``LIGHTHOUSE_TOKEN`` or ``LIGHTHOUSE_TOKEN_FILE``.
    ``cache_ttl`` and ``push_lease_seconds`` are the manager's (``manager serve --cache-ttl``,
    ``--push-lease-seconds``: 0 leases a TTL of steps on the push stream too, so an outage of
    half a TTL goes unnoticed, for changes that wait up to a TTL). ``run_id`` names this run of the
    training script (e.g. ``TORCHELASTIC_RESTART_COUNT`` when the whole job restarts together): an
    id the job never had ends its live run and begins a new one at the group's step, so the changes
    promised to the old run apply from the resume step. Leave it out when groups restart alone
    (torchft heals them): their run is the job's.
    """
    wait = seconds(timeout, DEFAULT_TIMEOUT)
    deadline = time.monotonic() + wait
    rank = _rank()
    lighthouse = lighthouse or _env(ENV_LIGHTHOUSE)
    replica_id = replica_id or _env(ENV_REPLICA_ID)
    job = job or os.environ.get(JOB_ENV) or None
    if job is not None:
        job = check_job_id(job)  # a bad id fails here, naming the rule, not in the manager's log
    if store is None:
        store = _torchrun_store(wait)
    key = store_key(replica_id, job)
    if rank == 0:
        tls = tls if tls is not None else lighthouse_tls_from_env()
        address = _start_manager(
            lighthouse,
            replica_id,
            job,
            cache_ttl,
            tls,
            deadline,
            lighthouse_token,
            run_id,
            push_lease_seconds,
        )
        store.set(key, address)
    else:
        address = _await_address(store, key, deadline)
    logger.info("rank %d: replica group %s's config manager is %s", rank, replica_id, address)
    return ManagerClient(
        address, timeout=wait, group_rank=rank, prefetch=prefetch, strict=strict, on_change=on_change
    )


def store_key(replica_id: str, job: str | None) -> str:
    """Where rank 0 publishes the manager's address: one key per group, job and torchrun restart."""
    restart = os.environ.get(ENV_RESTART_COUNT, "0")
    return f"lighthouse_config/{job or 'default'}/{replica_id}/restart{restart}/manager_addr"


def _env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"connect(): environment variable {name} is not set (or pass it as an argument)")
    return value


def _rank() -> int:
    text = _env(ENV_RANK)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"connect(): environment variable {ENV_RANK} is not an integer: {text!r}") from None


def _torchrun_store(wait: float) -> Any:
    """A client of the store torchrun serves at MASTER_ADDR:MASTER_PORT (what torchft's Manager uses)."""
    host = _env("MASTER_ADDR")
    port_text = _env("MASTER_PORT")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(
            f"connect(): environment variable MASTER_PORT is not a port: {port_text!r}"
        ) from None
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=wait))


def _await_address(store: Any, key: str, deadline: float) -> str:
    remaining = max(0.001, deadline - time.monotonic())
    try:
        store.wait([key], timedelta(seconds=remaining))
        value = store.get(key)
    except Exception as exc:  # torch raises its own store/timeout errors
        raise ConfigUnavailable(
            f"no config manager address under store key {key!r} after {remaining:.1f}s: "
            f"group rank 0 did not publish it (did it call connect()?): {exc}"
        ) from exc
    return value.decode() if isinstance(value, bytes) else str(value)


def _start_manager(
    lighthouse: str,
    replica_id: str,
    job: str | None,
    cache_ttl: float | None,
    tls: TLSConfig | None,
    deadline: float,
    token: str | None = None,
    run_id: str | int | None = None,
    push_lease_seconds: float | None = None,
) -> str:
    """Start ``manager serve`` on a free port as our child and return the address it printed."""
    if tls is not None and tls.ca is None and tls.cert is None:
        lighthouse = _as_https(lighthouse)  # TLS on the system's roots: https:// says so
    args = [sys.executable, "-m", "manager", "serve", "--lighthouse", lighthouse, "--bind", "[::]:0"]
    args += ["--replica-id", replica_id, "--parent-pid", str(os.getpid())]
    if job is not None:
        args += ["--job", job]
    if cache_ttl is not None:
        args += ["--cache-ttl", str(cache_ttl)]
    if push_lease_seconds is not None:
        args += ["--push-lease-seconds", str(push_lease_seconds)]
    if run_id is not None and str(run_id):
        args += ["--run-id", str(run_id)]
    if tls is not None:
        args += _lighthouse_tls_args(tls)
    env = dict(os.environ)
    for name in LIGHTHOUSE_TLS_ENVS:  # read into ``tls`` already: the options say it all
        env.pop(name, None)
    if token:  # in its environment, not its command line (ps shows that)
        env[LIGHTHOUSE_TOKEN_ENV] = token
        env.pop(LIGHTHOUSE_TOKEN_FILE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SOURCE_ROOT, env.get("PYTHONPATH")) if p)
    # stderr is inherited: the manager's log lands where rank 0's does.
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    if not _managers:
        atexit.register(_stop_managers)
    _managers.append(proc)
    try:
        return _first_line(proc, deadline)
    except BaseException:
        _stop(proc)
        raise


def _lighthouse_tls_args(tls: TLSConfig) -> list[str]:
    """``manager serve``'s options for the files of ``tls``."""
    if tls.server_name is not None:
        raise ValueError(
            "connect(tls=...): server_name cannot be passed on to the manager; "
            "dial a name the lighthouse's certificate holds instead"
        )
    files = [("--lighthouse-ca", tls.ca), ("--lighthouse-cert", tls.cert), ("--lighthouse-key", tls.key)]
    return [item for flag, path in files if path is not None for item in (flag, os.fspath(path))]


def _as_https(addresses: str) -> str:
    """The lighthouse list with every address written ``https://HOST:PORT``."""
    return ",".join("https://" + a.split("://", 1)[-1] for a in split_addresses(addresses))


def _first_line(proc: subprocess.Popen[bytes], deadline: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConfigUnavailable(f"the config manager did not print its address in time: {proc.args!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise ConfigUnavailable(
                f"the config manager exited ({proc.wait()}) before printing its address "
                f"(its error is on this rank's stderr): {proc.args!r}"
            )
        data += chunk
    return data.split(b"\n", 1)[0].decode().strip()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stop_managers() -> None:
    for proc in _managers:
        _stop(proc)
