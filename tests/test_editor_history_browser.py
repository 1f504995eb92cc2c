"""The editor in real Chromium: the author's name asked for once and kept, per-key diffs in the
history, and a Rollback button that stays on one line at a narrow width."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Locator, Page, expect

from lighthouse.client import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from tests.browser import HOSTILE
from tests.helpers_lighthouse import LighthouseProc, start_lighthouse


@pytest.fixture
def lh(tmp_path: Path) -> Iterator[LighthouseProc]:
    with start_lighthouse(tmp_path, config={"lr": 0.001, "name": "run-1", "f": 1.0, "old_key": 1}) as proc:
        yield proc


def open_editor(page: Page, lh: LighthouseProc, version: int) -> None:
    page.goto(lh.url + "config")
    expect(page.locator("#loaded-version")).to_have_text(f"v{version}")


def save(page: Page, old: str, new: str, version: int) -> None:
    text = page.input_value("#editor")
    assert old in text, text
    page.fill("#editor", text.replace(old, new))
    expect(page.locator("#save")).to_be_enabled()
    page.click("#save")
    expect(page.locator("#status")).to_contain_text(f"Saved as version {version}")


def authors(lh: LighthouseProc) -> list[str]:
    return [v["author"] for v in lh.http("GET", "/api/config/history").json["versions"]]


def test_the_name_is_asked_once_kept_and_changeable(page: Page, lh: LighthouseProc) -> None:
    open_editor(page, lh, 1)
    bar = page.get_by_test_id("author-bar")
    expect(bar).to_be_visible()
    expect(bar).to_contain_text("Your name (recorded as the author)")
    page.fill("#author-name", "alice")
    page.press("#author-name", "Enter")
    expect(bar).to_be_hidden()
    expect(page.get_by_test_id("author-edit")).to_have_text("author: alice ✎")
    save(page, "0.001", "0.002", 2)
    assert authors(lh)[0] == "alice"

    page.reload()
    expect(page.locator("#loaded-version")).to_have_text("v2")
    expect(page.get_by_test_id("author-edit")).to_have_text("author: alice ✎")
    expect(bar).to_be_hidden()  # kept (localStorage): not asked again
    save(page, "0.002", "0.003", 3)
    assert authors(lh)[0] == "alice"

    # Changed later through the header's control; any script's name, sent as UTF-8.
    page.get_by_test_id("author-edit").click()
    expect(bar).to_be_visible()
    expect(page.locator("#author-name")).to_have_value("alice")
    page.fill("#author-name", "Zoë 山田")
    page.get_by_role("button", name="Use name").click()
    expect(page.get_by_test_id("author-edit")).to_have_text("author: Zoë 山田 ✎")
    rollback = page.get_by_test_id("rollback-1")
    rollback.click()
    rollback.click()
    expect(page.locator("#status")).to_contain_text("version 4 has the content of version 1")
    assert authors(lh)[:3] == ["Zoë 山田", "alice", "alice"]
    assert page.evaluate("localStorage.getItem('lighthouse-author')") == "Zoë 山田"


def test_the_name_goes_with_the_credential(page: Page, tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 1}, token="s3cret") as secured:
        open_editor(page, secured, 1)
        page.fill("#author-name", "alice")  # typed, not confirmed: the next change uses it
        page.fill("#editor", '{"lr": 2}')
        page.click("#save")
        page.fill("#token", "s3cret")
        page.press("#token", "Enter")
        expect(page.locator("#status")).to_contain_text("Saved as version 2")
        expect(page.get_by_test_id("author-bar")).to_be_hidden()
        expect(page.get_by_test_id("author-edit")).to_have_text("author: alice ✎")
        assert authors(secured)[0] == "alice (admin token)"


def test_a_refused_name_shows_the_servers_message(page: Page, lh: LighthouseProc) -> None:
    open_editor(page, lh, 1)
    page.fill("#author-name", "guard")
    page.press("#author-name", "Enter")
    page.fill("#editor", page.input_value("#editor").replace("0.001", "0.5"))
    expect(page.locator("#save")).to_be_enabled()
    page.click("#save")
    reason = page.get_by_test_id("author-reason")
    expect(reason).to_be_visible()
    expect(reason).to_contain_text("X-Author 'guard' is not accepted")
    expect(page.get_by_test_id("author-bar")).to_be_visible()
    expect(page.locator("#status")).to_contain_text("Not saved")
    expect(page.get_by_test_id("author-edit")).to_have_text("author: not set ✎")
    assert authors(lh) == ["-"], "nothing stored under a refused name"

    page.fill("#author-name", "bob")
    page.press("#author-name", "Enter")
    expect(reason).to_be_hidden()
    page.click("#save")
    expect(page.locator("#status")).to_contain_text("Saved as version 2")
    assert authors(lh)[0] == "bob"


def test_history_rows_show_per_key_diffs(page: Page, lh: LighthouseProc) -> None:
    for body in ({"lr": 0.0005, "name": "run-2"}, {"warmup": 100, "old_key": None}, {"evil": HOSTILE}):
        assert lh.http("PATCH", "/api/config", body).status == 200
    replaced = {f"k{i}": i for i in range(6)}
    assert lh.http("PUT", "/api/config", replaced).status == 200
    open_editor(page, lh, 5)

    def row(version: int) -> Locator:
        return page.locator(f'#history tr[data-version="{version}"]')

    two = row(2).locator("summary")
    expect(two).to_contain_text("lr: 0.001 → 0.0005")
    expect(two).to_contain_text('name: "run-1" → "run-2"')
    expect(two.locator(".d")).to_have_count(2)
    three = row(3).locator("summary")
    expect(three).to_contain_text("+ warmup: 100")
    expect(three).to_contain_text("\u2212 old_key")  # a minus sign, as the page writes it
    # v5 replaced everything: lr, name, f, warmup, evil removed and k0..k5 added, 3 named.
    five = row(5).locator("summary")
    expect(five.locator(".d")).to_have_count(3)
    expect(five).to_contain_text("+8 more")
    assert "replace (" not in (page.locator("#history").inner_text())
    expect(row(1).locator("summary")).to_contain_text("+ lr: 0.001")

    # Expanded: per key old and new, not the whole config.
    two.click()
    lr = row(2).locator('.diff-table tr[data-key="lr"]')
    expect(lr).to_have_attribute("data-kind", "changed")
    expect(lr).to_contain_text("0.001 → 0.0005")
    expect(row(2).locator(".diff-table tr")).to_have_count(2)
    assert '"f"' not in row(2).inner_text()

    # Attacker-controlled values are text: shortened in the row, whole when expanded.
    four = row(4).locator("summary")
    expect(four).to_contain_text("+ evil: " + json.dumps(HOSTILE)[:20])
    four.click()
    expect(row(4).locator('.diff-table tr[data-key="evil"]')).to_contain_text(json.dumps(HOSTILE))
    five.click()
    expect(row(5).locator(".diff-table tr")).to_have_count(11)
    for selector in ("img", "script:not([src])", "[onerror]"):
        assert page.locator(selector).count() == 0, selector


def test_the_history_says_where_retention_cut_it(page: Page, tmp_path: Path) -> None:
    # A job stepping with a change every 10 steps, under --history-limit 3 and
    # --history-keep-steps 20: the answer and the page name the versions pruned and the fold step.
    args = ("--history-limit", "3", "--history-keep-steps", "20")
    with (
        start_lighthouse(tmp_path, config={"lr": 0}, args=args) as lh,
        LighthouseClient(lh.grpc_addr) as client,
    ):
        for step in range(0, 200, 10):
            status = pb.ManagerStatus(replica_id="g0", step=step)
            client.fetch(pb.LighthouseConfigRequest(status=status), timeout=10)
            assert lh.http("PATCH", "/api/config", {"lr": step}).status == 200
        answer = lh.http("GET", "/api/config/history").json
        cut = answer["retention"]
        assert cut["history_limit"] == 3 and cut["keep_steps"] == 20, cut
        kept = [v["version"] for v in answer["versions"]]
        assert kept == list(range(21, 21 - len(kept), -1)) and len(kept) < 21, kept
        # Past the newest 3, a version is kept only while its step is above the fold step (the
        # changes made now land above the steps the job was promised, ahead of its step).
        assert all(v["effective_step"] > cut["fold_step"] for v in answer["versions"][3:]), answer
        assert cut["pruned_through"] == kept[-1] - 1, (cut, kept)
        assert 190 - 40 <= cut["fold_step"] <= 190 - 20, cut
        open_editor(page, lh, 21)
        expect(page.get_by_test_id("history-cut")).to_have_text(
            f"Versions up to v{cut['pruned_through']} were pruned (history limit 3); steps up to "
            f"{cut['fold_step']} resolve as step {cut['fold_step']} (20 steps kept)."
        )
        expect(page.locator("#history tr[data-version]")).to_have_count(len(kept))


def test_rollback_button_stays_on_one_line_when_narrow(page: Page, lh: LighthouseProc) -> None:
    long = "a-comment-without-spaces-" * 8
    for i in range(3):
        patched = lh.http("PATCH", f"/api/config?comment={long}", {f"key_{i}_{'x' * 60}": "v" * 80})
        assert patched.status == 200
    page.set_viewport_size({"width": 800, "height": 900})
    open_editor(page, lh, 4)
    button = page.get_by_test_id("rollback-2")
    expect(button).to_have_text("Rollback")
    # One line: as tall as the same button laid out with nothing around it.
    heights = button.evaluate(
        """(b) => {
          const alone = b.cloneNode(true);
          document.body.append(alone);
          const h = [b.getBoundingClientRect().height, alone.getBoundingClientRect().height];
          alone.remove();
          return h;
        }"""
    )
    assert heights[0] == pytest.approx(heights[1], abs=0.5), heights
