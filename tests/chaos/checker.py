"""The chaos suite's checker: the recorded history of a run against the product's invariants.

It imports nothing of the product. What a config should be at a step it works out on its own
from the lighthouses' stored histories, by the rules docs/invariants.md states (a change made now
holds from the step its acknowledgement names, a scheduled one from its step, apply order by
``(epoch, order_step, version)``, a change made now that an ended run was promised holds at
every step of later runs, a cancel withdraws its target), and it first checks that those
histories hold every change the operator saw acknowledged, exactly as acknowledged.

Invariants (docs/invariants.md numbers them the same):
1. ``split``: every rank of every group trains the same config at a (job incarnation, step),
   unless it was told fallback, or an operator ended the run in between (a run's step leases
   end with it: a group behind the others trains the config as the operator left it); while a
   lighthouse of the release before step leases is on the prefix, within each group only (no
   lease is granted: the groups switch within a TTL of each other);
2. ``effective``: each served config is the one the committed changes give at its step (a change
   is in effect from its effective step on, in every group, and not before); with the old release
   on the prefix, one they gave at that step up to ``MIXED_STALE`` seconds before (docs/invariants.md);
3. ``lost``: every acknowledged change is in every lighthouse's history, as acknowledged; a
   refused one is in none;
4. ``version``: a version names one config at a step, wherever it is served;
5. ``order``: acknowledged order is effective order (changes made now);
6. ``resume``: a resumed job begins a run, whose base holds every change acknowledged before it;
7. ``fallback``: fallback only while a fault explains it (``EXPLAINS_ALL``, ``EXPLAINS_GROUP``);
8. ``liveness``: after the faults stop, every rank trains the final change (or a later one) within
   the bound.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FALLBACK = "fallback"
EXPLAINED_AFTER = 5.0  # seconds after a fault heals during which a fallback is still its doing
EXPLAINED_BEFORE = 0.5  # and before it began (the fault log is written as it is injected)
OPERATOR_END = "ended by"  # a run's end_reason when an operator ended it (POST .../runs/end)
MADE_NOW = ("patch", "put", "patch_if_match", "guard")  # the operator's changes made now ("guard": guarded)
PROMISES_OUTLIVE = 3.0  # seconds after an operator's end during which a group may serve its leases
MIXED = "old_release"  # a lighthouse of the release before step leases on the prefix
# It is still seen after it dies for its etcd lease's TTL (5 s), and every etcd leader election in
# that time gives each lease its TTL afresh (etcd's lessor promotes leases with a new leader);
# then its record is gone, and the managers' TTLs pass.
PEER_LEASE_TTL = 5.0
ELECTION = 3.0  # from an etcd member's fault to a new leader, at most (election timeout 1 s, loaded)
TTLS_AFTER = 3.0
ETCD_FAULTS = ("etcd_leader_kill", "etcd_member_kill", "etcd_member_stop")  # each may elect a leader
MIXED_STALE = 3.0  # how old a state a group may serve meanwhile: a TTL, a deadline, a slow host


@dataclass(frozen=True)
class Violation:
    invariant: str
    seed: int
    detail: str
    inc: int | None = None
    group: str | None = None
    step: int | None = None
    versions: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = " ".join(
            f"{name} {value}"
            for name, value in (("incarnation", self.inc), ("group", self.group), ("step", self.step))
            if value is not None
        )
        versions = f" versions {list(self.versions)}" if self.versions else ""
        return f"seed {self.seed}: {self.invariant}: {where}{versions}: {self.detail}"


@dataclass
class History:
    """Everything one run recorded."""

    seed: int
    records: list[dict[str, Any]] = field(default_factory=list)
    ops: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    lighthouses: dict[str, dict[str, Any]] = field(default_factory=dict)  # name: {"versions", "runs"}
    final: dict[str, Any] = field(default_factory=dict)


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the last line of a process killed while writing it
            continue
    return out


def load(workdir: Path) -> History:
    plan = json.loads((workdir / "plan.json").read_text())
    history = History(plan["seed"])
    for path in sorted((workdir / "records").glob("*.jsonl")):
        history.records.extend(load_jsonl(path))
    history.ops = load_jsonl(workdir / "ops.jsonl")
    history.faults = load_jsonl(workdir / "faults.jsonl")
    for path in sorted((workdir / "histories").glob("*.json")):
        history.lighthouses[path.stem] = json.loads(path.read_text())
    final = workdir / "final.json"
    history.final = json.loads(final.read_text()) if final.exists() else {}
    return history


def first_time_live(records: Iterable[dict[str, Any]], version: int, after: float) -> float | None:
    """When ``records`` (one rank's) first show ``version`` or a later one, not the fallback, at or
    after ``after`` (None: not yet): the final change or a change stored after it is live there."""
    times = [
        r["t"] for r in records if r["t"] >= after and r["version"] >= version and r["source"] != FALLBACK
    ]
    return float(min(times)) if times else None


# ---------------------------------------------------------------- the model
def served_equal(served: dict[str, str], expected: dict[str, Any]) -> bool:
    """Whether a served config (every value a string) is ``expected`` (JSON values): strings as
    they are, any other value as JSON text that parses back to it."""
    if served.keys() != expected.keys():
        return False
    for key, value in expected.items():
        text = served[key]
        if isinstance(value, str):
            if text != value:
                return False
            continue
        try:
            if json.loads(text) != value or type(json.loads(text)) is not type(value):
                return False
        except ValueError:
            return False
    return True


class Model:
    """The configs a job's stored history gives, worked out from its rows and runs record."""

    def __init__(self, versions: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
        self.rows = sorted(versions, key=lambda r: r["version"])
        self.created = [r["created_at"] for r in self.rows]
        self.ended = [r for r in runs if not r.get("live", r.get("ended_at") is None)]
        self.ends = sorted(r["end_version"] for r in self.ended)
        self.runs = sorted(runs, key=lambda r: r["number"])
        self._memo: dict[tuple[int, int, int], dict[str, Any]] = {}

    def head_at(self, t: float) -> int:
        """The newest version committed at wall time ``t`` (0: none)."""
        at = bisect.bisect_right(self.created, t)
        return max((r["version"] for r in self.rows[:at]), default=0)

    def heads_between(self, since: float, t: float) -> list[int]:
        """Every head the job had from ``since`` to ``t``."""
        first = bisect.bisect_right(self.created, since)
        last = bisect.bisect_right(self.created, t)
        return sorted({self.head_at(since), *(self.head_at(c) for c in self.created[first:last])})

    def heads_for(self, t: float, step: int) -> list[tuple[int, int]]:
        """The job's states a config served at ``t`` for ``step`` may come from, each as (head, the
        run it is served in): every change committed by then, but none committed after the end of
        the run the step belongs to (the latest run begun by ``t``; a step below its first one,
        served meanwhile on an earlier lease, belongs to the run before). Once that run has ended
        and before the next begins, a step may also get the latest state (no run is live: a change
        applies at once) unless it was promised to the ended run: either, as long as every group
        gets the same (``split``)."""
        head = self.head_at(t)
        begun = [r for r in self.runs if r["started_at"] <= t]
        if not begun:
            return [(head, 0)]
        run = begun[-1]
        if step < run["start_step"] and len(begun) > 1:
            run = begun[-2]
        number = run["number"]
        heads = []
        before = [r for r in self.runs if r["number"] < number]
        if (
            before
            and before[-1].get("end_reason", "").startswith(OPERATOR_END)
            and t <= run["started_at"] + PROMISES_OUTLIVE
        ):
            # An operator ended the run before while its groups stepped: a group may still serve
            # what that run promised it (not promised either way: docs/invariants.md).
            heads.append((min(head, before[-1]["end_version"]), before[-1]["number"]))
        if run.get("ended_at") is None:
            return [(head, number), *heads]
        heads.insert(0, (min(head, run["end_version"]), number))
        if t >= run["ended_at"] or run.get("end_reason", "").startswith(OPERATOR_END):
            heads.append((head, number + 1))  # after its end: the latest, in the runs after it
        return heads

    def _rebased(self, row: dict[str, Any], run: int) -> bool:
        """A change made now that a run before ``run`` was promised holds at every step of it."""
        return row["made_now"] and any(
            r["number"] < run and row["version"] <= r["end_version"] for r in self.ended
        )

    def config(self, head: int, step: int, run: int = 0) -> dict[str, Any]:
        """The config at ``step`` in the job's state at version ``head``, served in run ``run``."""
        key = (head, step, run)
        if key in self._memo:
            return self._memo[key]
        rows = [r for r in self.rows if r["version"] <= head]
        cancelled = {r["change"]["version"] for r in rows if r["op"] == "cancel"}
        applied = []
        for r in rows:
            if r["op"] == "cancel" or r["version"] in cancelled:
                continue
            effective = None if self._rebased(r, run) else r["effective_step"]
            if effective is None or effective <= step:
                epoch = bisect.bisect_left(self.ends, r["version"])
                applied.append(((epoch, r["order_step"], r["version"]), r))
        config: dict[str, Any] = {}
        for _, r in sorted(applied, key=lambda item: item[0]):
            if r["op"] == "put":
                config = dict(r["change"])
            else:
                for k, v in r["change"].items():
                    if v is None:
                        config.pop(k, None)
                    else:
                        config[k] = v
        self._memo[key] = config
        return config


# ---------------------------------------------------------------- invariants
def _canon(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _who(records: list[dict[str, Any]]) -> list[str]:
    return sorted({f"{r['group']}/{r['rank']}" for r in records})


@dataclass(frozen=True)
class _OperatorEnd:
    """An acknowledged operator run end and the steps it may split: those its incarnation trained up
    to ``PROMISES_OUTLIVE`` seconds after its answer (the ended run's steps, and the leases past
    them), per incarnation."""

    end_version: int
    sent: float
    through: dict[int, int]


def _operator_ends(h: History) -> list[_OperatorEnd]:
    ends = []
    for op in h.ops:
        if op["kind"] != "run_end" or op.get("status") != 200 or not op["answer"].get("ended"):
            continue
        until = op["answered"] + PROMISES_OUTLIVE
        through: dict[int, int] = {}
        for r in h.records:
            if r["t"] <= until:
                through[r["inc"]] = max(through.get(r["inc"], -1), r["step"])
        ends.append(_OperatorEnd(int(op["answer"]["ended"]["end_version"]), op["sent"], through))
    return ends


def _split_by_operator_end(
    ends: list[_OperatorEnd], inc: int, step: int, records: list[dict[str, Any]]
) -> bool:
    """Whether an operator's end explains a split at (inc, step): one side trained a config of the
    ended run (a version up to its last), one side trained after the end, and the step is one
    the incarnation reached by the time the ended run's leases ran out. A group behind the others
    (stopped, say) trains those steps later with the config as the operator left it, whichever
    version that is: not promised (docs/invariants.md)."""
    oldest = min(r["version"] for r in records)
    return any(
        step <= end.through.get(inc, -1)
        and oldest <= end.end_version
        and any(r["t"] >= end.sent for r in records)
        for end in ends
    )


def _mixed_windows(h: History) -> list[tuple[float, float]]:
    """When a lighthouse of the release before step leases was on the prefix, or still seen."""
    elections = sorted(f["start"] for f in h.faults if f["kind"] in ETCD_FAULTS)
    windows = []
    for f in h.faults:
        if f["kind"] != MIXED:
            continue
        gone = f.get("end", f["start"]) + PEER_LEASE_TTL  # its record's lease expires
        for start in elections:  # unless a new leader gave it its TTL afresh first
            if f["start"] <= start <= gone:
                gone = max(gone, start + ELECTION + PEER_LEASE_TTL)
        windows.append((f["start"] - EXPLAINED_BEFORE, gone + TTLS_AFTER))
    return windows


def _in(windows: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t <= b for a, b in windows)


def _mixed_since(windows: list[tuple[float, float]], t: float) -> float | None:
    """When the old release came, if ``t`` is in one of its windows (None: it is not)."""
    return min((a for a, b in windows if a <= t <= b), default=None)


def _pinned_at(records: list[dict[str, Any]]) -> dict[int, float]:
    """For each record (by ``id``), when its group first served that config at that step: a rank
    behind its group (woken from a SIGSTOP, restarted) gets its manager's pinned answer, made when
    the first rank asked; judged at its own time, a pin from a window with no lease would look
    like an answer given after it (seed 1931634541)."""
    keys = [(r["inc"], r["group"], r["step"], _canon(r["config"])) for r in records]
    first: dict[tuple[int, str, int, str], float] = {}
    for r, key in zip(records, keys, strict=True):
        first[key] = min(first.get(key, r["t"]), r["t"])
    return {id(r): first[key] for r, key in zip(records, keys, strict=True)}


def _split_between_groups_while_mixed(
    windows: list[tuple[float, float]], records: list[dict[str, Any]], pinned_at: dict[int, float]
) -> bool:
    """Whether a split is only between groups, served while no step lease was granted (an old
    release on the prefix): every group agrees within itself (its manager pins a step's answer)."""
    if not all(_in(windows, pinned_at[id(r)]) for r in records):
        return False
    per_group: dict[str, set[str]] = defaultdict(set)
    for r in records:
        per_group[r["group"]].add(_canon(r["config"]))
    return all(len(configs) == 1 for configs in per_group.values())


def split_steps(h: History) -> list[Violation]:
    seen: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in h.records:
        if r["source"] != FALLBACK:
            seen[(r["inc"], r["step"])][_canon(r["config"])].append(r)
    ends = _operator_ends(h)
    mixed = _mixed_windows(h)
    pinned_at = _pinned_at([r for configs in seen.values() for rs in configs.values() for r in rs])
    out = []
    for (inc, step), configs in sorted(seen.items()):
        records = [r for rs in configs.values() for r in rs]
        if (
            len(configs) > 1
            and not _split_by_operator_end(ends, inc, step, records)
            and not _split_between_groups_while_mixed(mixed, records, pinned_at)
        ):
            who = "; ".join(
                f"{_who(rs)} v{sorted({r['version'] for r in rs})} {c}" for c, rs in configs.items()
            )
            versions = tuple(sorted({r["version"] for rs in configs.values() for r in rs}))
            out.append(
                Violation("split", h.seed, f"{len(configs)} configs: {who}", inc, None, step, versions)
            )
    return out


def versions_name_one_config(h: History) -> list[Violation]:
    seen: dict[tuple[int, int], set[str]] = defaultdict(set)
    for r in h.records:
        if r["source"] != FALLBACK:
            seen[(r["version"], r["step"])].add(_canon(r["config"]))
    return [
        Violation(
            "version",
            h.seed,
            f"version {v} named {len(cs)} configs at one step: {sorted(cs)}",
            None,
            None,
            s,
            (v,),
        )
        for (v, s), cs in sorted(seen.items())
        if len(cs) > 1
    ]


def _rows(h: History, name: str) -> dict[int, dict[str, Any]]:
    return {r["version"]: r for r in h.lighthouses[name]["versions"]}


def acknowledged_in_history(h: History) -> list[Violation]:
    out = []
    names = sorted(h.lighthouses)
    if not names:
        return [Violation("lost", h.seed, "no lighthouse history was recorded")]
    reference = _rows(h, names[0])
    for name in names[1:]:
        other = _rows(h, name)
        for version in sorted(set(reference) ^ set(other)):
            out.append(
                Violation(
                    "lost",
                    h.seed,
                    f"{name} and {names[0]} disagree on version {version}",
                    versions=(version,),
                )
            )
        for version in sorted(set(reference) & set(other)):
            a, b = reference[version], other[version]
            fields = ("op", "change", "effective_step", "order_step", "made_now")
            if any(a[f] != b[f] for f in fields):
                out.append(
                    Violation(
                        "lost", h.seed, f"{name} stores version {version} differently", versions=(version,)
                    )
                )
    for op in h.ops:
        status, request = op.get("status"), op.get("request") or {}
        if status == 200 and op["kind"] != "run_end":
            answer = op["answer"]
            version = answer["version"]
            for name in names:
                row = _rows(h, name).get(version)
                if row is None:
                    out.append(
                        Violation(
                            "lost",
                            h.seed,
                            f"op{op['n']} ({op['kind']}) acknowledged as version {version}, "
                            f"missing on {name}",
                            versions=(version,),
                        )
                    )
                    continue
                problems = []
                if row["op"] != answer["op"]:
                    problems.append(f"op {row['op']} != {answer['op']}")
                if row["effective_step"] != answer["effective_step"]:
                    problems.append(f"effective_step {row['effective_step']} != {answer['effective_step']}")
                if op["kind"] in (*MADE_NOW, "scheduled") and row["change"] != request["body"]:
                    problems.append(f"change {row['change']} != {request['body']}")
                if op["kind"] == "cancel" and row["change"] != {"version": request["target"]}:
                    problems.append(f"cancel of {row['change']} != {request['target']}")
                if problems:
                    out.append(
                        Violation(
                            "lost",
                            h.seed,
                            f"op{op['n']} on {name}: " + "; ".join(problems),
                            versions=(version,),
                        )
                    )
        elif isinstance(status, int) and (400 <= status < 500 or status == 507) and request.get("body"):
            mark = request["body"].get("mark")
            for name in names:
                for row in _rows(h, name).values():
                    if (
                        mark is not None
                        and row["op"] in ("put", "patch")
                        and row["change"].get("mark") == mark
                    ):
                        out.append(
                            Violation(
                                "lost",
                                h.seed,
                                f"op{op['n']} was refused ({status}) but {name} stored it "
                                f"as version {row['version']}",
                                versions=(row["version"],),
                            )
                        )
    return out


def acknowledged_order(h: History) -> list[Violation]:
    """Changes made now, acknowledged one after the other within one run: versions and effective
    steps in that order."""
    runs = _runs(h)
    names = sorted(h.lighthouses)
    rows = h.lighthouses[names[0]]["versions"] if names else []
    cancelled = {r["change"]["version"] for r in rows if r["op"] == "cancel"}
    made_now = [
        op
        for op in h.ops
        if op.get("status") == 200
        and op["kind"] in MADE_NOW
        and not op["answer"].get("scheduled")
        and op["answer"]["version"] not in cancelled  # withdrawn (a rollback): no order to keep
    ]
    made_now.sort(key=lambda op: op["answered"])
    out = []
    for a, b in itertools.pairwise(made_now):
        if a["answered"] >= b["sent"]:
            continue  # concurrent: no order was acknowledged
        va, vb = a["answer"]["version"], b["answer"]["version"]
        if vb <= va:
            out.append(
                Violation(
                    "order",
                    h.seed,
                    f"op{b['n']} acknowledged after op{a['n']} got an older version",
                    versions=(va, vb),
                )
            )
        ea, eb = a["answer"]["effective_step"], b["answer"]["effective_step"]
        same_run = _run_of(runs, a["sent"]) is not None and _run_of(runs, a["sent"]) == _run_of(
            runs, b["answered"]
        )
        if same_run and ea is not None and eb is not None and eb < ea:
            out.append(
                Violation(
                    "order",
                    h.seed,
                    f"op{b['n']} takes effect at {eb}, before op{a['n']} acknowledged earlier at {ea}",
                    versions=(va, vb),
                )
            )
    return out


def _runs(h: History) -> list[dict[str, Any]]:
    names = sorted(h.lighthouses)
    return h.lighthouses[names[0]].get("runs", []) if names else []


def _run_of(runs: list[dict[str, Any]], t: float) -> int | None:
    for run in runs:
        end = run.get("ended_at") or float("inf")
        if run["started_at"] <= t <= end:
            return int(run["number"])
    return None


def effective_steps(h: History) -> list[Violation]:
    """Every config served (not fallback) is what the stored changes give at its step, in the job's
    state when it was served: the changes committed by then (the record's time), the runs record."""
    names = sorted(h.lighthouses)
    if not names:
        return []
    model = Model(h.lighthouses[names[0]]["versions"], _runs(h))
    mixed = _mixed_windows(h)
    served = [r for r in h.records if r["source"] != FALLBACK]
    pinned_at = _pinned_at(served)
    out = []
    reported: set[tuple[int, str]] = set()
    for r in sorted(served, key=lambda r: r["t"]):
        heads = model.heads_for(r["t"], r["step"])
        t = pinned_at[id(r)]  # when its group's manager made the answer
        since = _mixed_since(mixed, t)
        if since is not None:  # no lease: a state of the job of the last MIXED_STALE seconds, in any run
            runs = {run for _, run in heads} | {x["number"] for x in model.runs if x["started_at"] <= t}
            states = model.heads_between(max(since, t - MIXED_STALE), t)
            heads += [(head, run) for head in states for run in sorted(runs)]
        if any(served_equal(r["config"], model.config(head, r["step"], run)) for head, run in heads):
            continue
        head, run = heads[0]
        expected = model.config(head, r["step"], run)
        key = (r["inc"], r["group"])
        if key in reported:  # one per group and incarnation: the first says it
            continue
        reported.add(key)
        out.append(
            Violation(
                "effective",
                h.seed,
                f"rank {r['rank']} served {r['config']} (v{r['version']}, {r['source']}), "
                f"the history at v{head} gives {expected}",
                r["inc"],
                r["group"],
                r["step"],
                (r["version"], head),
            )
        )
    return out


def resumed_runs(h: History) -> list[Violation]:
    """A resumed job begins a run of its own whose base holds every change acknowledged before the
    job stopped; and in every run after the first, every change made now that was acknowledged
    before the run began holds from its first step (an ended run's promise, or a change made
    between runs: at once)."""
    runs = _runs(h)
    out = []
    names = sorted(h.lighthouses)
    rows = h.lighthouses[names[0]]["versions"] if names else []
    cancels = [(r["version"], r["change"]["version"]) for r in rows if r["op"] == "cancel"]
    for run in sorted(runs, key=lambda r: r["number"])[1:]:
        earlier = [r for r in runs if r["number"] < run["number"] and r.get("ended_at") is not None]
        for row in rows:
            if not row["made_now"] or row["version"] > run["base_version"]:
                continue
            if row["effective_step"] is None or row["effective_step"] <= run["start_step"]:
                continue
            if any(target == row["version"] for _, target in cancels):
                continue
            if any(row["version"] <= r["end_version"] for r in earlier):
                continue  # promised to an ended run: it holds at every step of the later ones
            out.append(
                Violation(
                    "resume",
                    h.seed,
                    f"v{row['version']}, made now before run {run['number']} began (at step "
                    f"{run['start_step']}), takes effect at step {row['effective_step']} in it",
                    versions=(row["version"],),
                )
            )
    for fault in h.faults:
        if fault["kind"] != "job_resume" or "incarnation" not in fault:
            continue
        inc = fault["incarnation"]
        run = next((r for r in runs if r.get("run_id") == f"inc{inc}"), None)
        if run is None:
            out.append(
                Violation("resume", h.seed, f"the job resumed as inc{inc} but no run has that id", inc)
            )
            continue
        for op in h.ops:
            if (
                op.get("status") == 200
                and op["kind"] != "run_end"
                and op["answered"] < fault["start"]
                and op["answer"]["version"] > run["base_version"]
            ):
                out.append(
                    Violation(
                        "resume",
                        h.seed,
                        f"op{op['n']}, acknowledged before the job stopped, is not in "
                        f"run {run['number']}'s base (v{run['base_version']})",
                        inc,
                        versions=(op["answer"]["version"],),
                    )
                )
    return out


# Faults that explain a fallback, and to whom: a group's own manager's; any lighthouse's, and a
# lighthouse cut off from etcd (it cannot promise steps: the managers move to another, at the cost
# of one deadline). The others (an etcd member or its leader, a full disk, a rank) must cost no
# fallback: the lighthouses serve from memory and the stored lease ceiling carries the leases.
# A whole job restarting explains its first steps' fallback for one deadline past its restart
# (``RESTART_GRACE``): its first lease waits for the new run's record and ceiling to be stored,
# which on a loaded host (and beside commits, which hold grants) may take longer than a worker's
# deadline (docs/invariants.md says so).
EXPLAINS_ALL = ("lighthouse_kill", "lighthouse_stop", "lighthouse_etcd_cut", MIXED)
EXPLAINS_GROUP = ("manager_kill", "manager_stop", "manager_cut")
RESTART = "job_resume"
RESTART_GRACE = 1.5


def _explains(fault: dict[str, Any], group: str) -> bool:
    if fault["kind"] in EXPLAINS_ALL:
        return True
    return fault["kind"] in EXPLAINS_GROUP and str(fault.get("target", "")).startswith(f"manager-{group}")


def _window(fault: dict[str, Any]) -> tuple[float, float]:
    """When a fallback is ``fault``'s doing."""
    end = fault.get("end", fault["start"])
    after = RESTART_GRACE if fault["kind"] == RESTART else EXPLAINED_AFTER
    return fault["start"] - EXPLAINED_BEFORE, end + after


def _operator_ends_as_faults(h: History) -> list[dict[str, Any]]:
    """An operator's run end, acknowledged, as a fault window: the groups' leases end with the run and
    the next run's first lease waits for its record and ceiling (a restart's grace after it)."""
    return [
        {"kind": RESTART, "start": op["sent"], "end": op["answered"], "all": True}
        for op in h.ops
        if op["kind"] == "run_end" and op.get("status") == 200
    ]


def unexplained_fallbacks(h: History) -> list[Violation]:
    out = []
    faults = [*h.faults, *_operator_ends_as_faults(h)]
    reported: set[tuple[int, str]] = set()
    for r in sorted(h.records, key=lambda r: r["t"]):
        if r["source"] != FALLBACK:
            continue
        if any(
            _window(f)[0] <= r["t"] <= _window(f)[1]
            for f in faults
            if _explains(f, r["group"])
            or (f["kind"] == RESTART and (f.get("all") or r["inc"] == f.get("incarnation")))
        ):
            continue
        key = (r["inc"], r["group"])
        if key not in reported:
            reported.add(key)
            out.append(
                Violation(
                    "fallback",
                    h.seed,
                    f"rank {r['rank']} got the fallback at {r['t']:.3f} with no fault near",
                    r["inc"],
                    r["group"],
                    r["step"],
                )
            )
    return out


def liveness(h: History) -> list[Violation]:
    """After the faults, every rank trains the final change, or a change stored after it (a config
    file edit the lighthouse reads on its restart, say), within the bound of its acknowledgement."""
    final = h.final
    if not final:
        return [Violation("liveness", h.seed, "the run ended before its final change")]
    by_rank: dict[str, list[dict[str, Any]]] = {rank: [] for rank in final["reached"]}
    for r in h.records:
        by_rank.setdefault(f"{r['group']}-{r['rank']}", []).append(r)
    version = final["answer"]["version"]
    reached = {rank: first_time_live(rs, version, final["acked"]) for rank, rs in by_rank.items()}
    out = []
    for rank, when in sorted(reached.items()):
        if when is None or when - final["acked"] > final["bound"]:
            late = "never" if when is None else f"after {when - final['acked']:.1f} s"
            out.append(
                Violation(
                    "liveness", h.seed, f"{rank} trained the final change {late} (bound {final['bound']} s)"
                )
            )
    return out


INVARIANTS = (
    split_steps,
    effective_steps,
    acknowledged_in_history,
    versions_name_one_config,
    acknowledged_order,
    resumed_runs,
    unexplained_fallbacks,
    liveness,
)


def check(h: History) -> list[Violation]:
    out: list[Violation] = []
    for invariant in INVARIANTS:
        out.extend(invariant(h))
    return out
