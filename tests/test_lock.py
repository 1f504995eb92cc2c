"""The lock file: every package `.ci/run` installs comes from `.ci/requirements.txt` at one exact
version, the lock covers every requirement of the extras CI installs, and the environment running
these tests is the lock's (docs/install.md)."""

from __future__ import annotations

import configparser
import importlib.metadata
import itertools
import re
import shlex

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.procs import ROOT

LOCK = ROOT / ".ci" / "requirements.txt"
CI_EXTRAS = ("test", "bench", "torchft")  # what .ci/lock compiles and .ci/run installs
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def pins(text: str) -> dict[str, str]:
    """The lock's ``name==version`` lines; any other requirement line raises."""
    found: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#")[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        assert match, f"not an exact pin in the lock: {raw!r}"
        found[canonicalize_name(match[1])] = match[2]
    return found


def unpinned_installs(script: str) -> list[str]:
    """The ``pip install`` commands of a shell script that take anything but the lock file (or the
    project itself without its dependencies)."""
    wrong = []
    for line in script.splitlines():
        command = line.split("#")[0]
        if not re.search(r"\bpip\b.*\binstall\b", command):
            continue
        words = shlex.split(command)
        args = list(
            itertools.takewhile(lambda w: ">" not in w and w != "|", words[words.index("install") + 1 :])
        )
        from_lock = [a for a in args if not a.startswith("-")] == [".ci/requirements.txt"] and "-r" in args
        if from_lock or "--no-deps" in args:
            continue
        wrong.append(line.strip())
    return wrong


def required(setup_cfg: str, extras: tuple[str, ...]) -> list[Requirement]:
    """``install_requires`` and the named extras of a setup.cfg."""
    parser = configparser.ConfigParser()
    parser.read_string(setup_cfg)
    blocks = [parser["options"]["install_requires"], *(parser["options.extras_require"][e] for e in extras)]
    lines = (line.split("#")[0].strip() for block in blocks for line in block.splitlines())
    return [Requirement(line) for line in lines if line]


def uncovered(requirements: list[Requirement], locked: dict[str, str]) -> list[str]:
    """Requirements the lock does not pin, or pins outside their range."""
    wrong = []
    for req in requirements:
        version = locked.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req} (locked: {version})")
    return wrong


def test_ci_installs_nothing_but_the_lock() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert unpinned_installs(script) == []
    assert "-r .ci/requirements.txt" in script and "--no-deps" in script  # the two installs are there
    # The check itself can fail: an unpinned install, or the project with its (ranged) dependencies.
    bad = "pip install -q mypy\npip install -e '.[test]'\npip install -r .ci/requirements.txt ruff 2>&1\n"
    assert len(unpinned_installs(bad)) == 3


def test_the_lock_pins_every_package_setup_cfg_asks_for_within_its_range() -> None:
    locked = pins(LOCK.read_text())
    wanted = required((ROOT / "setup.cfg").read_text(), CI_EXTRAS)
    assert len(wanted) >= 20 and len(locked) >= len(wanted)
    assert uncovered(wanted, locked) == []
    # The tools whose new releases turned a fresh machine red are among them, pinned.
    assert {"mypy", "ruff", "types-protobuf", "pytest", "playwright", "mkdocs", "torch"} <= locked.keys()
    assert uncovered([Requirement("mypy>=99"), Requirement("not-locked")], locked) == [
        f"mypy>=99 (locked: {locked['mypy']})",
        "not-locked (locked: None)",
    ]


def test_the_environment_running_the_tests_is_the_lock() -> None:
    """What `.ci/run` installed is what the lock says: no package of it at another version."""
    different = {}
    for name, version in pins(LOCK.read_text()).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "(missing)"
        if installed == "(missing)" or Version(installed) != Version(version):
            different[name] = f"{installed}, locked {version}"
    hint = "run bash .ci/run, or work in its environment: . .venv/bin/activate"
    assert different == {}, f"not the lock's environment: {different}; {hint}"


def test_the_readme_demo_installs_within_the_lock() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install -c .ci/requirements.txt -e ." in readme
