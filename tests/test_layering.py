"""Dependencies point one way (DESIGN.md): the manager uses only the lighthouse's client, and the
worker client neither the lighthouse nor the manager. Checked in a fresh interpreter, since what a
module imports at load time is what a deployment pays for."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.procs import child_env


def loaded_after(*modules: str, of: tuple[str, ...] = ("lighthouse", "manager")) -> list[str]:
    """The modules of the packages ``of`` that importing ``modules`` loads, in a fresh interpreter."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {of!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(None))
    assert done.returncode == 0, done.stderr
    result: list[str] = json.loads(done.stdout)
    return result


def test_the_manager_loads_no_server_side_of_the_lighthouse() -> None:
    loaded = loaded_after("manager.cli", "manager.server")
    lighthouse = [m for m in loaded if m.startswith("lighthouse")]
    assert lighthouse == ["lighthouse", "lighthouse.client"], lighthouse


def test_the_worker_client_loads_neither_lighthouse_nor_manager() -> None:
    assert loaded_after("worker_client", "worker_client.connect") == []


def test_torch_is_loaded_by_connect_only() -> None:
    """torch is an optional extra: nothing but a call of ``connect()`` without a store imports it."""
    modules = ("worker_client", "worker_client.connect", "manager.cli", "lighthouse.cli")
    assert loaded_after(*modules, of=("torch",)) == []


def test_lighthouse_server_is_still_importable_from_the_package() -> None:
    loaded = loaded_after("lighthouse")
    assert "lighthouse.server" not in loaded
    from lighthouse import LighthouseServer
    from lighthouse.server import LighthouseServer as Direct

    assert LighthouseServer is Direct
