"""The captured tables as the PostgreSQL source knows them (``PgTables``): catalog facts, Arrow shapes, the type
registry and the catalog connection, shared by the planner, the snapshot and the stream; the stream's Relation
messages become row decoders here, with a new schema version when a table's columns changed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from cdcd.capture.incremental import Incremental
from cdcd.errors import SourceError, SourceFatal, reason
from cdcd.events import Fill, TableId, TableSchema
from cdcd.sources.postgres import catalog, columns
from cdcd.sources.postgres.catalog import TableInfo
from cdcd.sources.postgres.connection import ConnectParams
from cdcd.sources.postgres.shape import (
    RowDecoder,
    TableShape,
    Warnings,
    known_columns,
    same_columns,
    shape_from_info,
    shape_from_relation,
    warn_unknown,
)
from cdcd.sources.postgres.types import TypeRegistry, Unrepresentable
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
    #: Queues an incremental re-snapshot of a table (the source's ``cdcd snapshot``): called with the table and why
    #: when the stream alone cannot make its mirror right (a schema change the catalog cannot tell, a rewrite).
    resnapshot: Callable[[TableId, str], None] | None = None
    #: Each table's columns as the checkpoint's batches landed them (``state.py``, ``"columns"``), set at connect
    #: and taken by the table's first Relation message.
    landed: dict[TableId, tuple[columns.Known, ...]] = field(default_factory=dict)
    #: The commit LSN of the checkpoint's position at connect: transactions committed before are sent again by the
    #: slot and skipped (their Relation messages update the shapes but call for no repair).
    replayed_below: int = 0
    #: Each table's largest column id the source ever saw (the checkpoint keeps it, ``state.py``): a dropped column
    #: above it is one the source never knew, which a Relation's new column may be (``columns.resolve``).
    tops: dict[TableId, int] = field(default_factory=dict)
    #: The new schemas of the tables whose Relation message changed them (not those of replayed transactions), in
    #: order: the stream takes them after each Relation and marks each as a schema change (``stream.py``).
    changes: list[TableSchema] = field(default_factory=list)

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
            self.tops.setdefault(t, max((c.attnum or 0 for c in info.columns), default=0))
            warn_unknown(self.shapes[t], self.warnings)
        return absent

    def oids(self) -> dict[str, int]:
        """Each loaded table's relation OID, as the checkpoint keeps them (``state.py``, ``"oids"``)."""
        return {str(t): info.oid for t, info in self.infos.items() if t in self.tables}

    async def ensure_sql(self) -> Any:
        if self.sql is None or self.sql.is_closed():
            self.sql = await catalog.connect_sql(self.params)
        return self.sql

    def drop_sql(self) -> None:
        """Drop the catalog connection: after the replication connection was lost it may be dead on the same path
        (a blackholed network answers nothing; its queries would wait out the read timeout). The next catalog
        read opens a new one."""
        if self.sql is not None and not self.sql.is_closed():
            self.sql.terminate()
        self.sql = None


    async def decoder(self, rel: pgoutput.Relation, commit_lsn: int | None = None) -> RowDecoder:
        """The decoder of a captured table's rows from its Relation message: its shape, a new schema version when
        its columns changed (key and dimensions then read again from the catalog). Every Relation is matched with
        the catalog's attributes (``columns.py``): a column dropped and added again under its name and type
        changes nothing else in the message."""
        table = TableId(rel.namespace, rel.name)
        oids = {c.type_oid for c in rel.columns}
        if self.registry.missing(oids):
            await catalog.load_types(await self.ensure_sql(), self.registry, oids)
        old = self.shapes.get(table)
        info = self.infos.get(table)
        attrs = await columns.read_attributes(await self.ensure_sql(), rel.oid)
        # The first Relation since a connect is matched with what the checkpoint's batches landed (the shape
        # read from the catalog at connect may already hold changes made since, which nothing landed yet). A
        # Relation of a transaction the checkpoint holds already (the slot sends it again after a start) is no
        # news: its rows are skipped, so it calls for no repair and leaves the landed columns for the next one.
        replayed = commit_lsn is not None and commit_lsn < self.replayed_below
        landed = None if replayed else self.landed.pop(table, None)
        before = landed if landed is not None else known_columns(old.schema) if old else ()
        named = [(c.name, c.source_type) for c in shape_from_relation(rel, info, self.registry, 0).schema.columns]
        top = self.tops.get(table, 0)
        res = columns.resolve(named, attrs, before, top)
        self.tops[table] = max([top, *(n for n in res.ids if n is not None)])
        ids = res.ids
        if not attrs:  # the table is gone (the heartbeat's check flags it): the names the source knew keep their ids
            by_name = {name: num for name, num, _ in before}
            ids = tuple(by_name.get(c.name) for c in rel.columns)
        shape = shape_from_relation(rel, info, self.registry, old.schema.version if old else 0, ids)
        if old is not None and (not same_columns(old.schema, shape.schema)
                                or (landed is not None and known_columns(shape.schema) != landed)):
            # The schema changed: refresh key and dimensions from the catalog, bump the version.
            try:
                self.infos[table] = info = await catalog.table_info(await self.ensure_sql(), table)
            except (SourceError, OSError) as exc:  # the stream goes on: the Relation holds every column
                log.warning("reading the changed table's key from the catalog failed: its previous key is kept",
                            table=str(table), error=reason(exc),
                            fix="if the key changed, run `cdcd snapshot TABLE` once the source answers again")
            shape = shape_from_relation(rel, info, self.registry, old.schema.version + 1, ids)
            fills, rewritten = self._fills(shape, res, attrs)
            if any(f is not None for f in fills):
                shape = shape_from_relation(rel, info, self.registry, shape.schema.version, ids, fills)
            log.info("table schema changed", table=str(table), version=shape.schema.version,
                     columns=list(shape.schema.column_names), ids=list(ids))
            if not replayed:
                self.changes.append(shape.schema)
            if attrs and not replayed:
                self._repair(table, res.doubts, rewritten)
        self.shapes[table] = shape
        warn_unknown(shape, self.warnings)
        return RowDecoder(shape, self.warnings)

    def _fills(self, shape: TableShape, res: columns.Resolution,
               attrs: tuple[columns.Attribute, ...]) -> tuple[list[Fill | None], list[str]]:
        """The fills of the columns new in ``shape`` (their constant default, decoded as pgoutput's text is), and
        the names of those whose ADD COLUMN rewrote the table (a volatile default or an identity)."""
        by_num = {a.attnum: a for a in attrs}
        fills: list[Fill | None] = []
        rewritten: list[str] = []
        for col, t, n, new in zip(shape.schema.columns, shape.types, res.ids, res.new, strict=True):
            a = by_num.get(n) if n is not None and new else None
            fill = None
            if a is not None and a.missing is not None:
                try:
                    fill = Fill(t.from_text(a.missing))
                except (Unrepresentable, ValueError) as exc:
                    self.warnings.once(shape.table, col.name, "the added column's default cannot be represented: "
                                       "the rows existing before land NULL in it", error=str(exc))
            elif a is not None and a.has_default:
                rewritten.append(col.name)
            fills.append(fill)
        return fills, rewritten

    def _repair(self, table: TableId, doubts: tuple[str, ...], rewritten: list[str]) -> None:
        """The stream cannot tell the mirror the truth (the catalog cannot tell which column is which, or an ADD
        COLUMN rewrote the table, which logical decoding does not send): re-snapshot the table."""
        rewrites = [f"column {n!r} was added with a volatile default or an identity: PostgreSQL rewrote the table "
                    "and logical decoding sends none of its rows" for n in rewritten]
        why = "; ".join([*doubts, *rewrites])
        if not why:
            return
        info = self.infos.get(table)
        if self.resnapshot is None or info is None or not info.key:
            log.error(f"{table}: {why}; the mirror's values of these columns may be wrong and cdcd cannot re-snapshot "
                      f"the table by itself{'' if info is None or info.key else ' (it has no key)'}. Fix: `cdcd "
                      f"snapshot -c CONFIG {table}` (tables without a key: restart with an empty state.path)",
                      table=str(table))
            return
        log.warning(f"{table}: {why}; re-snapshotting the table (an incremental snapshot) so the mirror holds the "
                    "source's values", table=str(table))
        self.resnapshot(table, why)


