"""Drive a PostgresSource the way the runtime does, without the runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from source_driver import SourceDriver, opening_truncate

from cdcd.config import Config, parse_config
from cdcd.events import ChangeEvent, Item, Mark
from cdcd.positions import Position, parse_lsn
from cdcd.sources.postgres import PostgresSource
from devtools.servers import PostgresServer


def pg_config(server: PostgresServer, db: str, tables: list[str], **sections: dict[str, Any]) -> Config:
    source: dict[str, Any] = {"kind": "postgres", "host": "127.0.0.1", "port": server.port, "user": "postgres",
                              "database": db, "tables": tables, "sslmode": "disable",
                              "postgres": {"slot": f"s_{db}", "publication": f"p_{db}"}}
    source.update(sections.pop("source", {}))
    # A state directory of the test's own: the stream spools in-progress transactions there.
    sections.setdefault("state", {"path": str(server.root / "states" / db / source["postgres"]["slot"])})
    doc: dict[str, Any] = {"source": source, **sections}
    return parse_config(doc, env={})


class Driver(SourceDriver):
    def __init__(self, config: Config, position: Position | None = None, state: dict[str, Any] | None = None,
                 expand_blocks: bool = True) -> None:
        super().__init__(PostgresSource(config), position, state, expand_blocks)


def marks(items: list[Item], kind: str) -> list[Mark]:
    return [i for i in items if isinstance(i, Mark) and i.kind == kind]


def changes(items: list[Item]) -> list[ChangeEvent]:
    """The change events, without a new snapshot's opening truncates (tests of those look for them)."""
    return [i for i in items if isinstance(i, ChangeEvent) and not opening_truncate(i)]


def apply(state: dict[tuple[Any, ...], dict[str, Any]], events: list[ChangeEvent]) -> None:
    """Apply events (ordered by position) to a key → row mirror, like the Spark merge."""
    for ev in sorted(events, key=lambda e: e.position):
        if ev.op.value == "t":
            state.clear()
        elif ev.op.value == "d":
            state.pop(ev.key_of(ev.before), None)  # type: ignore[arg-type]
        else:
            old = ev.before_key
            # an unavailable value is kept from the row the change took: the old key's for a key change
            prev = state.pop(old, None) if old is not None else state.get(ev.key)  # type: ignore[arg-type]
            row = dict(ev.after or {})
            for name in ev.unavailable:
                row[name] = prev[name] if prev else None
            state[ev.key] = row  # type: ignore[index]


async def wait_for(check: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        await asyncio.sleep(0.05)


def confirmed_flush(server: PostgresServer, slot: str) -> int:
    text = server.psql(f"SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{slot}'")
    return parse_lsn(text)
