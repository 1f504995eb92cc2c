"""``connect()`` and ``examples/train_ddp.py`` on real torchrun jobs: 2 replica groups x 2 ranks, gloo, CPU.

Every group is its own ``torchrun --standalone`` (as with torchft: one torchrun
per replica group), against a real lighthouse; the ranks print one JSON record
per step, with the lr they used and its MIN and MAX over the group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import http_steps
from tests.etcd_cluster import free_port
from tests.helpers_lighthouse import run_cli
from tests.procs import LighthouseProc, Proc, ProcessPool, poll
from tests.threads import CheckedThread
from tests.torchrun_jobs import (
    EXAMPLE,
    RUN_TIMEOUT,
    alive,
    descendants,
    finish,
    kill_group,
    max_step,
    records,
    torchrun,
)
from worker_client import ConfigUnavailable, connect
from worker_client.connect import store_key

CONFIG_PROC = Path(__file__).resolve().parent / "torchrun_config_proc.py"
OLD, NEW = {"lr": 0.1, "momentum": 0.0}, {"lr": 0.02, "momentum": 0.5}


def expected(step: int, switch_at: int) -> dict[str, float]:
    return OLD if step < switch_at else NEW


def check_steps(recs: list[dict[str, Any]], switch_at: int) -> None:
    for r in recs:
        want = expected(r["step"], switch_at)
        assert r["lr_min"] == r["lr_max"], r
        assert (r["lr"], r["momentum"]) == (want["lr"], want["momentum"]), (switch_at, r)


def ranks_cover(recs: list[dict[str, Any]], steps: range) -> None:
    for rank in (0, 1):
        seen = sorted(r["step"] for r in recs if r["rank"] == rank)
        assert seen == list(steps), (rank, seen[:5], seen[-5:])


# ------------------------------------------------------------------ connect() alone, against a real TCPStore


@pytest.fixture
def store_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A torchrun-like environment of group rank 1, with a real TCPStore server behind MASTER_PORT."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"RANK": "1", "REPLICA_GROUP_ID": "g7", "TORCHFT_LIGHTHOUSE": "127.0.0.1:1"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}
    for name in ("TORCHELASTIC_RESTART_COUNT", "LIGHTHOUSE_JOB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield server


@pytest.mark.parametrize(
    "name", ["RANK", "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR", "MASTER_PORT"]
)
def test_connect_names_the_missing_variable(
    store_env: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.delenv(name)
    with pytest.raises(ValueError, match=f"environment variable {name} is not set"):
        connect(timeout=0.5)


def test_connect_waits_for_the_address_no_longer_than_its_timeout(store_env: Any) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigUnavailable, match="g7/restart0/manager_addr"):
        connect(timeout=0.5)
    assert time.monotonic() - start < 0.5 + 2.0


def test_a_restarted_group_never_dials_its_previous_lives_manager(
    store_env: Any, monkeypatch: pytest.MonkeyPatch, procs: ProcessPool
) -> None:
    lighthouse = procs.lighthouse(OLD)
    manager = procs.manager(lighthouse.address, "g7")
    store_env.set(store_key("g7", None), manager.address)  # published by rank 0 of life 0
    with connect(timeout=2.0) as client:
        assert client.addr == manager.address
        assert client.get_config(step=0).get_float("lr") == OLD["lr"]

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the group
    assert "restart1" in store_key("g7", None)
    with pytest.raises(ConfigUnavailable, match="restart1"):
        connect(timeout=0.5)  # life 0's address is there, but not for this life


# ------------------------------------------------------------------ real torchrun jobs


@pytest.fixture
def lighthouse(procs: ProcessPool) -> LighthouseProc:
    return procs.lighthouse(OLD)


def two_groups(procs: ProcessPool, lighthouse: LighthouseProc, args: list[str]) -> list[Proc]:
    """Replica groups 0 and 1 of ``examples/train_ddp.py ARGS``, each its own torchrun."""
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
    return [torchrun(procs, g, EXAMPLE, args, env) for g in (0, 1)]


@pytest.mark.slow
def test_change_scheduled_at_a_step_switches_every_rank_of_both_groups_there(
    procs: ProcessPool, lighthouse: LighthouseProc
) -> None:
    steps = 200  # room for the switch ahead of both, also when one group's torch import lags seconds
    groups = two_groups(
        procs, lighthouse, ["--steps", str(steps), "--step-time", "0.05", "--cache-ttl", "0.2"]
    )
    poll(lambda: all(max_step(g) >= 3 for g in groups), 60, what="both groups training")
    switch_at = max(max_step(g) for g in groups) + 25  # ahead of both, while they run
    assert switch_at < steps - 10
    http_steps.change(lighthouse.url, "PUT", NEW, effective_step=switch_at)
    for g in groups:
        recs = finish(g)
        ranks_cover(recs, range(steps))
        check_steps(recs, switch_at)


@pytest.mark.slow
def test_steps_set_now_from_the_cli_stops_both_groups_at_the_step_it_names(
    procs: ProcessPool, lighthouse: LighthouseProc
) -> None:
    groups = two_groups(procs, lighthouse, ["--steps", "100000", "--step-time", "0.02", "--cache-ttl", "0.5"])
    poll(lambda: all(max_step(g) >= 10 for g in groups), 60, what="both groups training")
    out = run_cli("config", "set", "steps=0", "--url", lighthouse.url)
    assert out.returncode == 0, out.stderr
    found = re.search(r"takes effect at step ([\d,]+) in every group", out.stdout)
    assert found, out.stdout
    stop_at = int(found.group(1).replace(",", ""))
    for g in groups:
        recs = finish(g)
        ranks_cover(recs, range(stop_at))  # every step below it trained by both ranks, none from it on
        check_steps(recs, switch_at=stop_at)  # and the old values throughout


@pytest.mark.slow
def test_config_churn_every_few_ms_never_splits_a_group(
    procs: ProcessPool, lighthouse: LighthouseProc
) -> None:
    groups = two_groups(procs, lighthouse, ["--steps", "40", "--step-time", "0.02", "--cache-ttl", "0.01"])
    stop = threading.Event()
    edits = [0]

    def churn() -> None:
        while not stop.is_set() and edits[0] < 5000:
            edits[0] += 1
            http_steps.change(lighthouse.url, "PATCH", {"lr": round(0.001 * (edits[0] % 97 + 1), 6)})
            stop.wait(0.003)

    thread = CheckedThread(churn)  # a failed edit fails the test (in a plain thread it only warns)
    thread.start()
    try:
        results = [finish(g) for g in groups]  # the example exits non-zero at a split step
    finally:
        stop.set()
        thread.check(10)
    for recs in results:
        ranks_cover(recs, range(40))
        assert all(r["lr_min"] == r["lr_max"] for r in recs)
        by_step = {(r["step"], r["rank"]): r["lr"] for r in recs}
        assert all(by_step[(s, 0)] == by_step[(s, 1)] for s in range(40))
        assert len({r["lr"] for r in recs}) >= 3, "the churn did not reach the training loop"
    assert edits[0] >= 50


@pytest.mark.slow
def test_group_killed_and_started_again_resumes_with_the_config_of_its_step(
    procs: ProcessPool, lighthouse: LighthouseProc, tmp_path: Path
) -> None:
    steps, switch_at, kill_after = 150, 60, 15
    http_steps.change(lighthouse.url, "PUT", NEW, effective_step=switch_at)
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
    args = ["--steps", str(steps), "--step-time", "0.05", "--cache-ttl", "0.2"]
    args += ["--checkpoint-dir", str(tmp_path)]
    group0 = torchrun(procs, 0, EXAMPLE, args, env)
    first = torchrun(procs, 1, EXAMPLE, args, env)
    poll(lambda: max_step(first) >= kill_after, 60, what="group 1 at the kill step")
    before = kill_group(first)
    killed_at = time.time()
    reached = max(r["step"] for r in before if r["rank"] == 0)
    assert reached < switch_at

    again = torchrun(procs, 1, EXAMPLE, args, env)
    after = finish(again)
    (start0, start1) = sorted(records(again, "start"), key=lambda r: r["rank"])
    resumed = start0["first_step"]
    assert start1["first_step"] == resumed
    assert reached <= resumed <= reached + 1, (reached, resumed)  # the checkpoint of the step it reached
    ranks_cover(after, range(resumed, steps))
    check_steps(before + after, switch_at)  # old lr below the switch, new from it, in both lives

    recs0 = finish(group0)
    ranks_cover(recs0, range(steps))
    check_steps(recs0, switch_at)
    # No step's config call, in either group, past its deadline (5 s) plus a margin: the call's
    # own time, not the step's (a loaded machine stalls torch, gloo and the checkpoint too).
    slowest = max(recs0 + before + after, key=lambda r: r["config_seconds"])
    assert slowest["config_seconds"] < 5.0 + 1.0, slowest
    times = [r["time"] for r in recs0]
    assert any(killed_at < t < after[0]["time"] for t in times), "group 0 did not train during the outage"


def config_records(group: Proc) -> list[dict[str, Any]]:
    """The per-step records of tests/torchrun_config_proc.py's ranks."""
    return [r for r in map(json.loads, filter(lambda x: x.startswith("{"), group.lines())) if "step" in r]


