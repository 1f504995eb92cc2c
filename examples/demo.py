"""The demo: a lighthouse, two managers and four workers on this machine, with the dashboard.

Run ``python examples/demo.py`` and open the printed dashboard URL; change
``lr`` with the printed CLI commands or on the /config page and watch every rank
pick it up at the same step. Runs until Ctrl-C (or for ``--duration`` seconds,
changing lr halfway), prints one status line a second, and leaves no process behind.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lighthouse.admin import AdminClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def spawn(args: list[str]) -> subprocess.Popen[str]:
    """A child in its own session: the terminal's Ctrl-C reaches only the demo, which stops them in order."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
        start_new_session=True,
    )


def first_line(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        raise SystemExit(f"{what} did not start (exit code {proc.wait()})")
    return line


WORKER_LINE = re.compile(r"^(group\d+)/(\d+) step +(\d+) version +(\d+) lr (\S+)")


def relay(proc: subprocess.Popen[str], latest: dict[str, tuple[str, str, str]], verbose: bool) -> None:
    """Keeps each group's latest (step, version, lr); with --verbose also prints every worker line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        found = WORKER_LINE.match(line)
        if found:
            group, _rank, step, version, lr = found.groups()
            latest[group] = (step, version, lr)
        if verbose:
            sys.stdout.write(line)


def status_line(latest: dict[str, tuple[str, str, str]]) -> str:
    if not latest:
        return "waiting for the workers' first step..."
    parts = [
        f"{group} step {step} v{version} lr {lr}" for group, (step, version, lr) in sorted(latest.items())
    ]
    return " | ".join(parts)


def change_lr(url: str, lr: float) -> None:
    version = AdminClient(url, timeout=5).patch({"lr": lr}, comment="the demo, halfway")["version"]
    print(
        f"==> demo changed lr to {lr} (version {version}); every rank switches at the same step", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=float, default=0.0, help="seconds to run, changing lr halfway (0: until Ctrl-C)"
    )
    parser.add_argument("--dashboard", default="127.0.0.1:29511", help="dashboard address (port 0: any)")
    parser.add_argument("--step-time", type=float, default=0.5, help="seconds per worker step")
    parser.add_argument("--verbose", action="store_true", help="print every worker's line, not one a second")
    args = parser.parse_args()

    state_dir = Path(tempfile.mkdtemp(prefix="lighthouse-demo-"))
    procs: list[subprocess.Popen[str]] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    latest: dict[str, tuple[str, str, str]] = {}
    try:
        lighthouse = spawn(
            [
                "-m",
                "lighthouse",
                "serve",
                "--bind",
                "127.0.0.1:0",
                "--http-bind",
                args.dashboard,
                "--config",
                str(HERE / "demo_config.json"),
                "--state-dir",
                str(state_dir),
            ],
        )
        procs.append(lighthouse)
        address = first_line(lighthouse, "lighthouse")
        url = first_line(lighthouse, "lighthouse dashboard")
        managers = []
        for group in ("group0", "group1"):
            manager = spawn(
                [
                    "-m",
                    "manager",
                    "serve",
                    "--lighthouse",
                    address,
                    "--bind",
                    "127.0.0.1:0",
                    "--replica-id",
                    group,
                    "--cache-ttl",
                    "1.0",
                ],
            )
            procs.append(manager)
            managers.append((group, first_line(manager, f"manager {group}")))
        for group, manager_addr in managers:
            for rank in range(2):
                worker = spawn(
                    [
                        str(HERE / "demo_worker.py"),
                        "--manager",
                        manager_addr,
                        "--group",
                        group,
                        "--rank",
                        str(rank),
                        "--step-time",
                        str(args.step_time),
                    ],
                )
                procs.append(worker)
                threading.Thread(target=relay, args=(worker, latest, args.verbose), daemon=True).start()
        api = url.rstrip("/")
        print(
            f"started: lighthouse (gRPC {address}), managers {', '.join(a for _, a in managers)}", flush=True
        )
        print("         and two workers per manager (groups group0 and group1), reporting a loss", flush=True)
        print(f"dashboard: {url}   (edit the config at {url}config)", flush=True)
        print("try next, in another terminal:", flush=True)
        print(f"  lighthouse config set lr=0.01 --url {api}", flush=True)
        print(f"  lighthouse config history --url {api}", flush=True)
        print(f"  lighthouse metrics --url {api}", flush=True)
        if args.duration:
            print(
                f"stops by itself after {args.duration:g} s (changing lr halfway), or on Ctrl-C", flush=True
            )
        else:
            print("runs until Ctrl-C", flush=True)
        started = time.monotonic()
        changed = False
        next_status = started + 1.0
        while not stop.wait(0.2):
            now = time.monotonic()
            if not args.verbose and now >= next_status:
                print(status_line(latest), flush=True)
                next_status += 1.0
            elapsed = now - started
            if not changed and args.duration and elapsed > args.duration / 2:
                change_lr(url, 0.0005)
                changed = True
            if args.duration and elapsed > args.duration:
                break
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C (or the terminal's SIGINT to the whole group) must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(state_dir, ignore_errors=True)
        print("demo stopped; all processes ended", flush=True)


if __name__ == "__main__":
    main()
