"""Manager-side units: the per-step pins (StepPins) and the Snapshot with its pre-serialized replies."""

from __future__ import annotations

import threading

import pytest

from manager.pinning import StepPins
from manager.snapshot import CACHE, FALLBACK, LIGHTHOUSE, STALE, Snapshot
from protos import lighthouse_config_pb2 as pb
from tests.threads import CheckedThread


def snap(version: int) -> Snapshot:
    cfg = {"v": str(version)}
    return Snapshot(version, "s", "i", CACHE, (0,), (cfg,), cfg)


def decode(reply: bytes) -> pb.ManagerConfigResponse:
    return pb.ManagerConfigResponse.FromString(reply)


# ------------------------------------------------------------------ StepPins


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StepPins(0)


def test_first_answer_for_a_step_wins() -> None:
    pins = StepPins()
    assert pins.get(5) is None
    assert pins.pin(5, snap(1), b"first") == b"first"
    assert pins.pin(5, snap(2), b"second") == b"first"  # a later rank gets the pinned one
    assert pins.get(5) == b"first"
    assert pins.get(6) is None
    assert pins.max_step == 5 and len(pins) == 1


def test_pins_are_per_step() -> None:
    pins = StepPins()
    pins.pin(1, snap(1), b"a")
    pins.pin(2, snap(2), b"b")
    pins.pin(0, snap(2), b"c")  # an older step can still be pinned inside the window
    assert (pins.get(0), pins.get(1), pins.get(2)) == (b"c", b"a", b"b")
    assert pins.max_step == 2


def test_a_run_begun_at_a_step_drops_the_pins_from_it_on_and_keeps_those_below() -> None:
    """A run begins at step 5: what the group trained below it stays pinned (a rank behind replays
    it so), the steps from 5 on are the new run's (a resume asks for them again)."""
    pins = StepPins()
    for step in range(10):
        pins.pin(step, snap(1), b"old %d" % step)
    pins.drop_from(5)
    assert [pins.get(s) for s in range(10)] == [b"old %d" % s for s in range(5)] + [None] * 5
    assert pins.max_step == 4 and len(pins) == 5
    assert pins.pin(5, snap(2), b"new 5") == b"new 5"  # the new run's first step pins anew
    assert pins.pin(7, snap(2), b"new 7") == b"new 7" and pins.max_step == 7
    pins.drop_from(0)  # a resume from step 0: nothing stays
    assert pins.max_step == -1 and len(pins) == 0 and pins.get(3) is None


@pytest.mark.parametrize(
    ("run_start", "served_between", "kept"),
    [
        (None, False, []),  # a run ended: a resume may follow, every pin goes
        (None, True, []),
        (5, False, [0, 1, 2, 3, 4]),  # a run began at 5 (seen from the run before): its steps go
        (5, True, [0, 1, 2, 3, 4, 5]),  # ... at the step reported between runs, served already
        (20, False, list(range(10))),  # above every pin: all stay
        (0, False, []),  # a resume from step 0
    ],
)
def test_a_run_s_end_or_begin_forgets_the_pins_of_the_new_run_s_steps(
    run_start: int | None, served_between: bool, kept: list[int]
) -> None:
    pins = StepPins()
    for step in range(10):
        pins.pin(step, snap(1), b"%d" % step)
    pins.run_changed(run_start, served_between)
    assert [s for s in range(10) if pins.get(s) is not None] == kept
    assert pins.max_step == (kept[-1] if kept else -1)


