"""The pages in real Chromium: the dashboard's timeline and the editor's history mark where each of
the job's runs began, and at which step (issue 25)."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.http_steps import call, wait_for_end
from tests.http_util import wait_healthy
from tests.procs import ProcessPool, worker_records


@pytest.mark.slow
def test_timeline_and_history_show_where_each_run_began(page: Page, procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--run-end-after", "0"])
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=0.3)
    trained = worker_records(procs.worker(m.address, group="g0", rank=0, steps=20, step_interval=0.01))
    ended, heard = wait_for_end(lh.url)
    # Run 1 ended at the job's step: at least what the lighthouse had heard while it was live, at
    # most the last step trained (the manager's report of the last steps may come after the end).
    end_step = ended[0]["end_step"]
    assert heard <= end_step <= trained[-1]["step"] == 19, (heard, ended, trained[-1])
    call(lh.url, "PATCH", "/api/config", {"lr": 0.05})  # while down: live at once
    # Resumed from a checkpoint at step 5: run 2 begins there.
    worker_records(procs.worker(m.address, group="g0", rank=0, steps=5, first_step=5, step_interval=0.01))
    runs = call(lh.url, "GET", "/api/config/runs")["runs"]
    assert [(r["number"], r["start_step"]) for r in runs] == [(1, 0), (2, 5)], runs

    page.goto(lh.url)
    expect(page.locator('#timeline .tl-run[data-run="1"]')).to_have_attribute("data-step", "0")
    expect(page.locator('#timeline .tl-run[data-run="2"]')).to_have_attribute("data-step", "5")
    expect(page.locator('#timeline .tl-run[data-run="2"] text')).to_have_text("run 2 @ 5")
    page.goto(lh.url + "config")
    expect(page.locator('#history tr.history-run[data-run="2"]')).to_contain_text("began at step 5 after v2")
    expect(page.locator('#history tr.history-run[data-run="1"]')).to_contain_text(
        f"ended at step {end_step} (managers gone)"
    )
    # Run 2 began after v2: its row sits right above v2's.
    rows = page.locator("#history tr")
    texts = [rows.nth(i).inner_text() for i in range(rows.count())]
    at = next(i for i, t in enumerate(texts) if "run 2" in t)
    assert texts[at + 1].startswith("v2"), texts
