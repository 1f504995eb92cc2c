"""The metric charts of a job's dashboard in real Chromium: one marker per version at its step, the
scheduled change ahead, a non-finite value, a guarded change, and the per-group lines on demand.

The lighthouse is a real ``lighthouse serve``; the job's two replica groups report through the
lighthouse's gRPC API as managers do (``LighthouseClient.heartbeat`` carrying their summaries),
so the steps and the versions' steps are known exactly.
"""

from __future__ import annotations

import math
from array import array
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from lighthouse import LighthouseClient
from lighthouse.jobs.state import STEP_SLACK
from protos import lighthouse_config_pb2 as pb
from protos.metrics import pack
from tests.browser import watch_csp
from tests.helpers_lighthouse import LighthouseProc, start_lighthouse
from tests.procs import poll

NAN_STEP = 50


def report(client: LighthouseClient, replica: str, batch: int, steps: range) -> None:
    """Group ``replica`` reports ``steps`` (2 ranks each; one NaN of group g1 at NAN_STEP), and its step."""
    loss = [2.0 - s / 200 + (0.1 if replica == "g1" else 0.0) for s in steps]
    nonfinite = [int(replica == "g1" and s == NAN_STEP) for s in steps]
    summaries = pb.MetricSummaries(
        name="loss",
        steps=pack(array("q", steps)),
        count=pack(array("I", [2] * len(steps))),
        nonfinite=pack(array("I", nonfinite)),
        sum=pack(array("d", [v * (2 - bad) for v, bad in zip(loss, nonfinite, strict=True)])),
        min=pack(array("d", loss)),
        max=pack(array("d", loss)),
    )
    # Served a config first, as a manager is (a replica never served one reports no metrics).
    served = pb.ManagerStatus(replica_id=replica, address="127.0.0.1:1", step=-1)  # no step: no run
    client.fetch(pb.LighthouseConfigRequest(status=served), timeout=10)
    # A report moves the job's step at most STEP_SLACK steps beyond the last plus what the time
    # since makes plausible (a made-up leap is ignored): a batch longer than that climbs in hops
    # of STEP_SLACK, plausible however fast this test runs.
    for hop in range(steps[0] - 1 + STEP_SLACK, steps[-1], STEP_SLACK):
        client.heartbeat(pb.ManagerStatus(replica_id=replica, address="127.0.0.1:1", step=hop), timeout=10)
    status = pb.ManagerStatus(
        replica_id=replica, address="127.0.0.1:1", step=steps[-1], metrics=[summaries], metrics_batch=batch
    )
    client.heartbeat(status, timeout=10)


def change(lh: LighthouseProc, path: str, body: dict[str, object]) -> int:
    answer = lh.http("PATCH", path, body, headers={"X-Author": "alice"})
    assert answer.status == 200, answer.body
    return int(answer.json["version"])


