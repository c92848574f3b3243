"""Database sources. ``make_source`` picks the implementation for ``source.kind``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cdcd.config import Config
    from cdcd.runtime.interfaces import Source


def make_source(config: Config) -> Source:
    if config.source.kind == "postgres":
        from cdcd.sources.postgres import PostgresSource

        return PostgresSource(config)
    from cdcd.sources.mysql import MySqlSource

    return MySqlSource(config)
