"""A peer across a slow link (a real lighthouse behind a relay that holds every chunk 0.5 s each
way) is reached by the first call, when the call's deadline leaves time for the handshake.

Every channel once gave one connection attempt 100 ms to get the peer's HTTP/2 SETTINGS (gRPC's
``min_reconnect_backoff_ms`` is that timeout), and at most about a second later on: a lighthouse
across a link of 500 ms each way was never reached, whatever the deadline, and a host too busy
to answer within 100 ms failed a first call at once ("connection attempt timed out before
receiving SETTINGS frame"; a health check of a test's lighthouse failed so with three test
processes on two cores)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from lighthouse.client import LighthouseClient
from tests.chaos.proxy import Proxy
from tests.procs import ProcessPool
from worker_client import ManagerClient

CONFIG = {"lr": 0.25, "name": "slow"}
EACH_WAY = 0.5  # seconds a chunk is held each way: a handshake of three round trips takes ~3 s
DEADLINE = 10.0


@pytest.fixture
def slow_lighthouse(procs: ProcessPool) -> Iterator[Proxy]:
    lh = procs.lighthouse(CONFIG)
    proxy = Proxy(lh.address, delay=EACH_WAY)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.slow
def test_the_first_call_across_a_slow_link_gets_the_config(slow_lighthouse: Proxy) -> None:
    client = LighthouseClient(slow_lighthouse.address)
    try:
        began = time.monotonic()
        assert client.get_config(timeout=DEADLINE) == {"lr": "0.25", "name": "slow"}
        assert time.monotonic() - began < DEADLINE + 2  # and within its deadline
    finally:
        client.close()


@pytest.mark.slow
def test_a_manager_across_a_slow_link_relays_the_config_on_the_first_step(
    procs: ProcessPool, slow_lighthouse: Proxy
) -> None:
    manager = procs.manager(slow_lighthouse.address, "slow-link", lighthouse_timeout=DEADLINE)
    with ManagerClient(manager.address, timeout=DEADLINE + 5) as client:
        assert client.get_config(step=0) == {"lr": "0.25", "name": "slow"}
