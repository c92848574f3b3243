"""Verify's progress line: the table and its differing buckets read so far, on a TTY only (stderr), so the
report on stdout stays as scripts read it."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any


class Progress:
    def __init__(self) -> None:
        self._live: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if sys.stderr.isatty():  # rich is loaded only to draw
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(TextColumn("verify {task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("differing buckets read"), console=Console(stderr=True),
                                      transient=True)
            self._live.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.stop()

    def update(self, table: str, done: int, total: int) -> None:
        if self._live is None:
            return
        if self._task is None or self._live.tasks[self._task].description != table:
            self._task = self._live.add_task(table, total=total)
        self._live.update(self._task, completed=done, total=total)

    def done(self, table: str, checked: int, differing: int) -> None:
        if self._live is not None:
            self._live.console.print(f"verify {table}: {checked} buckets checked, {differing} differing")
