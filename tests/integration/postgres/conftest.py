from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pg_helpers import pg_config

from cdcd.config import Config
from devtools.servers import PostgresServer


@pytest.fixture
def make_config(pg_server: PostgresServer, pg_db: str) -> Callable[..., Config]:
    def make(tables: list[str], **sections: dict[str, Any]) -> Config:
        return pg_config(pg_server, pg_db, tables, **sections)

    return make


@pytest.fixture
def sql(pg_server: PostgresServer, pg_db: str) -> Callable[[str], str]:
    return lambda text: pg_server.psql(text, pg_db)
