"""The etcd store backend: every job's versions in an etcd cluster, so several lighthouses share them.

Key layout under PREFIX (default ``/lighthouse-config``; numbers zero-padded to 20
digits so keys sort by number)::

    {p}/index/{job}                                   ""  (the job stored a version)
    {p}/jobs/{job}/head                               latest version, decimal
    {p}/jobs/{job}/v/{version}                        one Change as JSON
    {p}/jobs/{job}/meta/{key}                         meta value (current_step, state_id, base, file:...)
    {p}/jobs/{job}/meta/lease_ceiling/{owner}         a live lighthouse life's step-lease ceiling
                                                      (on that life's etcd lease)
    {p}/jobs/{job}/meta/lease_ceiling_floor           the highest ceiling any life stored
    {p}/jobs/{job}/sw/{replica}/{step}/{version}      previous_step of a step switch
    {p}/jobs/{job}/schema/{time_ns}                   one schema change as JSON (id: create revision)
    {p}/jobs/{job}/guards/{version}                   a guarded change's guard as JSON

An append is one transaction comparing the job's head, so two lighthouses never
both commit a version and ``If-Match`` conflicts hold across lighthouses. A row
holds its change and, when both fit in one etcd request (etcd refuses requests
above ``--max-request-bytes``, 1.5 MiB by default), the resolved config; else the
store recomputes the config on load (it is a function of the rows).

The job step is written with "max" semantics (a compare-and-swap loop), so a
lighthouse never lowers a step another one stored. Steps and step switches come
from managers' calls: they are queued and written by a background thread, so a
manager's call never waits for etcd (nor fails when etcd has no quorum).

Each lighthouse watches the prefix (``subscribe``) and reloads a job when its head
moved, so an edit made through one lighthouse is served by all.

Step leases (see ``leases``) need two compares, so that no lighthouse commits a
change below a step another one promised: a lighthouse raises its lease ceiling
only while the job's head is the version it serves (else it has a change to
take first), and an append fails (HeadMoved: reload, plan again) when another
lighthouse raised its ceiling after the revision the commit's plan read.

Ceilings do not pile up with restarts: a life's own key lives on its etcd lease (deleted when it
closes, expiring ``CEILING_LEASE_TTL`` after it died), and every write of it also raises the
job's one floor key (compare-and-swap, in the same transaction), which outlives every life: a
restarted lighthouse, and its peers, read every promise any life made from the floor. Keys an
older release left without a lease are folded into the floor when a job is loaded.

Whether etcd can take a write now (``write_problem``, the lighthouse's ``lighthouse.store``
health, looked at each second) is known without writing: a linearizable read of one key needs
the quorum a commit needs (the leader confirms its leadership with a majority, through its read
index), and the Status of the member that answered lists the cluster's alarms (NOSPACE past
``--quota-backend-bytes``, CORRUPT) and a missing leader, each of which refuses every write. The
look is bounded (``PROBE_TIMEOUT``) and leaves a hung member after ``PROBE_ATTEMPT`` for the next.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from lighthouse.config.values import ConfigTooLarge
from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.connection import EtcdAuth
from lighthouse.etcd.errors import EtcdAuthFailed, EtcdError, EtcdUnavailable
from lighthouse.etcd.lease import KeepAlive
from lighthouse.etcd.types import Compare, Delete, Event, Get, KeyValue, Op, Put, prefix_end
from lighthouse.etcd.watch import Watch
from lighthouse.store.backend import (
    CeilingChanged,
    Change,
    GuardsChanged,
    HeadMoved,
    JobChanged,
    JobRecords,
    LeaseView,
    StepChanged,
    StoreFull,
    StoreUnavailable,
    Switch,
    stored_job,
    stored_jobs,
)
from protos.job_ids import JobId
from protos.tls import TLSConfig

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/lighthouse-config"
DEFAULT_TIMEOUT = 5.0
# etcd's default --max-request-bytes is 1.5 MiB; a row with its config must leave room for the
# rest of the append transaction (head, meta, index keys).
MAX_ROW_WITH_CONFIG = 1024 * 1024
MAX_REQUEST = 1536 * 1024 - 16 * 1024
TXN_OPS = 100  # etcd's default --max-txn-ops is 128
# Queued job steps and switches are written at most this often (one transaction per job whose
# step moved), so another lighthouse orders its changes by a step at most this old.
FLUSH_PAUSE = 0.25
FLUSH_BACKOFF_MAX = 2.0
FLUSH_TIMEOUT = 2.0  # per call of the background writer, so closing never waits long for it

LEASE_CEILING = "lease_ceiling/"  # meta key prefix: one key per live lighthouse life
CEILING_FLOOR = "lease_ceiling_floor"  # meta key: the highest ceiling any life of the job stored
CEILING_LEASE_TTL = 10.0  # seconds a dead life's own ceiling key outlives it (the floor keeps it)
RUNS_RECORD = "runs"  # the job's meta key of its runs record (``lighthouse.jobs.runs.RUNS_META``)
CEILING_CAS_TRIES = 16  # floor compare-and-swap attempts against other lighthouses' writes
# A ceiling is stored about a second before the leases need it (``SHARED_CEILING_AHEAD``), and a
# commit holds the grants while it is stored: a member that hangs gets this long before such a
# write moves to the next, not the client's whole attempt.
CEILING_ATTEMPT_TIMEOUT = 0.3
# ``write_problem``: the whole look, and each member's part of it.
PROBE_TIMEOUT = 0.5
PROBE_ATTEMPT = 0.2
PROBE_KEY = "write-probe"  # under the prefix (where an RBAC role lets the lighthouse read); never written


def _num(n: int) -> str:
    return f"{n:020d}"


def _no_quorum(exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(f"the config store has no quorum (etcd cannot commit now): {exc}")


# What etcd answers a write once its backend passed --quota-backend-bytes (its NOSPACE alarm).
NO_SPACE = "database space exceeded"


@contextmanager
def _mapped() -> Iterator[None]:
    """EtcdUnavailable -> the backend interface's StoreUnavailable (HTTP 503); etcd out of space ->
    StoreFull (507)."""
    try:
        yield
    except EtcdUnavailable as exc:
        raise _no_quorum(exc) from None
    except EtcdError as exc:
        if NO_SPACE not in exc.details:
            raise
        raise StoreFull(
            f"the config store is out of space (etcd: {exc.details}; compact, defragment and disarm "
            "its NOSPACE alarm); nothing was stored"
        ) from None


@dataclass(frozen=True)
class StoreUrl:
    endpoints: list[str]
    prefix: str
    tls: bool


def parse_store_url(url: str) -> StoreUrl:
    """``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (``etcds://`` = TLS); ValueError says what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise ValueError(f"store {url!r}: expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (or etcds://)")
    hosts, slash, path = rest.partition("/")
    endpoints = [h.strip() for h in hosts.split(",") if h.strip()]
    if not endpoints:
        raise ValueError(f"store {url!r}: no etcd endpoint (expected etcd://HOST:PORT[,HOST:PORT...])")
    for endpoint in endpoints:
        try:
            port = urlsplit(f"//{endpoint}").port
        except ValueError:
            port = None
        if port is None:
            raise ValueError(f"store {url!r}: endpoint {endpoint!r} is not HOST:PORT")
    prefix = ("/" + path).rstrip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    return StoreUrl(endpoints, prefix, scheme == "etcds")


def open_etcd_store(
    url: str,
    *,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    auth: EtcdAuth | None = None,
) -> EtcdBackend:
    """The backend ``--store URL`` names; ValueError for a bad URL or a refused login,
    StoreUnavailable when etcd cannot be reached."""
    parsed = parse_store_url(url)
    if not parsed.tls and (ca or cert or key):
        raise ValueError(f"store {url!r}: certificates given but the scheme is etcd:// (use etcds://)")
    if bool(cert) != bool(key):
        raise ValueError("--store-cert and --store-key go together (mutual TLS)")
    tls = TLSConfig(ca=ca, cert=cert, key=key) if parsed.tls else None
    return EtcdBackend(parsed.endpoints, parsed.prefix, tls=tls, auth=auth)


def _row_json(row: Change, with_config: bool) -> bytes:
    """How ``row`` is stored: its fields as JSON, made_now only when set, the config when it fits."""
    data = row.fields()
    config = data.pop("config")
    if not row.made_now:
        del data["made_now"]
    if with_config:
        data["config"] = config
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _row(value: bytes) -> tuple[Change, bool]:
    """The Change and whether its config was stored."""
    d = json.loads(value)
    return Change.from_fields({"config": {}, **d}), "config" in d


class EtcdBackend:
    """Every job under one etcd prefix; safe to share between threads and between lighthouses.

    Raises StoreUnavailable at construction when etcd cannot be reached within ``timeout``.
    """

    # Stores hand over every job step (``set_meta`` only queues it; the writer coalesces), so the
    # other lighthouses order changes by a step at most FLUSH_PAUSE old.
    step_save_interval = 0.0

    def __init__(
        self,
        endpoints: str | list[str],
        prefix: str = DEFAULT_PREFIX,
        tls: TLSConfig | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        auth: EtcdAuth | None = None,
        ceiling_lease_ttl: float = CEILING_LEASE_TTL,
    ) -> None:
        self.prefix = prefix.rstrip("/")
        if not self.prefix:
            raise ValueError("the etcd prefix must not be empty (default /lighthouse-config)")
        self.client = EtcdClient(endpoints, timeout=timeout, tls=tls, auth=auth)
        self._jobs_key = f"{self.prefix}/jobs/"
        self._lock = threading.Lock()
        self._pending_steps: dict[str, int] = {}
        self._pending_switches: dict[str, dict[tuple[str, int, int], int]] = {}
        self._seen_switches: dict[str, list[Switch]] = {}  # last read, served when etcd is unreachable
        self._known_jobs: set[str] = set()
        self._base_revision: dict[str, int] = {}  # mod revision of each job's pruned base, as loaded
        self._stored_steps: dict[str, tuple[int, int]] = {}  # job -> (step, mod revision) last seen
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._watch: Watch | None = None
        self._space_problem: str | None = None  # the last commit failed for lack of space
        # This life's own ceiling keys live on one etcd lease, granted at the first ceiling write.
        self._ceiling_ttl = ceiling_lease_ttl
        self._ceiling_lease = 0
        self._ceiling_lease_lost = threading.Event()
        self._ceiling_keepalive: KeepAlive | None = None
        self._ceiling_lease_lock = threading.Lock()
        try:
            with _mapped():
                self._start_revision = self.client.get(self.prefix + "/", prefix=True, limit=1).revision
        except EtcdAuthFailed as exc:
            self.client.close()
            raise ValueError(f"etcd store: {exc.details}") from None
        except BaseException:
            self.client.close()
            raise
        self._flusher = threading.Thread(target=self._flush_loop, name="etcd-store-flush", daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------ keys
    def _job(self, job: str) -> str:
        return f"{self._jobs_key}{job}/"

    def _index(self, job: str) -> str:
        return f"{self.prefix}/index/{job}"

    # ------------------------------------------------------------------ reads
    def is_empty(self) -> bool:
        """No key under the prefix (what ``lighthouse migrate`` requires)."""
        with _mapped():
            return not self.client.get(self.prefix + "/", prefix=True, limit=1, keys_only=True).kvs

    def jobs(self) -> list[JobId]:
        index = f"{self.prefix}/index/"
        with _mapped():
            kvs = self.client.get(index, prefix=True, keys_only=True).kvs
        return stored_jobs(kv.key.decode()[len(index) :] for kv in kvs)

    def load(self, job: str) -> JobRecords:
        base = self._job(job)
        with _mapped():  # one transaction: rows and meta from one revision
            result = self.client.txn([], [Get(base + "v/", prefix=True), Get(base + "meta/", prefix=True)])
        with self._lock:
            self._known_jobs.add(job)
        records = JobRecords(revision=result.revision)
        for kv in result.gets[0]:
            row, has_config = _row(kv.value)
            records.rows.append(row)
            if not has_config:
                records.unresolved.add(row.version)
        records.meta = {kv.key.decode()[len(base) + 5 :]: kv.value.decode() for kv in result.gets[1]}
        self._fold_unleased_ceilings(job, result.gets[1])
        base_kv = [kv.mod_revision for kv in result.gets[1] if kv.key == (base + "meta/base").encode()]
        with self._lock:
            self._base_revision[job] = base_kv[0] if base_kv else 0
        with self._lock:
            step = self._pending_steps.get(job)
        if step is not None and step > int(records.meta.get("current_step", "-1")):
            records.meta["current_step"] = str(step)
        return records

    def switches(self, job: str) -> list[Switch]:
        """Stored and queued switches; when etcd cannot answer, the last ones read (views stay up)."""
        key = self._job(job) + "sw/"
        with self._lock:  # before the read: a switch leaves the queue only once it is stored
            pending = [(r, v, s, p) for (r, s, v), p in self._pending_switches.get(job, {}).items()]
        try:
            kvs = self.client.get(key, prefix=True, serializable=True, timeout=1.0).kvs
        except EtcdUnavailable as exc:
            log.debug("job %s: switches from the last read (%s)", job, exc)
            with self._lock:
                stored = list(self._seen_switches.get(job, []))
        else:
            stored = []
            for kv in kvs:
                replica, step, version = kv.key.decode()[len(key) :].rsplit("/", 2)
                stored.append((replica, int(version), int(step), int(kv.value)))
            with self._lock:
                self._seen_switches[job] = stored
        return sorted(set(stored) | set(pending), key=lambda sw: (sw[0], sw[2], sw[1]))

    # ----------------------------------------------------------------- writes
    def append(
        self,
        job: str,
        rows: list[Change],
        meta: dict[str, str],
        expected_head: int,
        leases: LeaseView | None = None,
    ) -> None:
        """A commit holds the job's step-lease grants at their horizon until it is stored: it leaves
        a member that hangs as soon as a ceiling write does (``CEILING_ATTEMPT_TIMEOUT``)."""
        with self.client.attempts_within(CEILING_ATTEMPT_TIMEOUT):
            self._append(job, rows, meta, expected_head, leases)

    def _append(
        self,
        job: str,
        rows: list[Change],
        meta: dict[str, str],
        expected_head: int,
        leases: LeaseView | None,
    ) -> None:
        base = self._job(job)
        head = base + "head"
        values = [_row_json(row, with_config=True) for row in rows]
        if sum(map(len, values)) > MAX_ROW_WITH_CONFIG:
            values = [_row_json(row, with_config=False) for row in rows]  # recomputed on load
        size = sum(map(len, values))
        if size > MAX_REQUEST:
            raise ConfigTooLarge(f"the change is {size} bytes of JSON, more than etcd accepts")
        meta = dict(meta)
        step = meta.pop("current_step", None)
        row_keys = [base + "v/" + _num(row.version) for row in rows]
        compare = (
            Compare(head, "create", "==", 0)
            if expected_head == 0
            else Compare(head, "value", "==", str(expected_head))
        )
        ops = [
            *(Put(key, value) for key, value in zip(row_keys, values, strict=True)),
            Put(head, str(rows[-1].version)),
            Put(self._index(job), ""),
            *(Put(base + "meta/" + k, v) for k, v in meta.items()),
        ]
        compares = [compare, *self._ceilings_unchanged(job, leases), *self._runs_unchanged(job, leases)]
        try:
            with _mapped():
                result = self.client.txn(compares, ops, [Get(row_keys[-1]), Get(head)])
        except StoreFull as exc:
            self._space_problem = str(exc)
            raise
        self._space_problem = None  # a commit went through: etcd has space (again)
        if not result.succeeded:
            mine, current = result.gets
            if mine and mine[0].value == values[-1]:
                log.debug("job %s: version %d was committed by an earlier attempt", job, rows[-1].version)
            else:
                now = current[0].value.decode() if current else "0"
                raise HeadMoved(
                    f"job {job}: head is {now}, expected {expected_head}, or another lighthouse "
                    "raised its lease ceiling or began or ended a run"
                )
        if step is not None:
            self._queue_step(job, int(step))

    def _runs_unchanged(self, job: str, leases: LeaseView | None) -> list[Compare]:
        """The runs record is still the one the commit was planned under."""
        if leases is None or not leases.runs_checked:
            return []
        key = self._job(job) + "meta/" + RUNS_RECORD
        if leases.runs_record is None:
            return [Compare(key, "create", "==", 0)]
        return [Compare(key, "value", "==", leases.runs_record)]

    def _ceilings_unchanged(self, job: str, leases: LeaseView | None) -> list[Compare]:
        """No other lighthouse's lease ceiling of ``job`` changed after ``leases.revision``: every
        key of the range but our own (two ranges around it) has an older mod revision."""
        if leases is None:
            return []
        first = self._job(job) + "meta/" + LEASE_CEILING
        own = (self._job(job) + "meta/" + leases.own_key).encode()
        after_own = own + b"\0"
        end = prefix_end(first.encode())
        newer = leases.revision + 1
        return [
            Compare(first, "mod", "<", newer, range_end=own),
            Compare(after_own, "mod", "<", newer, range_end=end),
        ]

    def space_problem(self) -> str | None:
        return self._space_problem

    def write_problem(self) -> str | None:
        """A linearizable read (a quorum answers), then the answering member's alarms (see the module's
        docstring), within ``PROBE_TIMEOUT``."""
        deadline = time.monotonic() + PROBE_TIMEOUT
        try:
            with self.client.attempts_within(PROBE_ATTEMPT), _mapped():
                self.client.get(f"{self.prefix}/{PROBE_KEY}", keys_only=True, timeout=PROBE_TIMEOUT)
                status = self.client.status(timeout=max(0.05, deadline - time.monotonic()))
        except StoreUnavailable as exc:
            return str(exc)
        except EtcdError as exc:
            return f"etcd refused the look at its quorum: {exc.details}"
        if status.errors:
            return f"etcd refuses writes: {'; '.join(error.strip() for error in status.errors)}"
        return None

    def lease_ceiling_key(self, owner: str) -> str:
        return LEASE_CEILING + owner

    def save_lease_ceiling(self, job: str, owner: str, ceiling: int, served_head: int) -> None:
        """This life's key (on its etcd lease) and the job's floor raised to ``ceiling``, in one
        transaction comparing the head (HeadMoved: a change to take first) and the floor (another
        lighthouse raised it meanwhile: read it again and retry)."""
        with self.client.attempts_within(CEILING_ATTEMPT_TIMEOUT):
            self._save_lease_ceiling(job, owner, ceiling, served_head)

    def _save_lease_ceiling(self, job: str, owner: str, ceiling: int, served_head: int) -> None:
        base = self._job(job)
        head = base + "head"
        floor_key = base + "meta/" + CEILING_FLOOR
        compare_head = (
            Compare(head, "create", "==", 0)
            if served_head == 0
            else Compare(head, "value", "==", str(served_head))
        )
        with _mapped():
            kvs = self.client.get(floor_key).kvs
        floor, floor_mod = (int(kvs[0].value), kvs[0].mod_revision) if kvs else (-1, 0)
        for _ in range(CEILING_CAS_TRIES):
            lease = self._own_ceiling_lease()
            ops: list[Op] = [Put(base + "meta/" + LEASE_CEILING + owner, str(ceiling), lease=lease)]
            if ceiling > floor:
                ops.append(Put(floor_key, str(ceiling)))
            try:
                with _mapped():
                    result = self.client.txn(
                        [compare_head, Compare(floor_key, "mod", "==", floor_mod)],
                        ops,
                        [Get(head), Get(floor_key)],
                    )
            except EtcdError as exc:
                if "lease not found" not in exc.details:
                    raise
                log.warning("job %s: the lease of this lighthouse's ceilings expired; taking a new one", job)
                self._ceiling_lease_lost.set()
                continue
            if result.succeeded:
                return
            heads, floors = result.gets
            if (heads[0].value.decode() if heads else "0") != str(served_head):
                raise HeadMoved(f"job {job}: its head moved past version {served_head}")
            floor, floor_mod = (int(floors[0].value), floors[0].mod_revision) if floors else (-1, 0)
        raise HeadMoved(f"job {job}: the ceiling floor kept moving; try again")

    def _own_ceiling_lease(self) -> int:
        """The etcd lease of this life's ceiling keys (granted once, again when it was lost)."""
        with self._ceiling_lease_lock:
            if self._ceiling_lease and not self._ceiling_lease_lost.is_set():
                return self._ceiling_lease
            if self._ceiling_keepalive is not None:
                self._ceiling_keepalive.stop()
            self._ceiling_lease_lost.clear()
            with _mapped():
                self._ceiling_lease = self.client.lease_grant(self._ceiling_ttl)
            self._ceiling_keepalive = self.client.keep_alive(
                self._ceiling_lease, self._ceiling_ttl, self._ceiling_lease_lost.set
            )
            return self._ceiling_lease

    def _fold_unleased_ceilings(self, job: str, meta: list[KeyValue]) -> None:
        """Ceiling keys without a lease (an older release's lives, never deleted) go into the
        floor and are deleted, in one transaction that holds only if none of them moved; best
        effort (a later load tries again). The values were read already: nothing is lost."""
        base = self._job(job) + "meta/"
        own_prefix = (base + LEASE_CEILING).encode()
        floor_key = (base + CEILING_FLOOR).encode()
        old = [kv for kv in meta if kv.key.startswith(own_prefix) and kv.lease == 0][: TXN_OPS - 2]
        if not old:
            return
        floors = [kv for kv in meta if kv.key == floor_key]
        floor = max([int(kv.value) for kv in old + floors])
        compares = [Compare(kv.key, "mod", "==", kv.mod_revision) for kv in old]
        compares.append(Compare(floor_key, "mod", "==", floors[0].mod_revision if floors else 0))
        ops: list[Op] = [Put(floor_key, str(floor)), *(Delete(kv.key) for kv in old)]
        try:
            with _mapped():
                done = self.client.txn(compares, ops).succeeded
        except (StoreUnavailable, StoreFull, EtcdError) as exc:
            log.info("job %s: old lease-ceiling keys not folded yet: %s", job, exc)
            return
        if done:
            log.info("job %s: folded %d old lease-ceiling keys into its floor (%d)", job, len(old), floor)

    def add_schema(self, job: str, record: dict[str, Any]) -> None:
        """Schema changes sort by key (time of the change); their ``id`` is etcd's create revision."""
        key = self._job(job) + "schema/" + _num(time.time_ns())
        with _mapped():
            self.client.put(key, json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def schemas(self, job: str, limit: int) -> list[dict[str, Any]]:
        with _mapped():
            kvs = self.client.get(self._job(job) + "schema/", prefix=True).kvs
        out = [{**json.loads(kv.value), "id": kv.create_revision} for kv in kvs]
        return sorted(out, key=lambda r: r["id"], reverse=True)[:limit]

    def save_guard(self, job: str, record: dict[str, Any]) -> None:
        key = self._job(job) + "guards/" + _num(int(record["version"]))
        with _mapped():
            self.client.put(key, json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def guards(self, job: str) -> list[dict[str, Any]]:
        with _mapped():
            kvs = self.client.get(self._job(job) + "guards/", prefix=True).kvs
        return [json.loads(kv.value) for kv in kvs]

    def drop_guards(self, job: str, versions: list[int]) -> None:
        base = self._job(job) + "guards/"
        for start in range(0, len(versions), TXN_OPS):
            with _mapped():
                self.client.txn([], [Delete(base + _num(v)) for v in versions[start : start + TXN_OPS]])

    def set_meta(self, job: str, items: dict[str, str]) -> None:
        """``current_step`` is queued (max of every lighthouse's); anything else is written now."""
        items = dict(items)
        step = items.pop("current_step", None)
        if step is not None:
            self._queue_step(job, int(step))
        if items:
            base = self._job(job) + "meta/"
            with _mapped():
                self.client.txn([], [Put(base + k, v) for k, v in items.items()])

    def replace_meta(
        self, job: str, key: str, expected: str | None, items: dict[str, str], head: int | None = None
    ) -> bool:
        # A run's step goes with its record (not queued): a lighthouse that reads the new run reads
        # its step too (``ConfigStore.end_run``'s look at the stored step). Max semantics hold: a
        # later run's stored step is above every earlier run's (``runs.pack``).
        base = self._job(job) + "meta/"
        if expected is None:
            compares = [Compare(base + key, "create", "==", 0)]
        else:
            compares = [Compare(base + key, "value", "==", expected)]
        if head is not None:
            head_key = self._job(job) + "head"
            compares.append(
                Compare(head_key, "create", "==", 0)
                if head == 0
                else Compare(head_key, "value", "==", str(head))
            )
        # A run's first leases wait for its record (its ceiling is stored after it): urgent.
        with _mapped(), self.client.attempts_within(CEILING_ATTEMPT_TIMEOUT):
            result = self.client.txn(
                compares, [Put(base + k, v) for k, v in items.items()], [Get(base + key)]
            )
        # A retried attempt finds what the first one (timed out, yet applied) wrote: that is ours.
        return result.succeeded or (
            key in items and bool(result.gets[0]) and result.gets[0][0].value.decode() == items[key]
        )

    def stored_step(self, job: str) -> int:
        with _mapped():
            kvs = self.client.get(self._job(job) + "meta/current_step").kvs
        return int(kvs[0].value) if kvs else -1

    def add_switches(self, job: str, switches: list[Switch]) -> None:
        with self._lock:
            pending = self._pending_switches.setdefault(job, {})
            for replica, version, step, previous in switches:
                pending.setdefault((replica, step, version), previous)
        self._wake.set()

    def prune(self, job: str, gone: set[int], meta: dict[str, str], oldest_kept: int) -> None:
        """Best effort: when etcd cannot take it now, the versions stay (pruning never changes what
        any version resolves to) and the next prune deletes them too."""
        if not gone:
            return
        base = self._job(job)
        # Every version up to the newest gone one: the gone ones are the oldest, and this also
        # removes those an earlier, failed prune left.
        ops: list[Op] = [
            Delete(base + "v/", range_end=base + "v/" + _num(max(gone) + 1)),
            *(Put(base + "meta/" + k, v) for k, v in meta.items()),
        ]
        if sum(len(k) + len(v.encode()) for k, v in meta.items()) > MAX_REQUEST:
            log.warning("job %s: the pruned history's base is too large for one etcd request; kept", job)
            return
        with self._lock:
            loaded = self._base_revision.get(job, 0)
        # Only over the base this store folded into: another lighthouse may have pruned further.
        unchanged = Compare(base + "meta/base", "mod", "==", loaded)
        try:
            result = self.client.txn([unchanged], ops)
            if not result.succeeded:
                log.info("job %s: another lighthouse pruned the history first", job)
                return
            with self._lock:
                self._base_revision[job] = result.revision
            self._flush(only=job)  # the queued switches too
            self._prune_switches(job, oldest_kept)
        except (EtcdUnavailable, EtcdError) as exc:
            log.warning("job %s: pruning postponed: %s", job, exc)

    def _prune_switches(self, job: str, oldest_kept: int) -> None:
        """Drop switches to versions before ``oldest_kept`` but each group's latest such one."""
        key = self._job(job) + "sw/"
        latest: dict[str, int] = {}
        old: list[tuple[str, int, bytes]] = []
        for kv in self.client.get(key, prefix=True, keys_only=True).kvs:
            replica, step, version = kv.key.decode()[len(key) :].rsplit("/", 2)
            if int(version) < oldest_kept:
                latest[replica] = max(latest.get(replica, int(step)), int(step))
                old.append((replica, int(step), kv.key))
        doomed = [Delete(k) for replica, step, k in old if step < latest[replica]]
        for i in range(0, len(doomed), TXN_OPS):
            self.client.txn([], doomed[i : i + TXN_OPS])

    def delete_job(self, job: str) -> None:
        with self._lock:
            self._pending_steps.pop(job, None)
            self._pending_switches.pop(job, None)
            self._seen_switches.pop(job, None)
            self._base_revision.pop(job, None)
            self._stored_steps.pop(job, None)
        with _mapped():
            self.client.txn([], [Delete(self._job(job), prefix=True), Delete(self._index(job))])

    # ------------------------------------------------------------- queued writes
    def _queue_step(self, job: str, step: int) -> None:
        with self._lock:
            if step > self._pending_steps.get(job, -1):
                self._pending_steps[job] = step
        self._wake.set()

    def _flush_loop(self) -> None:
        backoff = FLUSH_PAUSE
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            try:
                self._flush(timeout=FLUSH_TIMEOUT)
                backoff = FLUSH_PAUSE
            except (EtcdUnavailable, EtcdError) as exc:
                log.warning("etcd store: job steps and step switches not saved yet: %s", exc)
                self._wake.set()  # retry after a pause
                backoff = min(backoff * 2, FLUSH_BACKOFF_MAX)
            self._stopping.wait(backoff)

    def _flush(self, timeout: float | None = None, only: str | None = None) -> None:
        """Write the queued steps and switches (of every job or ``only`` one); what fails stays queued."""
        with self._lock:
            steps = [(job, step) for job, step in self._pending_steps.items() if only in (None, job)]
            switches = [
                (job, list(items.items()))
                for job, items in self._pending_switches.items()
                if items and only in (None, job)
            ]
        for job, step in steps:
            self._store_max_step(job, step, timeout)
            with self._lock:
                if self._pending_steps.get(job) == step:
                    del self._pending_steps[job]
        for job, items in switches:
            key = self._job(job) + "sw/"
            for i in range(0, len(items), TXN_OPS):
                chunk = items[i : i + TXN_OPS]
                puts = [Put(f"{key}{r}/{_num(s)}/{_num(v)}", str(p)) for (r, s, v), p in chunk]
                self.client.txn([], puts, timeout=timeout)
                with self._lock:
                    pending = self._pending_switches.get(job, {})
                    for sw, _ in chunk:
                        pending.pop(sw, None)

    def _store_max_step(self, job: str, step: int, timeout: float | None) -> None:
        """Raise the stored job step to ``step`` unless another lighthouse stored a higher one
        (compare-and-swap on the key's revision, usually one transaction)."""
        key = self._job(job) + "meta/current_step"
        with self._lock:
            stored, revision = self._stored_steps.get(job, (-1, 0))
        while stored < step:
            result = self.client.txn(
                [Compare(key, "mod", "==", revision)], [Put(key, str(step))], [Get(key)], timeout=timeout
            )
            if result.succeeded:
                stored, revision = step, result.revision
            else:  # another lighthouse wrote it since: compare with what is there now
                kvs = result.gets[0]
                stored, revision = (int(kvs[0].value), kvs[0].mod_revision) if kvs else (-1, 0)
        with self._lock:
            self._stored_steps[job] = (stored, revision)

    # ------------------------------------------------------------------ watch
    def subscribe(
        self,
        on_job_changed: JobChanged,
        on_step: StepChanged,
        on_lease_ceiling: CeilingChanged,
        on_guards: GuardsChanged = lambda job: None,
    ) -> None:
        """Call ``on_job_changed(job, head)`` when a job's head moves (or it is deleted: head 0),
        ``on_step(job, step)`` when a job step is stored, ``on_lease_ceiling(job, key, ceiling,
        revision)`` when a lighthouse stored a lease ceiling and ``on_guards(job)`` when a guard was
        written or dropped, from the revision this backend first read.

        When etcd compacted the revisions the watch needed, every job is reported with head -1.
        """

        def events(batch: list[Event]) -> None:
            heads: dict[JobId, int] = {}
            steps: dict[JobId, int] = {}
            ceilings: list[tuple[JobId, str, int, int]] = []
            pruned: set[JobId] = set()
            guarded: set[JobId] = set()
            for event in batch:
                key = event.kv.key.decode()
                if not key.startswith(self._jobs_key):
                    continue
                name, _, sub = key[len(self._jobs_key) :].partition("/")
                job = stored_job(name)
                if job is None:
                    continue
                if sub == "head":
                    heads[job] = int(event.kv.value) if event.type == "put" else 0
                    if event.type != "put":
                        pruned.add(job)  # deleted (maybe written again in this batch, lower): re-read
                elif sub == "meta/current_step" and event.type == "put":
                    steps[job] = max(steps.get(job, -1), int(event.kv.value))
                elif sub.startswith("meta/" + LEASE_CEILING) and event.type == "put":
                    ceilings.append((job, sub[len("meta/") :], int(event.kv.value), event.revision))
                elif sub == "meta/base" and event.revision != self._base_revision.get(job):
                    pruned.add(job)  # another lighthouse pruned: reload the folded base
                elif sub == "meta/runs":
                    pruned.add(job)  # a run began or ended (maybe through another lighthouse): reload
                elif sub.startswith("schema/"):
                    pruned.add(job)  # a schema change (maybe another lighthouse's): reload
                elif sub.startswith("guards/"):
                    # A guard's own keys: reloading the whole job for them read every kept version
                    # again, three times per guarded change (made, baseline, decided), ours too.
                    guarded.add(job)
            for job in pruned:
                heads[job] = -1
            for job, step in steps.items():
                on_step(job, step)
            for job, key, ceiling, revision in ceilings:
                on_lease_ceiling(job, key, ceiling, revision)
            for job, head in heads.items():
                on_job_changed(job, head)
            for job in guarded - pruned:  # a reload reads the guards too
                on_guards(job)

        def compacted() -> int:
            result = self.client.get(f"{self.prefix}/index/", prefix=True, keys_only=True)
            with self._lock:
                names = set(self._known_jobs)
            names.update(kv.key.decode().rsplit("/", 1)[1] for kv in result.kvs)
            for job in stored_jobs(names):
                on_job_changed(job, -1)
            return result.revision

        self._watch = self.client.watch(
            self.prefix + "/",
            start_revision=self._start_revision + 1,
            on_events=events,
            on_compacted=compacted,
        )

    def close(self) -> None:
        """Stop watching; write what is queued (bounded), then close the connection."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.set()
        if self._watch is not None:
            self._watch.stop()
        self._flusher.join(timeout=FLUSH_TIMEOUT + 1)
        try:
            self._flush(timeout=1.0)
        except (EtcdUnavailable, EtcdError) as exc:
            log.warning("etcd store: closing with job steps or switches unsaved: %s", exc)
        self._end_ceiling_lease()
        self.client.close()

    def _end_ceiling_lease(self) -> None:
        """This life's ceiling keys go (the floor keeps what they promised)."""
        with self._ceiling_lease_lock:
            if self._ceiling_keepalive is not None:
                self._ceiling_keepalive.stop()
                self._ceiling_keepalive = None
            if self._ceiling_lease:
                try:
                    self.client.lease_revoke(self._ceiling_lease, timeout=1.0)
                except (EtcdUnavailable, EtcdError) as exc:
                    log.info("lease-ceiling keys left to expire with their lease: %s", exc)
                self._ceiling_lease = 0
