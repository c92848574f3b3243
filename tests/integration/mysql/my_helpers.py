"""Drive a MySqlSource the way the runtime does, without the runtime."""

from __future__ import annotations

import itertools
from typing import Any

import pymysql
from source_driver import SourceDriver, opening_truncate

from cdcd.config import Config, parse_config
from cdcd.events import ChangeEvent, Item
from cdcd.positions import Position
from cdcd.sources.mysql import MySqlSource
from devtools.servers import MariaDBServer

_server_ids = itertools.count(6001)


def my_config(server: MariaDBServer, db: str, tables: list[str], **sections: dict[str, Any]) -> Config:
    source: dict[str, Any] = {"kind": "mariadb", "host": "127.0.0.1", "port": server.port, "user": "cdc",
                              "password": "secret", "database": db, "sslmode": "disable",
                              "tables": [t if "." in t else f"{db}.{t}" for t in tables],
                              "mysql": {"server_id": next(_server_ids)}}
    source.update(sections.pop("source", {}))
    return parse_config({"source": source, **sections}, env={})


def execute(server: MariaDBServer, db: str, *statements: str, autocommit: bool = True) -> list[Any]:
    """Run statements as root over TCP in utf8mb4; returns the last statement's rows."""
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root", password="", database=db,
                           charset="utf8mb4", autocommit=autocommit)
    try:
        with conn.cursor() as cur:
            rows: list[Any] = []
            for s in statements:
                cur.execute(s)
                rows = list(cur.fetchall())
        if not autocommit:
            conn.commit()
        return rows
    finally:
        conn.close()


class Driver(SourceDriver):
    def __init__(self, config: Config, position: Position | None = None, state: dict[str, Any] | None = None) -> None:
        super().__init__(MySqlSource(config), position, state)


def events_of(items: list[Item]) -> list[ChangeEvent]:
    """The change events, without a new snapshot's opening truncates (tests of those look for them)."""
    return [i for i in items if isinstance(i, ChangeEvent) and not opening_truncate(i)]


def apply(rows: dict[Any, dict[str, Any]], events: list[ChangeEvent]) -> dict[Any, dict[str, Any]]:
    """Merge events into a key → row mirror, like the Spark consumer."""
    for e in events:
        if e.op.value in ("c", "u", "r"):
            if e.before_key is not None:
                rows.pop(e.before_key, None)
            assert e.after is not None
            rows[e.key] = dict(e.after)
        elif e.op.value == "d":
            rows.pop(e.key, None)
        elif e.op.value == "t":
            rows.clear()
    return rows
