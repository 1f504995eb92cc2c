"""The pages and step leases, in real Chromium: where a saved change takes effect, what is pending,
and a group that ran past its lease."""

from __future__ import annotations

import re
import signal

import pytest
from playwright.sync_api import Page, expect

from tests.http_util import call, live, wait_healthy
from tests.procs import ProcessPool, last_record, poll, records_so_far


@pytest.mark.slow
def test_save_says_where_every_group_switches_and_the_change_shows_while_pending(
    page: Page, procs: ProcessPool
) -> None:
    lh = procs.lighthouse({"lr": 0.1, "name": "run-1"})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=3.0)  # a lease of ~3 s of steps: a visible wait
    worker = procs.worker(m.address, group="g0", rank=0, steps=100_000, step_interval=0.01)
    poll(lambda: live(lh.url)["lease_horizon"] > 0, 20, what="a step lease granted")

    page.goto(lh.url + "config")
    expect(page.locator("#loaded-version")).to_have_text("v1")
    horizon = live(lh.url)["lease_horizon"]
    placeholder = page.get_attribute("#at-step", "placeholder") or ""
    assert placeholder.startswith("now, or ≥ ") and int(placeholder.rsplit(" ", 1)[1]) > 0, placeholder
    page.fill("#editor", page.input_value("#editor").replace("0.1", "0.2"))
    # The group holds still while the pages are read: the change stays pending however slow they are.
    worker.signal(signal.SIGSTOP)
    page.click("#save")
    status = page.locator("#status")
    expect(status).to_contain_text("in every group")
    saved = r"Saved as version 2\. It takes effect at step (\d+) in every group"
    found = re.search(saved, status.inner_text())
    assert found, status.inner_text()
    at = int(found.group(1))
    assert at > horizon, (at, horizon)
    assert call(lh.url, "GET", "/api/config/scheduled").json["scheduled"][0]["effective_step"] == at

    # Reopened while it is pending, the editor edits the config as of that step, not the live one.
    page.reload()
    assert live(lh.url)["current_step"] < at
    expect(page.locator("#upcoming")).to_contain_text(f"as of step {at}")
    assert '"lr": 0.2' in page.input_value("#editor")

    dashboard = page.context.new_page()
    dashboard.goto(lh.url)
    row = dashboard.locator('#scheduled tr[data-version="2"]')
    expect(row).to_contain_text("made now")  # the dashboard lists it as pending, made now, promised
    expect(row).to_contain_text(str(at))
    assert live(lh.url)["current_step"] < at  # all of the above was read while it was pending
    worker.signal(signal.SIGCONT)
    expect(row).to_have_count(0, timeout=30_000)  # gone once the job passed its step
    expect(dashboard.locator("#step-detail")).to_contain_text("promised through step")
    expect(dashboard.locator('#managers tr[data-replica="g0"] td.lease')).to_have_text(re.compile(r"^\d+"))
    worker.stop()
    used = sorted((r["step"], r["config"]["lr"]) for r in records_so_far(worker))
    assert {lr for step, lr in used if step >= at} == {"0.2"}
    assert {lr for step, lr in used if step < at} == {"0.1"}


@pytest.mark.slow
def test_the_managers_table_marks_a_group_that_ran_past_its_lease(page: Page, procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=0.3, lighthouse_timeout=0.3, backoff=0.2)
    worker = procs.worker(m.address, group="g0", rank=0, steps=100_000, step_interval=0.01)
    page.goto(lh.url)
    lease = page.locator('#managers tr[data-replica="g0"] td.lease')
    expect(lease).to_have_text(re.compile(r"^\d+$"))  # a step, no pill
    expect(lease.locator(".pill")).to_have_count(0)
    poll(lambda: records_so_far(worker), 20, what="the worker's first records")
    lh.signal(signal.SIGSTOP)  # a hung lighthouse: the group runs past its lease (fallback)
    try:
        poll(lambda: last_record(worker)["source"] == "fallback", 20, what="the fallback served")
    finally:
        lh.signal(signal.SIGCONT)
    expect(lease.locator(".pill")).to_have_text("past lease", timeout=15_000)
    managers = call(lh.url, "GET", "/api/managers").json["managers"]
    assert managers[0]["steps_past_lease"] > 0 and managers[0]["past_lease"]


@pytest.mark.slow
def test_the_managers_table_says_who_is_pushed_to_and_who_polls(page: Page, procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    procs.manager(lh.address, "pushed", cache_ttl=5.0)
    procs.manager(lh.address, "polling", cache_ttl=0.2, extra=["--poll"])
    page.goto(lh.url)
    expect(page.locator('#managers tr[data-replica="pushed"] td.mode')).to_have_text("push")
    expect(page.locator('#managers tr[data-replica="polling"] td.mode')).to_have_text("poll")
    assert call(lh.url, "PATCH", "/api/config", {"lr": 0.2}).status == 200
    expect(page.locator('#managers tr[data-replica="pushed"] td.served-version')).to_contain_text("current")
