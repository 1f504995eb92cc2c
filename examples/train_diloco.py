"""A training loop whose learning rate and sync interval come from the lighthouse, step by step.

Two replica groups of two ranks each; every rank is its own process (started
with ``subprocess``: never fork a process that holds a gRPC channel) and calls
``ManagerClient.get_config(step=step)`` at the start of every step:

* ``lr`` is applied to the rank's optimizer for that step;
* ``sync_every`` is the interval of a DiLoCo-style sync, simplified: every
  ``sync_every`` steps the ranks of a group average their parameters (through
  files in a shared folder; no torch.distributed). The averaging waits for
  every rank of the group, so it only works because all ranks agree on
  ``sync_every`` at every step, which is what step pinning guarantees.

Each rank reports its loss (``client.report(step, loss=loss)``): the dashboard
charts it against the config changes, and ``examples/adaptive_sync.py`` tunes
``sync_every`` from it while the job runs.

The model is a small linear regression: PyTorch on the CPU when importable,
otherwise NumPy (``--backend``). By default the script starts its own
lighthouse and managers; ``--lighthouse ADDR`` uses a running lighthouse
(the managers still live in this process). ``--schedule-lr-drop-at S``
schedules ``lr = lr / 10`` at step S through the admin API before training
starts, and at the end verifies that every rank switched at exactly step S.

It needs NumPy (the group's averaging uses it): ``pip install -e ".[examples]"``.

    python examples/train_diloco.py --steps 60 --schedule-lr-drop-at 30
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lighthouse.admin import AdminClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GROUPS, RANKS, FEATURES, BATCH = 2, 2, 8, 32
DEFAULT_LR, DEFAULT_SYNC_EVERY = 0.05, 10
SYNC_TIMEOUT = 60.0


# --------------------------------------------------------------------------- one rank
class NumpyModel:
    """Linear regression trained by plain SGD (the fallback when PyTorch is not installed)."""

    def __init__(self, np: Any) -> None:
        self.np = np
        self.w = np.zeros(FEATURES)
        self.b = 0.0

    def train_step(self, x: Any, y: Any, lr: float) -> float:
        err = x @ self.w + self.b - y
        loss = float((err**2).mean())
        self.w -= lr * 2 * (x.T @ err) / len(y)
        self.b -= lr * 2 * float(err.mean())
        return loss

    def params(self) -> Any:
        return self.np.append(self.w, self.b)

    def load(self, flat: Any) -> None:
        self.w, self.b = flat[:FEATURES].copy(), float(flat[FEATURES])


class TorchModel:
    """The same model as an ``nn.Linear`` with ``torch.optim.SGD``; lr is set on its param group."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        torch.manual_seed(0)
        self.model = torch.nn.Linear(FEATURES, 1)
        torch.nn.init.zeros_(self.model.weight)
        torch.nn.init.zeros_(self.model.bias)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=DEFAULT_LR)

    def train_step(self, x: Any, y: Any, lr: float) -> float:
        torch = self.torch
        for group in self.opt.param_groups:
            group["lr"] = lr
        xt = torch.from_numpy(x).float()
        yt = torch.from_numpy(y).float().unsqueeze(1)
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(xt), yt)
        loss.backward()
        self.opt.step()
        return float(loss.item())

    def params(self) -> Any:
        with self.torch.no_grad():
            return self.torch.nn.utils.parameters_to_vector(self.model.parameters()).double().numpy().copy()

    def load(self, flat: Any) -> None:
        with self.torch.no_grad():
            vec = self.torch.from_numpy(flat).float()
            self.torch.nn.utils.vector_to_parameters(vec, self.model.parameters())


def make_model(backend: str) -> tuple[Any, str]:
    if backend in ("auto", "torch"):
        try:
            import torch
        except ImportError:
            if backend == "torch":
                raise
        else:
            torch.set_num_threads(1)
            return TorchModel(torch), f"torch {torch.__version__}"
    import numpy as np

    return NumpyModel(np), f"numpy {np.__version__}"


def average_in_group(model: Any, sync_dir: Path, group: int, rank: int, step: int) -> None:
    """Write this rank's parameters, wait for every rank of the group, load their mean."""
    import numpy as np

    folder = sync_dir / f"group{group}" / f"step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.npy"
    np.save(tmp, model.params())
    os.replace(tmp, folder / f"rank{rank}.npy")
    paths = [folder / f"rank{r}.npy" for r in range(RANKS)]
    deadline = time.monotonic() + SYNC_TIMEOUT
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"group{group}/r{rank}: the group's ranks never met at step {step}")
        time.sleep(0.001)
    model.load(np.mean([np.load(p) for p in paths], axis=0))


