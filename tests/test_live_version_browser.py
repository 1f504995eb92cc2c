"""The pages in real Chromium: during a pending change the dashboard's card, timeline, live config
and managers table, `manager get` and `config managers` name the version served (the pending one
apart); the editor's type-change refusal and its override; a job whose ranks died marked stalled
on the jobs list and its dashboard."""

from __future__ import annotations

import json
import subprocess

import pytest
from playwright.sync_api import Page, expect

from tests.helpers_lighthouse import run_cli
from tests.http_util import call, get_json, live, wait_healthy
from tests.procs import ProcessPool, manager_cli, poll


def ok(done: subprocess.CompletedProcess[str]) -> str:
    """A CLI's stdout, once it ended well."""
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stdout


FAR = 1_000_000  # a step the job will not reach during the test: the change stays pending


@pytest.mark.slow
def test_card_timeline_and_live_config_agree_during_a_pending_change(page: Page, procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1, "name": "run-1"})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0")
    procs.worker(m.address, group="g0", rank=0, steps=100_000, step_interval=0.01)
    poll(lambda: live(lh.url)["current_step"] > 5, 20, what="the job steps")
    made = call(lh.url, "PATCH", f"api/config?effective_step={FAR}", {"lr": 0.5})
    assert made.status == 200, made.body
    view = live(lh.url)
    assert (view["version"], view["live_version"]) == (2, 1), view
    assert view["pending"] == {"version": 2, "effective_step": FAR}
    assert get_json(lh.url, "api/config/timeline")["live_version"] == 1

    # The manager says the same: `manager get` (stepless: at the job's step), its status, and
    # the managers table (API and `config managers`) name v1 as served and v2 apart.
    got = json.loads(ok(manager_cli("get", "--addr", m.address, "-o", "json")))
    assert (got["version"], got["config"]["lr"], got["config"]["name"]) == (1, "0.1", "run-1"), got
    assert (got["pending_version"], got["pending_step"]) == (2, FAR), got
    text = ok(manager_cli("get", "--addr", m.address)).splitlines()
    assert text[-2].startswith("version 1 of job default, source "), text
    assert text[-1] == f"pending: version 2 from step {FAR:,}", text

    def reported() -> bool:
        return bool(get_json(lh.url, "api/managers")["managers"][0]["pending_version"] == 2)

    poll(reported, 20, what="the manager's report of the pending change")
    (row,) = get_json(lh.url, "api/managers")["managers"]
    assert (row["version"], row["live_version"], row["pending_step"]) == (2, 1, FAR), row
    table = ok(run_cli("config", "managers", "--url", lh.url)).splitlines()
    assert table[-1] == f"live version 1, v2 pending from step {FAR:,}", table
    assert f"v2 at step {FAR:,}" in table[1] and "current" in table[1], table

    page.goto(lh.url)
    expect(page.locator("#version")).to_have_text("v1")
    expect(page.locator("#pending-version")).to_have_text(f"v2 pending, from step {FAR}")
    served = page.locator('#managers tr[data-replica="g0"] .served-version')
    expect(served).to_contain_text("v1")
    expect(served).to_contain_text(f"v2 pending from step {FAR}")
    expect(page.locator('#timeline .tl-seg.tl-live[data-version="1"]')).to_have_count(1)
    expect(page.locator("#timeline .tl-seg.tl-live")).to_have_count(1)
    expect(page.locator('#timeline .tl-seg.tl-pending[data-version="2"]')).to_have_count(1)
    expect(page.locator("#config")).to_contain_text("0.1")
    expect(page.locator("#config")).not_to_contain_text("0.5")
    expect(page.locator("#stalled")).to_be_hidden()

    # A change made now, in effect: all three move to it, and the pending one stays apart.
    now = call(lh.url, "PATCH", "api/config", {"name": "run-2"})
    assert now.status == 200, now.body
    poll(lambda: live(lh.url)["live_version"] == 3, 20, what="v3 in effect")
    expect(page.locator("#version")).to_have_text("v3")
    expect(page.locator('#timeline .tl-seg.tl-live[data-version="3"]')).to_have_count(1)
    expect(page.locator("#config")).to_contain_text("run-2")
    expect(page.locator("#pending-version")).to_have_text(f"v2 pending, from step {FAR}")


@pytest.mark.slow
def test_the_editor_shows_a_type_change_refusal_and_offers_the_override(
    page: Page, procs: ProcessPool
) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    page.goto(lh.url + "config")
    expect(page.locator("#loaded-version")).to_have_text("v1")
    expect(page.locator("#type-change")).to_be_hidden()
    page.fill("#editor", '{"lr": "0.0.1"}')
    expect(page.locator("#validation")).to_contain_text("lr: number -> string")
    expect(page.locator("#save")).to_be_disabled()
    expect(page.locator("#type-change")).to_be_visible()
    page.check("#allow-type-change")
    expect(page.locator("#validation")).to_contain_text("Valid")
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("Saved as version 2")
    assert live(lh.url)["config"] == {"lr": "0.0.1"}
    expect(page.locator("#type-change")).to_be_hidden()


@pytest.mark.slow
def test_a_job_whose_ranks_died_is_marked_stalled_on_both_pages(page: Page, procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=0.5)
    worker = procs.worker(m.address, group="g0", rank=0, steps=100_000, step_interval=0.01)
    poll(lambda: live(lh.url)["current_step"] > 5, 20, what="the job steps")
    other = call(lh.url, "PUT", "api/jobs/other/config", {"x": 1})  # two jobs: / lists them
    assert other.status == 200, other.body
    page.goto(lh.url)
    expect(page.locator('tr[data-job="default"]')).to_be_visible()
    expect(page.locator('tr[data-job="default"] [data-testid="stalled"]')).to_have_count(0)
    worker.stop()
    m.stop()
    expect(page.locator('tr[data-job="default"] [data-testid="stalled"]')).to_have_count(1, timeout=30_000)
    expect(page.locator('tr[data-job="default"]')).to_contain_text("every manager is gone")
    page.goto(lh.url + "jobs/default")
    expect(page.locator("#stalled")).to_contain_text("stalled: every manager is gone", timeout=10_000)
