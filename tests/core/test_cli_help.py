"""Every command's --help shows the bracketed names its help texts give ([task], [model], ...):
rich markup used to swallow them ("default:  app, else the built-in task of  + .")."""

from __future__ import annotations

import re

import click
import typer
from typer.testing import CliRunner

from shoal.cli import app

BRACKETED = re.compile(r"\[[A-Za-z_][A-Za-z0-9_.]*\]")


def _commands(group: click.Command, path: list[str]):
    yield path, group
    if isinstance(group, click.Group):
        for name, sub in sorted(group.commands.items()):
            yield from _commands(sub, [*path, name])


def _meant(text: str | None) -> list[str]:
    """The bracketed names a help text means to show (an escape for rich is not part of it)."""
    return BRACKETED.findall((text or "").replace("\\[", "["))


def test_every_help_text_shows_its_bracketed_names():
    root = typer.main.get_command(app)
    checked = 0
    for path, command in _commands(root, []):
        texts = [command.help] + [getattr(p, "help", None) for p in command.params]
        wanted = [name for t in texts for name in _meant(t)]
        if not wanted:
            continue
        res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
        assert res.exit_code == 0, res.output
        shown = " ".join(res.output.split())  # rich wraps lines; the names themselves have no spaces
        missing = sorted({w for w in wanted if w not in shown})
        assert not missing, (
            f"`shoal {' '.join(path)} --help` does not show {missing}: wrap the help text in "
            "shoal.cli_help.as_written() (rich markup takes [name] for a style tag)"
        )
        checked += 1
    assert checked >= 5  # server, client, simulate, data split, peer, privacy-sweep name config tables


def test_the_task_option_reads_as_written():
    res = CliRunner().invoke(app, ["server", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert "(default: [task] app, else the built-in task of [model] + [data])" in " ".join(res.output.split())
