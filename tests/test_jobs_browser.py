"""The cluster pages in real Chromium: the jobs list, each job's dashboard, editor and timeline.

One lighthouse serves the jobs ``default``, ``alpha`` and ``beta``; real managers of
``alpha`` and ``default`` share the replica id ``group0``.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from lighthouse import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from tests.browser import HOSTILE, watch_csp
from tests.helpers_lighthouse import LighthouseProc, start_lighthouse
from tests.procs import ProcessPool, poll
from worker_client import ManagerClient


def put(lh: LighthouseProc, job: str, config: dict[str, object], **kw: object) -> int:
    res = lh.http("PUT", f"/api/jobs/{job}/config", config, **kw)
    assert res.status == 200, res.body
    return int(res.json["version"])


def served(address: str) -> dict[str, str]:
    """The config a worker of this manager gets now."""
    with ManagerClient(address, timeout=timedelta(seconds=5)) as client:
        return dict(client.get_config(strict=True))


@pytest.mark.slow
def test_jobs_list_dashboard_and_editor_per_job(page: Page, procs: ProcessPool, tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 0.001}) as lh:
        put(lh, "alpha", {"lr": 0.1, "name": "alpha-run"})
        lh.http("PATCH", "/api/jobs/alpha/config", {"bs": 8}, headers={"X-Author": "alice"})
        put(lh, "beta", {"lr": 0.2})
        alpha = procs.manager(lh.grpc_addr, "group0", extra=["--job", "alpha"])
        default = procs.manager(lh.grpc_addr, "group0")
        for job in ("alpha", "default"):
            poll(lambda job=job: lh.http("GET", f"/api/jobs/{job}/managers").json["managers"], 10, what=job)

        csp = watch_csp(page)
        page.goto(lh.url)
        rows = page.locator("#jobs-body tr")
        expect(rows).to_have_count(3)
        assert [rows.nth(i).get_attribute("data-job") for i in range(3)] == ["alpha", "beta", "default"]
        alpha_row = page.locator('#jobs-body tr[data-job="alpha"]')
        expect(alpha_row.locator("td.version")).to_have_text("v2")
        expect(alpha_row.locator("td.changed")).to_contain_text("by alice")
        expect(alpha_row.locator("td.managers")).to_contain_text("1 of 1 live")
        expect(page.locator('#jobs-body tr[data-job="beta"] td.version')).to_have_text("v1")
        expect(page.locator('#jobs-body tr[data-job="beta"] td.managers')).to_have_text("none yet")
        assert alpha_row.get_by_test_id("editor-link").get_attribute("href") == "/jobs/alpha/config"
        expect(page.locator("#job-count")).to_have_text("3")

        alpha_row.get_by_test_id("job-link").click()
        page.wait_for_url("**/jobs/alpha")
        expect(page.locator("#job-name")).to_have_text("alpha")
        expect(page.locator("#version")).to_have_text("v2")
        expect(page.locator("#config")).to_contain_text("alpha-run")
        manager_row = page.locator('#managers tr[data-replica="group0"]')
        expect(manager_row).to_have_count(1)
        expect(manager_row.locator("td.mono")).to_have_text(alpha.address)  # alpha's group0, not default's
        assert page.title().startswith("alpha")

        page.get_by_role("link", name="Config editor").click()
        page.wait_for_url("**/jobs/alpha/config")
        expect(page.locator("#loaded-version")).to_have_text("v2")
        page.fill("#editor", page.input_value("#editor").replace("0.1", "0.05"))
        page.click("#save")
        expect(page.locator("#status")).to_contain_text("Saved as version 3")
        assert lh.http("GET", "/api/jobs/alpha/config").json["config"]["lr"] == 0.05
        assert lh.http("GET", "/api/config").json["version"] == 1, "job default unchanged"
        poll(lambda: served(alpha.address).get("lr") == "0.05", 10, what="alpha's workers get the edit")
        assert served(default.address) == {"lr": "0.001"}

        page.get_by_role("link", name="All jobs").click()
        page.wait_for_url(lh.url)
        expect(page.locator('#jobs-body tr[data-job="alpha"] td.version')).to_have_text("v3")
        expect(page.locator('#jobs-body tr[data-job="default"] td.version')).to_have_text("v1")
        assert csp == []


@pytest.mark.slow
def test_timeline_draws_versions_now_scheduled_and_late_groups(page: Page, tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 1}) as lh:
        put(lh, "alpha", {"lr": 0.1})
        with LighthouseClient(lh.grpc_addr, job="alpha") as client:
            client.heartbeat(
                pb.ManagerStatus(replica_id="g0", address="a:1", step=100, job="alpha"), timeout=5
            )
            lh.http("PATCH", "/api/jobs/alpha/config", {"lr": 0.2})  # v2 from step 100
            due = lh.http("PATCH", "/api/jobs/alpha/config?effective_step=300", {"lr": 0.3}).json["version"]
            ahead = lh.http("PATCH", "/api/jobs/alpha/config?effective_step=900", {"lr": 0.4}).json["version"]
            # A group's report moves the job's step by at most 64 steps plus its elapsed rate
            # (a made-up jump is ignored): g0 climbs to 300 in hops a real group could make.
            for step in range(160, 300, 60):
                status = pb.ManagerStatus(replica_id="g0", address="a:1", version=2, step=step, job="alpha")
                client.heartbeat(status, timeout=5)
            for replica, step in (("g0", 300), ("g1", 340)):
                switch = pb.StepSwitch(version=due, step=step, previous_step=step - 1)
                status = pb.ManagerStatus(
                    replica_id=replica, address="a:1", version=due, step=step, switches=[switch], job="alpha"
                )
                client.heartbeat(status, timeout=5)

        csp = watch_csp(page)
        page.goto(lh.url + "jobs/alpha")
        svg = page.locator("#timeline svg")
        expect(svg.locator(".tl-seg")).to_have_count(4)
        versions = [svg.locator(".tl-seg").nth(i).get_attribute("data-version") for i in range(4)]
        assert versions == ["1", "2", str(due), str(ahead)]
        assert svg.get_attribute("role") == "img"
        expect(svg.locator("title").first).to_have_text("Timeline of job alpha: versions by job step")
        expect(svg.locator("desc")).to_contain_text(f"Version {ahead} is scheduled for step 900")
        expect(svg.locator(f'.tl-seg.tl-live[data-version="{due}"]')).to_have_count(1)
        expect(svg.locator(f'.tl-seg.tl-pending[data-version="{ahead}"]')).to_have_count(1)
        expect(svg.locator(f'.tl-scheduled[data-version="{ahead}"]')).to_contain_text(f"v{ahead} @ 900")
        expect(svg.locator(".tl-now")).to_have_attribute("data-step", "340")
        expect(svg.locator(".tl-now")).to_contain_text("now · step 340")
        late = svg.locator(".tl-late")
        expect(late).to_have_count(1)
        assert late.get_attribute("data-replica") == "g1"
        expect(late).to_contain_text("+40 steps")
        # Ordered left to right by step: the now line lies between the live bar's start and the marker.
        live_x = float(svg.locator(f'.tl-seg[data-version="{due}"] .tl-bar').get_attribute("x") or "nan")
        now_x = float(svg.locator(".tl-now line").get_attribute("x1") or "nan")
        marker_x = float(svg.locator(".tl-scheduled line").get_attribute("x1") or "nan")
        assert live_x < now_x < marker_x
        page.screenshot(path=str(tmp_path / "timeline.png"), full_page=True)

        page.goto(lh.url + "jobs/default")  # the job default has a timeline of its own
        expect(page.locator("#timeline .tl-seg")).to_have_count(1)
        expect(page.locator("#timeline .tl-now")).to_contain_text("no step reported")
        page.goto(lh.url + "config")  # the unprefixed editor says it edits the job default
        expect(page.locator("#job-name")).to_have_text("default")
        expect(page.locator('a[data-nav="jobs"]')).to_be_visible()
        assert csp == []


def test_hostile_values_on_the_jobs_list_and_timeline_are_text(page: Page, tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 1}) as lh:
        put(lh, "alpha", {"evil": HOSTILE})
        # Parentheses are refused in an author (no one may fake a "(admin token)" suffix): the rest
        # of the hostile text is kept.
        hostile_author = HOSTILE.replace("(", "[").replace(")", "]")[:60]
        author = {"X-Author": hostile_author}
        assert (
            lh.http("PATCH", "/api/jobs/alpha/config?effective_step=50", {"lr": 2}, headers=author).status
            == 200
        )
        with LighthouseClient(lh.grpc_addr, job="alpha") as client:
            for replica, step in ((HOSTILE, 60), ("g0", 40)):
                switch = pb.StepSwitch(version=2, step=step, previous_step=step - 1)
                status = pb.ManagerStatus(
                    replica_id=replica, address="a:1", version=2, step=step, switches=[switch], job="alpha"
                )
                client.heartbeat(status, timeout=5)

        page.goto(lh.url)
        changed = page.locator('#jobs-body tr[data-job="alpha"] td.changed')
        expect(changed).to_contain_text(hostile_author[:30])
        page.goto(lh.url + "jobs/alpha")
        late = page.locator("#timeline .tl-late")
        expect(late).to_have_count(1)
        assert late.get_attribute("data-replica") == HOSTILE
        assert any(HOSTILE in t for t in page.locator("#timeline svg title").all_text_contents())
        assert json.dumps(HOSTILE) in page.locator("#config").inner_text()
        for selector in ("img", "script:not([src])", "[onerror]"):
            assert page.locator(selector).count() == 0, selector


@pytest.mark.slow
def test_job_tokens_are_asked_once_per_job(page: Page, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"alpha": ["alpha-tok"], "beta": ["beta-tok"]}))
    with start_lighthouse(tmp_path, config={"lr": 1}, args=("--tokens", str(tokens))) as lh:
        for job in ("alpha", "beta"):
            put(lh, job, {"lr": 1}, headers={"Authorization": f"Bearer {job}-tok"})

        def save(job: str, lr: int, token: str | None) -> None:
            page.goto(f"{lh.url}jobs/{job}/config")
            expect(page.locator("#loaded-version")).to_have_text(re.compile(r"v\d+"))
            page.fill("#editor", json.dumps({"lr": lr}))
            page.click("#save")
            if token is not None:
                expect(page.locator("#token-bar")).to_be_visible()
                page.fill("#token", token)
                page.press("#token", "Enter")
            expect(page.locator("#status")).to_contain_text("Saved as version")
            expect(page.locator("#token-bar")).to_be_hidden()

        save("alpha", 2, "alpha-tok")
        save("beta", 3, "beta-tok")  # alpha's token is refused (403) there: asked for beta's
        save("alpha", 4, None)  # alpha's token is still known in this tab
        save("beta", 5, None)
        assert lh.http("GET", "/api/jobs/alpha/config").json["config"] == {"lr": 4}
        assert lh.http("GET", "/api/jobs/beta/config").json["config"] == {"lr": 5}


@pytest.mark.slow
def test_jobs_list_follows_changes_and_marks_file_errors(page: Page, tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    folder.mkdir()
    for job in ("alpha", "beta"):
        (folder / f"{job}.json").write_text(json.dumps({"lr": 0.1}))
    with start_lighthouse(tmp_path, args=("--config-dir", str(folder))) as lh:
        page.goto(lh.url)
        beta = page.locator('#jobs-body tr[data-job="beta"]')
        expect(beta.locator("td.version")).to_have_text("v1")
        expect(page.locator("#jobs-body .pill.error")).to_have_count(0)
        # No reload: the list refreshes itself.
        lh.http("PATCH", "/api/jobs/beta/config?effective_step=500", {"lr": 0.2})
        expect(beta.locator("td.version")).to_have_text("v2", timeout=10_000)
        expect(beta.locator("td.scheduled")).to_have_text("1 pending")
        (folder / "alpha.json").write_text('{"lr": ')
        alpha = page.locator('#jobs-body tr[data-job="alpha"]')
        expect(alpha.locator(".pill.error")).to_have_text("file error", timeout=15_000)
        expect(alpha.locator(".file-error")).to_contain_text("alpha.json")
        expect(page.locator("#job-errors")).to_have_text("1 with a config file error")
        expect(beta.locator(".pill.error")).to_have_count(0)
        alpha.get_by_test_id("job-link").click()
        expect(page.locator("#file-error")).to_be_visible()
        expect(page.locator("#version")).to_have_text("v1")
