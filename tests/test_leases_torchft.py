"""Changes made now reach every torchft replica group at one step: real torchrun jobs, torchft's lighthouse.

Two replica groups (one ``torchrun`` each, 2 ranks, gloo) train ``examples/train_ddp.py
--torchft`` and average their gradients every step through torchft. Meanwhile an operator
thread makes 40 changes of lr and momentum, through every path there is:
an API PATCH, a PUT with If-Match as the editor sends it, the CLI's ``config set``, a rollback
and an edit of the config file. Most come at random moments; every second one (every fourth
after a restart) is isolated, so that nothing replaces it at its step (see ``Operator``). The
example itself all-reduces the values it used across
the groups and stops on a spread; here, from the records every rank prints:

* at every step both groups ran, they used the same lr and momentum;
* each change's new value is first used, in every group, at the effective step its
  reply (or the history) names, unless a later change replaced it there; every isolated
  change is seen so;
* both groups end with the same parameters (a hash of them).

The run does not end on a timer: once the operator is done and both groups have passed the
last change's effective step, the test sets the config's ``steps`` to 0 (a change made now)
and both groups stop at its effective step. So every change is reached however slow the
machine, and the stop is one more change that every group applies at one step.

Run so twice (the plain run is their first half: the suite's time goes to scenarios that add a
fault): the lighthouse SIGKILLed and restarted on its state directory halfway through; two
lighthouses on one etcd prefix, one group on each, changes made through both. Then one
``lighthouse serve --torchft`` as the only lighthouse, through a group killed and healed; and the
example's own stop: two groups on different configs stop at the first step both run.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.etcd_cluster import EtcdCluster
from tests.http_steps import call
from tests.http_util import call as http_call
from tests.http_util import wait_healthy
from tests.procs import ROOT, LighthouseProc, Proc, ProcessPool, child_env, poll
from tests.threads import CheckedThread
from tests.torchrun_jobs import EXAMPLE, finish, kill_group, max_step, records, torchft_lighthouse, torchrun

# Real torch jobs: a run takes a minute or two on 2 cores (longer than the suite's default timeout).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHANGES = 40
STEPS = 520
STEP_TIME = 0.03
# A run outlives any stall of the groups: under a CPU load of 18 a group stood 8 s inside torchft's
# quorum (a gRPC ping timeout), the 5 s default ended the run ("managers gone") and the stop,
# rebased onto the next run as documented, came at another step than its reply named. These
# tests are about switch steps within one run; run ends have their own (test_runs*.py).
ONE_RUN = ["--run-end-after", "120"]
Record = dict[str, Any]


class Operator:
    """Makes the changes, each through the next path, and remembers each one.

    Most changes come at random moments, so several often fall within one lease and share an
    effective step (the last one wins there). Every ``isolate_every``-th change is isolated
    instead: made once every earlier file edit is reloaded, and followed by nothing until both
    groups have passed its effective step. Nothing replaces an isolated change at its step, so
    each must be seen to switch both groups there.
    """

    PATHS = ("patch", "put_if_match", "cli", "rollback", "file")

    def __init__(
        self, urls: list[str], config_file: Path, seed: int, reached: Callable[[], int], isolate_every: int
    ) -> None:
        self.urls = urls
        self.config_file = config_file
        self.rng = random.Random(seed)
        self.reached = reached  # the step both groups have trained past
        self.isolate_every = isolate_every
        self.made: list[dict[str, Any]] = []  # path, lr, momentum, and from the reply version, effective_step
        self.fault_at = CHANGES  # the index of the first change made after the fault (none: CHANGES)
        self.conflicts = 0  # PUTs with If-Match refused (409) and redone

    def run(self, count: int, on_half: Any = None) -> None:
        """Run in a ``CheckedThread``: what it raises fails the test when it is joined."""
        for i in range(count):
            if on_half is not None and i == count // 2:
                on_half()
                self.fault_at = i
            isolated = i % self.isolate_every == self.isolate_every - 1
            if isolated:
                self.effective_steps()  # no earlier file edit can land after this change
            else:
                threading.Event().wait(self.rng.uniform(0.1, 0.7))  # a random moment
            self.change(i)
            if isolated:
                self.made[-1]["isolated"] = True
                self.settle()

    def effective_steps(self) -> list[int]:
        """Of every change made, once every edited file is reloaded (the lighthouse polls it)."""

        def known() -> list[int] | None:
            entries = history(self.urls[0])
            reloaded = {
                file_change_key(h["change"]): h["effective_step"] for h in entries if h["source"] == "file"
            }
            files = [e for e in self.made if e["path"] == "file"]
            if any(file_change_key(e) not in reloaded for e in files):
                return None
            return [
                reloaded[file_change_key(e)] if e["path"] == "file" else e["effective_step"]
                for e in self.made
            ]

        found: list[int] = poll(known, 30, what="every file edit reloaded")
        return found

    def settle(self, steps: int = 0) -> None:
        """Wait until both groups have trained past every change made (and ``steps``)."""
        past = max([steps, *self.effective_steps()])
        poll(lambda: self.reached() > past, 240, what=f"both groups past step {past}")

    def change(self, i: int) -> None:
        path = self.PATHS[i % len(self.PATHS)]
        url = self.urls[i % len(self.urls)]
        lr = round(0.001 * (i + 1) + 0.0001 * self.rng.randint(1, 9), 6)  # never used before
        momentum = round(self.rng.choice([0.0, 0.5, 0.9]), 2)
        entry: dict[str, Any] = {"path": path, "lr": lr, "momentum": momentum, "index": i}
        if path == "patch":
            reply = call(url, "PATCH", "/api/config", {"lr": lr, "momentum": momentum})
        elif path == "put_if_match":  # what the editor does: read, edit, save with the version read
            for _ in range(5):  # on a conflict, read again and redo the edit, as the editor's user does
                live = call(url, "GET", "/api/config")
                body = {**live["config"], "lr": lr, "momentum": momentum}
                result = http_call(
                    url, "PUT", "/api/config", body, headers={"If-Match": str(live["version"])}
                )
                if result.status != 409:
                    break
                # A file reload landed in between, or (two lighthouses) this one had not yet seen
                # through its etcd watch the change just made through the other.
                self.conflicts += 1
            assert result.status == 200, result.body
            reply = json.loads(result.body)
        elif path == "cli":
            command = ["config", "set", f"lr={lr}", f"momentum={momentum}", "--url", url]
            out = subprocess.run(
                [sys.executable, "-m", "lighthouse", *command],
                capture_output=True,
                text=True,
                env=child_env(),
                cwd=str(ROOT),
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            found = re.search(r"version (\d+) \(takes effect at step ([\d,]+)", out.stdout)
            assert found, out.stdout
            reply = {"version": int(found.group(1)), "effective_step": int(found.group(2).replace(",", ""))}
        elif path == "rollback":  # back to a version made earlier: its values are not new
            versions = [m["version"] for m in self.made if "version" in m]
            target = self.rng.choice(versions) if versions else 1
            reply = call(url, "POST", "/api/config/rollback", {"version": target})
            entry["lr"] = entry["momentum"] = None
        else:  # the config file, as an operator edits it; the lighthouse reloads it
            self.config_file.write_text(json.dumps({"lr": lr, "momentum": momentum}))
            self.made.append(entry)
            return
        entry["version"] = reply["version"]
        entry["effective_step"] = reply["effective_step"]
        self.made.append(entry)


def step_values(recs: list[Record]) -> dict[int, set[tuple[float, float]]]:
    """The (lr, momentum) a group used at each step, over its ranks and retries of the step."""
    out: dict[int, set[tuple[float, float]]] = defaultdict(set)
    for r in recs:
        out[r["step"]].add((r["lr"], r["momentum"]))
    return out


def file_change_key(values: Record) -> str:
    """A file edit's values, to find its version in the history (a reload has no reply to read)."""
    return json.dumps({"lr": values["lr"], "momentum": values["momentum"]}, sort_keys=True)


