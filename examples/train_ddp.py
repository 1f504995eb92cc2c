"""DDP training whose lr and momentum come from the lighthouse at every step (torchrun, gloo, CPU).

One ``torchrun`` per replica group, as in torchft's ``train_ddp.py``::

    lighthouse serve --config cfg.json          # prints its gRPC address, HOST:PORT
    export TORCHFT_LIGHTHOUSE=HOST:PORT
    REPLICA_GROUP_ID=0 torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 500
    REPLICA_GROUP_ID=1 torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 500

Each rank calls ``connect()`` once (group rank 0 starts the group's manager)
and, at every step, ``get_config(step=step)``; it applies ``lr`` and
``momentum`` to its optimizer and all-reduces the values it used (MIN and MAX
over the group). Ranks that applied different values at one step would
silently diverge under DDP; here the script stops with an error naming the step.
Every rank prints one JSON line per step (``"event": "step"``). A ``steps`` key
in the config overrides ``--steps`` while the job runs: every group reads it at
the same step, so all of them stop together (a change made now, ``lighthouse
config set steps=0``, stops the job at the step the CLI names).

``--checkpoint-dir DIR`` saves the group's state after every step and resumes
from it, so a group killed and started again goes on at the step it reached
and reads that step's config. Under ``--torchft`` it saves only at ``--save-at
STEP`` (torchft heals a group that restarts alone from a live one) and a
restart of the whole job resumes there: a new run of the job, which gets the
config as the operator left it from that step on (``--run-id`` names the run).

``--torchft`` (torchft installed) wraps training in torchft's ``Manager``, as
torchft's own example does: torchft's lighthouse forms the quorum across groups
and heals a restarted group from a live one; ours serves the config. One
``lighthouse serve --torchft --min-replicas 1`` is both: ``TORCHFT_LIGHTHOUSE=
http://HOST:PORT`` names it for the two (or ``--torchft-lighthouse`` torchft's
and ``--lighthouse`` ours, run apart).
Groups average their gradients every step, so a group that applied another lr
than the others would drift away for good: the script also all-reduces the
values it used across the groups (through torchft's Manager, like the
gradients) and stops with an error naming the step on a mismatch. Its client
is strict: a step whose config the lighthouse cannot confirm (an outage longer
than the group's step lease) raises instead of training on a fallback, so the
group stops and torchft heals it when it comes back. Each group prints a hash
of its parameters when it finishes (equal in every group of a healthy run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch import nn

from worker_client import ConfigUnavailable, ManagerClient, connect
from worker_client.trackers import TensorBoardTracker

FEATURES, HIDDEN, BATCH = 8, 16, 32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="train until this step (or the config's steps)")
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it)")
    p.add_argument("--lr", type=float, default=0.01, help="lr while the config has none")
    p.add_argument("--momentum", type=float, default=0.0, help="momentum while the config has none")
    p.add_argument("--lighthouse", default=None, help="config lighthouse (default: env TORCHFT_LIGHTHOUSE)")
    p.add_argument("--timeout", type=float, default=5.0, help="deadline of connect() and of each call")
    p.add_argument("--cache-ttl", type=float, default=None, help="the manager's cache TTL in seconds")
    p.add_argument(
        "--push-lease-seconds", type=float, default=None, help="the manager's step leases on its push stream"
    )
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="save every step, resume at start")
    p.add_argument("--save-at", type=int, default=None, help="--torchft: checkpoint at this step only")
    p.add_argument("--run-id", default=None, help="connect(run_id=...): a new id begins a new run")
    p.add_argument("--gloo-timeout", type=float, default=30.0, help="seconds before a collective fails")
    p.add_argument("--torchft", action="store_true", help="fault tolerance across groups with torchft")
    p.add_argument("--torchft-lighthouse", default=None, help="torchft's lighthouse (quorum)")
    p.add_argument("--tensorboard", type=Path, default=None, help="config changes to TensorBoard")
    return p.parse_args()


def emit(**record: Any) -> None:
    """One JSON line per event in one write (ranks share torchrun's stdout: lines must not interleave)."""
    sys.stdout.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
    sys.stdout.flush()


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every rank and group starts from the same weights
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def batch(group: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression batch, different for every group, rank and step."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{group}/{rank}/{step}".encode()))
    x = torch.randn(BATCH, FEATURES, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=gen)
    return x, y


