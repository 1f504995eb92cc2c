"""``lighthouse`` command: ``serve`` the config, and ``config ...`` to read and change it."""

from __future__ import annotations

import importlib

import click

from lighthouse.admin.config_commands import config, jobs, runs
from lighthouse.admin.guard_commands import guards
from lighthouse.admin.metric_commands import metrics


class _Commands(click.Group):
    """The admin commands are loaded with the group; the server side's (``serve``, ``migrate``)
    modules only once one of them is named, so an operator's ``lighthouse config ...`` loads no
    store, job logic or HTTP server."""

    LAZY = {"serve": "lighthouse.serve.command:serve", "migrate": "lighthouse.store.migrate:migrate_command"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.LAZY])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.LAZY:
            return super().get_command(ctx, cmd_name)
        module, name = self.LAZY[cmd_name].split(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Lighthouse: the central service holding a training job's live config.

    Workers never talk to it directly: each replica group's manager fetches the
    config from here and relays it to the group's ranks.
    """


config.add_command(guards)
main.add_command(config)
main.add_command(jobs)
main.add_command(runs)
main.add_command(metrics)
