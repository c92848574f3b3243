"""Real servers for the tests: one PostgreSQL and one MariaDB per session.

Each test gets a database of its own (``pg_db`` / ``maria_db``) so tests do
not see each other's tables.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from cdcd.devservers import MariaDBServer, PostgresServer

_names = itertools.count(1)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def maria_server() -> Iterator[MariaDBServer]:
    server = MariaDBServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_db(pg_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; its replication slots are dropped after it."""
    name = pg_server.create_database(f"t{next(_names)}")
    yield name
    pg_server.drop_slots(name)


@pytest.fixture
def maria_db(maria_server: MariaDBServer) -> str:
    """A fresh, empty MariaDB database for one test."""
    return maria_server.create_database(f"t{next(_names)}")