def first_use(recs: list[Record], lr: float) -> int | None:
    steps = [r["step"] for r in recs if r["lr"] == lr]
    return min(steps) if steps else None


def check_run(
    groups: dict[str, list[Record]],
    params: dict[str, set[str]],
    operator: Operator,
    history: list[Record],
    min_checked: int = CHANGES // 3,
) -> None:
    """The run's properties (see the module docstring). ``min_checked``: changes whose switch step
    must be seen (changes made within one lease share an effective step: only the last shows)."""
    assert len(operator.made) == CHANGES
    values = {g: step_values(recs) for g, recs in groups.items()}
    a, b = values.values()
    common = sorted(set(a) & set(b))
    assert len(common) > STEPS // 2, "the groups did not train side by side"
    spread = [(s, a[s], b[s]) for s in common if a[s] != b[s] or len(a[s]) != 1]
    assert not spread, f"steps at which the groups used different values: {spread[:5]}"
    # Each change switched every group at its effective step (a file edit's: from the history).
    by_version = {h["version"]: h for h in history}
    file_versions = {file_change_key(h["change"]): h["version"] for h in history if h["source"] == "file"}
    checked = checked_after_fault = 0
    unchecked: Counter[str] = Counter()
    last = min(max(v) for v in (a, b))
    for entry in operator.made:
        if entry["lr"] is None:
            continue  # a rollback's values were used before
        if entry["path"] == "file":
            version = file_versions[file_change_key(entry)]
        else:
            version = entry["version"]
            assert by_version[version]["effective_step"] == entry["effective_step"], entry
        at = by_version[version]["effective_step"]
        assert at is not None and not by_version[version]["scheduled"], by_version[version]
        later_same_step = [
            h for h in history if h["effective_step"] == at and h["version"] > version and h["op"] != "cancel"
        ]
        if at > last:
            skipped = "not reached"  # within the run
        elif later_same_step:
            skipped = "replaced"  # at its step, by a later change
        elif by_version[version]["cancelled"]:
            skipped = "withdrawn"  # by a rollback to an earlier version, before it was promised
        else:
            skipped = ""
        if skipped:
            assert not entry.get("isolated"), f"an isolated change {skipped}: {entry}"
            unchecked[skipped] += 1
            continue
        for group, recs in groups.items():
            assert first_use(recs, entry["lr"]) == at, (group, entry, at)
        checked += 1
        checked_after_fault += entry["index"] >= operator.fault_at
    assert checked >= min_checked, (
        f"only {checked} changes were seen to take effect; skipped: {dict(unchecked)}, "
        f"PUTs redone after a conflict: {operator.conflicts}"
    )
    if operator.fault_at < CHANGES:
        assert checked_after_fault >= 2, f"only {checked_after_fault} changes after the fault took effect"
    hashes = set().union(*params.values())
    assert len(hashes) == 1, f"the groups ended with different parameters: {params}"