@pytest.mark.slow
def test_connect_reads_the_job_and_a_lighthouse_list_and_alone_imports_torch(procs: ProcessPool) -> None:
    """``LIGHTHOUSE_JOB`` picks the job, ``TORCHFT_LIGHTHOUSE`` may list several lighthouses (the
    first one listed here has nothing listening), and torch is loaded by ``connect()`` only."""
    lighthouse = procs.lighthouse(OLD)
    http_steps.call(lighthouse.url, "PUT", "/api/jobs/alpha/config", NEW)
    nothing_there = f"127.0.0.1:{free_port()}"
    env = {"TORCHFT_LIGHTHOUSE": f"{nothing_there},{lighthouse.address}", "LIGHTHOUSE_JOB": "alpha"}
    group = torchrun(procs, 0, CONFIG_PROC, ["--steps", "20", "--interval", "0.02", "--hold-manager"], env)
    try:
        code = group.wait(RUN_TIMEOUT)
    except Exception:
        raise AssertionError(f"{group.name} still running after {RUN_TIMEOUT}s\n{group.stderr()}") from None
    assert code == 0, group.stderr()
    poll(group.output_ended, 10, what="the end of its output")
    starts = [json.loads(x) for x in group.lines() if x.startswith('{"event": "start"')]
    assert sorted(r["rank"] for r in starts) == [0, 1]
    assert all(not r["torch_before"] and r["torch_after"] for r in starts), starts
    recs = config_records(group)
    assert len(recs) == 2 * 20
    assert {(r["job"], r["lr"]) for r in recs} == {("alpha", str(NEW["lr"]))}, "not job alpha's config"
    assert {r["source"] for r in recs} <= {"lighthouse", "cache"}


