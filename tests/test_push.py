"""Push: the lighthouse sends each new version down one stream per manager (real processes).

Workers here call ``get_config()`` without a step (the config at the job's step), so
what they see is when a version reached their manager, not a step lease's switch step.
"""

from __future__ import annotations

import itertools
import re
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from manager.status_client import manager_info
from protos import lighthouse_config_pb2 as pb
from protos.rpc import LIGHTHOUSE_WATCH
from tests.etcd_cluster import EtcdCluster
from tests.http_util import change, get_json, live, wait_healthy
from tests.procs import Proc, ProcessPool, last_record, metric, poll, records_so_far, wait_ready
from tests.stuck_lighthouse import StuckLighthouse, get_config_server, replica_starting_on
from tests.threads import CheckedThread

Record = dict[str, Any]


def no_step_workers(procs: ProcessPool, managers: list[str], interval: float = 0.02) -> list[Proc]:
    workers = [
        procs.worker(
            addr, group=f"g{i}", rank=0, steps=10**6, step_interval=interval, no_step=True, wait=False
        )
        for i, addr in enumerate(managers)
    ]
    wait_ready(workers)
    return workers


def managers_table(url: str) -> dict[str, Record]:
    return {m["replica_id"]: m for m in get_json(url, "api/managers")["managers"]}


