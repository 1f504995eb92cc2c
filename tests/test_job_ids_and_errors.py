"""Where a job id is checked (and where "" becomes ``default``), and the one table of HTTP answers
to domain errors: against the real classes and a real ``lighthouse serve``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from lighthouse.config.schema import SchemaInvalid, SchemaViolation
from lighthouse.config.values import ConfigError, ConfigTooLarge
from lighthouse.jobs.registry import JobBusy, TooManyJobs
from lighthouse.jobs.versions import NotCancellable, NotFound, StepPromised, VersionConflict
from lighthouse.store.backend import StoreUnavailable
from lighthouse.web.errors import http_error
from lighthouse.web.messages import HttpError
from protos.job_ids import JOB_ID_RULE, InvalidJobId, check_job_id, check_job_name
from tests.helpers_lighthouse import LighthouseProc, run_cli, start_lighthouse
from tests.http_util import get_json


def test_only_a_request_gets_default_for_an_empty_job() -> None:
    assert check_job_id("") == check_job_id(None) == "default"
    assert check_job_name("train-7b") == "train-7b"
    for name in ("", ".", "a b"):  # a file name, a store or peer key, a tokens file's key
        with pytest.raises(InvalidJobId, match="1-64 characters"):
            check_job_name(name)


@pytest.mark.parametrize(
    ("exc", "status", "extra"),
    [
        (ConfigError("bad value"), 400, {}),
        (SchemaInvalid("not a schema"), 400, {}),  # a ConfigError: its base's row
        (InvalidJobId("bad id"), 400, {}),
        (NotFound("no such version"), 404, {}),
        (VersionConflict(3, 5), 409, {"version": 5}),
        (StepPromised("promised", 12), 409, {"earliest_step": 12}),
        (NotCancellable("already cancelled", 7), 409, {"version": 7}),
        (NotCancellable("the guard passed"), 409, {}),
        (JobBusy("live managers"), 409, {}),
        (ConfigTooLarge("too large"), 413, {}),  # a ConfigError too, with a row of its own
        (SchemaViolation([{"path": "/lr", "message": "too big"}]), 422, {}),
        (StoreUnavailable("no quorum"), 503, {}),
        (TooManyJobs("10000 jobs"), 507, {}),
    ],
)
def test_each_domain_error_has_its_status_and_fields(exc: Exception, status: int, extra: dict) -> None:
    error = http_error(exc)
    assert error is not None and (error.status, error.message) == (status, str(exc))
    if isinstance(exc, SchemaViolation):
        extra = {"violations": exc.violations}
    assert error.extra == extra


def test_a_refusal_passes_and_a_bug_is_no_answer() -> None:
    refusal = HttpError(415, "Content-Type must be application/json")
    assert http_error(refusal) is refusal
    assert http_error(RuntimeError("a bug")) is None  # the server answers 500 and logs it


@pytest.fixture(scope="module")
def lh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LighthouseProc]:
    with start_lighthouse(tmp_path_factory.mktemp("errors"), config={"lr": 0.1}) as proc:
        yield proc
        assert "Traceback" not in proc.log()


def test_a_bad_job_in_the_path_is_400_naming_the_rule(lh: LighthouseProc) -> None:
    for path in ("/api/jobs/a%20b/config", "/jobs/a%20b"):
        answer = lh.http("GET", path)
        assert answer.status == 400 and answer.json == {"error": f"invalid job id 'a%20b': {JOB_ID_RULE}"}
    answer = lh.http("GET", "/api/jobs/nope/config")
    assert answer.status == 404 and answer.json == {"error": "no job 'nope' on this lighthouse"}


def test_a_cancel_of_what_is_not_pending_is_409(lh: LighthouseProc) -> None:
    scheduled = lh.http("PATCH", "/api/config?effective_step=100000", {"lr": 0.2}).json["version"]
    assert lh.http("DELETE", f"/api/config/scheduled/{scheduled}").status == 200
    head = lh.http("GET", "/api/config").json["version"]
    again = lh.http("DELETE", f"/api/config/scheduled/{scheduled}")
    assert again.status == 409 and again.json == {
        "error": f"version {scheduled} is already cancelled",
        "version": head,
    }
    guarded = lh.http("PATCH", "/api/config?guard=loss:1.5", {"lr": 0.3}).json["version"]
    assert lh.http("DELETE", f"/api/config/guards/{guarded}").status == 200
    twice = lh.http("DELETE", f"/api/config/guards/{guarded}")
    assert twice.status == 409
    assert twice.json == {"error": f"the guard of version {guarded} is cancelled already"}


@pytest.mark.slow
def test_an_empty_name_is_no_job(tmp_path: Path) -> None:
    """A ``--config-dir`` file ``.json`` is not the job ``default``'s, a tokens file's "" no job."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / ".json").write_text(json.dumps({"lr": 9}))
    (folder / "alpha.json").write_text(json.dumps({"lr": 0.1}))
    with start_lighthouse(tmp_path, args=("--config-dir", str(folder))) as proc:
        assert {j["job"] for j in get_json(proc.url, "/api/jobs")["jobs"]} == {"alpha"}
        assert get_json(proc.url, "/api/config")["config"] == {}
        assert f"file {folder / '.json'} skipped: invalid job id ''" in proc.log()
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"": ["tok"]}))
    done = run_cli(
        "serve",
        *("--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0", "--state-dir", str(tmp_path / "s")),
        *("--tokens", str(tokens)),
    )
    assert done.returncode != 0 and f"invalid job id '': {JOB_ID_RULE}" in done.stderr, done.stderr
