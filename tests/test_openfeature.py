"""``LighthouseProvider`` through the real OpenFeature SDK, against a real lighthouse and managers.

One lighthouse serves the module; each test has its own job (jobs share nothing: a test's step
run or change is no other test's) and its own manager, or its own lighthouse when it kills one.
"""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openfeature import api
from openfeature.client import OpenFeatureClient
from openfeature.evaluation_context import EvaluationContext
from openfeature.event import EventDetails, ProviderEvent
from openfeature.exception import ErrorCode
from openfeature.flag_evaluation import FlagEvaluationDetails, Reason
from openfeature.provider import ProviderStatus

from manager.status_client import manager_info
from tests.http_util import call, wait_healthy
from tests.procs import LighthouseProc, ManagerProc, ProcessPool, child_env, poll
from worker_client import ManagerClient
from worker_client.openfeature import LighthouseProvider

TYPED = {
    "amp": True,
    "name": "run-1",
    "warmup": 100,
    "as_float_int": 5.0,
    "lr": 0.001,
    "sched": {"kind": "cosine", "steps": [10, 20]},
    "layers": [1, 2],
    "nothing": None,
}


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LighthouseProc]:
    pool = ProcessPool(tmp_path_factory.mktemp("openfeature"))
    try:
        lh = pool.lighthouse()
        wait_healthy(lh.url)
        yield lh
    finally:
        pool.stop_all()


@pytest.fixture
def flags() -> Iterator[None]:
    """The OpenFeature API is process-global: every test leaves it without providers or handlers."""
    try:
        yield
    finally:
        api.clear_providers()  # shuts the providers down


def put_job(lh: LighthouseProc, job: str, config: dict[str, Any]) -> int:
    answer = call(lh.url, "PUT", f"api/jobs/{job}/config", config)
    assert answer.status == 200, answer.body
    return int(answer.json["version"])


def patch_job(lh: LighthouseProc, job: str, change: dict[str, Any]) -> dict[str, Any]:
    answer = call(lh.url, "PATCH", f"api/jobs/{job}/config", change)
    assert answer.status == 200, answer.body
    result: dict[str, Any] = answer.json
    return result


def manager(procs: ProcessPool, lh: LighthouseProc, job: str, *extra: str, **kw: Any) -> ManagerProc:
    return procs.manager(lh.address, f"{job}-g0", extra=["--job", job, *extra], **kw)


def provided(provider: LighthouseProvider, domain: str) -> OpenFeatureClient:
    api.set_provider_and_wait(provider, domain)
    return api.get_client(domain)


def at(step: int) -> EvaluationContext:
    return EvaluationContext(attributes={"step": step})


def collect(client: OpenFeatureClient, event: ProviderEvent) -> queue.Queue[EventDetails]:
    events: queue.Queue[EventDetails] = queue.Queue()
    client.add_handler(event, events.put)
    return events


def test_importing_worker_client_loads_no_openfeature() -> None:
    """openfeature is an optional extra: only ``worker_client.openfeature`` imports it."""
    code = (
        "import sys, worker_client, worker_client.connect\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'openfeature'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(None))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_typed_flags_with_the_version_as_variant(
    lighthouse: LighthouseProc, procs: ProcessPool, flags: None
) -> None:
    version = put_job(lighthouse, "typed", TYPED)
    m = manager(procs, lighthouse, "typed")
    client = provided(LighthouseProvider(m.address, timeout=5.0), "typed")  # an address: its own client
    assert client.get_provider_status() == ProviderStatus.READY
    assert api.get_provider_metadata("typed").name == "lighthouse"

    for context in (None, at(3)):
        got = {
            "amp": client.get_boolean_details("amp", False, context),
            "name": client.get_string_details("name", "", context),
            "warmup": client.get_integer_details("warmup", 0, context),
            "as_float_int": client.get_integer_details("as_float_int", 0, context),
            "lr": client.get_float_details("lr", 1.0, context),
            "warmup_as_float": client.get_float_details("warmup", 0.5, context),
            "sched": client.get_object_details("sched", {}, context),
            "layers": client.get_object_details("layers", [], context),
        }
        values = {key: details.value for key, details in got.items()}
        assert values == {
            "amp": True,
            "name": "run-1",
            "warmup": 100,
            "as_float_int": 5,
            "lr": 0.001,
            "warmup_as_float": 100.0,
            "sched": {"kind": "cosine", "steps": [10, 20]},
            "layers": [1, 2],
        }
        assert type(values["warmup_as_float"]) is float and type(values["as_float_int"]) is int
        for key, details in got.items():
            assert details.error_code is None, (key, details.error_message)
            assert details.variant == str(version), key
            source = details.flag_metadata["source"]
            assert details.reason == {"lighthouse": Reason.STATIC, "cache": Reason.CACHED}[str(source)], key
            assert details.flag_metadata["job"] == "typed"
            assert details.flag_metadata.get("step") == (None if context is None else 3)
            assert details.flag_metadata["pinned"] is (context is not None)
    # The manager answers from its confirmed cache as a rule: the usual reason is CACHED.
    assert client.get_integer_details("warmup", 0, at(4)).reason == Reason.CACHED


