"""The segments a store serves (its config per step range, computed incrementally, commit after
commit) agree with the definition of a version, resolved in this file from the committed rows
alone, at every step, for random histories: changes made now with and without step leases granted
and renewed (so made-now changes wait above a promise, next to scheduled ones, some of those
promised meanwhile), schedules and cancels (also refused ones), rollbacks, puts, deletes, runs
that end and resume at earlier steps, and lighthouse restarts within a run.

The oracle (``Oracle``) uses no product helper: it reads the rows' fields (op, change,
effective step, order step, made now) and the versions at which runs ended, both recorded here as
the history is played. The fields the product chose are checked against the design as well
(``Model.check_row``): where a change made now takes effect, how it is ordered, which schedules
and cancels are refused, and that every promise is kept."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from lighthouse.config.values import ConfigError
from lighthouse.jobs.leases import LeaseBook, LeasePolicy
from lighthouse.jobs.versions import Change, ConfigStore, Edit, NotCancellable, Segment, StepPromised
from lighthouse.store.sqlite import SqliteBackend

KEYS = ("a", "b", "c")
FAR = 10**6  # a step past every one a history reaches
values = st.one_of(st.none(), st.integers(0, 9))
patches = st.dictionaries(st.sampled_from(KEYS), values, min_size=1, max_size=2)
# Each kind of op with its weight: histories keep stepping and promising while changes come.
OPS: dict[str, tuple[int, st.SearchStrategy[Any]]] = {
    "step": (3, st.integers(1, 6)),
    "lease": (4, st.tuples(st.integers(0, 3), st.integers(0, 60))),  # a group's lag, a run's start
    "now": (3, patches),
    "put": (1, st.dictionaries(st.sampled_from(KEYS), st.integers(0, 9), max_size=3)),
    "at": (3, st.tuples(st.integers(-3, 10), patches)),  # at an offset from the job's step
    "cancel": (2, st.integers(0, 40)),
    "rollback": (1, st.integers(0, 40)),
    "end_run": (1, st.none()),
    "begin_run": (1, st.integers(0, 60)),
    "restart": (1, st.none()),
}
ops = st.one_of([st.tuples(st.just(op), arg) for op, (weight, arg) in OPS.items() for _ in range(weight)])
policies = st.builds(LeasePolicy, min_steps=st.integers(1, 6), extra_steps=st.integers(0, 2))

# What the histories must reach, as a share of them at least (about half the least share seen in
# 25 runs of 500): a change made now waiting above the promised steps (in 54-73% of the histories),
# a scheduled one above them (33-52%), both at once (20-39%), a scheduled change promised while
# pending (7-17%, but 2.8% once in hunt 13: 1% is asked), a change made now that a run's end
# rebased (5-20%), a restart with promises standing (22-34%), a schedule refused at a promised
# step (28-45%).
# Not required, only counted: "cancel of a change promised to an ended run refused" (2 to 24 in
# 500 histories over runs; test_runs' rewind asserts that refusal in a history of its own).
REQUIRED = {
    "made now, pending above a promise": 0.3,
    "scheduled, pending above a promise": 0.15,
    "made now and scheduled, both pending above a promise": 0.1,
    "scheduled, pending within a promise": 0.01,
    "made now, rebased into a later run": 0.02,
    "restart within a promised run": 0.1,
    "schedule refused at a promised step": 0.1,
}


# ------------------------------------------------------------------ the definition


def fold(rows: Iterable[Change]) -> dict[str, Any]:
    """Rows applied in order: a put replaces the config, a patch sets keys (null deletes one)."""
    config: dict[str, Any] = {}
    for row in rows:
        if row.op == "put":
            config = dict(row.change)
            continue
        for key, value in row.change.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
    return config


class Oracle:
    """The config the state at version V gives for step s, by definition, from the committed rows
    and the versions at which runs ended (``ends``: the job's head when each ended):

    * the changes of V are the rows up to V that are not cancels, less every version a cancel up
      to V names;
    * a change applies at s when it applies at every step (no effective step), or from its
      effective step on. A change made now whose step was a promise to a run that ended before V
      (acknowledged at or before that run's end) holds at every step of the later runs;
    * the changes that apply are folded in apply order: a later run's on top of an earlier one's
      (the runs that ended before the change was acknowledged), then by order step, then by
      version.
    """

    def __init__(self, rows: Sequence[Change], ends: Sequence[int]) -> None:
        self.rows = list(rows)
        self.ends = list(ends)
        self._changes: dict[int, list[tuple[int | None, Change]]] = {}
        self._folded: dict[tuple[int, ...], dict[str, Any]] = {}

    def effective(self, row: Change, version: int) -> int | None:
        if row.made_now and any(row.version <= end < version for end in self.ends):
            return None
        return row.effective_step

    def changes(self, version: int) -> list[tuple[int | None, Change]]:
        """(effective step, row) of the changes of ``version``, in apply order."""
        if version not in self._changes:
            rows = [r for r in self.rows if r.version <= version]
            cancelled = {int(r.change["version"]) for r in rows if r.op == "cancel"}
            kept = [r for r in rows if r.op != "cancel" and r.version not in cancelled]
            kept.sort(key=lambda r: (sum(end < r.version for end in self.ends), r.order_step, r.version))
            self._changes[version] = [(self.effective(r, version), r) for r in kept]
        return self._changes[version]

    def config(self, version: int, step: int) -> dict[str, Any]:
        applied = [row for at, row in self.changes(version) if at is None or at <= step]
        key = tuple(row.version for row in applied)
        if key not in self._folded:
            self._folded[key] = fold(applied)
        return self._folded[key]


def served(segments: list[Segment], step: int) -> dict[str, Any]:
    starts = [seg.from_step for seg in segments]
    return segments[max(0, bisect.bisect_right(starts, step) - 1)].config


# ------------------------------------------------------------------ the history, played and recorded


@dataclass
class Model:
    """What the history did, as the test saw it: the rows committed, the job's step, the runs and
    the promises made to the live one."""

    rows: list[Change] = field(default_factory=list)
    step: int = -1  # the job's step
    ends: list[int] = field(default_factory=list)  # the head when each run ended
    began: bool = False  # a run ever began
    before_runs: int = -1  # the job's step before the first run began
    live: bool = False  # a run is live
    granted: int = -1  # the highest step promised to the live run in this lighthouse life
    floor: int = -1  # the ceiling earlier lives stored for the live run
    ceiling: int = -1  # the highest ceiling stored for the live run
    promises: list[tuple[int, int, int]] = field(default_factory=list)  # (version served, from, through)
    seen: set[str] = field(default_factory=set)

    @property
    def head(self) -> int:
        return self.rows[-1].version if self.rows else 0

    @property
    def horizon(self) -> int:
        """The highest step the live run may have been promised (-1: none)."""
        return max(self.granted, self.floor)

    def oracle(self) -> Oracle:
        return Oracle(self.rows, self.ends)

    def new_run(self) -> None:
        self.granted = self.floor = self.ceiling = -1
        self.promises = []

    def rebased(self, row: Change) -> bool:
        """A change made now acknowledged in a run that ended: its step was a promise to that run."""
        return row.made_now and bool(self.ends) and row.version <= self.ends[-1]

    def pending(self, rows: Sequence[Change]) -> list[Change]:
        """The changes at a step the job has not reached (in the current run), not cancelled."""
        cancelled = {int(r.change["version"]) for r in rows if r.op == "cancel"}
        return [
            r
            for r in rows
            if r.op != "cancel"
            and r.version not in cancelled
            and r.effective_step is not None
            and r.effective_step > self.step
            and not self.rebased(r)
        ]

    def now_step(self, rows: Sequence[Change]) -> int | None:
        """Where a change made now takes effect (None: at once): above every step promised to the
        live run and the job's step, and never below a pending change made now."""
        pending = max((r.effective_step or 0 for r in self.pending(rows) if r.made_now), default=None)
        if self.horizon < 0:
            return pending
        return max(max(self.horizon, self.step) + 1, -1 if pending is None else pending)

    def order_step(self, rows: Sequence[Change], effective_step: int | None) -> int:
        """The step the job had reached (never below a change made at once before it in this epoch;
        with no run live, before anything the next run does), or the change's step if later."""
        if self.began and not self.live:
            base = -1
        else:
            epoch = len(self.ends)
            at_once = [
                r.order_step
                for r in rows
                if r.effective_step is None and sum(end < r.version for end in self.ends) == epoch
            ]
            base = max([self.step, *at_once])
        return base if effective_step is None else max(base, effective_step)

    def check_row(self, rows: Sequence[Change], row: Change, edit: Edit) -> None:
        """``row``, committed for ``edit`` on top of ``rows``, as the design says it must be."""
        assert (row.op, row.change) == (edit.op, edit.change)
        if edit.op == "cancel":
            assert (row.effective_step, row.made_now) == (None, False), row
        elif edit.effective_step is None:
            expected = self.now_step(rows)
            assert (row.effective_step, row.made_now) == (expected, expected is not None), (row, self)
        else:
            assert (row.effective_step, row.made_now) == (edit.effective_step, False), row
            assert edit.effective_step > self.horizon, (row, self)
        assert row.order_step == self.order_step(rows, row.effective_step), (row, self)

    def note_state(self) -> None:
        """Label what the state after an op holds (hypothesis events, and the counts asserted)."""
        if not self.live or self.horizon < 0:
            return
        pending = self.pending(self.rows)
        above = {r.made_now for r in pending if (r.effective_step or 0) > self.horizon}
        if True in above:
            self.seen.add("made now, pending above a promise")
        if False in above:
            self.seen.add("scheduled, pending above a promise")
        if above == {True, False}:
            self.seen.add("made now and scheduled, both pending above a promise")
        if any(not r.made_now and (r.effective_step or 0) <= self.horizon for r in pending):
            self.seen.add("scheduled, pending within a promise")
        if any(self.rebased(r) for r in self.rows if r.effective_step is not None):
            self.seen.add("made now, rebased into a later run")


class Lighthouse:
    """One job's store on one backend, with ceilings stored at once, restarted at will."""

    def __init__(self, policy: LeasePolicy) -> None:
        self.policy = policy
        self.backend = SqliteBackend()
        self.model = Model()
        self.store = self.open()

    def open(self) -> ConfigStore:
        holder: list[ConfigStore] = []

        def write(book: LeaseBook[Any]) -> None:
            wanted = book.wanted
            holder[0].save_lease_ceiling(wanted, book.served_version)
            book.ceiling_stored(wanted)
            self.model.ceiling = max(self.model.ceiling, wanted)

        store = ConfigStore(self.backend, lease_policy=self.policy, request_ceiling=write)
        holder.append(store)
        store.leases.publish("snapshot", store.head)
        return store

    def close(self) -> None:
        self.store.close()
        self.backend.close()

    def commit(self, edits: list[Edit]) -> list[Change]:
        rows = list(self.store.apply(edits).rows)
        kept = [e for e in edits if not e.optional or any(r.change == e.change for r in rows)]
        assert len(kept) == len(rows)
        for row, edit in zip(rows, kept, strict=True):
            self.model.check_row(self.model.rows, row, edit)
            self.model.rows.append(row)
        return rows

    def begin_run(self, step: int) -> None:
        model = self.model
        run = self.store.begin_run(step)
        assert (run is None) == model.live
        if run is not None:
            model.began = model.live = True
            model.step = step
            model.new_run()

    def play(self, op: str, arg: Any) -> None:
        model, store = self.model, self.store
        if op == "step":
            model.step = max(model.step, 0) + arg
            store.advance_step(model.step)
            if not model.began:
                model.before_runs = model.step
        elif op == "lease":  # a group at the job's step, or a few behind, asks a lease or renews it
            lag, start = arg
            if not model.live:  # its first step begins a run
                self.begin_run(start)
            at = max(model.step - lag, 0)
            _, horizon = store.leases.grant(at, 1.0)
            assert at <= horizon <= at + self.policy.length(0.0, 1.0), (at, horizon)
            model.granted = max(model.granted, horizon)
            model.promises.append((model.head, at, horizon))
        elif op in ("now", "put"):
            self.commit([Edit("patch" if op == "now" else "put", arg, "t")])
        elif op == "at":
            offset, change = arg
            at = max(model.step + offset, 0)
            try:
                self.commit([Edit("patch", change, "t", effective_step=at)])
            except StepPromised as refused:
                assert at <= model.horizon and refused.earliest == model.horizon + 1, (at, model)
                model.seen.add("schedule refused at a promised step")
            else:
                assert at > model.horizon
        elif op == "cancel":
            self.cancel(arg)
        elif op == "rollback":
            self.rollback(arg)
        elif op == "end_run":
            # A version says that the changes made now promised to the run, pending or in effect,
            # hold at every step from the next run on (LighthouseState.end_run commits it when
            # ConfigStore.promised_to says so; here the model says when, and the store must agree).
            # Before issue 35 it came only while one was pending: one already in effect held from
            # the next run's first step only from the version after.
            cancelled = {int(r.change["version"]) for r in model.rows if r.op == "cancel"}
            rebased = any(
                r.made_now and r.version not in cancelled and not model.rebased(r) for r in model.rows
            )
            run = store.end_run("test")
            assert (run is None) == (not model.live)
            if run is not None:
                assert run.end_version == model.head
                model.ends.append(model.head)
                model.live = False
                model.new_run()
                assert store.promised_to(run) == rebased
                if rebased:
                    self.commit([Edit("patch", {}, "run")])
        elif op == "begin_run":
            self.begin_run(arg)
        elif op == "restart" and model.live and model.before_runs <= model.step:
            # Within a run only, and not below a step reached before the first run: two product bugs
            # (issue 35, item 3's report). After a restart between runs a change made now waits above
            # the ended run's ceiling; the first run stores its step as a job without runs does, so
            # a restart gives it the higher step the job had reached before the run began.
            store.close()
            self.store = self.open()
            assert self.store.current_step == model.step
            model.granted = -1
            model.floor = model.ceiling
            assert self.store.leases.horizon == model.horizon
            if model.horizon >= 0:
                model.seen.add("restart within a promised run")

    def cancel(self, pick: int) -> None:
        model = self.model
        # Any change: a cancel of one made at once, or cancelled, or in effect, is refused, and so
        # is one of a change made now promised to a run that ended (it holds at every step of the
        # later runs; before issue 35 its cancel was taken while its old step lay above the job's
        # and the promises, and a later run's steps changed back).
        targets = [r for r in model.rows if r.op != "cancel"]
        if not targets:
            return
        target = targets[pick % len(targets)]
        at = target.effective_step
        cancelled = any(r.op == "cancel" and r.change["version"] == target.version for r in model.rows)
        refusal: type[ConfigError] | None = None
        if at is None or cancelled:
            refusal = NotCancellable
        elif model.rebased(target):
            refusal = NotCancellable
            model.seen.add("cancel of a change promised to an ended run refused")
        elif at <= model.horizon:
            refusal = StepPromised
        elif at <= model.step:
            refusal = NotCancellable
        try:
            self.commit([Edit("cancel", {"version": target.version}, "t")])
        except ConfigError as refused:
            assert type(refused) is refusal, (refused, target, model)
            if refusal is StepPromised:
                model.seen.add("cancel refused at a promised step")
        else:
            assert refusal is None, (target, model)
            model.seen.add("cancel")

    def rollback(self, pick: int) -> None:
        """As ``LighthouseState.rollback``: the content the target version gave at the job's step,
        after cancelling what is pending and was acknowledged after it, unless already promised."""
        model = self.model
        targets = [r.version for r in model.rows if r.op != "cancel"]
        if not targets:
            return
        target = targets[pick % len(targets)]
        content = model.oracle().config(target, model.step)
        pending = [r.version for r in model.pending(model.rows) if r.version > target]
        edits = [Edit("cancel", {"version": v}, "t", optional=True) for v in pending]
        rows = self.commit([*edits, Edit("put", content, "rollback")])
        kept = {int(r.change["version"]) for r in rows if r.op == "cancel"}
        by_version = {r.version: r for r in model.rows}
        assert kept == {v for v in pending if (by_version[v].effective_step or 0) > model.horizon}
        model.seen.add("rollback" if kept == set(pending) else "rollback keeping a promised pending change")


def compare(model: Model, store: ConfigStore, versions: Iterable[int]) -> None:
    """The product's segments at each of ``versions`` give the oracle's config at every step from 0
    past the last step the history names (and far beyond); every promise to the live run holds."""
    oracle = model.oracle()
    named = [model.step, *(r.effective_step or 0 for r in model.rows), *(h for _, _, h in model.promises)]
    steps = [*range(max(named) + 3), FAR]
    for version in versions:
        segments = store.segments(version)
        starts = [seg.from_step for seg in segments]
        assert starts[0] == 0 and starts == sorted(set(starts)), segments
        got = [served(segments, s) for s in steps]
        expected = [oracle.config(version, s) for s in steps]
        if got != expected:
            wrong = [(s, g, e) for s, g, e in zip(steps, got, expected, strict=True) if g != e]
            raise AssertionError(f"version {version}: (step, served, defined) {wrong[:3]}; {segments}")
    for served_version, start, through in model.promises:  # the config served with a lease holds
        for s in range(start, through + 1):
            assert oracle.config(model.head, s) == oracle.config(served_version, s), (served_version, s)


def test_served_segments_are_the_config_defined_at_every_step() -> None:
    counts: Counter[str] = Counter()
    examples = 0

    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(policies, st.lists(ops, min_size=8, max_size=40))
    # A change made now between runs (ordered at -1) under a change scheduled at step 0 that is not
    # pending: the remembered segments were extended as if it sorted under pending rows only (CI).
    @example(
        LeasePolicy(min_steps=1, extra_steps=0),
        [("step", 1)] * 4
        + [("lease", (0, 0)), ("end_run", None), ("at", (0, {"a": None})), ("now", {"a": 0})],
    )
    def check(policy: LeasePolicy, history: list[tuple[str, Any]]) -> None:
        nonlocal examples
        lighthouse = Lighthouse(policy)
        model = lighthouse.model
        try:
            for op, arg in history:
                head = model.head
                lighthouse.play(op, arg)
                model.note_state()
                if model.head and (model.head != head or op in ("end_run", "begin_run", "restart")):
                    compare(model, lighthouse.store, [model.head])  # as served, commit after commit
            if model.head:
                compare(model, lighthouse.store, range(1, model.head + 1))
                stored = lighthouse.backend.load(lighthouse.store.job).rows
                assert [r.fields() for r in stored] == [r.fields() for r in model.rows]
        finally:
            lighthouse.close()
        for label in sorted(model.seen):
            event(label)
        counts.update(model.seen)
        examples += 1

    check()
    rare = {label: counts[label] for label, share in REQUIRED.items() if counts[label] < share * examples}
    assert not rare, f"too rare in {examples} histories: {rare}"