def run_rank(args: argparse.Namespace) -> None:
    import numpy as np

    from worker_client import ManagerClient

    group, rank = args.group, args.rank
    model, backend = make_model(args.backend)
    print(json.dumps({"backend": backend}), flush=True)
    # The same true weights everywhere; each rank has its own data shard.
    w_true = np.random.default_rng(0).normal(size=FEATURES)
    rng = np.random.default_rng(1000 + 10 * group + rank)
    x_all = rng.normal(size=(4096, FEATURES))
    y_all = x_all @ w_true + 0.3 + 0.05 * rng.normal(size=len(x_all))
    client = ManagerClient(args.manager, timeout=5.0, group_rank=rank)
    try:
        for step in range(args.steps):
            cfg = client.get_config(step=step)
            lr = cfg.get_float("lr", DEFAULT_LR)
            sync_every = cfg.get_int("sync_every", DEFAULT_SYNC_EVERY)
            idx = rng.integers(0, len(x_all), size=BATCH)
            loss = model.train_step(x_all[idx], y_all[idx], lr)
            client.report(step, loss=loss)  # a memory append: it rides on the next step's get_config
            synced = sync_every > 0 and (step + 1) % sync_every == 0
            if synced:
                average_in_group(model, Path(args.sync_dir), group, rank, step)
            record = {"g": group, "r": rank, "step": step, "v": cfg.version, "src": cfg.source}
            record.update({"lr": lr, "sync_every": sync_every, "loss": loss, "synced": synced})
            print(json.dumps(record), flush=True)
            if args.step_interval:
                time.sleep(args.step_interval)
    finally:
        client.close()


# --------------------------------------------------------------------------- the launcher
def schedule_lr_drop(url: str, step: int) -> tuple[float, float, int]:
    """PATCH lr = lr / 10 at ``step``; returns (old lr, new lr, version)."""
    admin = AdminClient(url, token=os.environ.get("LIGHTHOUSE_ADMIN_TOKEN"))
    old = float(admin.show()["config"].get("lr", DEFAULT_LR))
    new = old / 10
    answer = admin.patch({"lr": new}, effective_step=step, comment="lr drop")
    return old, new, int(answer["version"])


