"""A reply to a manager carries only the segments from the group's step on (issue 25 item 7): its
size does not grow with the number of changes in the job's history."""

from __future__ import annotations

import pytest

from lighthouse.config.values import ConfigTooLarge, encode_config
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from protos.rpc import MAX_REPLY_BYTES
from tests.store_edits import commit


def _ask(state: LighthouseState, step: int) -> tuple[int, pb.LighthouseConfigResponse]:
    request = pb.LighthouseConfigRequest(status=pb.ManagerStatus(replica_id="g0", step=step))
    answered = state.answer(0, "", -1, request, "peer")
    assert answered is not None
    return len(answered[0]), pb.LighthouseConfigResponse.FromString(answered[0])


@pytest.mark.slow
def test_a_stepping_groups_reply_stays_the_same_size_however_long_the_history() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    store = state.store
    commit(store, "put", {"lr": 0.1, "wd": 0.01}, source="t")
    sizes = {}
    for i in range(1, 151):  # one change per step, each scheduled two steps ahead of the job
        store.advance_step(i)
        commit(store, "patch", {"lr": i / 10_000}, source="t", effective_step=i + 2)
        state.refresh()
        if i in (20, 150):
            sizes[i], reply = _ask(state, i)
            # What it carries is the history's config at every step from the group's on.
            assert reply.segments[0].from_step <= i
            for seg in reply.segments:
                assert dict(seg.config_data) == encode_config(store.resolve(reply.version, seg.from_step))
            assert dict(reply.config_data) == encode_config(store.resolve(reply.version, i))
    assert len(store.segments(store.head)) > 150  # the history holds every step's segment...
    assert sizes[150] <= sizes[20] * 1.2  # ...the reply only what the group can still use


def test_a_stepless_reply_and_one_for_an_early_step_still_carry_the_history_they_need() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    store = state.store
    commit(store, "put", {"lr": 0.1}, source="t")
    for i in range(1, 50):
        commit(store, "patch", {"lr": i / 100}, source="t", effective_step=10 * i)
    state.refresh()
    _, early = _ask(state, 15)
    assert [s.from_step for s in early.segments] == [10 * i for i in range(1, 50)]
    request = pb.LighthouseConfigRequest()
    answered = state.answer(0, "", -1, request, "peer")
    assert answered is not None
    stepless = pb.LighthouseConfigResponse.FromString(answered[0])
    assert [s.from_step for s in stepless.segments] == [0] + [10 * i for i in range(1, 50)]


@pytest.mark.slow  # about 70 commits of a 900 KB config: a minute on a loaded machine
def test_a_change_whose_reply_would_pass_the_grpc_limit_is_refused_when_made() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    big = "x" * 900_000  # a 900 KB config: about 70 segments ahead of the job pass 64 MiB
    state.change("put", {"blob": big, "lr": 0}, source="t")
    refused = None
    for i in range(1, 100):
        try:
            state.change("patch", {"lr": i}, source="t", effective_step=10 * i)
        except ConfigTooLarge as exc:
            refused = (i, str(exc))
            break
    assert refused is not None, "no change was refused"
    i, message = refused
    assert 60 <= i <= 80 and "bytes" in message and str(MAX_REPLY_BYTES) in message
    assert state.store.head == i  # never stored: the put and the i - 1 accepted patches
    request = pb.LighthouseConfigRequest(status=pb.ManagerStatus(replica_id="g0", step=0))
    answered = state.answer(0, "", -1, request, "peer")
    assert answered is not None and len(answered[0]) <= MAX_REPLY_BYTES
