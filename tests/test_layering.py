"""Dependencies point one way (DESIGN.md). Two views: what importing a module loads, in a fresh
interpreter (what a deployment pays for), and the import graph read from the source, where every
import counts (module level, inside functions, under ``TYPE_CHECKING``), so a circle or a wrong-way
import hidden in a function is caught too."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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


@pytest.mark.slow
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


def loaded_by_cli(*args: str) -> tuple[list[str], str]:
    """The lighthouse modules loaded when ``python -m lighthouse ARGS`` ends, in a fresh interpreter
    (modules a command imports through ``importlib`` too), and what the command printed."""
    code = (
        "import json, runpy, sys\n"
        f"sys.argv = ['lighthouse', *{list(args)!r}]\n"
        "try:\n"
        "    runpy.run_module('lighthouse', run_name='__main__', alter_sys=True)\n"
        "except SystemExit as end:\n"
        "    assert end.code in (0, None), end.code\n"
        "names = sorted(m for m in sys.modules if m.split('.')[0] == 'lighthouse')\n"
        "print(json.dumps(names), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(None))
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stderr.splitlines()[-1])
    return loaded, done.stdout


ADMIN_SIDE = ("lighthouse.admin", "lighthouse.config")


def test_config_show_loads_only_the_admin_side() -> None:
    """An operator's command loads the admin client, config values and protos: 12 lighthouse
    modules (the package, cli, client, admin's 7, config's 2), none of the server side."""
    loaded, printed = loaded_by_cli("config", "show", "--help")
    assert "Usage:" in printed and "--url" in printed, printed
    outside = [
        m
        for m in loaded
        if m not in ("lighthouse", "lighthouse.cli", "lighthouse.client")
        and not any(m == side or m.startswith(side + ".") for side in ADMIN_SIDE)
    ]
    assert outside == [], outside
    assert "lighthouse.admin.config_commands" in loaded  # the probe sees what the command uses
    assert len(loaded) <= 12, loaded


@pytest.mark.slow
def test_serve_help_loads_the_server_side() -> None:
    """``serve`` (named lazily by the cli) still comes with its flags, from the server side."""
    loaded, printed = loaded_by_cli("serve", "--help")
    for flag in ("--state-dir", "--store", "--tokens", "--lease-min-steps", "--tls-cert", "--schema"):
        assert flag in printed, flag
    assert {"lighthouse.server", "lighthouse.serve.command"} <= set(loaded), loaded


def test_lighthouse_server_is_still_importable_from_the_package() -> None:
    loaded = loaded_after("lighthouse")
    assert "lighthouse.server" not in loaded
    from lighthouse import LighthouseServer
    from lighthouse.server import LighthouseServer as Direct

    assert LighthouseServer is Direct


ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lighthouse", "manager", "worker_client", "protos", "tests", "benchmarks", "examples")

# lighthouse's floors, bottom first: a subpackage may import its own floor's and lower floors'
# modules, never a higher one's. "top" is the package's own modules (server, service, cli, client);
# "serve" (the serve command and the server's options) sits above it, as the command builds a server.
FLOORS: dict[str, int] = {
    "config": 0,
    "etcd": 0,
    "store": 1,
    "jobs": 2,
    "peers": 3,
    "web": 4,
    "rpc": 5,
    "top": 6,
    "serve": 7,
}
# What each subpackage may import beyond the floor rule's "anything lower".
ONLY: dict[str, set[str]] = {
    "config": {"config"},
    "etcd": {"etcd"},
    "admin": {"admin", "config"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path) -> Iterator[str]:
    """Every module of the checkout that ``name`` imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _ours(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                anchor = here[: len(here) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield from _ours(submodule if submodule in modules() else base)


def _ours(module: str) -> Iterator[str]:
    """The module itself when it is ours (its deepest known prefix otherwise: ``a.b`` of ``a.b.X``)."""
    parts = module.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules():
            yield candidate
            return
        parts.pop()


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's imports of ours; read once, when a test first asks (not in every xdist process's
    collection: parsing the checkout takes a second)."""
    return {m: set(imports_of(m, p)) - {m} for m, p in modules().items()}


def floor_of(module: str) -> str:
    """``lighthouse.jobs.state`` -> ``jobs``; a module directly in ``lighthouse`` -> ``top``."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / "lighthouse" / parts[1] / "__init__.py").exists():
        return parts[1]
    return "top"


def _is_package(module: str) -> bool:
    return module in modules() and modules()[module].name == "__init__.py"


def lighthouse_edges() -> Iterator[tuple[str, str, str, str]]:
    for source, targets in graph().items():
        if not source.startswith("lighthouse."):
            continue
        for target in targets:
            if target.startswith("lighthouse.") or target == "lighthouse":
                yield source, target, floor_of(source), floor_of(target)


def test_the_graph_was_read() -> None:
    """The checks below mean something only if the parser found the real imports."""
    assert "lighthouse.jobs.state" in modules() and "lighthouse.web.routes" in modules()
    assert "lighthouse.jobs.versions" in graph()["lighthouse.jobs.state"]
    relay = graph()["manager.upstream"] | graph()["manager.server"]
    assert "lighthouse.client" in relay


def test_no_circle_anywhere_in_the_checkout() -> None:
    """Tarjan's strongly connected components: any component of two or more modules is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        work = [(node, iter(sorted(graph()[node])))]
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        while work:
            current, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph()[child]))))
                    break
                if child in on_stack:
                    low[current] = min(low[current], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))

    for module in sorted(graph()):
        if module not in index:
            visit(module)
    # A package's __init__ re-exporting its own submodule is no circle of code: drop that edge only.
    real = [c for c in circles if not all(_only_package_reexports(c, m) for m in c)]
    assert real == [], real


def _only_package_reexports(component: list[str], module: str) -> bool:
    return _is_package(module) and all(t.startswith(module + ".") for t in graph()[module] if t in component)


def test_lighthouse_subpackages_import_only_downwards() -> None:
    wrong = []
    for source, target, source_floor, target_floor in lighthouse_edges():
        if source_floor == target_floor or target == "lighthouse":
            continue
        allowed = ONLY.get(source_floor)
        if allowed is not None:
            if target_floor not in allowed:
                wrong.append(f"{source} -> {target}")
        elif source_floor != "top" and (
            target_floor == "admin" or FLOORS[target_floor] >= FLOORS[source_floor]
        ):
            wrong.append(f"{source} -> {target}")
    assert wrong == [], wrong


def test_admin_imports_no_server_code() -> None:
    """The operator's side runs on a login node: nothing of the store, jobs, web or gRPC service."""
    admin = {m: graph()[m] for m in graph() if m.startswith("lighthouse.admin")}
    assert len(admin) >= 5, sorted(admin)
    wrong = {
        f"{m} -> {t}"
        for m, targets in admin.items()
        for t in targets
        if t.startswith("lighthouse") and not t.startswith(("lighthouse.admin", "lighthouse.config"))
    }
    assert wrong == set(), sorted(wrong)


def test_jobs_import_no_store_backend() -> None:
    """One job's logic talks to persistence through the protocol only (store.backend)."""
    wrong = {
        f"{m} -> {t}"
        for m, targets in graph().items()
        if m.startswith("lighthouse.jobs")
        for t in targets
        if t.startswith("lighthouse.store.") and t != "lighthouse.store.backend"
    }
    assert wrong == set(), sorted(wrong)


@pytest.mark.parametrize("package", ["lighthouse", "manager", "worker_client"])
def test_protos_imports_nothing_of_ours(package: str) -> None:
    wrong = {
        f"{m} -> {t}" for m in graph() if m.startswith("protos") for t in graph()[m] if t.startswith(package)
    }
    assert wrong == set(), sorted(wrong)


def test_the_manager_reaches_only_the_lighthouse_client() -> None:
    manager = [targets for m, targets in graph().items() if m.startswith("manager")]
    reached = {t for targets in manager for t in targets if t.startswith("lighthouse")}
    assert reached <= {"lighthouse", "lighthouse.client"}, sorted(reached)


def test_worker_client_reaches_neither_lighthouse_nor_manager() -> None:
    reached = {
        t
        for m in graph()
        if m.startswith("worker_client")
        for t in graph()[m]
        if t.startswith(("lighthouse", "manager"))
    }
    assert reached == set(), sorted(reached)


def test_no_module_imports_a_test_module() -> None:
    """What tests share lives in helper modules (tests/procs.py, tests/stuck_lighthouse.py...): a
    test module imported by another ties the two together and collects its tests' names twice."""
    assert any(m.startswith("tests.test_") for m in graph()), "no test module read"
    wrong = {f"{m} -> {t}" for m, targets in graph().items() for t in targets if t.startswith("tests.test_")}
    assert wrong == set(), sorted(wrong)


def test_lighthouse_top_level_holds_at_most_eight_modules() -> None:
    """Every other module belongs to a room (a subpackage answering one question, DESIGN.md)."""
    top = sorted(p.name for p in (ROOT / "lighthouse").glob("*.py"))
    assert len(top) <= 8, top
