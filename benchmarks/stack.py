"""The product as users run it: a ``lighthouse serve`` and ``manager serve`` processes, and the admin API.

The benchmark measures the CLIs in their own processes (not the Python API in
the benchmark's process) so the server side has its own GIL, as in production.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.procs import Children
from lighthouse.admin import AdminClient
from protos.job_ids import DEFAULT_JOB
from tests.procs import Proc, lighthouse_command, manager_command

# A typical training config: ~30 keys, mostly scalars, a few small JSON values (~1 KiB encoded).
CONFIG: dict[str, Any] = {
    "lr": 0.0003,
    "min_lr": 3e-05,
    "warmup_steps": 2000,
    "lr_schedule": "cosine",
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-08,
    "grad_clip": 1.0,
    "batch_size": 512,
    "micro_batch_size": 8,
    "grad_accum_steps": 4,
    "seq_len": 4096,
    "dropout": 0.0,
    "label_smoothing": 0.0,
    "checkpoint_every": 1000,
    "eval_every": 500,
    "log_every": 10,
    "mixed_precision": "bf16",
    "activation_checkpointing": True,
    "compile": False,
    "sync_every": 100,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "data_mixture": {"web": 0.6, "code": 0.2, "books": 0.1, "math": 0.1},
    "quorum_timeout_s": 60,
    "min_replicas": 2,
    "loss_spike_threshold": 4.5,
    "skip_bad_batches": True,
    "notes": "run-42: lowered lr after loss spike at step 18k",
}


def encoded_config() -> dict[str, str]:
    """The config as workers get it (``dict[str, str]``), by the product's own encoding rule."""
    from lighthouse.config.values import encode_config

    return encode_config(CONFIG)


def serve_lighthouse(
    children: Children, name: str, *flags: str, dashboard: bool = True
) -> tuple[Proc, str, str]:
    """``lighthouse serve`` on loopback port 0 with ``flags``, logging warnings; returns (child, gRPC
    address, dashboard URL; "" without ``dashboard``)."""
    http_bind = "127.0.0.1:0" if dashboard else "off"
    child = children.command(
        name, lighthouse_command("127.0.0.1:0", http_bind, "--log-level", "warning", *flags)
    )
    return child, child.readline(), child.readline().rstrip("/") if dashboard else ""


def start_lighthouse(
    children: Children, work_dir: Path, name: str = "lighthouse", *flags: str, dashboard: bool = True
) -> tuple[Proc, str, str]:
    """``serve_lighthouse`` serving ``CONFIG`` from a file, its versions in a state directory."""
    config_file = work_dir / f"{name}-config.json"
    config_file.write_text(json.dumps(CONFIG))
    files = ("--config", str(config_file), "--state-dir", str(work_dir / f"{name}-state"))
    return serve_lighthouse(children, name, *files, *flags, dashboard=dashboard)


def start_manager(
    children: Children,
    lighthouse: str,
    name: str,
    ttl: float = 1.0,
    lighthouse_timeout: float = 1.0,
    backoff: float = 1.0,
    push: bool = True,
    job: str = DEFAULT_JOB,
    flags: Sequence[str] = (),
) -> Proc:
    """``manager serve`` of ``job`` with ``flags`` (read its address with ``readline()``, so several
    can start in parallel); ``push=False`` only polls every TTL (``--poll``)."""
    mode = "--push" if push else "--poll"
    extra = [mode, "--job", job, "--log-level", "warning", *flags]
    return children.command(
        name, manager_command(lighthouse, name, ttl, lighthouse_timeout, backoff, extra=extra)
    )


def patch_config(url: str, body: dict[str, Any], timeout: float = 10.0) -> int:
    """PATCH /api/config; returns the acknowledged version."""
    return int(AdminClient(url, timeout=timeout).patch(body)["version"])


def read_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """The lighthouse's ``/metrics``: each sample by its name with labels (``name{job="a"}``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def lighthouse_calls(url: str, timeout: float = 10.0) -> int:
    """GetConfig + Heartbeat calls so far, all jobs summed, from ``/metrics`` (or the managers' fetches)."""
    try:
        samples = read_metrics(url, timeout)
        calls = [
            value
            for name, value in samples.items()
            if name.partition("{")[0]
            in ("lighthouse_get_config_calls_total", "lighthouse_heartbeat_calls_total")
        ]
        if calls:
            return int(sum(calls))
    except OSError:
        pass
    managers = AdminClient(url, timeout=timeout).managers()["managers"]
    return sum(int(m.get("fetches", 0)) for m in managers)
