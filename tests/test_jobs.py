"""Many jobs on one lighthouse: isolation, job ids, per-job tokens, --config-dir, deletes, metrics,
and a state directory of the single-job release opening as the job ``default``.

Everything runs against real ``lighthouse serve`` and ``manager serve`` processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from lighthouse.client import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from protos.job_ids import InvalidJobId, check_job_id
from protos.rpc import LIGHTHOUSE_GET_CONFIG, make_channel
from tests.helpers_lighthouse import run_cli
from tests.http_util import call, get_json
from tests.procs import ProcessPool, poll, records_so_far, wait_ready, worker_records
from worker_client import ManagerClient

LEGACY_STATE = Path(__file__).resolve().parent / "data" / "state_v1"


def test_job_id_rule() -> None:
    assert check_job_id("") == "default"
    assert check_job_id(None) == "default"
    assert check_job_id("train-7b_v2.1") == "train-7b_v2.1"
    assert check_job_id("x" * 64) == "x" * 64
    for bad in ("x" * 65, "a b", "job/1", "ümlaut", "a\n", "..", "."):
        with pytest.raises(InvalidJobId, match="1-64 characters"):
            check_job_id(bad)


@pytest.mark.slow
def test_jobs_are_isolated_over_http_and_grpc(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    # A PUT to a job that does not exist creates it; each job's history starts at 1.
    for job, lr in (("alpha", 0.5), ("beta", 0.7)):
        res = call(lh.url, "PUT", f"api/jobs/{job}/config", {"lr": lr})
        assert res.status == 200, res.body
        assert res.json["version"] == 1 and res.json["job"] == job
    assert call(lh.url, "PATCH", "api/jobs/alpha/config", {"bs": 8}).json["version"] == 2
    assert get_json(lh.url, "api/jobs/beta/config")["version"] == 1
    assert get_json(lh.url, "api/jobs/beta/config")["config"] == {"lr": 0.7}
    assert get_json(lh.url, "api/config")["config"] == {"lr": 0.1}  # default untouched
    assert [v["version"] for v in get_json(lh.url, "api/jobs/alpha/config/history")["versions"]] == [2, 1]
    # Scheduled changes are per job too.
    assert call(lh.url, "PATCH", "api/jobs/beta/config?effective_step=100", {"lr": 0.01}).status == 200
    assert get_json(lh.url, "api/jobs/alpha/config/scheduled")["scheduled"] == []
    assert len(get_json(lh.url, "api/jobs/beta/config/scheduled")["scheduled"]) == 1

    # gRPC: the job on the wire picks the config; empty is "default".
    assert LighthouseClient(lh.address).get_config(timeout=5) == {"lr": "0.1"}
    assert LighthouseClient(lh.address, job="alpha").get_config(timeout=5) == {"lr": "0.5", "bs": "8"}
    assert LighthouseClient(lh.address, job="beta").get_config(timeout=5) == {"lr": "0.7"}

    # The same replica id in two jobs is two managers.
    ma = procs.manager(lh.address, "group0", extra=["--job", "alpha"])
    mb = procs.manager(lh.address, "group0", extra=["--job", "beta"])
    with ManagerClient(ma.address, timeout=5) as ca, ManagerClient(mb.address, timeout=5) as cb:
        cfg_a, cfg_b = ca.get_config(step=3), cb.get_config(step=3)
    assert (cfg_a["lr"], cfg_a.job) == ("0.5", "alpha")
    assert (cfg_b["lr"], cfg_b.job) == ("0.7", "beta")
    for job in ("alpha", "beta"):
        managers = poll(
            lambda job=job: get_json(lh.url, f"api/jobs/{job}/managers")["managers"], 10, what="manager"
        )
        assert [m["replica_id"] for m in managers] == ["group0"]
    assert get_json(lh.url, "api/managers")["managers"] == []  # default has none

    jobs = {j["job"]: j for j in get_json(lh.url, "api/jobs")["jobs"]}
    assert set(jobs) == {"default", "alpha", "beta"}
    assert jobs["alpha"]["version"] == 2 and jobs["alpha"]["managers"] == 1
    assert jobs["beta"]["scheduled"] == 1 and jobs["default"]["managers"] == 0
    assert get_json(lh.url, "api/jobs/alpha") == jobs["alpha"]  # one job's line of the list
    assert call(lh.url, "GET", "api/jobs/nope").status == 404

    # `manager get` shows the job.
    out = subprocess_json([*manager_cmd(), "get", "--addr", mb.address, "-o", "json"])
    assert out["job"] == "beta" and out["config"] == {"lr": "0.7"}


def manager_cmd() -> list[str]:
    import sys

    return [sys.executable, "-m", "manager"]


def subprocess_json(args: list[str]) -> dict[str, object]:
    import subprocess

    from tests.procs import child_env

    done = subprocess.run(args, capture_output=True, text=True, timeout=30, env=child_env(None))
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_unknown_and_invalid_jobs(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    res = call(lh.url, "GET", "api/jobs/nope/config")
    assert res.status == 404 and "nope" in res.error
    for path in ("api/jobs/a%20b/config", "api/jobs/" + "x" * 65 + "/config"):
        res = call(lh.url, "PUT", path, {"lr": 1})
        assert res.status == 400 and "1-64 characters" in res.error, res.body
    # gRPC refuses a bad job id with INVALID_ARGUMENT naming the rule.
    channel = make_channel(lh.address)
    try:
        stub = channel.unary_unary(
            LIGHTHOUSE_GET_CONFIG,
            request_serializer=pb.LighthouseConfigRequest.SerializeToString,
            response_deserializer=pb.LighthouseConfigResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            stub(pb.LighthouseConfigRequest(job="bad job!"), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1-64 characters" in (err.value.details() or "")
        # A valid job nobody made (an operator, the config directory, a manager with its token):
        # NOT_FOUND naming it, and nothing is created.
        with pytest.raises(grpc.RpcError) as missing:
            stub(pb.LighthouseConfigRequest(job="later"), timeout=5)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no job 'later'" in (missing.value.details() or "")
    finally:
        channel.close()
    with pytest.raises(InvalidJobId):
        LighthouseClient(lh.address, job="bad job!")


@pytest.mark.slow
def test_per_job_tokens(procs: ProcessPool, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alpha": ["alpha-tok"], "beta": ["beta-tok", "beta-tok-2"]}))
    lh = procs.lighthouse({"lr": 0.1}, extra=["--admin-token", "root", "--tokens", str(tokens)])

    def put(job: str, token: str | None, lr: float) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return call(lh.url, "PUT", f"api/jobs/{job}/config", {"lr": lr}, headers=headers).status

    assert put("alpha", "alpha-tok", 0.2) == 200
    assert put("beta", "beta-tok-2", 0.3) == 200
    res = call(
        lh.url, "PUT", "api/jobs/beta/config", {"lr": 9}, headers={"Authorization": "Bearer alpha-tok"}
    )
    assert res.status == 403 and "alpha" in res.error and "beta" in res.error
    assert put("alpha", None, 0.4) == 401
    assert put("alpha", "wrong", 0.4) == 401
    assert put("default", "alpha-tok", 0.4) == 403
    assert put("beta", "root", 0.5) == 200  # the admin edits every job
    assert put("default", "root", 0.6) == 200
    # Nothing refused changed anything.
    assert get_json(lh.url, "api/jobs/beta/config")["config"] == {"lr": 0.5}
    assert get_json(lh.url, "api/jobs/alpha/config")["config"] == {"lr": 0.2}
    # Deleting a job is the admin's only.
    res = call(lh.url, "DELETE", "api/jobs/alpha", headers={"Authorization": "Bearer alpha-tok"})
    assert res.status == 403
    # Reads stay open.
    assert call(lh.url, "GET", "api/jobs").status == 200


@pytest.mark.slow
def test_delete_job(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--admin-token", "root"])
    admin = {"Authorization": "Bearer root"}
    for job in ("gone", "busy"):
        assert call(lh.url, "PUT", f"api/jobs/{job}/config", {"lr": 1}, headers=admin).status == 200
    m = procs.manager(lh.address, "g0", extra=["--job", "busy"])
    with ManagerClient(m.address, timeout=5) as client:
        assert client.get_config(step=1)["lr"] == "1"
    poll(lambda: get_json(lh.url, "api/jobs/busy/managers")["managers"], 10, what="manager of busy")
    res = call(lh.url, "DELETE", "api/jobs/busy", headers=admin)
    assert res.status == 409 and "g0" in res.error
    assert call(lh.url, "DELETE", "api/jobs/gone").status == 401
    assert call(lh.url, "DELETE", "api/jobs/gone", headers=admin).status == 200
    assert call(lh.url, "GET", "api/jobs/gone/config").status == 404
    assert "gone" not in {j["job"] for j in get_json(lh.url, "api/jobs")["jobs"]}
    # A job made again starts over at version 1.
    assert call(lh.url, "PUT", "api/jobs/gone/config", {"lr": 2}, headers=admin).json["version"] == 1


@pytest.mark.slow
def test_config_dir(procs: ProcessPool, tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "alpha.json").write_text(json.dumps({"lr": 0.1}))
    (folder / "beta.json").write_text(json.dumps({"lr": 0.2, "name": "ß"}))
    (folder / "bad name.json").write_text("{}")
    (folder / "broken.json").write_text('{"lr": ')  # invalid from the start
    lh = procs.lighthouse(extra=["--config-dir", str(folder)])
    broken = get_json(lh.url, "api/jobs/broken/config")  # listed, empty, with its file error
    assert broken["version"] == 0 and broken["config"] == {} and "broken.json" in broken["file"]["error"]
    assert get_json(lh.url, "api/jobs/alpha/config")["config"] == {"lr": 0.1}
    assert get_json(lh.url, "api/jobs/beta/config")["config"] == {"lr": 0.2, "name": "ß"}
    # A new file creates its job; an edit is a new version of that job only.
    (folder / "gamma.json").write_text(json.dumps({"lr": 0.3}))
    poll(lambda: call(lh.url, "GET", "api/jobs/gamma/config").status == 200, 10, what="job gamma")
    (folder / "alpha.json").write_text(json.dumps({"lr": 0.15}))
    alpha = poll(
        lambda: (v := get_json(lh.url, "api/jobs/alpha/config"))["version"] == 2 and v, 10, what="alpha v2"
    )
    assert alpha["config"] == {"lr": 0.15}
    assert get_json(lh.url, "api/jobs/beta/config")["version"] == 1
    # An invalid file is that job's file error; its live config stays.
    (folder / "beta.json").write_text("{not json")
    beta = poll(
        lambda: (v := get_json(lh.url, "api/jobs/beta/config"))["file"]["error"] and v, 10, what="file error"
    )
    assert beta["config"] == {"lr": 0.2, "name": "ß"} and beta["version"] == 1
    assert "beta.json" in beta["file"]["error"]
    jobs = {j["job"] for j in get_json(lh.url, "api/jobs")["jobs"]}
    assert jobs == {"alpha", "beta", "gamma", "broken"}  # "bad name" is not a job id
    (folder / "broken.json").write_text(json.dumps({"lr": 0.4}))  # fixed: its first version
    poll(lambda: get_json(lh.url, "api/jobs/broken/config")["version"] == 1, 10, what="broken fixed")


@pytest.mark.slow
def test_metrics_are_labelled_per_job(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    call(lh.url, "PUT", "api/jobs/alpha/config", {"lr": 1})
    call(lh.url, "PATCH", "api/jobs/alpha/config", {"lr": 2})
    body = call(lh.url, "GET", "metrics").body.decode()
    assert 'lighthouse_config_version{job="default"} 1' in body
    assert 'lighthouse_config_version{job="alpha"} 2' in body


@pytest.mark.slow
def test_admin_cli_takes_a_job(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    url = lh.url
    done = run_cli("config", "set", "lr=0.25", "--url", url, "--job", "alpha", "--create")
    assert done.returncode == 0, done.stderr
    done = run_cli("config", "show", "--url", url, "-o", "json", env={"LIGHTHOUSE_JOB": "alpha"})
    assert json.loads(done.stdout)["config"] == {"lr": 0.25}
    done = run_cli("jobs", "--url", url, "-o", "json")
    assert {j["job"] for j in json.loads(done.stdout)["jobs"]} == {"default", "alpha"}
    done = run_cli("config", "show", "--url", url, "--job", "no such")
    assert done.returncode == 2 and "1-64 characters" in done.stderr


def test_pages_per_job(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    single = call(lh.url, "GET", "/").body.decode()
    assert "dashboard.js" in single  # only the job default: / is its dashboard
    call(lh.url, "PUT", "api/jobs/alpha/config", {"lr": 1})
    assert "jobs.js" in call(lh.url, "GET", "/").body.decode()
    assert "dashboard.js" in call(lh.url, "GET", "/jobs/alpha").body.decode()
    assert "editor.js" in call(lh.url, "GET", "/jobs/alpha/config").body.decode()
    assert call(lh.url, "GET", "/jobs/alpha/nope").status == 404


def test_state_dir_of_the_single_job_release_opens_as_job_default(procs: ProcessPool, tmp_path: Path) -> None:
    """tests/data/state_v1 was written by the release before jobs (3 versions, a scheduled change at
    step 50, switches of two groups, job step 60)."""
    state = tmp_path / "state"
    shutil.copytree(LEGACY_STATE, state)
    lh = procs.lighthouse(state_dir=state)
    view = get_json(lh.url, "api/config")
    assert view["version"] == 3 and view["current_step"] == 60
    assert view["config"] == {"lr": 0.0005, "batch_size": 32, "name": "run-1"}
    versions = get_json(lh.url, "api/config/history")["versions"]
    assert [(v["version"], v["author"]) for v in versions] == [(3, "bob"), (2, "alice"), (1, "-")]
    (item,) = get_json(lh.url, "api/config/scheduled")["scheduled"]
    assert item["effective_step"] == 50 and item["status"] == "in_effect"
    at = get_json(lh.url, "api/config/at-step/55")
    assert at["groups"]["group0"]["version"] == 3 and at["groups"]["group1"]["version"] == 2
    # New versions go on from the old head, and other jobs start at 1 beside it.
    assert call(lh.url, "PATCH", "api/config", {"lr": 0.1}).json["version"] == 4
    assert call(lh.url, "PUT", "api/jobs/other/config", {"x": 1}).json["version"] == 1
    lh.stop()
    lh = procs.lighthouse(state_dir=state)
    assert get_json(lh.url, "api/config")["version"] == 4
    assert get_json(lh.url, "api/jobs/other/config")["version"] == 1


def test_config_dir_schemas_are_per_job(procs: ProcessPool, tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    folder.mkdir()
    schema = {"type": "object", "properties": {"lr": {"type": "number", "maximum": 1}}, "required": ["lr"]}
    (folder / "alpha.schema.json").write_text(json.dumps(schema))
    (folder / "alpha.json").write_text(json.dumps({"lr": 0.1}))
    (folder / "beta.json").write_text(json.dumps({"lr": 5}))  # beta has no schema: anything goes
    lh = procs.lighthouse(extra=["--config-dir", str(folder)])
    assert get_json(lh.url, "api/jobs/alpha/schema")["schema"] == schema
    assert get_json(lh.url, "api/jobs/beta/schema")["schema"] is None
    refused = call(lh.url, "PATCH", "api/jobs/alpha/config", {"lr": 3})
    assert refused.status == 422 and refused.json["violations"][0]["path"] == "/lr"
    assert call(lh.url, "PATCH", "api/jobs/beta/config", {"lr": 3}).status == 200
    # A file edit that breaks alpha's schema is alpha's file error; its live config stays.
    (folder / "alpha.json").write_text(json.dumps({"lr": 7}))
    alpha = poll(
        lambda: (v := get_json(lh.url, "api/jobs/alpha/config"))["file"]["error"] and v, 10, what="file error"
    )
    assert alpha["config"] == {"lr": 0.1} and "lr" in alpha["file"]["error"]
    # A schema PUT through the job's route is checked against that job's live config.
    tight = {**schema, "properties": {"lr": {"type": "number", "maximum": 0.05}}}
    assert call(lh.url, "PUT", "api/jobs/alpha/schema", tight).status == 422
    assert call(lh.url, "PUT", "api/jobs/beta/schema", schema).status == 422  # beta's lr is 3
    history = get_json(lh.url, "api/jobs/alpha/schema/history")["schemas"]
    assert len(history) == 1 and history[0]["source"] == "file"


@pytest.mark.slow
def test_an_edit_of_one_job_reaches_its_workers_only(procs: ProcessPool) -> None:
    """Two jobs, two managers each with the same replica ids, a worker process per manager."""
    lh = procs.lighthouse({"lr": 0.1})
    for job, lr in (("alpha", 0.2), ("beta", 0.3)):
        assert call(lh.url, "PUT", f"api/jobs/{job}/config", {"lr": lr}).status == 200
    # Every manager first, then the workers together: a worker started beside the managers that
    # start after it could finish its run before the edit is made.
    managers = {
        (job, group): procs.manager(lh.address, group, cache_ttl=0.1, extra=["--job", job])
        for job in ("alpha", "beta")
        for group in ("group0", "group1")
    }
    workers = {
        (job, group): procs.worker(m.address, group=group, rank=0, steps=300, step_interval=0.02, wait=False)
        for (job, group), m in managers.items()
    }
    wait_ready(list(workers.values()))
    poll(lambda: all(len(records_so_far(w)) > 10 for w in workers.values()), 30, what="workers stepping")
    assert call(lh.url, "PATCH", "api/jobs/alpha/config", {"lr": 0.9}).status == 200
    for (job, group), worker in workers.items():
        lrs = [r["config"].get("lr") for r in worker_records(worker, timeout=60)]
        if job == "alpha":
            assert set(lrs) <= {"0.2", "0.9"} and lrs[-1] == "0.9", (group, lrs)
        else:
            assert set(lrs) == {"0.3"}, (group, lrs)  # never alpha's values
    managers = {j["job"]: j["managers"] for j in get_json(lh.url, "api/jobs")["jobs"]}
    assert managers == {"default": 0, "alpha": 2, "beta": 2}
    assert [v["version"] for v in get_json(lh.url, "api/jobs/beta/config/history")["versions"]] == [1]


@pytest.mark.slow
def test_if_match_rollback_and_at_step_under_a_job_s_routes(procs: ProcessPool) -> None:
    """Each works on the job named in the path, never on the job default beside it."""
    lh = procs.lighthouse({"lr": 0.1})  # the job default is at version 1
    config = "api/jobs/alpha/config"
    assert call(lh.url, "PUT", config, {"lr": 1}).json["version"] == 1
    assert call(lh.url, "PATCH", config, {"lr": 2}).json["version"] == 2

    # If-Match is compared with alpha's version: 1 is default's head but stale for alpha.
    stale = call(lh.url, "PATCH", config, {"lr": 3}, headers={"If-Match": "1"})
    assert stale.status == 409, stale.body
    assert get_json(lh.url, config)["config"] == {"lr": 2}
    assert call(lh.url, "PATCH", config, {"lr": 3}, headers={"If-Match": "2"}).json["version"] == 3
    assert call(lh.url, "PUT", "api/config", {"lr": 0.2}, headers={"If-Match": "3"}).status == 409

    # Rollback makes a new version of alpha with the content of alpha's version 1.
    rolled = call(lh.url, "POST", f"{config}/rollback", {"version": 1})
    assert rolled.status == 200, rolled.body
    assert rolled.json["version"] == 4
    assert get_json(lh.url, config)["config"] == {"lr": 1}
    default = get_json(lh.url, "api/config")
    assert (default["version"], default["config"]) == (1, {"lr": 0.1})
    for n in range(4):  # default reaches version 5, which alpha does not have
        assert call(lh.url, "PATCH", "api/config", {"n": n}).status == 200
    assert call(lh.url, "POST", f"{config}/rollback", {"version": 5}).status == 404

    # At-step replays alpha's schedule, not default's.
    assert call(lh.url, "PATCH", f"{config}?effective_step=100", {"lr": 9}).status == 200
    assert get_json(lh.url, f"{config}/at-step/99")["config"] == {"lr": 1}
    assert get_json(lh.url, f"{config}/at-step/100")["config"] == {"lr": 9}
    assert get_json(lh.url, "api/config/at-step/100")["config"] == {"lr": 0.1, "n": 3}


def test_a_schema_change_needs_a_token_for_its_job(procs: ProcessPool, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alpha": ["alpha-tok"]}))
    lh = procs.lighthouse({"lr": 0.1}, extra=["--admin-token", "root", "--tokens", str(tokens)])
    assert (
        call(lh.url, "PUT", "api/jobs/alpha/config", {"lr": 0.2}, headers=bearer("alpha-tok")).status == 200
    )
    schema = {"type": "object", "properties": {"lr": {"type": "number", "maximum": 1}}}

    for path in ("api/config/schema", "api/jobs/alpha/schema"):
        for headers in ({}, bearer("wrong")):
            refused = call(lh.url, "PUT", path, schema, headers=headers)
            assert refused.status == 401, (path, headers, refused.body)
        assert call(lh.url, "DELETE", path).status == 401
    assert call(lh.url, "PUT", "api/config/schema", schema, headers=bearer("alpha-tok")).status == 403
    for job in ("default", "alpha"):  # nothing refused was stored
        assert get_json(lh.url, f"api/jobs/{job}/schema")["schema"] is None

    assert call(lh.url, "PUT", "api/jobs/alpha/schema", schema, headers=bearer("alpha-tok")).status == 200
    assert call(lh.url, "PUT", "api/config/schema", schema, headers=bearer("root")).status == 200
    for job in ("default", "alpha"):
        assert get_json(lh.url, f"api/jobs/{job}/schema")["schema"] == schema


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_config_dir_schema_files_are_watched(procs: ProcessPool, tmp_path: Path) -> None:
    """An edited DIR/<job>.schema.json guards that job's next edits; a new one gives its job a schema."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    loose = {"type": "object", "properties": {"lr": {"type": "number", "maximum": 1}}}
    (folder / "alpha.schema.json").write_text(json.dumps(loose))
    for job in ("alpha", "beta"):
        (folder / f"{job}.json").write_text(json.dumps({"lr": 0.1}))
    lh = procs.lighthouse(extra=["--config-dir", str(folder)])
    assert call(lh.url, "PATCH", "api/jobs/alpha/config", {"lr": 0.7}).status == 200

    tight = {"type": "object", "properties": {"lr": {"type": "number", "maximum": 0.8}}}
    (folder / "alpha.schema.json").write_text(json.dumps(tight))
    poll(lambda: get_json(lh.url, "api/jobs/alpha/schema")["schema"] == tight, 10, what="alpha's new schema")
    refused = call(lh.url, "PATCH", "api/jobs/alpha/config", {"lr": 0.9})
    assert refused.status == 422 and refused.json["violations"][0]["path"] == "/lr", refused.body
    assert [s["source"] for s in get_json(lh.url, "api/jobs/alpha/schema/history")["schemas"]] == [
        "file",
        "file",
    ]

    (folder / "beta.schema.json").write_text(json.dumps(tight))  # a schema file that was not there
    poll(lambda: get_json(lh.url, "api/jobs/beta/schema")["schema"] == tight, 10, what="beta's schema")
    assert call(lh.url, "PATCH", "api/jobs/beta/config", {"lr": 0.9}).status == 422
    assert get_json(lh.url, "api/jobs/beta/config")["config"] == {"lr": 0.1}
