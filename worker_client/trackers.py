"""Ready ``on_change`` callbacks that put config changes where ML engineers look.

Each imports its library only when built (extras ``tensorboard``, ``wandb``, ``mlflow``)::

    client = ManagerClient(addr, on_change=TensorBoardTracker("runs/exp1"))

Only one rank per job logs, so a tracker sees each change once: rank 0 of
replica group 0. The rank is ``rank=`` or env ``RANK`` (torchrun's), the group
``group=`` or env ``REPLICA_GROUP_ID`` (torchft's); unset means 0. On any other
rank a tracker does nothing (and opens no writer). ``all_ranks=True`` logs everywhere.
"""

from __future__ import annotations

import json
import os
from typing import Any

from worker_client.changes import ConfigChange

PREFIX = "config/"  # scalar and metric names: config/lr


def logs_here(rank: int | str | None = None, group: int | str | None = None) -> bool:
    """Whether this process is rank 0 of group 0 (arguments first, then RANK and REPLICA_GROUP_ID)."""
    rank = os.environ.get("RANK", "0") if rank is None else rank
    group = os.environ.get("REPLICA_GROUP_ID", "0") if group is None else group
    return str(rank).strip() in ("", "0") and str(group).strip() in ("", "0")


class _Tracker:
    def __init__(self, rank: int | str | None, group: int | str | None, all_ranks: bool) -> None:
        self.active = all_ranks or logs_here(rank, group)

    def __call__(self, change: ConfigChange) -> None:
        if self.active:
            self.log(change)

    def log(self, change: ConfigChange) -> None:
        raise NotImplementedError


class TensorBoardTracker(_Tracker):
    """Each changed numeric key as a scalar (``config/lr``) and the change as text
    (``config/changes``), at the step it took effect. ``log_dir`` opens a
    ``torch.utils.tensorboard`` SummaryWriter (tensorboardX's without torch);
    ``writer`` reuses yours (anything with ``add_scalar``/``add_text``)."""

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        writer: Any = None,
        rank: int | str | None = None,
        group: int | str | None = None,
        all_ranks: bool = False,
    ) -> None:
        super().__init__(rank, group, all_ranks)
        self.writer = writer
        if self.active and writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from tensorboardX import SummaryWriter  # type: ignore[import-not-found,no-redef]
            self.writer = SummaryWriter(log_dir=None if log_dir is None else str(log_dir))

    def log(self, change: ConfigChange) -> None:
        for key, value in change.numbers().items():
            self.writer.add_scalar(PREFIX + key, value, change.step)
        self.writer.add_text(PREFIX + "changes", change.describe(), change.step)
        self.writer.flush()  # changes are rare: on disk now, not in two minutes

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker(_Tracker):
    """The run's config updated with every key of the new version (``allow_val_change``: a
    changed lr replaces the old), and each changed numeric key logged as ``config/<key>`` at its
    step. ``run`` defaults to ``wandb.run`` (call ``wandb.init`` first). W&B steps only grow:
    ask for a step's config before logging that step's metrics."""

    def __init__(
        self,
        run: Any = None,
        *,
        rank: int | str | None = None,
        group: int | str | None = None,
        all_ranks: bool = False,
    ) -> None:
        super().__init__(rank, group, all_ranks)
        self.run = run
        if self.active and run is None:
            import wandb

            if wandb.run is None:
                raise ValueError("WandbTracker: no W&B run: call wandb.init() first or pass run=")
            self.run = wandb.run

    def log(self, change: ConfigChange) -> None:
        self.run.config.update({k: _value(v) for k, v in change.config.items()}, allow_val_change=True)
        values: dict[str, Any] = {PREFIX + k: v for k, v in change.numbers().items()}
        values[PREFIX + "version"] = change.version
        self.run.log(values, step=change.step)


class MlflowTracker(_Tracker):
    """Each changed numeric key as the metric ``config/<key>`` at its step; the change as the
    tags ``config.version`` and ``config.change`` (the last) and as the text artifact
    ``config_changes/v<version>.txt`` (MLflow params cannot change). ``run_id`` defaults to
    the active run (``mlflow.start_run()`` first); ``client`` to an ``MlflowClient()``."""

    def __init__(
        self,
        run_id: str | None = None,
        *,
        client: Any = None,
        rank: int | str | None = None,
        group: int | str | None = None,
        all_ranks: bool = False,
    ) -> None:
        super().__init__(rank, group, all_ranks)
        self.run_id = run_id
        self.client = client
        if self.active:
            import mlflow

            if run_id is None:
                active = mlflow.active_run()
                if active is None:
                    raise ValueError("MlflowTracker: no MLflow run: call mlflow.start_run() or pass run_id=")
                self.run_id = active.info.run_id
            if client is None:
                self.client = mlflow.MlflowClient()

    def log(self, change: ConfigChange) -> None:
        for key, value in change.numbers().items():
            self.client.log_metric(self.run_id, PREFIX + key, value, step=change.step)
        text = change.describe()
        self.client.set_tag(self.run_id, "config.version", str(change.version))
        self.client.set_tag(self.run_id, "config.change", text[:5000])  # tags hold at most 5,000 chars
        self.client.log_text(self.run_id, text + "\n", f"config_changes/v{change.version}.txt")


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # a plain string is stored as it is