def test_a_run_ended_then_begun_again_keeps_what_the_group_trained_below_its_steps_since() -> None:
    """Chaos seed 788386760: an operator ended the run and the group's next step began another; a
    rank behind its group asked for steps its group-mate had trained in the ended run. The end
    sets the pins aside (nothing answers from them between the runs); the begin brings back those
    below the new run's first step and below every step asked since the end."""
    pins = StepPins()
    for step in range(10):
        pins.pin(step, snap(1), b"run 1 %d" % step)
    pins.run_changed(None, served_between=False)  # the run ended
    assert len(pins) == 0 and pins.get(5) is None and pins.max_step == -1
    assert pins.pin(10, snap(2), b"between 10") == b"between 10"  # the group's next step
    pins.run_changed(10, served_between=True)  # began at the step served between the runs
    assert [pins.get(s) for s in range(11)] == [b"run 1 %d" % s for s in range(10)] + [b"between 10"]
    assert pins.max_step == 10
    assert pins.pin(11, snap(3), b"run 2 11") == b"run 2 11"
    # Once taken back, they are gone: a later end and begin brings back only what was pinned then.
    pins.run_changed(None, served_between=False)
    pins.run_changed(30, served_between=False)
    assert sorted(s for s in range(40) if pins.get(s) is not None) == list(range(12))


def test_a_resume_between_two_runs_gets_its_own_answers_not_the_ended_run_s() -> None:
    """Steps asked between a run's end and the next begin are a resume's: the ended run's pins
    from the lowest of them on stay set aside, also below the new run's first step."""
    pins = StepPins()
    for step in range(10):
        pins.pin(step, snap(1), b"run 1 %d" % step)
    pins.run_changed(None, served_between=False)
    assert pins.pin(3, snap(2), b"resumed 3") == b"resumed 3"  # a resume from a checkpoint at 3
    pins.run_changed(8, served_between=True)  # another group began the run at 8
    assert [pins.get(s) for s in range(10)] == [b"run 1 0", b"run 1 1", b"run 1 2", b"resumed 3"] + [None] * 6
    assert pins.max_step == 3


