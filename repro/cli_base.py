"""What every `repro` command shares: one-line refusals and the model and scale choices.

Imports neither torch nor any framework, like every command module: `repro --help` stays instant.
"""
from __future__ import annotations

import sys

import click

from repro import registry

MODELS = tuple(registry.WORKLOADS)
SCALES = ("smoke", "paper")


def fail(message: str, code: int = 2) -> None:
    click.echo(f"repro: {message}", err=True)
    sys.exit(code)


class OneLineErrors(click.Group):
    """Usage errors (a bad option value, a missing argument) in one line, like every other refusal."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as error:
            command = error.ctx.command_path if error.ctx else "repro"
            fail(f"{error.format_message()} (see {command} -h)", error.exit_code)
        except click.ClickException as error:
            fail(error.format_message(), error.exit_code)
        except click.Abort:
            fail("aborted", 130)
