"""The gRPC port as a trust boundary (issue 26, items 1-3): managers authenticate, a report cannot
steer a job, and a flood of records or job ids leaves the lighthouse's state bounded.

The attacker is a raw gRPC client on the generated stubs; the lighthouse, managers and workers
are real processes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import grpc
import pytest

from manager.metrics import GroupMetrics
from manager.status_client import manager_info
from protos import lighthouse_config_pb2 as pb
from protos import lighthouse_config_pb2_grpc as pb_grpc
from protos.limits import MAX_LEASE_SECONDS, SWITCHES_HELD
from protos.rpc import make_channel
from protos.torchft_seed import JOB_METADATA, SEED_GET_CONFIG, SeedConfigRequest, SeedConfigResponse
from tests.grpc_calls import bearer, code_of
from tests.http_util import call, get_json
from tests.procs import LighthouseProc, ProcessPool, last_record, poll, records_so_far, worker_records

TOKEN_A, TOKEN_B = "token-of-job-a-0123456789", "token-of-job-b-0123456789"
HUGE = 10**15


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "manager-tokens.json"
    path.write_text(json.dumps({"default": [TOKEN_A], "other": [TOKEN_B]}))
    path.chmod(0o600)
    return path


def stub(address: str) -> tuple[grpc.Channel, pb_grpc.LighthouseServiceStub]:
    channel = make_channel(address)
    return channel, pb_grpc.LighthouseServiceStub(channel)


def report(step: int, replica: str = "evil", job: str = "") -> pb.LighthouseConfigRequest:
    return pb.LighthouseConfigRequest(
        job=job, status=pb.ManagerStatus(replica_id=replica, step=step, job=job)
    )


def job_step(lh: LighthouseProc) -> int:
    step: int = get_json(lh.url, "/api/config")["current_step"]
    return step


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_with_manager_tokens_an_anonymous_or_foreign_caller_is_refused(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--manager-tokens-file", str(tokens_file(tmp_path))])
    assert "managers must present a token" in lh.stderr()
    channel, lighthouse = stub(lh.address)
    with channel:
        assert code_of(lighthouse.GetConfig, report(100, "g"), metadata=bearer(TOKEN_A)) == grpc.StatusCode.OK
        for rpc, request in [
            (lighthouse.GetConfig, report(HUGE)),
            (lighthouse.Heartbeat, pb.LighthouseHeartbeatRequest(status=report(HUGE).status)),
        ]:
            assert code_of(rpc, request) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(rpc, request, metadata=bearer("made-up")) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(rpc, request, metadata=bearer(TOKEN_B)) == grpc.StatusCode.PERMISSION_DENIED
        # The seed's RPC follows the same rule.
        seed = channel.unary_unary(
            SEED_GET_CONFIG,
            request_serializer=SeedConfigRequest.SerializeToString,
            response_deserializer=SeedConfigResponse.FromString,
        )
        assert code_of(seed, SeedConfigRequest()) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(seed, SeedConfigRequest(), metadata=bearer(TOKEN_A)) == grpc.StatusCode.OK
        assert (
            code_of(seed, SeedConfigRequest(), metadata=[(JOB_METADATA, "other"), *bearer(TOKEN_A)])
            == grpc.StatusCode.PERMISSION_DENIED
        )
    assert job_step(lh) == 100
    managers = get_json(lh.url, "/api/managers")["managers"]
    assert [(m["replica_id"], m["identity"]) for m in managers] == [("g", "token of job default")]


def test_a_manager_with_its_token_trains_and_one_without_is_refused(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--manager-tokens-file", str(tokens_file(tmp_path))])
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN_A + "\n")
    manager = procs.manager(lh.address, "g0", extra=["--lighthouse-token-file", str(token_file)])
    records = worker_records(procs.worker(manager.address, group="g0", rank=0, first_step=0, steps=20))
    assert all(r["config"] == {"lr": "0.1"} and r["source"] != "fallback" for r in records), records
    poll(lambda: job_step(lh) == 19, 10, 0.1, "the group's steps counted")
    rows = get_json(lh.url, "/api/managers")["managers"]
    assert [(m["replica_id"], m["identity"]) for m in rows] == [("g0", "token of job default")]
    # Job A's token for job "other" (which an operator made), and no token at all: refused.
    assert call(lh.url, "PUT", "/api/jobs/other/config", {"lr": 0.2}).status in (200, 201)
    foreign = procs.manager(
        lh.address, "g1", extra=["--lighthouse-token-file", str(token_file), "--job", "other"]
    )
    anonymous = procs.manager(lh.address, "g2")
    for m, code in ((foreign, "PERMISSION_DENIED"), (anonymous, "UNAUTHENTICATED")):
        refused = worker_records(procs.worker(m.address, group="g", rank=0, first_step=0, steps=1, timeout=3))
        assert refused[0]["source"] == "fallback" and refused[0]["config"] == {}, refused
        # The cause, not a slow start: the lighthouse never answered it and refused it with ``code``.
        info = manager_info(m.address, 5)
        assert info.last_error.split(":")[0] == code and info.last_answer_age_s == -1, info
        assert info.source == "fallback" and info.upstream_failures >= 1, info
        assert f"lighthouse unavailable ({code})" in m.stderr(), m.stderr()
    assert get_json(lh.url, "/api/jobs/other/managers")["managers"] == []
    assert [m["replica_id"] for m in get_json(lh.url, "/api/managers")["managers"]] == ["g0"]


def test_an_open_lighthouse_says_so_and_serves_a_manager_without_credentials(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    assert "gRPC is open" in lh.stderr()
    manager = procs.manager(lh.address, "g0")
    records = worker_records(procs.worker(manager.address, group="g0", rank=0, first_step=0, steps=3))
    assert [r["config"] for r in records] == [{"lr": "0.1"}] * 3
    assert get_json(lh.url, "/api/managers")["managers"][0]["identity"] == ""


@pytest.mark.slow
def test_without_credentials_a_made_up_replica_cannot_steer_the_step(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    manager = procs.manager(lh.address, "g", cache_ttl=0.05)
    worker_records(procs.worker(manager.address, group="g", rank=0, first_step=100, steps=2))
    poll(lambda: job_step(lh) == 101, 10, 0.1, "the group's step counted")
    channel, lighthouse = stub(lh.address)
    with channel:
        for _ in range(3):  # a confirmed leap counted before
            lighthouse.GetConfig(report(HUGE), timeout=10)
            lighthouse.Heartbeat(pb.LighthouseHeartbeatRequest(status=report(HUGE + 1).status), timeout=10)
        lighthouse.GetConfig(report(HUGE, replica="evil2"), timeout=10)
    assert job_step(lh) == 101
    assert "beyond what the job's step" in lh.stderr()
    scheduled = call(lh.url, "PATCH", "/api/config?effective_step=200", {"lr": 0.5})
    assert scheduled.status == 200, scheduled.body
    records = worker_records(
        procs.worker(manager.address, group="g", rank=0, first_step=102, steps=110, step_interval=0.005)
    )
    by_step = {r["step"]: r["config"]["lr"] for r in records}
    assert {s for s, lr in by_step.items() if lr == "0.5"} == set(range(200, 212)), by_step


def test_step_switches_a_manager_could_not_have_made_are_not_stored(procs: ProcessPool) -> None:
    """Made-up replicas report switches to versions the job never had (never pruned with the
    history: each (step, version) a row for good), at steps that cannot follow their own, more in one report
    than a manager holds: none is stored; a true switch is."""
    lh = procs.lighthouse({"lr": 0.1})
    head = get_json(lh.url, "/api/config")["version"]
    lies = {
        "above": [(head + 1000 + i, 10 + i, 9 + i) for i in range(50)],  # versions the job never had
        "backwards": [(head, 80, 90)],  # after a later step than its own
        "true": [(head, 3, -1)],
        "flood": [(head, 100 + i, 99 + i) for i in range(SWITCHES_HELD + 500)],  # more than held
    }
    channel, lighthouse = stub(lh.address)
    with channel:
        for replica, switches in lies.items():
            request = report(5, replica=replica)
            request.status.switches.extend(
                pb.StepSwitch(version=v, step=s, previous_step=p) for v, s, p in switches
            )
            lighthouse.GetConfig(request, timeout=10)

    last_step = 10**18 - 1  # the highest step the HTTP API names

    def groups(step: int) -> dict[str, Any]:
        found: dict[str, Any] = get_json(lh.url, f"/api/config/at-step/{step}")["groups"]
        return found

    poll(lambda: {"true", "flood"} <= set(groups(600)), 10, 0.1, "the true switches stored")
    assert sorted(groups(last_step)) == ["flood", "true"]
    assert groups(last_step)["flood"]["version"] == head
    assert sorted(groups(599)) == ["true"]  # the flood's first 500 of 1,500 are not a manager's


@pytest.mark.slow
def test_fake_metrics_from_a_replica_that_trained_no_step_trigger_no_guard(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.01})
    manager = procs.manager(lh.address, "g0", cache_ttl=0.2)
    worker = procs.worker(
        manager.address, group="g0", rank=0, steps=400, step_interval=0.02, extra=["--report"]
    )
    poll(lambda: job_step(lh) >= 20, 60, 0.2, "a baseline's worth of steps")
    made = call(lh.url, "PATCH", "/api/config?guard=loss:10&guard_steps=60", {"batch_size": 64})
    assert made.status == 200, made.body
    version = made.json["version"]
    guard = next(g for g in get_json(lh.url, "/api/config/guards")["guards"] if g["version"] == version)
    metrics = GroupMetrics()
    start = guard["effective_step"]
    metrics.add([pb.StepMetrics(step=s, values={"loss": math.nan}) for s in range(start, start + 60)])
    batch, batch_id = metrics.take(everything=True)
    channel, lighthouse = stub(lh.address)
    with channel:
        # No step, a leap (no step of it counted), or the job's own step: plausible, but it was
        # never served a config (issue 36: heartbeats of NaN at steps 78-89 rolled a change back).
        for step in (-1, HUGE, job_step(lh)):
            status = pb.ManagerStatus(replica_id="evil", step=step, metrics=batch, metrics_batch=batch_id)
            lighthouse.Heartbeat(pb.LighthouseHeartbeatRequest(status=status), timeout=10)
            batch_id += 1
    decided = poll(
        lambda: (
            (
                g := next(
                    g for g in get_json(lh.url, "/api/config/guards")["guards"] if g["version"] == version
                )
            )["status"]
            != "active"
            and g
        ),
        90,
        0.2,
        "the guard decided",
    )
    assert decided["status"] == "passed", decided
    assert get_json(lh.url, "/api/config")["version"] == version
    worker_records(worker, timeout=60)


# What a flood of refused or made-up calls may add to the lighthouse's RSS. Before refused calls
# freed their requests at once (service.frees_refused_requests), the 400 heartbeats below (80 MB
# of ids) added 156 MiB; a flood of 10,000 made-up jobs adds about 10 MiB (garbage between two
# collections of the young generation, not records).
FLOOD_RSS_BOUND_KIB = 24 * 1024


@pytest.mark.slow
def test_oversized_ids_are_refused_naming_the_field(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    channel, lighthouse = stub(lh.address)
    big = "x" * 100_000
    with channel:
        lighthouse.GetConfig(pb.LighthouseConfigRequest(), timeout=10)  # the server's threads started
        before = rss_kib(lh.popen.pid)
        for i in range(400):
            status = pb.ManagerStatus(replica_id=f"{i}{big}", address=big)
            try:
                lighthouse.Heartbeat(pb.LighthouseHeartbeatRequest(status=status), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "status.replica_id is longer than 256 bytes" in (exc.details() or "")
            else:
                raise AssertionError("a 100 KB replica id was taken")
        with pytest.raises(grpc.RpcError) as address:
            lighthouse.GetConfig(
                pb.LighthouseConfigRequest(status=pb.ManagerStatus(replica_id="g", address=big)), timeout=10
            )
        assert "status.address" in (address.value.details() or "")
        grown = rss_kib(lh.popen.pid) - before
    assert grown < FLOOD_RSS_BOUND_KIB, f"400 refused 200 KB heartbeats grew the lighthouse by {grown} KiB"
    assert get_json(lh.url, "/api/managers")["managers"] == []
    assert len(call(lh.url, "GET", "/metrics").body) < 100_000


@pytest.mark.slow
def test_a_flood_of_made_up_replicas_and_jobs_stays_bounded(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--max-managers", "100"])
    channel, lighthouse = stub(lh.address)
    with channel:
        lighthouse.GetConfig(report(5, replica="real"), timeout=10)
        futures = []
        for i in range(2000):
            status = pb.ManagerStatus(replica_id=f"fake-{i}", step=5)
            futures.append(
                lighthouse.Heartbeat.future(pb.LighthouseHeartbeatRequest(status=status), timeout=60)
            )
            if i % 100 == 99:  # the real group keeps reporting, as it would every few seconds
                [f.result() for f in futures]
                futures = []
                lighthouse.GetConfig(report(5, replica="real"), timeout=10)
        rows = get_json(lh.url, "/api/managers")["managers"]
        assert len(rows) == 100
        assert "real" in {m["replica_id"] for m in rows}  # evicted: the oldest-unseen, never the live one
        before = rss_kib(lh.popen.pid)
        codes: dict[grpc.StatusCode, int] = {}
        for start in range(0, 10_000, 200):
            calls = [
                lighthouse.GetConfig.future(report(5, replica="r", job=f"made-up-{i}"), timeout=60)
                for i in range(start, start + 200)
            ]
            for f in calls:
                code = f.exception().code() if f.exception() is not None else grpc.StatusCode.OK
                codes[code] = codes.get(code, 0) + 1
    assert codes == {grpc.StatusCode.NOT_FOUND: 10_000}
    assert [j["job"] for j in get_json(lh.url, "/api/jobs")["jobs"]] == ["default"]
    grown = rss_kib(lh.popen.pid) - before
    assert grown < FLOOD_RSS_BOUND_KIB, f"10,000 calls for made-up jobs grew the lighthouse by {grown} KiB"
    made = call(lh.url, "PUT", "/api/jobs/new-job/config", {"lr": 1})  # job slots are all free
    assert made.status in (200, 201), made.body


def test_records_unseen_for_the_ttl_expire(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--manager-record-ttl", "1"])
    channel, lighthouse = stub(lh.address)
    with channel:
        lighthouse.Heartbeat(
            pb.LighthouseHeartbeatRequest(status=pb.ManagerStatus(replica_id="gone")), timeout=10
        )
    assert [m["replica_id"] for m in get_json(lh.url, "/api/managers")["managers"]] == ["gone"]
    poll(lambda: get_json(lh.url, "/api/managers")["managers"] == [], 10, 0.1, "the record expired")


@pytest.mark.slow
def test_a_lease_asked_for_ever_holds_no_change_back_nor_the_run_open(procs: ProcessPool) -> None:
    """A made-up manager asks for leases of 1e300 s (and NaN, infinite, negative ones) while a real
    group steps: the lease it gets, the change made now after it and the live run's TTL stay
    within MAX_LEASE_SECONDS; the asks that are no number of seconds are INVALID_ARGUMENT."""
    lh = procs.lighthouse({"lr": 0.1}, extra=["--lease-ceiling-ahead", "0.2"])
    manager = procs.manager(lh.address, "g0")
    worker = procs.worker(manager.address, group="g0", rank=0, steps=100_000, step_interval=0.01)
    poll(lambda: job_step(lh) > 50, 20, what="the group stepping")
    # The group steps at most 100 times a second (it sleeps 10 ms a step): a lease of
    # MAX_LEASE_SECONDS is at most this many steps (and a few of slack) ahead of the job.
    most = 100 * MAX_LEASE_SECONDS + 10
    channel, lighthouse = stub(lh.address)
    with channel:
        for _ in range(20):  # the ceiling a lease asks for is raised in the background: ask again
            step = job_step(lh)
            request = report(step, replica="liar")
            request.lease_seconds = 1e300
            reply = lighthouse.GetConfig(request, timeout=10)
            assert reply.HasField("stable_through_step"), reply  # leased, as a real manager is
            assert reply.stable_through_step <= step + most, (reply.stable_through_step, step)
        for lie in (math.nan, math.inf, -math.inf, -1.0):
            request = report(job_step(lh), replica="liar")
            request.lease_seconds = lie
            with pytest.raises(grpc.RpcError) as refused:
                lighthouse.GetConfig(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, lie
            assert "lease_seconds" in (refused.value.details() or ""), refused.value.details()
    view = get_json(lh.url, "/api/config")
    now = view["current_step"]
    assert view["lease_horizon"] <= now + most, view
    assert view["run"]["ttl"] == MAX_LEASE_SECONDS, view["run"]  # it ends 2 TTLs after its last step
    made = call(lh.url, "PATCH", "/api/config", {"lr": 0.5})
    assert made.status == 200, made.body
    assert made.json["effective_step"] <= now + most, (made.json, now)
    liar = [m for m in get_json(lh.url, "/api/managers")["managers"] if m["replica_id"] == "liar"]
    assert [m["ttl_s"] for m in liar] == [MAX_LEASE_SECONDS], liar
    # The real group trains on with its config: the ceiling (raised every 0.2 s of steps here)
    # went on being stored. (Asked for ever, the ceiling wanted was past what a store holds, and
    # no lease was granted again: the group got the empty fallback within seconds.)
    poll(lambda: last_record(worker)["step"] > now + 500, 30, what="500 steps more")
    records = records_so_far(worker)
    assert [r for r in records if r["source"] == "fallback"] == [], records[-3:]