@pytest.mark.slow
def test_a_change_reaches_every_worker_of_20_managers_within_2_s_at_a_30_s_ttl(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    managers = [procs.manager(lh.address, f"m{i:02}", cache_ttl=30.0).address for i in range(20)]
    workers = no_step_workers(procs, managers)
    poll(lambda: metric(lh.url, "lighthouse_watch_streams") == 20, 30, what="20 push streams open")
    poll(lambda: all(records_so_far(w) for w in workers), 30, what="every worker calling")
    for value in (0.2, 0.3):
        answer = change(lh.url, "PATCH", {"lr": value})
        assert answer.status == 200, answer.body
        version = answer.json["version"]
        changed_at = answer.json["created_at"]

        def everyone_has_it(version: int = version) -> bool:
            return all(any(r["version"] >= version for r in records_so_far(w)[-5:]) for w in workers)

        poll(everyone_has_it, 10, interval=0.05, what=f"every worker on version {version}")
        # Bounded behaviour, generous on purpose (the speed goal is in benchmarks/push.py): each
        # worker's first call that returned the version came within 2 s of the acknowledged edit,
        # 15 times sooner than the 30 s TTL would allow.
        firsts = [min(r["t"] for r in records_so_far(w) if r["version"] >= version) for w in workers]
        assert max(firsts) - changed_at < 2.0, [round(t - changed_at, 3) for t in firsts]
        newest = [r for w in workers for r in records_so_far(w) if r["version"] == version]
        assert newest and all(r["config"]["lr"] == str(value) for r in newest)
    table = managers_table(lh.url)
    assert {m["mode"] for m in table.values()} == {"push"} and len(table) == 20
    assert {m["behind_versions"] for m in table.values()} == {0}
    assert metric(lh.url, "lighthouse_get_config_calls_total") <= 20  # at most their first polls


def changes_in_background(url_of: Any, stop: threading.Event) -> tuple[CheckedThread, list[int]]:
    """PATCHes every ~50 ms until ``stop`` (a refused or failed edit, while the lighthouse is down,
    is simply not counted); the versions acknowledged."""
    made: list[int] = []

    def run() -> None:
        for i in itertools.count():
            if stop.wait(0.05):
                return
            try:
                answer = change(url_of(), "PATCH", {"n": i}, timeout=2)
            except OSError:
                continue
            if answer.status == 200:
                made.append(answer.json["version"])

    thread = CheckedThread(target=run, name="changes")
    thread.start()
    return thread, made


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigkill_restart", "sigstop_resume"])
def test_after_a_lighthouse_crash_or_hang_every_manager_ends_on_the_newest_version(
    procs: ProcessPool, tmp_path: Any, fault: str
) -> None:
    state = tmp_path / "state"
    lh = procs.lighthouse({"n": -1}, state_dir=state)
    wait_healthy(lh.url)
    managers = [
        procs.manager(lh.address, f"m{i}", cache_ttl=5.0, lighthouse_timeout=0.5, backoff=0.2).address
        for i in range(3)
    ]
    workers = no_step_workers(procs, managers)
    poll(lambda: metric(lh.url, "lighthouse_watch_streams") == 3, 30, what="3 push streams open")
    current = [lh]
    stop = threading.Event()
    editor, made = changes_in_background(lambda: current[0].url, stop)
    try:
        poll(lambda: len(made) >= 10, 30, what="edits before the fault")
        if fault == "sigkill_restart":
            lh.signal(signal.SIGKILL)
            lh.wait(10)
            current[0] = procs.restart_lighthouse(lh, state_dir=state)
        else:
            lh.signal(signal.SIGSTOP)
            threading.Event().wait(3.0)  # the hang itself: a frozen host for 3 s
            lh.signal(signal.SIGCONT)
        count = len(made)
        poll(lambda: len(made) >= count + 10, 30, what="edits after the fault")
    finally:
        stop.set()
        editor.check(timeout=10)
    newest = live(current[0].url)["version"]
    assert newest == max(made)

    def all_on_newest() -> bool:
        return all(last_record(w)["version"] == newest for w in workers)

    poll(all_on_newest, 40, interval=0.1, what=f"every worker on version {newest}")
    table = managers_table(current[0].url)
    poll(lambda: metric(current[0].url, "lighthouse_watch_streams") == 3, 40, what="streams open again")
    assert {m["version"] for m in managers_table(current[0].url).values()} == {newest}, table
    for worker in workers:
        served = [r["version"] for r in records_so_far(worker) if r["source"] != "fallback"]
        went_back = [(a, b) for a, b in itertools.pairwise(served) if b < a]
        assert not went_back, (worker.name, went_back[:5])


class _OldLighthouse:
    """A lighthouse of a release before push: GetConfig only (a real gRPC server, in this process)."""

    def __init__(self, config: dict[str, str]) -> None:
        self.reply = pb.LighthouseConfigResponse(
            config_data=config, version=1, instance_id="old", state_id="s"
        )
        self.calls = 0
        self.server, self.address = get_config_server(self._get_config)

    def _get_config(self, request: pb.LighthouseConfigRequest, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if request.known_version == self.reply.version and request.known_state_id == self.reply.state_id:
            return pb.LighthouseConfigResponse(
                version=self.reply.version, not_modified=True, instance_id="old", state_id="s"
            )
        return self.reply

    def set(self, config: dict[str, str], version: int) -> None:
        self.reply = pb.LighthouseConfigResponse(
            config_data=config, version=version, instance_id="old", state_id="s"
        )


def test_a_new_manager_polls_a_lighthouse_without_push(procs: ProcessPool) -> None:
    old = _OldLighthouse({"lr": "0.1"})
    try:
        m = procs.manager(old.address, "g0", cache_ttl=0.2)
        stepping = procs.worker(m.address, group="g0", rank=0, steps=10**6, step_interval=0.01)
        calling = no_step_workers(procs, [m.address])[0]
        poll(lambda: "has no push streams" in m.stderr(), 20, what="the manager falling back to polling")
        poll(lambda: records_so_far(stepping) and records_so_far(calling), 20, what="the workers calling")
        old.set({"lr": "0.5"}, 2)
        for worker in (stepping, calling):
            poll(lambda w=worker: last_record(w)["config"] == {"lr": "0.5"}, 10, what="polled change")
        records = records_so_far(stepping) + records_so_far(calling)
        assert {r["source"] for r in records} <= {"lighthouse", "cache"}  # never the fallback
        assert {r["stable_through_step"] for r in records} == {None}  # no leases from an old release
        assert old.calls >= 2  # polled: the change came with a later GetConfig than the first
    finally:
        old.server.stop(0)


@pytest.mark.slow
def test_a_polling_manager_works_against_a_lighthouse_with_push(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "old", cache_ttl=0.2, extra=["--poll"])
    worker = no_step_workers(procs, [m.address])[0]
    poll(lambda: records_so_far(worker), 20, what="the worker calling")
    version = change(lh.url, "PATCH", {"lr": 0.5}).json["version"]
    poll(lambda: last_record(worker)["version"] == version, 10, what="the polled change")
    assert metric(lh.url, "lighthouse_watch_streams") == 0
    assert managers_table(lh.url)["old"]["mode"] == "poll"
    assert metric(lh.url, "lighthouse_get_config_calls_total") >= 2  # the change came by polling


@pytest.mark.slow
def test_a_change_through_one_lighthouse_reaches_the_managers_of_another_by_push(
    procs: ProcessPool, etcd1: EtcdCluster
) -> None:
    store = f"etcd://{etcd1.endpoints}/push/{uuid.uuid4().hex}"
    a, b = procs.lighthouse(store=store), procs.lighthouse(store=store)
    for lh in (a, b):
        wait_healthy(lh.url)
    first = change(a.url, "PUT", {"lr": 0.1}).json["version"]
    poll(lambda: live(b.url)["version"] == first, 10, what="b at the first version")
    managers = [procs.manager(b.address, f"m{i}", cache_ttl=30.0).address for i in range(2)]
    workers = no_step_workers(procs, managers)
    poll(lambda: metric(b.url, "lighthouse_watch_streams") == 2, 30, what="2 streams on b")
    poll(lambda: all(records_so_far(w) for w in workers), 20, what="the workers calling")
    answer = change(a.url, "PATCH", {"lr": 0.9})
    version = answer.json["version"]
    poll(
        lambda: all(last_record(w)["version"] == version for w in workers),
        10,
        interval=0.05,
        what="b's managers on the version made through a",
    )
    firsts = [min(r["t"] for r in records_so_far(w) if r["version"] == version) for w in workers]
    assert max(firsts) - answer.json["created_at"] < 2.0  # pushed, not polled (TTL 30 s)


def _watch(address: str, replica: str, stop: threading.Event, options: list[tuple[str, Any]]) -> Any:
    """A raw ``WatchConfig`` stream of ``replica``: its first request, then nothing until ``stop``."""

    def requests() -> Any:
        # No step (-1, as a manager whose workers asked for none): a step 0 reported here would
        # lease the job, and a change made now would wait for a step no group ever takes.
        status = pb.ManagerStatus(replica_id=replica, step=-1)
        yield pb.LighthouseConfigRequest(replica_id=replica, status=status)
        stop.wait()

    channel = grpc.insecure_channel(address, options=options)
    watch = channel.stream_stream(
        LIGHTHOUSE_WATCH,
        request_serializer=pb.LighthouseConfigRequest.SerializeToString,
        response_deserializer=pb.LighthouseConfigResponse.FromString,
    )
    return channel, watch(requests())


@pytest.mark.slow
def test_a_stream_silent_for_two_keepalives_ends_and_the_manager_polls(procs: ProcessPool) -> None:
    """``--keepalive-interval 1``: the keep-alives come each second; a hung lighthouse sends none, and
    the manager (nothing to report, no lease to renew: only the silence can end it) ends the stream
    after two of them and polls."""
    lh = procs.lighthouse({"lr": 0.1}, extra=["--keepalive-interval", "1"])
    wait_healthy(lh.url)
    stop = threading.Event()
    channel, raw = _watch(lh.address, "reader", stop, [])
    try:
        first, began = next(raw), time.monotonic()
        keepalive = next(raw)  # nothing changed: only a keep-alive comes
        assert (first.keepalive_ms, keepalive.keepalive_ms) == (1000, 1000)
        assert keepalive.version == first.version and time.monotonic() - began < 5.0  # not the 15 s default
    finally:
        stop.set()
        raw.cancel()
        channel.close()
    m = procs.manager(lh.address, "g0", cache_ttl=30.0, lighthouse_timeout=0.5)
    poll(lambda: "push stream from" in m.stderr() and "open" in m.stderr(), 20, what="the push stream open")
    # The manager's one report after its first request (its version changed, 0 to 1); then it has
    # nothing to say. (The raw stream above sent one message too.)
    poll(lambda: metric(lh.url, "lighthouse_watch_messages_total") >= 3, 20, what="the manager's report")
    before = manager_info(m.address, 5).upstream_failures
    lh.signal(signal.SIGSTOP)
    try:
        dropped = poll(
            lambda: re.search(r"dropped: silent for ([0-9.]+)s \(keep-alive every 1s\)", m.stderr()),
            20,
            what="the manager ending the silent stream",
        )
        assert float(dropped.group(1)) > 2 * 1.0  # two keep-alives missed (plus the deadline's slack)
        assert "no answer to a request" not in m.stderr()  # the silence ended it, nothing else
        assert m.stderr().count("dropped:") == 1, m.stderr()[-3000:]  # ended, and logged, once
        poll(
            lambda: manager_info(m.address, 5).upstream_failures > before,
            20,
            what="the manager polling the hung lighthouse",
        )
    finally:
        lh.signal(signal.SIGCONT)
    try:
        poll(lambda: m.stderr().count(" open") >= 2, 60, what="a new push stream once the lighthouse is back")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the manager's log:\n{m.stderr()[-3000:]}") from None


@pytest.mark.slow
def test_a_manager_that_reads_nothing_holds_up_no_other(procs: ProcessPool) -> None:
    """A raw stream that never reads (flow control stops the lighthouse's writes to it: the config
    is ~800 KB a message) while two real managers get every change within 2 s."""
    lh = procs.lighthouse({"lr": 0.1, "blob": "x" * 800_000})
    wait_healthy(lh.url)
    stop = threading.Event()
    # No BDP probing: the stream's receive window stays at its 64 KiB, far below one message.
    channel, _slow = _watch(lh.address, "slow", stop, [("grpc.http2.bdp_probe", 0)])
    try:
        poll(lambda: "slow" in managers_table(lh.url), 20, what="the slow stream's first request taken")
        managers = [procs.manager(lh.address, f"m{i}", cache_ttl=30.0).address for i in range(2)]
        workers = no_step_workers(procs, managers)
        poll(lambda: all(records_so_far(w) for w in workers), 20, what="the workers calling")
        for value in (0.2, 0.3, 0.4):
            answer = change(lh.url, "PATCH", {"lr": value})
            assert answer.status == 200, answer.body
            version, changed_at = answer.json["version"], answer.json["created_at"]
            poll(
                lambda v=version: all(last_record(w)["version"] == v for w in workers),
                10,
                interval=0.05,
                what=f"both managers' workers on version {version}",
            )
            firsts = [min(r["t"] for r in records_so_far(w) if r["version"] == version) for w in workers]
            assert max(firsts) - changed_at < 2.0, [round(t - changed_at, 3) for t in firsts]
        table = managers_table(lh.url)
        # The slow stream got none of it: its first write never completed (so it is not counted as a
        # stream, and it is listed as polling), and it is behind by every version.
        assert table["slow"]["behind_versions"] >= 4 and table["slow"]["mode"] == "poll", table["slow"]
        assert metric(lh.url, "lighthouse_watch_streams") == 2
        assert {table[f"m{i}"]["behind_versions"] for i in range(2)} == {0}
    finally:
        stop.set()
        _slow.cancel()
        channel.close()


@pytest.mark.slow
def test_a_lighthouse_killed_and_restarted_gives_stepless_workers_no_fallback_at_a_30_s_ttl(
    procs: ProcessPool, tmp_path: Any
) -> None:
    """The end of a push stream keeps the cache: a snapshot confirmed at t is served until t + TTL."""
    state = tmp_path / "state"
    lh = procs.lighthouse({"lr": 0.1}, state_dir=state)
    wait_healthy(lh.url)
    managers = [
        procs.manager(lh.address, f"m{i}", cache_ttl=30.0, lighthouse_timeout=0.5, backoff=0.2).address
        for i in range(2)
    ]
    workers = no_step_workers(procs, managers * 5, interval=0.05)  # 10 stepless workers
    poll(lambda: metric(lh.url, "lighthouse_watch_streams") == 2, 30, what="2 push streams open")
    poll(lambda: all(records_so_far(w) for w in workers), 20, what="the workers calling")
    lh.signal(signal.SIGKILL)
    lh.wait(10)
    killed = time.time()
    threading.Event().wait(4.0)  # the outage itself: the lighthouse is down for 4 s
    lh = procs.restart_lighthouse(lh, state_dir=state)
    poll(lambda: metric(lh.url, "lighthouse_watch_streams") == 2, 30, what="streams open again")
    back = time.time()
    poll(lambda: all(last_record(w)["t"] > back for w in workers), 20, what="calls after the restart")
    for worker in workers:
        records = records_so_far(worker)
        during = [r for r in records if killed < r["t"] < back]
        assert len(during) >= 20, (worker.name, len(during))  # it kept calling through the outage
        sources = {r["source"] for r in records}
        assert sources <= {"lighthouse", "cache"}, (worker.name, sources)
        assert all(r["config"] == {"lr": "0.1"} for r in records), worker.name


@pytest.fixture
def hung() -> Iterator[StuckLighthouse]:
    server = StuckLighthouse()
    try:
        yield server
    finally:
        server.close()


def test_a_manager_with_a_stuck_lighthouse_first_still_pushes_from_the_healthy_one(
    procs: ProcessPool, hung: StuckLighthouse
) -> None:
    """The "no push here" mark is per lighthouse: the stuck one first in the list (it accepts and never
    answers, and has no WatchConfig) does not keep the manager polling the healthy one."""
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    addresses = f"{hung.address},{lh.address}"
    m = procs.manager(
        addresses, replica_starting_on(addresses, hung.address), cache_ttl=30.0, lighthouse_timeout=0.5
    )
    worker = no_step_workers(procs, [m.address])[0]
    poll(lambda: metric(lh.url, "lighthouse_watch_streams") == 1, 15, what="a push stream on the healthy one")
    assert "GetConfig" in hung.calls  # the manager really started on the stuck one
    poll(lambda: records_so_far(worker), 20, what="the worker calling")
    version = change(lh.url, "PATCH", {"lr": 0.5}).json["version"]
    made = time.time()
    poll(lambda: last_record(worker)["version"] == version, 10, interval=0.05, what="pushed")
    first = min(r["t"] for r in records_so_far(worker) if r["version"] == version)
    assert first - made < 2.0  # pushed, not polled (TTL 30 s)
