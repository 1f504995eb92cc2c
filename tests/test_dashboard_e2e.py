"""The operator's loop in a real browser: edit lr on /config, a running worker picks it up,
the managers table shows its manager catching up, then a rollback brings the old value back."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import Page, expect

from tests.procs import Proc, ProcessPool, poll


def latest_lr(worker: Proc) -> tuple[int, str] | None:
    records = [json.loads(line) for line in worker.lines() if line.startswith("{")]
    return (records[-1]["version"], records[-1]["config"].get("lr")) if records else None


@pytest.mark.slow
def test_edit_in_browser_reaches_worker_and_managers_table(procs: ProcessPool, page: Page) -> None:
    lh = procs.lighthouse({"lr": 0.001, "batch_size": 32})
    manager = procs.manager(lh.address, "group-a", cache_ttl=0.3)
    worker = procs.worker(manager.address, group="group-a", rank=0, steps=100_000, step_interval=0.05)
    poll(lambda: latest_lr(worker) == (1, "0.001"), 20, what="worker on version 1")

    page.goto(lh.url)
    row = page.locator('#managers tr[data-replica="group-a"]')
    expect(row.locator(".served-version")).to_contain_text("v1")

    page.goto(lh.url + "config")
    expect(page.locator("#loaded-version")).to_have_text("v1")
    page.fill("#editor", json.dumps({"lr": 0.01, "batch_size": 32}, indent=2))
    expect(page.locator('#diff tr[data-key="lr"]')).to_be_visible()
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("Saved as version 2")

    poll(lambda: latest_lr(worker) == (2, "0.01"), 20, what="worker picking up lr=0.01")
    page.goto(lh.url)
    expect(row.locator(".served-version")).to_contain_text("v2", timeout=20_000)
    expect(row.locator(".served-version")).to_contain_text("current")

    page.goto(lh.url + "config")
    rollback = page.locator('#history tr[data-version="1"] button', has_text="Rollback")
    rollback.click()
    page.locator('#history tr[data-version="1"] button').first.click()  # confirm
    expect(page.locator("#status")).to_contain_text("version 3 has the content of version 1")
    poll(lambda: latest_lr(worker) == (3, "0.001"), 20, what="worker back on lr=0.001 after rollback")