def run_job(
    procs: ProcessPool,
    lighthouses: list[str],
    urls: list[str],
    config_file: Path,
    seed: int,
    on_half: Any = None,
    cache_ttl: float = 1.0,
    steps: int = STEPS,
    isolate_every: int = 2,
    extra: tuple[str, ...] = (),
) -> tuple[dict[str, list[Record]], dict[str, set[str]], Operator]:
    """Train at least ``steps`` steps and until every change is reached, then stop both groups
    (``extra``: more flags of the training script)."""
    env = {"TORCHFT_LIGHTHOUSE": torchft_lighthouse(procs)}
    groups = {
        str(group): start_group(procs, group, env, steps, cache_ttl, ["--lighthouse", lighthouse, *extra])
        for group, lighthouse in enumerate(lighthouses)
    }
    poll(lambda: all(max_step(p) >= 20 for p in groups.values()), 120, what="both groups training")
    operator = Operator(urls, config_file, seed, lambda: min(map(max_step, groups.values())), isolate_every)
    editor = CheckedThread(operator.run, CHANGES, on_half, name="operator")
    editor.start()
    editor.check(timeout=240)  # joined: its error (or its hang) fails the test here, before the settle
    operator.settle(steps)  # then stop both with a change made now: at its effective step
    done, params = stop_groups(urls[0], groups)
    return done, params, operator


def start_group(
    procs: ProcessPool, group: int, env: dict[str, str], steps: int, cache_ttl: float, extra: list[str]
) -> Proc:
    """One group of ``examples/train_ddp.py --torchft``, training until the config's ``steps``."""
    cap = str(20 * steps)  # reached only if the stop is not (the test then fails on the last step trained)
    args = ["--torchft", "--steps", cap, "--cache-ttl", str(cache_ttl), "--step-time", str(STEP_TIME)]
    # Gloo waits 30 s for a peer: beside 2 busy processes (load average 19) the whole machine stood
    # still for 10 s (torchft's lighthouse logged nothing, no rank heartbeated) and a rank's
    # all_reduce gave up at 10 s, ending its group (hunt 12). And on a loaded machine one rank
    # starts long after the other (a lost group's peers fail at once on the reset connection).
    gloo = ["--gloo-timeout", "30"]
    return torchrun(procs, group, EXAMPLE, [*args, *gloo, "--timeout", "10", *extra], env)


def stop_groups(url: str, groups: dict[str, Proc]) -> tuple[dict[str, list[Record]], dict[str, set[str]]]:
    """Stop every group with a change made now (``steps`` 0): each at its effective step, untrained.

    Returns each group's step records and its ranks' parameter hashes (equal within a group).
    """
    stop_at: int = call(url, "PATCH", "/api/config", {"steps": 0})["effective_step"]
    done = {g: finish(p, timeout=240) for g, p in groups.items()}
    for g, recs in done.items():  # both stopped at the stop's effective step, without training it
        assert max(r["step"] for r in recs) == stop_at - 1, (g, stop_at)
    params = {g: {r["sha"] for r in records(p, "params")} for g, p in groups.items()}
    assert all(len(p) == 1 for p in params.values()), params  # ranks of a group agree
    return done, params


