"""The demo: a lighthouse, two managers and four workers on this machine, with the dashboard.

Run ``python examples/demo.py`` and open the printed dashboard URL; change
``lr`` on the /config page (or let the demo change it for you halfway) and watch
every rank pick it up at the same step. Stops after ``--duration`` seconds or
on Ctrl-C, and leaves no process behind.
"""

from __future__ import annotations

import argparse
import os
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


def spawn(args: list[str], **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT), **kw
    )  # type: ignore[call-overload]


def first_line(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        raise SystemExit(f"{what} did not start (exit code {proc.wait()})")
    return line


def relay(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)


def change_lr(url: str, lr: float) -> None:
    version = AdminClient(url, timeout=5).patch({"lr": lr}, comment="the demo, halfway")["version"]
    print(
        f"==> demo changed lr to {lr} (version {version}); every rank switches at the same step", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds to run (0: until Ctrl-C)")
    parser.add_argument("--dashboard", default="127.0.0.1:29511", help="dashboard address (port 0: any)")
    parser.add_argument("--step-time", type=float, default=0.5, help="seconds per worker step")
    args = parser.parse_args()

    state_dir = Path(tempfile.mkdtemp(prefix="lighthouse-demo-"))
    procs: list[subprocess.Popen[str]] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
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
                threading.Thread(target=relay, args=(worker,), daemon=True).start()
        print(f"lighthouse {address}; managers {', '.join(a for _, a in managers)}", flush=True)
        print(f"dashboard: {url}   (edit the config at {url}config)", flush=True)
        started = time.monotonic()
        changed = False
        while not stop.wait(0.2):
            elapsed = time.monotonic() - started
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
