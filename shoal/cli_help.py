"""Help texts shown as written.

typer renders ``--help`` with rich, whose markup takes ``[task]`` or ``[model]`` for a style tag
and drops it ("default: [task] app" came out as "default:  app"). Help texts that name config
tables go through :func:`as_written`; tests/core/test_cli_help.py renders every command's
``--help`` and checks that each bracketed name in it is shown.
"""

from __future__ import annotations


def as_written(text: str) -> str:
    """``text`` with every ``[`` escaped for rich markup, so ``[task]`` is shown as ``[task]``."""
    return text.replace("\\[", "[").replace("[", "\\[")