def test_a_step_costs_one_call_to_the_manager(
    lighthouse: LighthouseProc, procs: ProcessPool, flags: None
) -> None:
    put_job(lighthouse, "one-call", TYPED)
    m = manager(procs, lighthouse, "one-call")
    client = provided(LighthouseProvider(ManagerClient(m.address)), "one-call")
    before = manager_info(m.address, 5.0).requests
    for key in ("warmup", "as_float_int"):
        assert client.get_integer_value(key, 0, at(7)) > 0
    assert client.get_float_value("lr", 1.0, at(7)) == 0.001
    assert manager_info(m.address, 5.0).requests == before + 1
    client.get_float_value("lr", 1.0, at(8))
    assert manager_info(m.address, 5.0).requests == before + 2


def test_wrong_types_and_missing_keys_answer_the_default_with_an_error(
    lighthouse: LighthouseProc, procs: ProcessPool, flags: None
) -> None:
    put_job(lighthouse, "mismatch", {**TYPED, "text": "hello", "text_like_nan": "NaN"})
    m = manager(procs, lighthouse, "mismatch")
    client = provided(LighthouseProvider(ManagerClient(m.address)), "mismatch")
    wrong = [
        client.get_string_details("warmup", "dflt"),  # a number asked as a string: no silent cast
        client.get_string_details("amp", "dflt"),
        client.get_integer_details("name", -1),  # a string asked as an int
        client.get_integer_details("lr", -1),  # not integral
        client.get_integer_details("amp", -1),  # a boolean is no number
        client.get_float_details("amp", -1.0),
        client.get_boolean_details("warmup", False),
        client.get_object_details("name", {"d": 1}),
        client.get_object_details("nothing", {"d": 1}),  # null is no object
        client.get_float_details("text_like_nan", -1.0),  # "NaN" is a string on the wire
    ]
    for details in wrong:
        assert details.error_code == ErrorCode.TYPE_MISMATCH, details
        assert details.reason == Reason.ERROR, details
        assert details.value in ("dflt", -1, -1.0, False, {"d": 1}), details
        assert details.flag_key in (details.error_message or ""), details
    assert client.get_string_value("text_like_nan", "") == "NaN"
    missing = client.get_float_details("absent", 0.5, at(1))
    assert (missing.value, missing.reason, missing.error_code) == (
        0.5,
        Reason.ERROR,
        ErrorCode.FLAG_NOT_FOUND,
    )
    for bad in (True, -1, "7", 7.0):
        invalid = client.get_integer_details("warmup", 0, EvaluationContext(attributes={"step": bad}))
        assert (invalid.value, invalid.error_code) == (0, ErrorCode.INVALID_CONTEXT), bad


def test_an_unreachable_manager_answers_defaults_without_raising(flags: None) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    client = provided(LighthouseProvider(address, timeout=0.5), "nowhere")
    stale = collect(client, ProviderEvent.PROVIDER_STALE)
    details = client.get_integer_details("warmup", 42, at(1))
    assert (details.value, details.reason, details.error_code) == (42, Reason.ERROR, ErrorCode.GENERAL)
    assert "fallback" in (details.error_message or "")
    assert stale.get(timeout=5).provider_name == "lighthouse"
    assert client.get_provider_status() == ProviderStatus.STALE
    strict = provided(LighthouseProvider(ManagerClient(address, timeout=0.5, strict=True)), "strict")
    assert strict.get_boolean_details("amp", True).error_code == ErrorCode.GENERAL  # no ConfigUnavailable


def test_every_rank_resolves_the_same_value_at_each_step_across_a_change(
    lighthouse: LighthouseProc, procs: ProcessPool, flags: None
) -> None:
    """Two ranks of one group, each with its own client: the manager pins each step, and a change made
    now takes effect at the step its acknowledgement names, in both."""
    put_job(lighthouse, "ranks", {"bs": 32})
    m = manager(procs, lighthouse, "ranks")
    ranks = [provided(LighthouseProvider(ManagerClient(m.address)), f"rank{r}") for r in range(2)]
    seen: dict[int, list[tuple[int, str | None]]] = {}
    effective: int | None = None
    step = 0
    while effective is None or step < effective + 3:
        if step == 20:  # the group is stepping: its run is live, so the change is made at a later step
            answer = patch_job(lighthouse, "ranks", {"bs": 64})
            effective = answer["effective_step"]
            # Step 20 itself when no lease reached it yet (no rank has asked for it): 20 once in a
            # hunt (hunt 12), above it when the group's lease did.
            assert effective is not None and effective >= step, answer
        order = ranks if step % 2 else ranks[::-1]  # either rank may ask first
        answers = [c.get_integer_details("bs", -1, at(step)) for c in order]
        seen[step] = [(d.value, d.variant) for d in answers]
        assert seen[step][0] == seen[step][1], (step, seen[step])
        step += 1
        assert step < 10_000, "the change never took effect"
    assert effective is not None
    values = {s: pairs[0][0] for s, pairs in seen.items()}
    assert {v for s, v in values.items() if s < effective} == {32}
    assert {v for s, v in values.items() if s >= effective} == {64}


