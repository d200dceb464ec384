"""What the ``reliable`` commands print: tables and progress bars through rich.

Tables go to stdout (plain columns when piped, so ``grep``/``awk`` still
work); progress bars go to stderr and only to a terminal, so piped output is
the command's one summary line and nothing else.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # rich is imported by the commands that print a table or a bar
    from rich.console import Console
    from rich.progress import Progress

PIPED_WIDTH = 10_000
"""Columns a table may take when stdout is not a terminal: never wrapped or cut."""


def stdout() -> Console:
    """The console for a command's result: the terminal's width, or unlimited when piped."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH, highlight=False)


def show_table(records: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> None:
    """``records`` as a table with one column per key, or ``(none)``."""
    from rich import box
    from rich.table import Table

    if not records:
        stdout().print("(none)")
        return
    table = Table(box=box.SIMPLE_HEAD if sys.stdout.isatty() else None, show_edge=False, pad_edge=False)
    for name in columns or list(records[0]):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    for record in records:
        table.add_row(*(_cell(record[name]) for name in columns or list(records[0])))
    stdout().print(table)


def _cell(value: Any) -> str:
    """A table cell: a list of names as ``a, b`` (not Python's ``('a', 'b')``)."""
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(str(v) for v in value)
    return str(value)


@contextmanager
def progress_bar(total: int, label: str) -> Iterator[Progress]:
    """A bar of ``total`` steps on stderr while the block runs (nothing when stderr is no terminal);
    the block calls ``bar.advance(task, n)`` on the one task, ``bar.task_ids[0]``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True, disable=not console.is_terminal)
    with bar:
        bar.add_task(label, total=total)
        yield bar


def listening(option: str, host: str, port: int, serve: Callable[[], int], paths: str) -> None:
    """Start the server ``serve`` starts (it returns the port bound) and say on stderr where it
    listens (``--metrics-port 0`` binds any free port); a port or host it cannot bind is refused
    naming ``option``, not with a traceback."""
    try:
        bound = serve()
    except OSError as exc:
        raise click.BadParameter(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                 "choose another port (0: any free one)", param_hint=f"'{option}'") from exc
    click.echo(f"serving {paths} on http://{host}:{bound}", err=True)
