"""The real processes of a chaos run, and what the nemesis does to them.

Lighthouses (one on SQLite, or two on one prefix of a 3-member etcd), one manager per group
(``--run-id inc<N>``, every lighthouse in its list), two ranks per group (``rank.py``). Every
process is started through its CLI on port 0 the first time; a killed lighthouse or manager comes
back on the ports it had, so the others find it where they left it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import old_release
from tests.chaos.proxy import Proxy
from tests.chaos.schedule import Plan
from tests.etcd_cluster import EtcdCluster, Member
from tests.http_util import call
from tests.procs import LighthouseProc, ManagerProc, Proc, ProcessPool, lighthouse_command, poll

RANK_SCRIPT = Path(__file__).resolve().parent / "rank.py"
RESTART_TIMEOUT = 30.0


@dataclass
class Group:
    name: str
    interval: float
    manager: ManagerProc | None = None
    ranks: dict[int, Proc] = field(default_factory=dict)
    bind: str = "127.0.0.1:0"  # the manager's address once it first bound
    links: list[Proxy] = field(default_factory=list)  # to each lighthouse: what a partition cuts


class Cluster:
    """Starts, kills, stops and restarts the processes of one run; ``close`` ends every one."""

    def __init__(self, plan: Plan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir
        self.records = workdir / "records"
        self.records.mkdir(parents=True, exist_ok=True)
        self.pool = ProcessPool(workdir / "logs")
        (workdir / "logs").mkdir(exist_ok=True)
        self.etcd: EtcdCluster | None = None
        self.lighthouses: list[LighthouseProc] = []
        self.groups = [Group(f"g{i}", plan.intervals[i]) for i in range(plan.groups)]
        self.incarnation = 1
        self.clock = (0.0, 0)  # (wall time, step): when the incarnation's first step was due
        self.config_file = workdir / "config.json"
        self._stopped: set[int] = set()  # pids stopped with SIGSTOP, continued by ``close`` at the latest
        self.store_links: list[list[Proxy]] = []  # each lighthouse's links to the etcd members
        self.disk: Path | None = None  # SQLite: the small tmpfs holding the state directory
        self.rolled_back: int | None = None  # the lighthouse running the release before step leases

    # ------------------------------------------------------------------ start
    def start(self, initial: dict[str, Any]) -> None:
        self.config_file.write_text(json.dumps(initial))
        if self.plan.store == "etcd":
            shm = Path("/dev/shm")
            data = Path(tempfile.mkdtemp(prefix="chaos-etcd-", dir=shm if shm.is_dir() else None))
            self.etcd = EtcdCluster(data, size=3).start()
        else:
            self.disk = mount_tmpfs(self.workdir / "disk")
        for index in range(self.plan.lighthouses):
            self.lighthouses.append(self._lighthouse("127.0.0.1:0", "127.0.0.1:0", self._store(index)))
        for group in self.groups:
            group.links = [Proxy(lh.address) for lh in self.lighthouses]
            self._manager(group)
        self.clock = (time.time() + 0.5, 0)
        for group in self.groups:
            for rank in range(self.plan.ranks):
                self._rank(group, rank, 0)

    def _store(self, index: int) -> list[str]:
        """Lighthouse ``index``'s store flags: etcd through links of its own (so it alone can be cut
        off), or its SQLite state directory on the small disk."""
        if self.etcd is None:
            assert self.disk is not None
            return ["--state-dir", str(self.disk / "state")]
        if len(self.store_links) <= index:
            self.store_links.append([Proxy(m.endpoint) for m in self.etcd.members])
        endpoints = ",".join(p.address for p in self.store_links[index])
        return ["--store", f"etcd://{endpoints}/chaos{self.plan.seed}"]

    def _lighthouse(self, bind: str, http_bind: str, store: list[str], old: bool = False) -> LighthouseProc:
        """This release's lighthouse, or (``old``) the release before step leases, which reads no
        config file."""
        if old:
            args = old_release.lighthouse_command(bind, http_bind, store[-1])
            env = old_release.env(old_release.install(self.workdir))
            proc: LighthouseProc = self.pool.spawn(args, "old-lighthouse", LighthouseProc, env=env)
        else:
            args = lighthouse_command(bind, http_bind, *store, "--config", str(self.config_file))
            proc = self.pool.spawn(args, "lighthouse", LighthouseProc)
        proc.address = proc.readline()
        proc.url = proc.readline()
        return proc

    def _manager(self, group: Group) -> None:
        order = [link.address for link in group.links]
        index = int(group.name[1:])
        order = order[index % len(order) :] + order[: index % len(order)]
        args = [
            sys.executable,
            "-m",
            "manager",
            "serve",
            "--lighthouse",
            ",".join(order),
            "--bind",
            group.bind,
        ]
        args += ["--replica-id", group.name, "--run-id", f"inc{self.incarnation}"]
        proc: ManagerProc = self.pool.spawn(args, f"manager-{group.name}", ManagerProc)
        proc.address = proc.readline()
        group.manager = proc
        group.bind = proc.address

    def _rank(self, group: Group, rank: int, first_step: int) -> None:
        """A rank from ``first_step``, on the incarnation's clock (its epoch is when the incarnation's
        first step was due: a rank restarted later catches up)."""
        assert group.manager is not None
        args = [sys.executable, str(RANK_SCRIPT), "--addr", group.manager.address]
        args += [
            "--out",
            str(self.records / f"{group.name}-{rank}.jsonl"),
            "--incarnation",
            str(self.incarnation),
        ]
        args += ["--group", group.name, "--rank", str(rank), "--first-step", str(first_step)]
        epoch, epoch_step = self.clock
        args += [
            "--interval",
            str(group.interval),
            "--epoch",
            str(epoch + (first_step - epoch_step) * group.interval),
        ]
        proc: Proc = self.pool.spawn(args, f"rank-{group.name}-{rank}")
        proc.readline()  # "ready"
        group.ranks[rank] = proc

    # ------------------------------------------------------------------ state
    def url(self, index: int) -> str:
        """Lighthouse ``index``'s HTTP API; while it runs the old release, the other one's (an
        operator edits through this release: docs/stores-and-ha.md, mixed releases)."""
        index %= len(self.lighthouses)
        if index == self.rolled_back:
            index = (index + 1) % len(self.lighthouses)
        return self.lighthouses[index].url

    def last_step(self, group: Group, rank: int) -> int:
        """The last step ``rank`` of ``group`` recorded (-1: none)."""
        path = self.records / f"{group.name}-{rank}.jsonl"
        if not path.exists():
            return -1
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [line for line in f.read().splitlines() if line.strip()]
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except ValueError:  # the line being written when the rank was killed
                continue
        return -1

    # ------------------------------------------------------------------ faults
    def _kill(self, proc: Proc) -> None:
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.popen.wait(10)

    def kill_lighthouse(self, index: int) -> None:
        self._kill(self.lighthouses[index])

    def restart_lighthouse(self, index: int, old: bool = False) -> None:
        """Lighthouse ``index`` back on its ports (``old``: with the release before step leases)."""
        was = self.lighthouses[index]
        http_bind = was.url.split("://", 1)[-1].rstrip("/")
        self.lighthouses[index] = self._retry(
            lambda: self._lighthouse(was.address, http_bind, self._store(index), old), "lighthouse"
        )

    def roll_back_lighthouse(self, index: int, group: Group) -> None:
        """Lighthouse ``index``'s host killed and brought back with the release before step leases,
        on its ports, and ``group``'s manager cut off from the others: it talks to the old one."""
        self.kill_lighthouse(index)
        self.restart_lighthouse(index, old=True)
        self.rolled_back = index
        self.cut([link for i, link in enumerate(group.links) if i != index])

    def upgrade_lighthouse(self, index: int, group: Group) -> None:
        """The rolled-back lighthouse killed and brought back with this release; ``group`` healed."""
        self.kill_lighthouse(index)
        self.rolled_back = None
        self.restart_lighthouse(index)
        self.heal_links(group.links)

    def pause(self, proc: Proc | Member) -> None:
        pid = proc.popen.pid if proc.popen is not None else None
        if pid is not None:
            os.kill(pid, signal.SIGSTOP)
            self._stopped.add(pid)

    def resume(self, proc: Proc | Member) -> None:
        pid = proc.popen.pid if proc.popen is not None else None
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
            self._stopped.discard(pid)

    def kill_manager(self, group: Group) -> None:
        assert group.manager is not None
        self._kill(group.manager)

    def restart_manager(self, group: Group) -> None:
        self._retry(lambda: self._manager(group), f"manager {group.name}")

    def kill_rank(self, group: Group, rank: int) -> int:
        """SIGKILL one rank; the step it will resume at (as torchft heals a rank from its peers)."""
        self._kill(group.ranks[rank])
        return self.last_step(group, rank) + 1

    def restart_rank(self, group: Group, rank: int, first_step: int) -> None:
        self._rank(group, rank, first_step)

    def kill_job(self) -> int:
        """SIGKILL every rank and manager (a crash of the whole job); the lowest step any rank reached."""
        reached = []
        for group in self.groups:
            for rank, proc in group.ranks.items():
                self._kill(proc)
                reached.append(self.last_step(group, rank))
            if group.manager is not None:
                self._kill(group.manager)
        return min(reached)

    def resume_job(self, step: int) -> None:
        """The job restarted from a checkpoint at ``step``: a new incarnation (a new run id)."""
        self.incarnation += 1
        for group in self.groups:
            self.restart_manager(group)
        self.clock = (time.time() + 0.5, step)
        for group in self.groups:
            for rank in range(self.plan.ranks):
                self._rank(group, rank, step)

    def etcd_members(self) -> list[Member]:
        assert self.etcd is not None
        return self.etcd.members

    def etcd_leader(self) -> Member:
        assert self.etcd is not None
        return self.etcd.leader(timeout=10)

    def kill_member(self, member: Member) -> None:
        assert self.etcd is not None
        self.etcd.kill(member)

    def restart_member(self, member: Member) -> None:
        assert self.etcd is not None
        self.etcd.start_member(member)

    def cut(self, links: list[Proxy]) -> None:
        for link in links:
            link.cut()

    def heal_links(self, links: list[Proxy]) -> None:
        for link in links:
            link.heal()

    def fill_disk(self) -> Path:
        """Fill the SQLite lighthouse's disk to the last byte; the filler, to delete to heal."""
        assert self.disk is not None
        filler = self.disk / "filler"
        with filler.open("wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass
        return filler

    @staticmethod
    def _retry(start: Any, what: str) -> Any:
        """``start()`` until it binds: the port a killed process held may take a moment to free."""

        def attempt() -> Any:
            try:
                return start() or True
            except AssertionError as exc:
                if "exited" in str(exc):
                    return None
                raise

        return poll(attempt, RESTART_TIMEOUT, interval=0.2, what=f"{what} back on its port")

    # ------------------------------------------------------------------ end
    def heal(self) -> None:
        """Continue every stopped process and restart every etcd member that is down."""
        for pid in list(self._stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self._stopped.discard(pid)
        if self.etcd is not None:
            for m in self.etcd.members:
                if not m.running():
                    self.etcd.start_member(m)
        for link in [*self._links()]:
            link.heal()
        if self.disk is not None:
            (self.disk / "filler").unlink(missing_ok=True)

    def _links(self) -> list[Proxy]:
        return [p for g in self.groups for p in g.links] + [p for links in self.store_links for p in links]

    def history(self, index: int) -> dict[str, Any]:
        """A lighthouse's whole history and runs record (GET .../history)."""
        res = call(self.url(index), "GET", "api/config/history?limit=1000000", timeout=30)
        assert res.status == 200, res.body[:300]
        body: dict[str, Any] = res.json
        return body

    def close(self) -> None:
        self.heal()
        for group in self.groups:  # ranks first: their last lines are written
            for proc in group.ranks.values():
                if proc.popen.poll() is None:
                    proc.popen.kill()
        self.pool.stop_all()
        for link in self._links():
            link.close()
        if self.disk is not None:
            subprocess.run(["umount", "-l", str(self.disk)], check=False, capture_output=True)
        if self.etcd is not None:
            self.etcd.stop()
            data = self.etcd.members[0].data_dir.parent
            shutil.rmtree(data, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


DISK_BYTES = 64 << 20


def mount_tmpfs(path: Path) -> Path:
    """A small tmpfs at ``path`` the nemesis can fill (root only, as test_full_disk)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"the chaos suite's SQLite runs mount a tmpfs (a disk to fill): {done.stderr.strip()}"
        )
    return path
