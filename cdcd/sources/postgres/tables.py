"""The captured tables as the PostgreSQL source knows them (``PgTables``): catalog facts, Arrow shapes, the type
registry and the catalog connection, shared by the planner, the snapshot and the stream; the stream's Relation
messages become row decoders here, with a new schema version when a table's columns changed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import structlog

from cdcd.errors import SourceError, SourceFatal
from cdcd.events import TableId
from cdcd.sources.postgres import catalog
from cdcd.sources.postgres.catalog import TableInfo
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.shape import (
    RowDecoder,
    TableShape,
    Warnings,
    same_columns,
    shape_from_info,
    shape_from_relation,
    warn_unknown,
)
from cdcd.sources.postgres.types import TypeRegistry
from cdcd.sources.postgres.wire import pgoutput

log = structlog.get_logger("cdcd.source.postgres")


@dataclass
class PgTables:
    """The captured tables as the source knows them: shared by the planner, the snapshot and the stream."""

    params: ConnectParams
    tables: list[TableId]
    registry: TypeRegistry = field(default_factory=TypeRegistry)
    warnings: Warnings = field(default_factory=Warnings)
    infos: dict[TableId, TableInfo] = field(default_factory=dict)
    shapes: dict[TableId, TableShape] = field(default_factory=dict)
    sql: Any = None  # the catalog connection (asyncpg)

    async def load(self, absent_ok: frozenset[TableId] = frozenset()) -> list[TableId]:
        """Catalog facts, types and shapes of every table (``sql`` must be open). A table of ``absent_ok`` (one the
        checkpoint captured) may be gone: returned, not loaded, for the caller to flag; any other is an error."""
        absent: list[TableId] = []
        for t in self.tables:
            try:
                self.infos[t] = await catalog.table_info(self.sql, t)
            except SourceFatal:
                if t not in absent_ok:
                    raise
                absent.append(t)
                self.infos.pop(t, None)  # what an earlier connect of this process loaded is gone now
                self.shapes.pop(t, None)
        oids = {c.type_oid for info in self.infos.values() for c in info.columns}
        await catalog.load_types(self.sql, self.registry, oids)
        for t, info in self.infos.items():
            self.shapes[t] = shape_from_info(info, self.registry)
            warn_unknown(self.shapes[t], self.warnings)
        return absent

    def oids(self) -> dict[str, int]:
        """Each loaded table's relation OID, as the checkpoint keeps them (``state.py``, ``"oids"``)."""
        return {str(t): info.oid for t, info in self.infos.items() if t in self.tables}

    async def ensure_sql(self) -> Any:
        if self.sql is None or self.sql.is_closed():
            self.sql = await catalog.connect_sql(self.params)
        return self.sql


    async def decoder(self, rel: pgoutput.Relation) -> RowDecoder:
        """The decoder of a captured table's rows from its Relation message: its shape, a new schema version when
        its columns changed (key and dimensions then read again from the catalog)."""
        table = TableId(rel.namespace, rel.name)
        oids = {c.type_oid for c in rel.columns}
        if self.registry.missing(oids):
            await catalog.load_types(await self.ensure_sql(), self.registry, oids)
        old = self.shapes.get(table)
        info = self.infos.get(table)
        shape = shape_from_relation(rel, info, self.registry, old.schema.version if old else 0)
        if old is not None and not same_columns(old.schema, shape.schema):
            # The schema changed: refresh key and dimensions from the catalog, bump the version.
            with contextlib.suppress(SourceError, OSError):
                self.infos[table] = info = await catalog.table_info(await self.ensure_sql(), table)
            shape = shape_from_relation(rel, info, self.registry, old.schema.version + 1)
            log.info("table schema changed", table=str(table), version=shape.schema.version,
                     columns=list(shape.schema.column_names))
        self.shapes[table] = shape
        warn_unknown(shape, self.warnings)
        return RowDecoder(shape, self.warnings)


def replaced_why(publication: str, old: int, new: int | None) -> str:
    """Why a captured table whose relation OID was ``old`` needs a re-snapshot (``new``: its OID now, None: gone).
    The heartbeat's check and the check at connect (``source.py``) say the same."""
    if new is None:
        return f"it was dropped (relation OID {old} is gone), so publication {publication!r} no longer covers it"
    return (f"it was dropped and re-created (relation OID {old} is now {new}), so publication {publication!r} no "
            "longer covers it")
