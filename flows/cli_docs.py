"""The CLI reference (docs/reference/cli.md), generated from the typer app in flows/cli.py.

Typer's own Markdown generator (what `typer flows.cli utils docs` prints) over the app: every
command and sub-command, its usage, help, arguments and options with their defaults. The
site's build calls `cli_reference()` (docs/hooks.py), so the page cannot lag behind the app;
tests/test_docs.py checks that it names every command.

    python -m flows.cli_docs      # print the page
"""

from __future__ import annotations

import sys

import typer
from typer.cli import get_docs_for_click

PROG = "campaign"


def cli_reference(app: typer.Typer | None = None) -> str:
    """The page's Markdown: a line on where it comes from, then typer's pages for `campaign` and each command."""
    if app is None:
        from flows.cli import app
    command = typer.main.get_command(app)
    body = get_docs_for_click(obj=command, ctx=typer.Context(command), name=PROG, title="CLI reference")
    title, _, rest = body.strip().partition("\n")
    intro = (f"Every command of `{PROG}`, generated from the typer app in `flows/cli.py` when this site is built "
             f"(`{PROG} COMMAND --help` prints the same). Bad input exits with code 2 before anything starts.")
    return f"{title}\n\n{intro}\n{rest}\n"


if __name__ == "__main__":
    sys.stdout.write(cli_reference())