def pump(proc: subprocess.Popen[str], out: queue.Queue[dict[str, Any] | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            out.put(json.loads(line))
    out.put(None)


def summarize(records: list[dict[str, Any]], drop: tuple[int, float, float] | None) -> bool:
    """Print what each rank saw; True when every check passed."""
    ok = True
    by_rank: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rec in records:
        by_rank.setdefault((rec["g"], rec["r"]), []).append(rec)
    if not by_rank:  # nothing to verify is no proof: never an OK for zero ranks
        print("FAILED: no rank reported a step (see the ranks' errors above)")
        return False
    for group in range(GROUPS):
        steps: dict[int, set[tuple[int, float, int]]] = {}
        for rec in records:
            if rec["g"] == group:
                steps.setdefault(rec["step"], set()).add((rec["v"], rec["lr"], rec["sync_every"]))
        split = [s for s, seen in steps.items() if len(seen) > 1]
        print(
            f"group{group}: {len(steps)} steps, ranks agreed on (version, lr, sync_every) at every step: "
            f"{'yes' if not split else f'NO, at steps {split[:5]}'}"
        )
        ok &= not split
    switches = {}
    for (group, rank), recs in sorted(by_rank.items()):
        recs.sort(key=lambda r: r["step"])
        changes = [r["step"] for prev, r in itertools.pairwise(recs) if r["lr"] != prev["lr"]]
        switches[(group, rank)] = changes
        print(
            f"group{group}/r{rank}: lr {recs[0]['lr']:g} -> {recs[-1]['lr']:g}, changed at steps {changes}, "
            f"final loss {recs[-1]['loss']:.5f}"
        )
    same = len({tuple(c) for c in switches.values()}) == 1
    print(f"all {len(switches)} ranks changed lr at the same steps: {'yes' if same else 'NO'}")
    ok &= same
    if drop is not None:
        step, old, new = drop
        exact = all(
            all((r["lr"] == old) if r["step"] < step else (r["lr"] == new) for r in recs)
            for recs in by_rank.values()
        )
        verdict = "OK" if exact else "FAILED"
        print(f"verify: all {len(by_rank)} ranks switched lr {old:g} -> {new:g} at step {step}: {verdict}")
        ok &= exact
    return ok


def launch(args: argparse.Namespace) -> int:
    try:
        import numpy  # noqa: F401  (every rank needs it: fail once here, not in four tracebacks)
    except ImportError:
        print('train_diloco needs numpy: pip install -e ".[examples]"', file=sys.stderr)
        return 2
    from lighthouse import LighthouseServer
    from manager import ManagerServer

    work = Path(tempfile.mkdtemp(prefix="train_diloco-"))
    lighthouse = None
    managers: list[ManagerServer] = []
    ranks: list[subprocess.Popen[str]] = []
    try:
        if args.lighthouse:
            lighthouse_addr, url = args.lighthouse, args.url
        else:
            cfg_path = work / "config.json"
            cfg_path.write_text(json.dumps({"lr": args.lr, "sync_every": args.sync_every}))
            lighthouse = LighthouseServer(
                "127.0.0.1:0", cfg_path, state_dir=work / "state", http_bind="127.0.0.1:0"
            )
            lighthouse_addr, url = lighthouse.address(), lighthouse.dashboard_url()
            print(f"lighthouse {lighthouse_addr}, dashboard {url}")
        managers = [
            ManagerServer(lighthouse_addr, "127.0.0.1:0", f"group{g}", cache_ttl=0.2) for g in range(GROUPS)
        ]
        drop = None
        if args.schedule_lr_drop_at is not None:
            if not url:
                raise SystemExit("--schedule-lr-drop-at with --lighthouse needs --url (the dashboard URL)")
            old, new, version = schedule_lr_drop(url, args.schedule_lr_drop_at)
            drop = (args.schedule_lr_drop_at, old, new)
            print(f"scheduled lr {old:g} -> {new:g} at step {args.schedule_lr_drop_at} (version {version})")
            # Start training once both managers know of it (they would also learn within their TTL).
            deadline = time.monotonic() + 10
            while min(m.serving_version() for m in managers) < version:
                if time.monotonic() > deadline:
                    raise SystemExit("the managers did not pick up the scheduled change")
                time.sleep(0.01)
        sync_dir = work / "sync"
        out: queue.Queue[dict[str, Any] | None] = queue.Queue()
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        for g in range(GROUPS):
            for r in range(RANKS):
                cmd = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps)]
                cmd += ["--backend", args.backend, "--step-interval", str(args.step_interval)]
                cmd += ["--_rank", "--group", str(g), "--rank", str(r), "--manager", managers[g].address()]
                cmd += ["--sync-dir", str(sync_dir)]
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
                )
                ranks.append(proc)
                threading.Thread(target=pump, args=(proc, out), daemon=True).start()
        records: list[dict[str, Any]] = []
        backends: set[str] = set()
        last_lr: dict[tuple[int, int], float] = {}
        last_sync: dict[tuple[int, int], int] = {}
        running = len(ranks)
        while running:
            rec = out.get()
            if rec is None:
                running -= 1
            elif "backend" in rec:
                backends.add(rec["backend"])
            else:
                records.append(rec)
                rank_id = (rec["g"], rec["r"])
                changed = rank_id in last_lr and last_lr[rank_id] != rec["lr"]
                last_lr[rank_id] = rec["lr"]
                resynced = rank_id in last_sync and last_sync[rank_id] != rec["sync_every"]
                last_sync[rank_id] = rec["sync_every"]
                if rec["step"] % args.print_every == 0 or changed or resynced:  # every change is shown
                    sync = " sync" if rec["synced"] else ""
                    note = " <- lr changed" if changed else ""
                    note += f" <- sync_every {rec['sync_every']}" if resynced else ""
                    print(
                        f"group{rec['g']}/r{rec['r']} step {rec['step']:5d} v{rec['v']} lr {rec['lr']:<8g}"
                        f" loss {rec['loss']:.5f}{sync}{note}"
                    )
        codes = [p.wait() for p in ranks]
        print(f"backend: {', '.join(sorted(backends))}")
        ok = summarize(records, drop)
        if any(codes) or len(records) != GROUPS * RANKS * args.steps:
            print(f"ranks exited with {codes}, {len(records)} step records")
            ok = False
        return 0 if ok else 1
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for m in managers:
            m.shutdown()
        if lighthouse is not None:
            lighthouse.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lighthouse", help="address of a running lighthouse (default: start one here)")
    parser.add_argument("--url", help="its dashboard URL, for --schedule-lr-drop-at")
    parser.add_argument("--schedule-lr-drop-at", type=int, metavar="STEP", help="schedule lr = lr/10 at STEP")
    parser.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help="initial lr of a lighthouse started here"
    )
    parser.add_argument(
        "--sync-every", type=int, default=DEFAULT_SYNC_EVERY, help="initial sync_every, likewise"
    )
    parser.add_argument("--backend", choices=["auto", "torch", "numpy"], default="auto")
    parser.add_argument("--step-interval", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--print-every", type=int, default=1, help="print every Nth step (lr changes always)")
    # Internal: run one rank.
    parser.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--manager", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._rank:
        run_rank(args)
        return
    sys.exit(launch(args))


if __name__ == "__main__":
    main()