@pytest.mark.slow
def test_rank0_killed_other_ranks_get_the_fallback_within_the_deadline(
    procs: ProcessPool, lighthouse: LighthouseProc
) -> None:
    deadline = 2.0
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
    args = ["--steps", "100000", "--interval", "0.05", "--timeout", str(deadline)]
    # torchrun would stop rank 1 as soon as it sees rank 0 failed: let it look only once a minute.
    group = torchrun(procs, 0, CONFIG_PROC, args, env, monitor_interval=60)

    def by_rank(rank: int) -> list[dict[str, Any]]:
        return [r for r in config_records(group) if r["rank"] == rank]

    poll(lambda: len(by_rank(0)) >= 5 and len(by_rank(1)) >= 5, 60, what="both ranks asking")
    assert {r["source"] for r in by_rank(1)} <= {"cache", "lighthouse"}
    assert by_rank(1)[-1]["lr"] == str(OLD["lr"])
    rank0 = by_rank(0)[0]["pid"]
    managers = descendants(rank0)
    assert managers, "rank 0 has no manager child"

    os.kill(rank0, signal.SIGKILL)
    poll(lambda: not any(alive(pid) for pid in managers), 5, what="the manager to stop with rank 0")
    seen = len(by_rank(1))
    poll(lambda: len(by_rank(1)) >= seen + 10, 3 * deadline + 10, what="rank 1 going on")
    later = by_rank(1)[seen:]
    assert later[-1]["source"] == "fallback"
    assert later[-1]["lr"] is None  # the fallback is the empty config
    # Never hangs past its deadline (the margin: four torch processes share two busy cores).
    assert max(r["elapsed"] for r in later) < deadline + 3.0


@pytest.mark.slow
def test_a_change_made_now_appears_once_in_tensorboard_at_the_step_every_group_switched(
    procs: ProcessPool, lighthouse: LighthouseProc, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = 120
    boards = [tmp_path / f"tb{g}" for g in (0, 1)]
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address}
    args = ["--steps", str(steps), "--step-time", "0.05", "--cache-ttl", "0.2"]
    groups = [torchrun(procs, g, EXAMPLE, [*args, "--tensorboard", str(boards[g])], env) for g in (0, 1)]
    poll(lambda: all(max_step(g) >= 5 for g in groups), 60, what="both groups training")
    http_steps.change(lighthouse.url, "PATCH", NEW)  # made now: it takes effect at a leased step
    switches = set()
    for g in groups:
        recs = finish(g)
        ranks_cover(recs, range(steps))
        switches.add(min(r["step"] for r in recs if r["lr"] == NEW["lr"]))
        check_steps(recs, min(switches))
    (switch_at,) = switches  # every rank of both groups at one step
    assert not boards[1].exists()  # only rank 0 of group 0 logs
    events = EventAccumulator(str(boards[0]))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("config/lr")] == [
        (0, OLD["lr"]),
        (switch_at, NEW["lr"]),
    ]
    assert [e.step for e in events.Tensors("config/changes/text_summary")] == [0, switch_at]