class Knobs:
    """What this step reads from the config, applied to the optimizer and checked across the group."""

    def __init__(self, client: ManagerClient, args: argparse.Namespace) -> None:
        self.client, self.args = client, args
        self.until = args.steps  # the config's ``steps`` as of the last step read: train below it

    def apply(self, step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        asked = time.monotonic()
        cfg = self.client.get_config(step=step)
        config_seconds = time.monotonic() - asked  # what config sharing cost this step
        lr = cfg.get_float("lr", self.args.lr)
        momentum = cfg.get_float("momentum", self.args.momentum)
        until = cfg.get_int("steps", self.args.steps)
        for group in optimizer.param_groups:
            group["lr"], group["momentum"] = lr, momentum
        # MAX of (x, -x) gives the group's MAX and MIN in one collective.
        used = torch.tensor([lr, -lr, momentum, -momentum, until, -until], dtype=torch.float64)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        maxes = used.tolist()
        lr_max, lr_min, m_max, m_min = maxes[0], -maxes[1], maxes[2], -maxes[3]
        u_max, u_min = maxes[4], -maxes[5]
        if lr_min != lr_max or m_min != m_max or u_min != u_max:
            raise SystemExit(
                f"step {step}: ranks of the group used different values (lr {lr_min}..{lr_max}, "
                f"momentum {m_min}..{m_max}, steps {u_min:.0f}..{u_max:.0f}); stopping before they diverge"
            )
        self.until = until
        return {"lr": lr, "momentum": momentum, "lr_min": lr_min, "lr_max": lr_max,
                "version": cfg.version, "source": cfg.source, "pinned": cfg.pinned,
                "config_seconds": round(config_seconds, 4)}  # fmt: skip


def train_plain(args: argparse.Namespace, group: str, rank: int, knobs: Knobs) -> None:
    """torch DDP within the group; optional per-step checkpoint to resume at the step reached."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    path = args.checkpoint_dir / f"group-{group}.pt" if args.checkpoint_dir else None
    first = 0
    if path is not None and path.exists():
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        first = state["step"]
    ddp = nn.parallel.DistributedDataParallel(model)
    emit(event="start", group=group, rank=rank, pid=os.getpid(), first_step=first)
    step = first
    while step < knobs.until:
        used = knobs.apply(step, optimizer)
        if step >= knobs.until:
            break
        x, y = batch(group, rank, step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        emit(event="step", group=group, rank=rank, step=step, loss=round(loss.item(), 6), **used)
        if path is not None and rank == 0:
            tmp = path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, path)
        time.sleep(args.step_time)
        step += 1


def params_hash(model: nn.Module) -> str:
    """A digest of the parameters: equal across groups exactly when they hold the same replica."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def check_across_groups(manager: Any, step: int, used: dict[str, Any]) -> bool:
    """All-reduce the lr and momentum this group used (SUM of 1, x and x*x over the participating
    groups, torchft zeroes a healing group's tensor) and stop on any spread between groups.

    False: the all-reduce failed (a group was lost), so this step commits nowhere."""
    from torch.distributed import ReduceOp

    lr, momentum = used["lr"], used["momentum"]
    sums = torch.tensor([1.0, lr, lr * lr, momentum, momentum * momentum], dtype=torch.float64)
    manager.allreduce(sums, reduce_op=ReduceOp.SUM).wait()
    if manager.errored():
        return False  # the step will not commit anywhere; nothing trained on these values
    n, lr_sum, lr_sq, m_sum, m_sq = sums.tolist()
    for name, total, squares in (("lr", lr_sum, lr_sq), ("momentum", m_sum, m_sq)):
        mean = total / n
        if abs(squares / n - mean * mean) > 1e-12 * max(1.0, mean * mean):
            raise SystemExit(
                f"step {step}: the replica groups used different {name} values (mean {mean} over "
                f"{n:.0f} groups, this group {used[name]}); stopping before they diverge"
            )
    return True


def train_torchft(args: argparse.Namespace, group: str, rank: int, knobs: Knobs) -> None:
    """torchft's Manager across groups (quorum, healing), the group's ranks averaged by gloo."""
    from torchft import Manager, Optimizer, ProcessGroupGloo

    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    path = args.checkpoint_dir / f"group-{group}.pt" if args.checkpoint_dir else None
    saved = torch.load(path) if path is not None and path.exists() else None
    if saved is not None:  # the whole job restarted: resume at the checkpoint's step
        load_state_dict(saved)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.gloo_timeout)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{group}",
        lighthouse_addr=args.torchft_lighthouse,
        use_async_quorum=False,  # the step is known (healed) before we ask for its config
        timeout=timedelta(seconds=args.gloo_timeout),
    )
    if saved is not None:
        manager.load_state_dict(saved["manager"])
    optimizer = Optimizer(manager, inner)
    emit(event="start", group=group, rank=rank, pid=os.getpid(), first_step=manager.current_step())
    try:
        while manager.current_step() < knobs.until:
            optimizer.zero_grad()  # quorum; a restarted group is healed here and jumps to the live step
            step = manager.current_step()
            try:
                used = knobs.apply(step, optimizer)
            except ConfigUnavailable as exc:  # stop; torchft heals the group when it is started again
                emit(event="unconfirmed", group=group, rank=rank, step=step, error=str(exc))
                raise SystemExit(f"step {step}: {exc}") from None
            if step >= knobs.until:  # every group read this step's config: all stop here
                break
            if path is not None and step == args.save_at and rank == 0:  # the state before step
                tmp = path.with_suffix(".tmp")
                torch.save({**state_dict(), "manager": manager.state_dict()}, tmp)
                os.replace(tmp, path)
            loss = None
            if check_across_groups(manager, step, used):
                x, y = batch(group, rank, step)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
            else:  # a group was lost: zeros, so the ranks' collectives below still match
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            # Averaged across groups by torchft's Manager, in one all-reduce as DDP's one bucket.
            # Not torchft 0.2.0's DistributedDataParallel: its gradient hook asserts (``assert
            # fut._fut``) when the all-reduce fails, so a group lost in the middle of a backward
            # pass crashed the others too; a failed ``manager.allreduce`` is recorded and the step
            # is not committed.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()
            torch.nn.utils.vector_to_parameters(flat, grads)
            for p in model.parameters():  # and across this group's ranks (gloo has no AVG)
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            optimizer.step()  # applied only if every group in the quorum committed
            committed = manager.current_step() > step
            emit(event="step", group=group, rank=rank, step=step,
                 loss=None if loss is None else round(loss.item(), 6),
                 committed=committed, participants=manager.num_participants(), **used)  # fmt: skip
            time.sleep(args.step_time)
        emit(event="params", group=group, rank=rank, step=manager.current_step(), sha=params_hash(model))
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    args = parse_args()
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.gloo_timeout))
    rank = dist.get_rank()
    # Under torchft a strict client: no step trains on a config the lighthouse did not confirm.
    tracker = TensorBoardTracker(args.tensorboard, rank=rank, group=group) if args.tensorboard else None
    client = connect(
        lighthouse=args.lighthouse,
        timeout=args.timeout,
        cache_ttl=args.cache_ttl,
        push_lease_seconds=args.push_lease_seconds,
        strict=args.torchft,
        on_change=tracker,
        run_id=args.run_id,
    )
    knobs = Knobs(client, args)
    try:
        (train_torchft if args.torchft else train_plain)(args, group, rank, knobs)
    finally:
        client.close()
        if tracker is not None:
            tracker.close()
    emit(event="done", group=group, rank=rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