def test_configuration_changed_names_the_changed_keys(
    lighthouse: LighthouseProc, procs: ProcessPool, flags: None
) -> None:
    put_job(lighthouse, "changes", {"a": 1, "b": "x", "c": True, "d": [1]})
    m = manager(procs, lighthouse, "changes")
    client = provided(LighthouseProvider(ManagerClient(m.address)), "changes")
    changed = collect(client, ProviderEvent.PROVIDER_CONFIGURATION_CHANGED)
    assert client.get_integer_value("a", 0) == 1  # the first answer: what changes compare with

    def change_and_see(body: dict[str, Any], key: str, kind: str) -> EventDetails:
        version = patch_job(lighthouse, "changes", body)["version"]
        resolve = getattr(client, f"get_{kind}_details")
        poll(lambda: resolve(key, None).variant == str(version), 10, what=f"version {version} served")
        return changed.get(timeout=5)

    event = change_and_see({"a": 2, "c": None, "e": 5, "d": [1]}, "a", "integer")
    assert event.flags_changed == ["a", "c", "e"]  # d was written with its own value: no change
    assert event.provider_name == "lighthouse" and event.metadata["previous_version"] == 1
    # The next event names only the next change: none came between.
    event = change_and_see({"b": "y"}, "b", "string")
    assert event.flags_changed == ["b"]
    assert changed.empty()


def wait_for(events: queue.Queue[EventDetails], timeout: float) -> EventDetails:
    return events.get(timeout=timeout)


def resolve_until(
    client: OpenFeatureClient, reasons: tuple[Reason, ...], timeout: float, what: str
) -> FlagEvaluationDetails[float]:
    """Resolve the stepless float flag ``lr`` until its reason is one of ``reasons``; those details."""
    found: list[FlagEvaluationDetails[float]] = []

    def check() -> bool:
        found[:] = [client.get_float_details("lr", 1.0)]
        return found[0].reason in reasons

    poll(check, timeout, what=what)
    return found[0]


@pytest.mark.slow
def test_stale_when_the_lighthouse_dies_and_ready_when_it_is_back(
    procs: ProcessPool, tmp_path: Path, flags: None
) -> None:
    """Stepless flags: past its TTL a manager without a lighthouse serves the fallback (ERROR, the
    default) or with --serve-stale the last good config (STALE); both providers emit STALE, then
    READY once the lighthouse is back on its port."""
    state = tmp_path / "state"
    lh = procs.lighthouse({"lr": 0.1}, state_dir=state)
    wait_healthy(lh.url)
    timing: dict[str, Any] = {"cache_ttl": 0.2, "lighthouse_timeout": 0.5, "backoff": 0.2}
    plain = procs.manager(lh.address, "plain", **timing)
    keeps = procs.manager(lh.address, "keeps", extra=["--serve-stale"], **timing)
    clients = {
        name: provided(LighthouseProvider(ManagerClient(m.address)), name)
        for name, m in (("plain", plain), ("keeps", keeps))
    }
    stale = {name: collect(c, ProviderEvent.PROVIDER_STALE) for name, c in clients.items()}
    ready = {name: collect(c, ProviderEvent.PROVIDER_READY) for name, c in clients.items()}
    for events in ready.values():  # added while READY: the SDK runs the handler at once
        wait_for(events, 5)
    for client in clients.values():
        assert client.get_float_details("lr", 1.0).reason in (Reason.CACHED, Reason.STATIC)

    lh.signal(signal.SIGKILL)
    lh.wait(10)
    unconfirmed = (Reason.ERROR, Reason.STALE)
    outage = {
        name: resolve_until(client, unconfirmed, 15, f"{name}: an unconfirmed answer")
        for name, client in clients.items()
    }
    assert (outage["plain"].value, outage["plain"].error_code) == (1.0, ErrorCode.GENERAL)
    assert (outage["keeps"].value, outage["keeps"].reason, outage["keeps"].error_code) == (
        0.1,
        Reason.STALE,
        None,
    )
    for name, client in clients.items():
        assert wait_for(stale[name], 5).metadata["source"] == ("fallback" if name == "plain" else "stale")
        assert client.get_provider_status() == ProviderStatus.STALE

    lh = procs.restart_lighthouse(lh, state_dir=state)
    for name, client in clients.items():
        back = resolve_until(client, (Reason.CACHED, Reason.STATIC), 20, f"{name}: a confirmed answer again")
        assert back.value == 0.1
        wait_for(ready[name], 5)
        assert client.get_provider_status() == ProviderStatus.READY
        assert stale[name].empty()  # one STALE per outage, however many resolutions saw it
