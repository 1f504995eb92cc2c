"""The docs: README.md is a short first read, the MkDocs site builds strictly, every page is in the nav."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.procs import ROOT

COMMANDS = ("pip install -c .ci/requirements.txt -e . && python examples/demo.py", "bash .ci/run")


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160, "README.md is the first read: move the rest to docs/"
    first = re.search(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    assert first is not None, "README.md has no code block"
    lines = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert lines == list(COMMANDS), lines


def test_mkdocs_build_strict_succeeds(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "site" / "step-consistency" / "index.html").exists()


def _nav_pages(nav: object) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(value) for value in nav.values()))
    return set()


def test_every_docs_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages and pages == _nav_pages(config["nav"])
