"""The dashboard pages in a real headless Chromium (the ``page`` fixture of tests/browser.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from lighthouse import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from tests.browser import HOSTILE
from tests.helpers_lighthouse import LighthouseProc, start_lighthouse
from tests.procs import poll


@pytest.fixture
def lh(tmp_path: Path) -> Iterator[LighthouseProc]:
    with start_lighthouse(tmp_path, config={"lr": 0.001, "name": "run-1", "f": 1.0}) as proc:
        yield proc


def open_editor(page: Page, lh: LighthouseProc, version: int) -> None:
    page.goto(lh.url + "config")
    expect(page.locator("#loaded-version")).to_have_text(f"v{version}")


def test_edit_in_the_editor_and_save(page: Page, lh: LighthouseProc) -> None:
    open_editor(page, lh, 1)
    text = page.input_value("#editor")
    assert '"lr": 0.001' in text and '"f": 1.0' in text, text

    page.fill("#editor", "[1, 2]")
    expect(page.locator("#validation")).to_contain_text("must be a JSON object")
    expect(page.locator("#save")).to_be_disabled()
    page.fill("#editor", '{"": 1}')
    expect(page.locator("#validation")).to_contain_text("empty")
    page.fill("#editor", '{"lr": ')
    expect(page.locator("#validation")).to_contain_text("Not valid JSON")

    page.fill("#editor", text.replace("0.001", "0.02") + "\n")
    changed = page.locator('#diff tr[data-key="lr"]')
    expect(changed).to_have_attribute("data-kind", "changed")
    expect(changed).to_contain_text("0.02")
    expect(page.locator("#diff tr")).to_have_count(1)
    page.fill("#comment", "lower lr")
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("Saved as version 2")
    view = lh.http("GET", "/api/config").json
    assert view["version"] == 2
    assert view["config"] == {"lr": 0.02, "name": "run-1", "f": 1.0}
    assert b'"f":1.0' in lh.http("GET", "/api/config").body, "untouched numbers keep their JSON text"
    expect(page.locator('#history tr[data-version="2"]')).to_contain_text("lower lr")


def test_scheduled_save_from_the_editor(page: Page, lh: LighthouseProc) -> None:
    open_editor(page, lh, 1)
    page.fill("#editor", page.input_value("#editor").replace('"run-1"', '"run-2"'))
    page.fill("#at-step", "soon")
    expect(page.locator("#save")).to_be_disabled()
    page.fill("#at-step", "700")
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("takes effect at step 700")
    view = lh.http("GET", "/api/config").json
    assert (view["live"]["name"], view["config"]["name"], view["from_step"]) == ("run-1", "run-2", 700)
    assert lh.http("GET", "/api/config/at-step/700").json["config"]["name"] == "run-2"
    # Only the edited key is scheduled: an unrelated edit made before step 700 is not undone.
    assert lh.http("GET", "/api/config/history").json["versions"][0]["change"] == {"name": "run-2"}
    assert lh.http("PATCH", "/api/config", {"lr": 0.5}).status == 200
    at_700 = lh.http("GET", "/api/config/at-step/700").json["config"]
    assert (at_700["name"], at_700["lr"]) == ("run-2", 0.5)


def test_the_editor_edits_around_a_change_scheduled_ahead(page: Page, lh: LighthouseProc) -> None:
    """The editor edits the latest version's config, the change scheduled ahead in it; saved now,
    only the keys edited go (a patch), so that change still lands at its step; an edit of a key it
    sets would be undone there: refused before Save, with what to do instead."""
    ahead = lh.http("PATCH", "/api/config?effective_step=900", {"name": "run-2"}).json["version"]
    open_editor(page, lh, ahead)
    expect(page.locator("#upcoming")).to_contain_text("as of step 900")
    expect(page.locator("#upcoming")).to_contain_text("Save sends only the keys you change")
    text = page.input_value("#editor")
    assert '"name": "run-2"' in text, text
    page.fill("#editor", text.replace("0.001", "0.02"))
    expect(page.locator("#validation")).to_contain_text("saving makes version 3")
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("Saved as version 3. It is in effect now.")
    assert lh.http("GET", "/api/config/history").json["versions"][0]["change"] == {"lr": 0.02}
    before, at = (lh.http("GET", f"/api/config/at-step/{s}").json["config"] for s in (899, 900))
    assert (before["name"], before["lr"], at["name"], at["lr"]) == ("run-1", 0.02, "run-2", 0.02)

    expect(page.locator("#loaded-version")).to_have_text("v3")
    page.fill("#editor", page.input_value("#editor").replace('"run-2"', '"run-3"'))
    expect(page.locator("#validation")).to_contain_text("sets name too")
    expect(page.locator("#validation")).to_contain_text("effective_step=900")
    expect(page.locator("#save")).to_be_disabled()
    assert lh.http("GET", "/api/config").json["version"] == 3


def test_conflicting_save_is_refused(page: Page, lh: LighthouseProc) -> None:
    open_editor(page, lh, 1)
    page.fill("#editor", page.input_value("#editor").replace("0.001", "0.3"))
    assert lh.http("PATCH", "/api/config", {"lr": 0.5}).status == 200  # someone else, meanwhile
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("changed by someone else since you loaded version 1")
    expect(page.locator("#stale")).to_be_visible()
    assert lh.http("GET", "/api/config").json["config"]["lr"] == 0.5
    page.click("#stale-reload")
    expect(page.locator("#loaded-version")).to_have_text("v2")


def test_rollback_button(page: Page, lh: LighthouseProc) -> None:
    assert lh.http("PATCH", "/api/config", {"lr": 0.9}).status == 200
    open_editor(page, lh, 2)
    button = page.get_by_test_id("rollback-1")
    button.click()
    expect(button).to_have_text("Confirm rollback")
    button.click()
    expect(page.locator("#status")).to_contain_text("version 3 has the content of version 1")
    view = lh.http("GET", "/api/config").json
    assert view["version"] == 3 and view["config"]["lr"] == 0.001


def test_hostile_values_render_as_text(page: Page, lh: LighthouseProc) -> None:
    assert lh.http("PATCH", "/api/config", {"evil": HOSTILE, HOSTILE[:200]: "key"}).status == 200
    with LighthouseClient(lh.grpc_addr) as client:
        client.heartbeat(pb.ManagerStatus(replica_id=HOSTILE, address=HOSTILE, version=2), timeout=5)

    page.goto(lh.url)
    expect(page.locator("#version")).to_have_text("v2")
    config_text = page.locator("#config").inner_text()
    assert json.dumps(HOSTILE) in config_text and HOSTILE[:200] in config_text
    expect(page.locator("#managers tr")).to_have_count(1)
    assert page.locator("#managers tr").get_attribute("data-replica") == HOSTILE
    assert HOSTILE in page.locator("#managers").inner_text()
    open_editor(page, lh, 2)
    assert json.dumps(HOSTILE) in page.input_value("#editor")
    page.fill("#editor", page.input_value("#editor").replace("0.001", "0.01"))  # show a diff too
    page.locator('#history tr[data-version="2"] summary').click()
    assert json.dumps(HOSTILE) in page.locator("#history").inner_text()
    expect(page.locator('#diff tr[data-key="lr"]')).to_have_count(1)
    for selector in ("img", "script:not([src])", "[onerror]"):
        assert page.locator(selector).count() == 0, selector


def test_token_is_asked_once_and_kept(page: Page, tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 1}, token="s3cret") as secured:
        page.goto(secured.url + "config")
        expect(page.locator("#loaded-version")).to_have_text("v1")
        page.fill("#editor", '{"lr": 2}')
        page.click("#save")
        expect(page.locator("#token-bar")).to_be_visible()
        # The user's words, not HTTP's.
        expect(page.locator("#token-reason")).to_have_text("Changes need a token: paste it here.")
        page.fill("#token", "s3cret")
        page.press("#token", "Enter")
        expect(page.locator("#status")).to_contain_text("Saved as version 2")
        expect(page.locator("#token-bar")).to_be_hidden()
        page.fill("#editor", '{"lr": 3}')
        page.click("#save")
        expect(page.locator("#status")).to_contain_text("Saved as version 3")
        history = secured.http("GET", "/api/config/history").json["versions"]
        assert [v["author"] for v in history[:2]] == ["admin token", "admin token"]


def test_dashboard_shows_managers_schedule_and_file_errors(page: Page, lh: LighthouseProc) -> None:
    assert lh.http("PATCH", "/api/config", {"lr": 0.5}).status == 200
    scheduled = lh.http("PATCH", "/api/config?effective_step=9000", {"lr": 0.05}).json["version"]
    with LighthouseClient(lh.grpc_addr) as client:
        for group, version in (("group-0", scheduled), ("group-1", scheduled - 1)):
            status = pb.ManagerStatus(
                replica_id=group,
                address=f"{group}:29512",
                version=version,
                requests=200,
                cache_hits=150,
                step=42,
            )
            client.heartbeat(status, timeout=5)

    page.goto(lh.url)
    current = page.locator('#managers tr[data-replica="group-0"]')
    behind = page.locator('#managers tr[data-replica="group-1"]')
    expect(current).to_contain_text("current")
    expect(current).to_contain_text("75.0 %")
    expect(behind).to_contain_text("behind")
    expect(page.locator("#step")).to_have_text("42")
    # The card names the version served at the job's step; the scheduled one is named apart.
    expect(page.locator("#version")).to_have_text(f"v{scheduled - 1}")
    expect(page.locator("#pending-version")).to_have_text(f"v{scheduled} pending, from step 9000")

    cancel = page.get_by_test_id(f"cancel-{scheduled}")
    cancel.click()
    cancel.click()
    expect(page.locator("#status")).to_contain_text(f"Cancelled the change scheduled as v{scheduled}")
    items = lh.http("GET", "/api/config/scheduled").json["scheduled"]
    assert [s["status"] for s in items] == ["cancelled"]

    assert lh.config_path is not None
    lh.config_path.write_text('{"lr": ')
    expect(page.locator("#file-error")).to_be_visible(timeout=15_000)
    expect(page.locator("#file-error-text")).to_contain_text("not valid JSON")
    assert poll(lambda: lh.http("GET", "/api/config").json["config"]["lr"] == 0.5, 10, what="file reload")


def test_untouched_editor_follows_the_live_version(page: Page, lh: LighthouseProc) -> None:
    open_editor(page, lh, 1)
    assert lh.http("PATCH", "/api/config", {"lr": 0.7}).status == 200
    expect(page.locator("#loaded-version")).to_have_text("v2")
    assert '"lr": 0.7' in page.input_value("#editor")
    expect(page.locator("#stale")).to_be_hidden()


@pytest.mark.slow
def test_editor_shows_schema_violations_while_typing_and_keeps_save_disabled(
    page: Page, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "lr": {"type": "number", "maximum": 1, "description": "learning rate, at most 1"},
            "name": {"type": "string", "description": "run name"},
        },
        "required": ["lr"],
        "additionalProperties": False,
    }
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(json.dumps(schema))
    config = {"lr": 0.1, "name": "a"}
    with start_lighthouse(tmp_path, config=config, args=("--schema", str(schema_path))) as lh:
        open_editor(page, lh, 1)
        expect(page.locator('#keys tr[data-key="lr"]')).to_contain_text("learning rate, at most 1")
        expect(page.locator('#keys tr[data-key="name"]')).to_contain_text("run name")

        page.fill("#editor", '{"name": "a", "lr": ')
        page.locator("#editor").press_sequentially("50}", delay=30)  # typed key by key
        expect(page.locator('#violations li[data-path="/lr"]')).to_contain_text("maximum")
        expect(page.locator('#keys tr[data-key="lr"]')).to_have_class("violates")
        expect(page.locator("#validation")).to_contain_text("schema refuses")
        expect(page.locator("#save")).to_be_disabled()

        page.fill("#editor", '{"name": "a", "lr": 0.5, "typo_key": 1}')
        expect(page.locator('#violations li[data-path="/typo_key"]')).to_be_visible()
        expect(page.locator("#save")).to_be_disabled()
        page.fill("#editor", '{"name": "a"}')
        expect(page.locator('#violations li[data-path="/lr"]')).to_contain_text("missing")
        expect(page.locator("#save")).to_be_disabled()
        assert [v["version"] for v in lh.http("GET", "/api/config/history").json["versions"]] == [1]

        page.fill("#editor", '{"name": "a", "lr": 0.5}')
        expect(page.locator("#validation")).to_contain_text("saving makes version 2")
        expect(page.locator("#violations li")).to_have_count(0)
        expect(page.locator("#save")).to_be_enabled()
        page.click("#save")
        expect(page.locator("#status")).to_contain_text("Saved as version 2")
        assert lh.http("GET", "/api/config").json["config"] == {"name": "a", "lr": 0.5}