def replaced_why(publication: str, old: int, new: int | None) -> str:
    """Why a captured table whose relation OID was ``old`` needs a re-snapshot (``new``: its OID now, None: gone).
    The heartbeat's check and the check at connect (``source.py``) say the same."""
    if new is None:
        return f"it was dropped (relation OID {old} is gone), so publication {publication!r} no longer covers it"
    return (f"it was dropped and re-created (relation OID {old} is now {new}), so publication {publication!r} no "
            "longer covers it")


def check_oids(t: PgTables, recorded: dict[str, int], publication: str, incr: Incremental) -> dict[str, int]:
    """A captured table dropped or re-created while cdcd was stopped (or before its flag was committed): its
    relation OID in the checkpoint (``recorded``) differs from the catalog's, or it is gone. Flag it as the
    heartbeat's check does (``PgStream._check_replaced``); the stream goes on for the others. Returns the OIDs to
    keep: a flagged table keeps its old one until its re-snapshot publishes the new table (``_republish``), so a
    restart before the flag is committed flags it again. A checkpoint without OIDs (written before they were kept)
    takes the catalog's: nothing to compare with, no flag."""
    oids: dict[str, int] = {}
    for table in t.tables:
        name = str(table)
        old = recorded.get(name)
        info = t.infos.get(table)
        now = info.oid if info is not None else None
        if old is not None and old != now:
            why = replaced_why(publication, old, now)
            if now is None:  # gone: an incremental snapshot of it the checkpoint resumes has nothing to read
                incr.cancel({table}, why)
            incr.mark_stale(table, why)
        if old is not None and (now is None or table in incr.stale):
            oids[name] = old
        elif now is not None:
            oids[name] = now
    return oids
