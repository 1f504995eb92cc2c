"""Real headless Chromium for the page tests (Debian's, never a downloaded build).

The ``browser`` and ``page`` fixtures and page helpers live here, not in a test module, so that a
module that only needs them imports no other module's tests; tests/conftest.py
makes them available to every test. A missing Chromium fails the tests that
use it (.ci/run installs it): a skip would hide that the pages went untested.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Dialog, Page, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# A value that would run script or load an image if a page ever put it in the DOM as HTML.
HOSTILE = "</script><script>alert(1)</script>`${alert(2)}`\"'><img src=x onerror=alert(3)>"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (as .ci/run does)")
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh page; the test fails if a dialog fired or a script raised while it ran."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    opened.set_default_timeout(10_000)
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    opened.on("dialog", on_dialog)
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield opened
        assert dialogs == [], f"a dialog fired: {dialogs}"
        assert errors == [], f"script errors: {errors}"
    finally:
        context.close()


def watch_csp(page: Page) -> list[str]:
    """Content Security Policy violations the page reports (inline styles, scripts, foreign assets)."""
    violations: list[str] = []
    page.on(
        "console", lambda msg: violations.append(msg.text) if "Content Security Policy" in msg.text else None
    )
    return violations
