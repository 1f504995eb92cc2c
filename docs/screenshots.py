"""Make the docs' screenshots from a real demo run: ``python docs/screenshots.py``.

Starts examples/demo.py on a free dashboard port, opens the dashboard in headless
Chromium (Debian's /usr/bin/chromium) and waits until the loss chart has drawn data
(not "connecting..."), then writes docs/images/*.png.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def main() -> None:
    demo = subprocess.Popen(
        [sys.executable, "examples/demo.py", "--dashboard", "127.0.0.1:0", "--step-time", "0.1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert demo.stdout is not None
        url = ""
        for line in demo.stdout:
            found = re.search(r"dashboard: (http://\S+/)", line)
            if found:
                url = found.group(1)
                break
        if not url:
            raise SystemExit(f"the demo printed no dashboard URL (exit code {demo.wait()})")
        IMAGES.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            page.goto(url)
            # Data, not "connecting...": the connection says live and the loss chart drew a line.
            page.wait_for_selector("#conn.ok", timeout=30_000)
            page.wait_for_selector('svg.chart[data-metric="loss"] path.ch-mean', timeout=30_000)
            page.wait_for_timeout(3000)  # a few more steps on the chart, for a fuller picture
            page.screenshot(path=str(IMAGES / "dashboard.png"))
            page.goto(url + "config")
            page.wait_for_selector("#conn.ok", timeout=30_000)
            page.screenshot(path=str(IMAGES / "editor.png"))
            browser.close()
    finally:
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=30)
    print(f"wrote {', '.join(p.name for p in sorted(IMAGES.glob('*.png')))} in {IMAGES}")


if __name__ == "__main__":
    main()
