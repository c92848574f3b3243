from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from my_helpers import execute, my_config

from cdcd.config import Config
from devtools.servers import MariaDBServer


@pytest.fixture
def make_config(maria_server: MariaDBServer, maria_db: str) -> Callable[..., Config]:
    def make(tables: list[str], **sections: dict[str, Any]) -> Config:
        return my_config(maria_server, maria_db, tables, **sections)

    return make


@pytest.fixture
def sql(maria_server: MariaDBServer, maria_db: str) -> Callable[..., list[Any]]:
    return lambda *statements: execute(maria_server, maria_db, *statements)