@pytest.mark.slow
def test_the_chart_marks_every_version_at_its_step(page: Page, tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 0.01}) as lh, LighthouseClient(lh.grpc_addr) as client:
        expected = {1: 0}  # version -> step of its marker: the config file's, before any step
        for batch, steps in enumerate((range(0, 100), range(100, 200), range(200, 300)), start=1):
            for replica in ("g0", "g1"):
                report(client, replica, batch, steps)
            if batch == 1:
                expected[change(lh, "/api/config", {"lr": 0.02})] = 99  # made now: the job's step
            elif batch == 2:
                guarded = change(lh, "/api/config?guard=loss:1.5&guard_steps=50", {"batch_size": 64})
                expected[guarded] = 199
        scheduled = change(lh, "/api/config?effective_step=400", {"lr": 0.005})
        expected[scheduled] = 400

        csp = watch_csp(page)
        page.goto(lh.url)
        chart = page.locator('svg.chart[data-metric="loss"]')
        expect(chart).to_have_count(1)
        markers = chart.locator(".ch-version")
        expect(markers).to_have_count(len(expected))
        s0, s1 = (float(chart.get_attribute(a) or "nan") for a in ("data-step-from", "data-step-to"))
        left, right = (float(chart.get_attribute(a) or "nan") for a in ("data-plot-left", "data-plot-right"))
        assert (s0, s1) == (0, 400 + math.ceil(400 * 0.02))
        seen = {}
        for i in range(markers.count()):
            marker = markers.nth(i)
            version, step = (
                int(marker.get_attribute("data-version") or 0),
                int(marker.get_attribute("data-step") or -1),
            )
            x = float(marker.locator("line").get_attribute("x1") or "nan")
            assert x == left + (step - s0) / (s1 - s0) * (right - left), (version, step, x)
            seen[version] = step
        assert seen == expected
        expect(chart.locator(f'.ch-version.ch-scheduled[data-version="{scheduled}"]')).to_have_count(1)
        tip = chart.locator(f'.ch-version[data-version="{guarded - 1}"] title').text_content() or ""
        assert "lr = 0.02" in tip and "alice via api" in tip, tip
        expect(chart.locator(f'.ch-nonfinite[data-step="{NAN_STEP}"]')).to_have_count(1)
        expect(chart.locator(".ch-nonfinite")).to_have_count(1)
        expect(chart.locator(f'.ch-guard[data-version="{guarded}"]')).to_have_count(1)
        assert (chart.locator(".ch-mean").get_attribute("d") or "").count("L") >= 200

        expect(chart.locator(".ch-group")).to_have_count(0)
        page.check("#chart-groups")
        expect(chart.locator(".ch-group")).to_have_count(2)
        assert {chart.locator(".ch-group").nth(i).get_attribute("data-replica") for i in range(2)} == {
            "g0",
            "g1",
        }
        # A legend names each line's replica group.
        legend = page.locator('.chart-legend[data-metric="loss"] li')
        expect(legend).to_have_count(2)
        assert [legend.nth(i).get_attribute("data-replica") for i in range(2)] == ["g0", "g1"]
        expect(legend.nth(1)).to_have_text("g1")
        assert csp == []


def test_the_group_legend_names_a_few_and_counts_the_rest(page: Page, tmp_path: Path) -> None:
    replicas = [f"group-{i:02d}" for i in range(15)]
    with start_lighthouse(tmp_path, config={"lr": 0.01}) as lh, LighthouseClient(lh.grpc_addr) as client:
        for replica in replicas:
            report(client, replica, 1, range(0, 20))
        page.goto(lh.url)
        page.check("#chart-groups")
        chart = page.locator('svg.chart[data-metric="loss"]')
        expect(chart.locator(".ch-group")).to_have_count(15)
        named = page.locator(".chart-legend li[data-replica]")
        expect(named).to_have_count(12)
        assert [named.nth(i).inner_text() for i in range(12)] == replicas[:12]
        more = page.locator(".chart-legend li.more")
        expect(more).to_have_text("3 more")
        assert more.get_attribute("title") == ", ".join(replicas[12:])


def test_a_lapsed_guard_is_listed_with_why_and_its_change_kept(page: Page, tmp_path: Path) -> None:
    """A guard on a metric the job never reports lapses once the job stood past its last step for
    ``--guard-lapse-seconds``: the dashboard lists it as lapsed, with the reason, and no rollback."""
    args = ("--guard-lapse-seconds", "1")
    with (
        start_lighthouse(tmp_path, config={"lr": 0.01}, args=args) as lh,
        LighthouseClient(lh.grpc_addr) as client,
    ):
        report(client, "g0", 1, range(0, 100))
        unjudged = change(lh, "/api/config?guard=val_loss:1.5&guard_steps=20", {"batch_size": 64})
        report(client, "g0", 2, range(100, 200))  # past the guard's last step, 119; val_loss never
        lapsed = poll(
            lambda: next(
                (g for g in lh.http("GET", "/api/config/guards").json["guards"] if g["status"] != "active"),
                None,
            ),
            20,
            0.2,
            "the guard decided",
        )
        assert lapsed["status"] == "lapsed" and lapsed["version"] == unjudged, lapsed

        page.goto(lh.url)
        item = page.locator(f'#guards-list li[data-version="{unjudged}"]')
        expect(item).to_have_attribute("data-status", "lapsed")
        expect(item.locator(".pill")).to_have_text("lapsed")
        expect(item).to_contain_text(f"guard of v{unjudged}: val_loss")
        expect(item).to_contain_text("lapsed: not judged: val_loss never reported")
        expect(item).not_to_contain_text("rolled back")
        assert lh.http("GET", "/api/config").json["config"]["batch_size"] == 64  # the change stays