def history(url: str) -> list[Record]:
    versions: list[Record] = call(url, "GET", "/api/config/history?limit=1000")["versions"]
    return versions


def test_one_lighthouse_serves_quorum_and_config_through_a_group_killed_and_healed(
    procs: ProcessPool, tmp_path: Path
) -> None:
    """``lighthouse serve --torchft`` is the only lighthouse: ``TORCHFT_LIGHTHOUSE`` names it for
    torchft's quorum and for the config. The groups form a quorum through its port; group 1 is
    killed as a lost machine, started again and healed from group 0 (it jumps to the live step);
    then a change made now takes effect at its effective step in both, and they end equal."""
    torchft = [
        "--torchft",
        "--min-replicas",
        "1",
        "--join-timeout-ms",
        "500",
        "--heartbeat-timeout-ms",
        "1000",
        *ONE_RUN,
    ]
    lh = procs.lighthouse({"lr": 0.01, "momentum": 0.0}, extra=torchft)
    wait_healthy(lh.url)
    env = {"TORCHFT_LIGHTHOUSE": f"http://{lh.address}"}  # no --lighthouse: the config's is this one too
    steps = STEPS  # only a cap (20x): the stop is a change of the config

    def start(group: int) -> Proc:
        return start_group(procs, group, env, steps, cache_ttl=1.0, extra=[])

    def running(proc: Proc) -> Proc:  # a group that failed fails the test at once, with its log
        code = proc.popen.poll()
        assert code is None, f"{proc.name} exited {code}\n{proc.stderr()[-3000:]}"
        return proc

    def joint_steps(proc: Proc) -> int:  # steps committed by both groups together
        return sum(1 for r in records(running(proc)) if r["participants"] == 2 and r["committed"])

    def in_quorum(proc: Proc) -> bool:
        return joint_steps(proc) > 0

    def members() -> dict[str, tuple[str, int]] | None:  # torchft's latest quorum, as the dashboard shows it
        quorum = call(lh.url, "GET", "/api/torchft")["torchft"]["quorum"]
        found = {m["replica_id"].split(":")[0]: (m["replica_id"], quorum["id"]) for m in quorum["members"]}
        return found if len(found) == 2 else None

    group0, first = start(0), start(1)
    # Group 1 is lost once both trained a while together, in one quorum. Not at the first steps
    # after one healed into it: on a loaded machine group 0 started late and healed from group 1
    # at step 35, group 1 was killed at once, and torchft's DDP hook failed group 0's next step
    # (``assert fut._fut``, torchft/ddp.py) instead of dropping it as it does later on.
    poll(lambda: min(max_step(running(g)) for g in (group0, first)) >= 20, 240, what="both groups training")
    poll(lambda: min(joint_steps(g) for g in (group0, first)) >= 10, 240, what="10 joint steps")
    together = poll(members, 30, what="a quorum of both groups on the dashboard")
    assert sorted(together) == ["train_ddp_0", "train_ddp_1"], together
    before = kill_group(first)
    lost_at = max(r["step"] for r in before)
    again = start(1)
    poll(lambda: in_quorum(again), 240, what="group 1 healed into the quorum")
    healed = min(r["step"] for r in records(again))
    assert healed > lost_at, f"group 1 restarted at step {healed}, not healed to group 0's ({lost_at}+)"
    rejoined = poll(members, 30, what="the healed group in the quorum on the dashboard")
    assert rejoined["train_ddp_1"][0] != together["train_ddp_1"][0]  # a new member (torchft's uuid)
    assert rejoined["train_ddp_1"][1] > together["train_ddp_1"][1]  # of a later quorum
    change = call(lh.url, "PATCH", "/api/config", {"lr": 0.004, "momentum": 0.5})
    at = change["effective_step"]
    poll(lambda: min(max_step(group0), max_step(again)) > at, 120, what=f"both groups past step {at}")
    done, params = stop_groups(lh.url, {"0": group0, "1": again})
    lives = {"0": done["0"], "1": before + done["1"]}
    a, b = (step_values(recs) for recs in lives.values())
    common = sorted(set(a) & set(b))
    assert [s for s in common if s > healed and s > at], "the healed group never trained beside the other"
    assert all(a[s] == b[s] and len(a[s]) == 1 for s in common), [
        (s, a[s], b[s]) for s in common if a[s] != b[s]
    ]
    for group, recs in lives.items():  # the change, first used at its effective step in both groups
        assert first_use(recs, 0.004) == at, (group, at, first_use(recs, 0.004))
    assert len(set().union(*params.values())) == 1, f"the groups ended with different parameters: {params}"


