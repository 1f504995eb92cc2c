"""``lighthouse`` command: ``serve`` the config, and ``config ...`` to read and change it."""

from __future__ import annotations

import click

from lighthouse.admin.config_commands import config, jobs
from lighthouse.admin.guard_commands import guards
from lighthouse.admin.metric_commands import metrics
from lighthouse.serve_command import serve
from lighthouse.store.migrate import migrate_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Lighthouse: the central service holding a training job's live config.

    Workers never talk to it directly: each replica group's manager fetches the
    config from here and relays it to the group's ranks.
    """


config.add_command(guards)
main.add_command(config)
main.add_command(jobs)
main.add_command(metrics)
main.add_command(serve)
main.add_command(migrate_command)
