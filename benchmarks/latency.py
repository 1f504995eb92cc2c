"""Single-client latency of every per-step read, measured interleaved in round-robin batches.

Each round runs one batch of every case, in a rotated order, so a noisy moment
on the machine (another process, a CPU frequency change) lands on all cases
alike and the ratios between them hold even when absolute numbers move.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.floor import FRESH_METHOD, FloorClient
from lighthouse.client import LighthouseClient
from worker_client import ManagerClient

Batch = Callable[[int], list[float]]


@dataclass
class Case:
    name: str
    label: str
    run_batch: Batch  # runs n calls, returns each call's latency in µs
    close: Callable[[], None] = field(default=lambda: None)
    extra: dict[str, Any] = field(default_factory=dict)


def timed(call: Callable[[], Any]) -> Batch:
    """A batch of back-to-back calls, each timed alone."""

    def run(n: int) -> list[float]:
        clock = time.perf_counter_ns
        out = []
        for _ in range(n):
            started = clock()
            call()
            out.append((clock() - started) / 1000)
        return out

    return run


class StepCounter:
    """One step sequence per manager, so every step case stays inside the manager's pinning window."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self.last = 0

    def take(self, n: int = 1) -> int:
        first = next(self._next)
        for _ in range(n - 1):
            next(self._next)
        self.last = first + n - 1
        return first


def relay_cases(manager_addr: str, floor_addr: str, work_s: float) -> list[Case]:
    """The worker's calls through the relay, the floor, and the floor reached through the worker client."""
    hit = ManagerClient(manager_addr, timeout=5.0)
    stepper = ManagerClient(manager_addr, timeout=5.0)
    floor = FloorClient(floor_addr)
    fresh = FloorClient(floor_addr, FRESH_METHOD)
    via_client = ManagerClient(floor_addr, timeout=5.0)
    steps = StepCounter()

    def new_step() -> None:
        stepper.get_config(step=steps.take())

    def same_step() -> None:
        stepper.get_config(step=steps.last)

    prefetch = PrefetchBatch(manager_addr, steps, work_s)
    memory = MemoryReadBatch(work_s)
    return [
        Case(
            "floor",
            "plain grpcio unary call, pre-serialized reply (the floor)",
            timed(floor.get),
            floor.close,
        ),
        Case("floor_fresh", "plain grpcio unary call, reply built per call", timed(fresh.get), fresh.close),
        Case(
            "client_to_floor",
            "ManagerClient.get_config() to the floor server (client-side cost)",
            timed(via_client.get_config),
            via_client.close,
        ),
        Case(
            "relay_hit", "ManagerClient.get_config() via manager, cache hit", timed(hit.get_config), hit.close
        ),
        Case("relay_step_new", "get_config(step=N), a new step each call (pins it)", timed(new_step)),
        Case(
            "relay_step_same",
            "get_config(step=N), same step again (pinned hit)",
            timed(same_step),
            stepper.close,
        ),
        Case(
            "relay_prefetch",
            f"prefetch=True, critical path of get_config(step=N) ({work_s * 1e3:g} ms work/step)",
            prefetch.run,
            extra=prefetch.stats,
        ),
        Case(
            "memory_read",
            f"a dict read after the same {work_s * 1e3:g} ms sleep (floor of any in-memory answer)",
            memory.run,
        ),
    ]


def lighthouse_case(lighthouse_addr: str) -> Case:
    client = LighthouseClient(lighthouse_addr)
    return Case(
        "lighthouse_direct",
        "LighthouseClient.get_config() (direct, full reply)",
        timed(client.get_config),
        client.close,
    )


class PrefetchBatch:
    """A training loop: ``work_s`` of work (sleep: GPU work releases the GIL), then the timed step call
    (with ``metrics``, followed by ``report(step, **metrics)``: the two are the step's critical path).

    A fresh client per batch, closed after it, so its background thread does not
    run while the other cases are timed. The steps of the first ``warmup_s`` (0: none)
    only let the prefetcher learn the step time and are neither timed nor counted:
    the figure is then the steady state; without, it is every step from the client's first.
    """

    WARMUP_S = 0.2

    def __init__(
        self,
        addr: str,
        steps: StepCounter,
        work_s: float,
        metrics: dict[str, float] | None = None,
        *,
        pause_every: int = 0,
        pause_s: float = 0.0,
        warmup_s: float = WARMUP_S,
    ) -> None:
        self.addr = addr
        self.warmup_s = warmup_s
        self.steps = steps
        self.work_s = work_s
        self.metrics = metrics
        self.pause_every = pause_every  # a pause (an evaluation, a checkpoint) every this many steps
        self.pause_s = pause_s
        self.stats: dict[str, Any] = {"calls": 0, "from_memory": 0, "wrong_step": 0, "not_pinned": 0}
        self.stats |= {"client_asks": 0, "client_from_memory": 0}  # ManagerClient.steps_from_memory

    def run(self, n: int) -> list[float]:
        client = ManagerClient(self.addr, timeout=5.0, prefetch=True)
        prefetcher = client._prefetch  # diagnostic only: was the step ready before the call?
        clock = time.perf_counter_ns
        out = []
        warmup = int(self.warmup_s / max(self.work_s, 1e-4))
        counted = (0, 0)  # the client's (from memory, asked) when the timed steps begin
        try:
            first = self.steps.take(warmup + n)
            for i, step in enumerate(range(first, first + warmup + n)):
                if i == warmup:
                    counted = client.steps_from_memory
                if self.pause_every and i > warmup and (i - warmup) % self.pause_every == 0:
                    time.sleep(self.pause_s)
                time.sleep(self.work_s)
                ready = prefetcher is not None and step in prefetcher.ready
                started = clock()
                cfg = client.get_config(step=step)
                if self.metrics is not None:
                    client.report(step, **self.metrics)
                elapsed = (clock() - started) / 1000
                if i < warmup:
                    continue
                out.append(elapsed)
                self.stats["calls"] += 1
                self.stats["from_memory"] += int(ready)
                self.stats["wrong_step"] += int(cfg.step != step)
                self.stats["not_pinned"] += int(not cfg.pinned)
            hits, asks = client.steps_from_memory
            # The timed steps only: a new client's first steps cannot be prefetched yet.
            self.stats["client_from_memory"] += hits - counted[0]
            self.stats["client_asks"] += asks - counted[1]
        finally:
            client.close()
        return out


class MemoryReadBatch:
    """The prefetch loop with the call replaced by a dict pop: what a memory read costs right after
    the step's work on this machine (a CPU idle for a millisecond or more answers slower)."""

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s

    def run(self, n: int) -> list[float]:
        clock = time.perf_counter_ns
        ready: dict[int, object] = {}
        out = []
        for step in range(n):
            ready[step] = object()
            time.sleep(self.work_s)
            started = clock()
            ready.pop(step, None)
            out.append((clock() - started) / 1000)
        return out


def run_interleaved(cases: list[Case], rounds: int, batch: int, warmup: int) -> dict[str, list[float]]:
    """``rounds`` rounds of one ``batch`` per case, the case order rotated each round."""
    for case in cases:
        case.run_batch(warmup)
    samples: dict[str, list[float]] = {case.name: [] for case in cases}
    for r in range(rounds):
        shift = r % len(cases)
        for case in cases[shift:] + cases[:shift]:
            samples[case.name].extend(case.run_batch(batch))
    return samples