def test_concurrent_pins_for_one_step_agree() -> None:
    pins = StepPins()
    barrier = threading.Barrier(16)
    results: list[bytes] = []
    lock = threading.Lock()

    def rank(i: int) -> None:
        barrier.wait()
        got = pins.pin(42, snap(i), f"reply-{i}".encode())
        with lock:
            results.append(got)

    threads = [CheckedThread(rank, i) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.check(10)
    assert len(results) == 16 and len(set(results)) == 1
    assert pins.get(42) == results[0]


def test_window_evicts_old_steps_and_bounds_memory() -> None:
    pins = StepPins(window=10)
    for step in range(100):
        pins.pin(step, snap(1), str(step).encode())
    assert pins.max_step == 99
    assert len(pins) <= 20
    assert pins.get(99) == b"99" and pins.get(89) == b"89"
    assert pins.get(50) is None  # evicted
    assert pins.outside_window(88) and not pins.outside_window(89)
    assert not pins.outside_window(150)  # future steps are never outside


def test_many_older_steps_stay_bounded() -> None:
    pins = StepPins(window=4)
    pins.pin(1000, snap(1), b"x")
    for step in range(996, 1000):
        pins.pin(step, snap(1), b"y")
    assert len(pins) <= 8


def test_switches_record_the_first_step_of_each_version() -> None:
    pins = StepPins()
    pins.pin(0, snap(1), b"")
    pins.pin(1, snap(1), b"")
    pins.pin(2, snap(2), b"")
    pins.pin(2, snap(3), b"")  # lost the race: not a switch
    pins.pin(1, snap(4), b"")  # an older step: not a switch
    pins.pin(3, snap(2), b"")
    pins.pin(5, snap(3), b"")
    sent = pins.take_switches()
    assert sent == [(1, 0, -1), (2, 2, 1), (3, 5, 3)]  # (version, first step, highest step before)
    pins.pin(6, snap(4), b"")  # a switch made while the report was in flight
    pins.ack_switches(sent[:2])
    assert pins.take_switches() == [(3, 5, 3), (4, 6, 5)]
    pins.ack_switches(sent)
    pins.ack_switches(sent)  # acknowledged twice (fetch and heartbeat both carried it): harmless
    assert pins.take_switches() == [(4, 6, 5)]
    pins.ack_switches([])
    pins.ack_switches([(4, 6, 5)])
    assert pins.take_switches() == []


def test_switches_are_bounded_while_unacknowledged() -> None:
    pins = StepPins(window=2)
    for step in range(3000):
        pins.pin(step, snap(step), b"")
    switches = pins.take_switches()
    assert len(switches) <= 1000
    assert switches[-1] == (2999, 2999, 2998)


# ------------------------------------------------------------------ Snapshot


def lighthouse_reply(segments: list[tuple[int, dict[str, str]]] | None = None) -> pb.LighthouseConfigResponse:
    reply = pb.LighthouseConfigResponse(
        config_data={"lr": "0.1", "名": "値"}, version=9, instance_id="inst", state_id="state"
    )
    for from_step, cfg in segments or []:
        reply.segments.add(from_step=from_step, config_data=cfg)
    return reply


def test_snapshot_without_segments_holds_for_every_step() -> None:
    s = Snapshot.from_reply(lighthouse_reply())
    assert (s.version, s.state_id, s.instance_id, s.kind) == (9, "state", "inst", CACHE)
    assert s.configs == ({"lr": "0.1", "名": "値"},)
    assert s.from_steps == (0,)
    for step in (-1, 0, 1, 10**9):
        assert s.segment(step) == 0


def test_snapshot_segments_pick_the_range_holding_the_step() -> None:
    s = Snapshot.from_reply(
        lighthouse_reply([(0, {"lr": "0.1"}), (100, {"lr": "0.2"}), (250, {"lr": "0.3"})])
    )
    assert s.from_steps == (0, 100, 250)
    assert [s.segment(x) for x in (-3, 0, 99, 100, 101, 249, 250, 10**6)] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert s.configs[s.segment(99)] == {"lr": "0.1"}
    assert s.configs[s.segment(100)] == {"lr": "0.2"}
    assert s.configs[s.segment(300)] == {"lr": "0.3"}


def test_snapshot_replies_are_serialized_once_and_correct() -> None:
    s = Snapshot.from_reply(lighthouse_reply([(0, {"lr": "0.1"}), (100, {"lr": "0.2"})]))
    pinned = s.reply(1, True)
    assert s.reply(1, True) is pinned  # cached bytes, no per-call work
    msg = decode(pinned)
    assert dict(msg.config_data) == {"lr": "0.2"}
    assert (msg.version, msg.source, msg.pinned) == (9, CACHE, True)
    unpinned = decode(s.reply(0, False))
    assert dict(unpinned.config_data) == {"lr": "0.1"} and not unpinned.pinned


def test_fresh_reply_is_labelled_lighthouse() -> None:
    s = Snapshot.from_reply(lighthouse_reply())
    msg = decode(s.fresh_reply(0, False))
    assert (msg.source, msg.version, dict(msg.config_data)) == (LIGHTHOUSE, 9, s.configs[0])
    assert s.fresh_reply(0, True) is not s.fresh_reply(0, True)  # not cached: rare path
    assert decode(s.fresh_reply(0, True)).pinned


def test_stale_view_keeps_content_and_says_stale() -> None:
    s = Snapshot.from_reply(lighthouse_reply([(0, {"lr": "0.1"}), (100, {"lr": "0.2"})]))
    stale = s.as_stale()
    assert stale is s.as_stale()
    assert stale.kind == STALE and s.kind == CACHE
    assert (stale.version, stale.from_steps, stale.configs) == (s.version, s.from_steps, s.configs)
    msg = decode(stale.reply(1, True))
    assert (msg.source, msg.version, dict(msg.config_data)) == (STALE, 9, {"lr": "0.2"})


def test_fallback_is_empty_version_zero() -> None:
    fb = Snapshot.fallback("job-a")
    assert (fb.version, fb.kind, fb.configs, fb.job) == (0, FALLBACK, ({},), "job-a")
    msg = decode(fb.reply(fb.segment(77), True))
    assert (msg.source, msg.version, dict(msg.config_data), msg.pinned) == (FALLBACK, 0, {}, True)
    assert msg.job == "job-a"  # a worker sees which job's manager answered, even in an outage
