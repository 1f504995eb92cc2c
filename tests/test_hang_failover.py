"""A lighthouse that hangs (SIGSTOP, or a server whose handlers never return) costs its managers at
most one slow call: the call is hedged to the next lighthouse within the same deadline, and the
manager stays on the one that answered. No worker gets the fallback while a listed lighthouse
answers."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from lighthouse.client import HEDGE_FRACTION, LighthouseClient
from manager.push import PushStream
from tests.etcd_cluster import EtcdCluster
from tests.http_util import change, live, wait_healthy
from tests.procs import LighthouseProc, ProcessPool, metric, poll, records_so_far
from tests.stuck_lighthouse import StuckLighthouse, replica_starting_on
from worker_client import ManagerClient

CONFIG = {"lr": 0.25}
LIGHTHOUSE_TIMEOUT = 1.0  # the manager's --lighthouse-timeout in these tests (its default)
# A hung lighthouse is asked once, and once more beside the next one when it has not answered
# within the hedge delay (one that is only slow may still answer first).
ASKED_TWICE = ["GetConfig", "GetConfig"]


@pytest.fixture
def stuck() -> Iterator[Callable[[], StuckLighthouse]]:
    """Makes stuck lighthouses; all are closed when the test ends."""
    made: list[StuckLighthouse] = []

    def make() -> StuckLighthouse:
        made.append(StuckLighthouse())
        return made[-1]

    try:
        yield make
    finally:
        for server in made:
            server.close()


def test_a_hung_lighthouse_costs_one_hedge_then_nothing(
    procs: ProcessPool, stuck: Callable[[], StuckLighthouse]
) -> None:
    lh, hung = procs.lighthouse(CONFIG), stuck()
    timeout = 2.0
    with LighthouseClient(f"{hung.address},{lh.address}") as client:
        grpc.channel_ready_future(client._endpoints[0].channel).result(timeout=10)  # handshake done
        started = time.monotonic()
        assert client.get_config(timeout=timeout) == {"lr": "0.25"}
        elapsed = time.monotonic() - started
        assert elapsed >= HEDGE_FRACTION * timeout  # the stuck one was given its fraction first
        assert elapsed < timeout  # and the answer came within the same deadline
        assert client.current == lh.address
        # The second ask went out beside the live one, which may have answered before the stuck
        # server's thread recorded it.
        poll(lambda: hung.calls == ASKED_TWICE, 5, what="both asks of the hung lighthouse recorded")
        for _ in range(5):  # it stays on the lighthouse that answered: the stuck one is not asked again
            assert client.get_config(timeout=timeout) == {"lr": "0.25"}
        assert hung.calls == ASKED_TWICE


def test_each_hung_lighthouse_gets_a_fraction_of_the_deadline(
    procs: ProcessPool, stuck: Callable[[], StuckLighthouse]
) -> None:
    lh, first, second = procs.lighthouse(CONFIG), stuck(), stuck()
    timeout = 2.0
    with LighthouseClient(f"{first.address},{second.address},{lh.address}") as client:
        started = time.monotonic()
        assert client.get_config(timeout=timeout) == {"lr": "0.25"}
        assert time.monotonic() - started < timeout
        assert client.current == lh.address
    assert (first.calls, second.calls) == (ASKED_TWICE, ["GetConfig"])


def test_when_every_lighthouse_hangs_the_call_ends_at_its_deadline(
    stuck: Callable[[], StuckLighthouse],
) -> None:
    first, second = stuck(), stuck()
    timeout = 1.0
    with LighthouseClient(f"{first.address},{second.address}") as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.get_config(timeout=timeout)
        elapsed = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert timeout * 0.9 <= elapsed < timeout + 2.0  # bounded by the deadline, plus a margin
        assert client.current == first.address  # nothing answered: no reason to move
    assert (first.calls, second.calls) == (ASKED_TWICE, ["GetConfig"])


@pytest.mark.slow
def test_a_manager_starting_on_a_hung_lighthouse_serves_the_live_config(
    procs: ProcessPool, stuck: Callable[[], StuckLighthouse]
) -> None:
    lh, hung = procs.lighthouse(CONFIG), stuck()
    addresses = f"{hung.address},{lh.address}"
    replica = replica_starting_on(addresses, hung.address)
    m = procs.manager(addresses, replica, cache_ttl=0.2, lighthouse_timeout=LIGHTHOUSE_TIMEOUT)
    with ManagerClient(m.address, timeout=10) as client:
        started = time.monotonic()
        first = client.get_config()
        elapsed = time.monotonic() - started
    # The manager's first fetch hung on the stuck lighthouse and was hedged to the live one: the
    # first worker call waits for it, within the manager's deadline, and gets the live config.
    assert first.source in {"lighthouse", "cache"}, first.source
    assert dict(first) == {"lr": "0.25"}
    assert elapsed < LIGHTHOUSE_TIMEOUT + 0.5, elapsed
    assert "GetConfig" in hung.calls  # it really started on the stuck one
    worker = procs.worker(m.address, group="g", rank=0, steps=150, step_interval=0.01)
    poll(lambda: worker.lines() and worker.seen[-1] == "done", 60, what="worker done")
    records = records_so_far(worker)
    assert len(records) == 150
    assert {r["source"] for r in records} <= {"lighthouse", "cache"}
    assert all(r["config"] == {"lr": "0.25"} for r in records)
    assert hung.calls == ASKED_TWICE  # then never again
    assert f"now using lighthouse {lh.address}" in m.stderr()


def store_url(cluster: EtcdCluster) -> str:
    return f"etcd://{cluster.endpoints}/test-hang/{uuid.uuid4().hex}"


def get_config_calls(lh: LighthouseProc) -> float:
    """Requests the lighthouse answered: GetConfig calls and requests on push streams."""
    return metric(lh.url, "lighthouse_get_config_calls_total") + metric(
        lh.url, "lighthouse_watch_messages_total"
    )


def settled_calls(lh: LighthouseProc) -> float:
    """The lighthouse's request count once it stopped moving (a resumed process first drains the
    requests that queued up while it was stopped)."""
    seen: list[float] = []

    def stable() -> bool:
        seen.append(get_config_calls(lh))
        return len(seen) >= 3 and seen[-1] == seen[-3]

    poll(stable, 10, interval=0.2, what="the call count to settle")
    return seen[-1]


@pytest.mark.slow
def test_sigstop_of_the_lighthouse_in_use_serves_no_fallback_and_the_manager_stays_moved(
    procs: ProcessPool, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    store = store_url(etcd1)
    a, b = (procs.lighthouse(store=store) for _ in range(2))
    for lh in (a, b):
        wait_healthy(lh.url)
    change(a.url, "PUT", CONFIG)
    poll(lambda: live(b.url)["version"] == 1, 5, what="b at version 1")
    addresses = f"{a.address},{b.address}"
    m = procs.manager(
        addresses,
        replica_starting_on(addresses, a.address),
        cache_ttl=0.5,
        lighthouse_timeout=LIGHTHOUSE_TIMEOUT,
    )
    worker = procs.worker(m.address, group="g", rank=0, steps=100_000, step_interval=0.01)
    poll(lambda: len(records_so_far(worker)) > 30, 20, what="worker steps")
    poll(lambda: get_config_calls(a) > 0, 10, what="the manager on lighthouse a")

    a.signal(signal.SIGSTOP)  # a frozen host: connections stay open, nothing answers
    stopped_at = len(records_so_far(worker))
    poll(lambda: f"now using lighthouse {b.address}" in m.stderr(), 10, what="the manager on b")
    poll(lambda: len(records_so_far(worker)) > stopped_at + 150, 30, what="steps while a is stopped")
    a.signal(signal.SIGCONT)
    wait_healthy(a.url)

    a_calls = settled_calls(a)
    b_calls = get_config_calls(b)
    poll(lambda: get_config_calls(b) >= b_calls + 4, 20, what="four more requests to b")
    assert get_config_calls(a) == a_calls, "the manager went back to the resumed lighthouse"
    worker.stop()

    records = records_so_far(worker)
    sources = {r["source"] for r in records}
    assert "fallback" not in sources, [r for r in records if r["source"] == "fallback"][:3]
    assert all(r["config"] == {"lr": "0.25"} for r in records)
    slow = [r["elapsed"] for r in records if r["elapsed"] > LIGHTHOUSE_TIMEOUT]
    assert len(slow) <= 1, slow
    assert f"now using lighthouse {a.address}" not in m.stderr()


def test_a_push_stream_opened_to_a_hung_lighthouse_follows_the_manager_that_moved(
    procs: ProcessPool, tmp_path: Path
) -> None:
    """A push stream opened to the lighthouse in use just as it hung, and a poll that then moved the
    manager to the next one: when the hung host resumes, its answer must not make the stream live
    there (the manager's renewals and reports would go back to the host it left, found by CI on
    the SIGSTOP test above); the stream is opened again to the lighthouse the manager moved to."""
    a, b = (procs.lighthouse(CONFIG, state_dir=tmp_path / name) for name in "ab")
    with LighthouseClient(f"{a.address},{b.address}") as client:
        a_instance = client.fetch(client.request(), timeout=5).instance_id
        replies: list[str] = []
        a.signal(signal.SIGSTOP)
        # A long open timeout: the stream to the hung host is still waiting when it resumes.
        stream = PushStream(
            client, client.request, lambda r: replies.append(r.instance_id), lambda _: None, 60
        )
        try:
            poll(lambda: stream.address == a.address, 5, what="a stream opened to the hung lighthouse")
            assert client.get_config(timeout=2.0) == {"lr": "0.25"}  # hedged to b: the client moved
            assert client.current == b.address
            a.signal(signal.SIGCONT)
            poll(lambda: stream.live and stream.address == b.address, 10, what="the stream live on b")
            time.sleep(0.5)  # a stream left live on a would carry its answers by now
            assert a_instance not in replies
            assert stream.live and stream.address == b.address
        finally:
            a.signal(signal.SIGCONT)
            stream.stop()