def test_the_same_with_the_lighthouse_sigkilled_and_restarted_on_its_state(
    procs: ProcessPool, tmp_path: Path
) -> None:
    config, state = tmp_path / "config.json", tmp_path / "state"
    extra = ["--lease-ceiling-ahead", "2", *ONE_RUN]  # so the changes after the restart land within the run
    lh = procs.lighthouse({"lr": 0.01, "momentum": 0.0}, config_path=config, state_dir=state, extra=extra)
    wait_healthy(lh.url)
    holder: list[LighthouseProc] = [lh]

    def crash() -> None:
        holder[0].signal(signal.SIGKILL)
        holder[0].wait(10)
        holder[0] = procs.restart_lighthouse(holder[0], state_dir=state, config_path=config, extra=extra)

    # A lease of 5 s of steps, renewed half-way, outlasts the restart: the groups keep training
    # through it (and run longer, so that the changes made after it, each about a lease ahead,
    # take effect within the run). A TTL's lease on the push stream too: a push-speed one covers
    # ~80 ms, and past it a strict client's step would wait out the restart.
    groups, params, operator = run_job(
        procs,
        [lh.address] * 2,
        [lh.url],
        config,
        seed=17,
        on_half=crash,
        cache_ttl=5.0,
        steps=2 * STEPS,
        isolate_every=4,  # each isolated change waits out a lease of 5 s
        extra=("--push-lease-seconds", "0"),
    )
    check_run(groups, params, operator, history(holder[0].url), min_checked=6)


def test_the_same_with_two_lighthouses_on_one_etcd_prefix(
    procs: ProcessPool, tmp_path: Path, etcd1: EtcdCluster
) -> None:
    import uuid

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"lr": 0.01, "momentum": 0.0}))
    store = f"etcd://{etcd1.endpoints}/torchft-leases/{uuid.uuid4().hex}"
    a = procs.lighthouse(
        store=store, config_path=config, extra=ONE_RUN
    )  # the file is a's; edits go through both
    b = procs.lighthouse(store=store, extra=ONE_RUN)
    for lh in (a, b):
        wait_healthy(lh.url)
    poll(lambda: call(b.url, "GET", "/api/config")["version"] >= 1, 10, what="b serving the file's version")
    groups, params, operator = run_job(procs, [a.address, b.address], [a.url, b.url], config, seed=18)
    check_run(groups, params, operator, history(a.url))


def test_groups_on_different_configs_stop_naming_the_step(procs: ProcessPool, tmp_path: Path) -> None:
    """The example's own check: two groups whose configs differ (each its own config lighthouse, lr
    0.01 and 0.02) stop at the first step both run, naming it, and neither trains it."""
    lighthouses = []
    for group, lr in enumerate((0.01, 0.02)):
        lh = procs.lighthouse(
            {"lr": lr, "momentum": 0.0},
            config_path=tmp_path / f"config{group}.json",
            state_dir=tmp_path / f"state{group}",
        )
        wait_healthy(lh.url)
        lighthouses.append(lh.address)
    env = {"TORCHFT_LIGHTHOUSE": torchft_lighthouse(procs)}
    groups = []
    for group, lighthouse in enumerate(lighthouses):
        args = ["--torchft", "--lighthouse", lighthouse, "--steps", "2000", "--step-time", str(STEP_TIME)]
        args += ["--gloo-timeout", "30", "--timeout", "10"]
        groups.append(torchrun(procs, group, EXAMPLE, args, env))
    stops = []
    for group, proc in enumerate(groups):
        try:
            code = proc.wait(240)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"group {group} still training after 240 s\n{proc.stderr()[-3000:]}"
            ) from None
        assert code != 0, f"group {group} trained to the end on its own lr"
        stop = re.search(
            r"step (\d+): the replica groups used different lr values \(mean \S+ over 2 groups, this "
            r"group (\S+)\); stopping before they diverge",
            proc.stderr(),
        )
        assert stop, proc.stderr()[-3000:]
        assert float(stop.group(2)) == (0.01, 0.02)[group]
        stops.append(int(stop.group(1)))
    assert stops[0] == stops[1], stops  # the same step in both groups
    for proc in groups:  # nothing trained at or after it (a group may train alone before the other joins)
        trained = records(proc)
        assert all(r["step"] < stops[0] for r in trained), trained[-3:]
