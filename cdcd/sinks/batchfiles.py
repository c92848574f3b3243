"""A batch as landed files: its rows grouped per (table, schema version), converted to Arrow and Parquet, and the
manifest records of its marks. Shared by the file-system writer (landing.py) and the object-store one
(objlanding.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdcd.errors import SinkFatal
from cdcd.events import ChangeBlock, ChangeEvent, Mark, MarkKind, RowBlock, TableId, TableSchema, is_schema_change
from cdcd.landing.columns import CDC_POS
from cdcd.landing.manifest import CoveredRecord, PositionLostRecord, SchemaChangeRecord
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.arrow import block_to_table, change_blocks_to_table, events_to_table


@dataclass(slots=True)
class _Run:
    """Events of one group in batch order (other tables' events may sit between them), with their indexes."""

    events: list[ChangeEvent] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Group:
    """The rows of one (table, schema version) in a batch, in batch order: runs of events, row and change blocks."""

    schema: TableSchema
    parts: list[_Run | tuple[int, RowBlock | ChangeBlock]] = field(default_factory=list)
    rows: int = 0

    def run(self) -> _Run:
        """The run that takes the group's next events (a new one after a block)."""
        last = self.parts[-1] if self.parts else None
        if type(last) is _Run:
            return last
        run = _Run()
        self.parts.append(run)
        return run

    def to_table(self, batch_seq: int) -> pa.Table:
        tables: list[pa.Table] = []
        blocks: list[tuple[int, ChangeBlock]] = []  # consecutive ChangeBlocks: converted together
        for p in self.parts:
            if type(p) is tuple and type(p[1]) is ChangeBlock:
                blocks.append(p)  # type: ignore[arg-type]
                continue
            if blocks:
                tables.append(change_blocks_to_table(self.schema, batch_seq, blocks))
                blocks = []
            tables.append(events_to_table(self.schema, batch_seq, p.events, p.indexes) if isinstance(p, _Run)
                          else block_to_table(self.schema, batch_seq, p[0], p[1]))
        if blocks:
            tables.append(change_blocks_to_table(self.schema, batch_seq, blocks))
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _group(batch: Batch) -> list[_Group]:
    """Rows per (table, schema version), in order of first appearance.

    ``_cdc_index`` counts rows across the batch: a block of n rows takes n
    consecutive indexes, exactly as n events would. Per event this costs an
    identity check of its schema against the previous event's (a stream
    lands long runs of one table); only a change of schema object looks the
    group up.
    """
    groups: dict[tuple[TableId, int], _Group] = {}
    by_schema: dict[int, _Group] = {}  # id() of a schema object the batch holds -> its group
    index = 0
    last_schema: TableSchema | None = None
    events: list[ChangeEvent] = []
    indexes: list[int] = []

    def group_of(schema: TableSchema) -> _Group:
        group = by_schema.get(id(schema))
        if group is None:
            group = groups.setdefault((schema.table, schema.version), _Group(schema))
            by_schema[id(schema)] = group
        return group

    for item in batch.items:
        if type(item) is ChangeEvent:
            schema = item.schema
            if schema is not last_schema:
                run = group_of(schema).run()
                events, indexes, last_schema = run.events, run.indexes, schema
            events.append(item)
            indexes.append(index)
            index += 1
        elif (type(item) is RowBlock or type(item) is ChangeBlock) and item.rows:
            group = group_of(item.schema)
            group.parts.append((index, item))
            group.rows += item.rows
            index += item.rows
            last_schema = None  # the group's next events start a new run
    for group in groups.values():
        group.rows += sum(len(p.events) for p in group.parts if isinstance(p, _Run))
    return list(groups.values())


def _positions(table: pa.Table) -> set[str]:
    """The lowest and highest ``_cdc_pos`` of a landed table (all the manifest records of them)."""
    bounds = pc.min_max(table.column(CDC_POS))
    return {bounds["min"].as_py(), bounds["max"].as_py()}


def covered(batch: Batch) -> list[CoveredRecord]:
    """The manifest records of the batch's SNAPSHOT_COVERED marks, in batch order.

    The mark's ``detail`` holds ``table`` (a ``TableId`` or its ``schema.table`` text) and
    ``below`` (the position of the re-snapshot's first low watermark).
    """
    out = []
    for item in batch.items:
        if type(item) is Mark and item.kind is MarkKind.SNAPSHOT_COVERED:
            table, below = item.detail.get("table"), item.detail.get("below")
            try:
                tid = table if isinstance(table, TableId) else TableId.parse(str(table))
                encoded = below if isinstance(below, str) else below.encoded  # type: ignore[union-attr]
            except (ValueError, AttributeError) as exc:
                raise SinkFatal(
                    f"batch {batch.seq}: a {item.kind} mark at {item.position.encoded} needs detail 'table' "
                    f"(schema.table) and 'below' (a position), got {item.detail!r}: {exc}"
                ) from exc
            out.append(CoveredRecord(tid.schema, tid.name, encoded, item.detail.get("range")))
    return out


def position_lost(batch: Batch) -> list[PositionLostRecord]:
    """The manifest records of the batch's POSITION_LOST marks (``detail``: ``lost``, ``from``, ``to``, the positions
    encoded), in batch order."""
    out = []
    for item in batch.items:
        if type(item) is Mark and item.kind is MarkKind.POSITION_LOST:
            detail = item.detail
            if not isinstance(detail.get("lost"), str) or not isinstance(detail.get("to"), str):
                raise SinkFatal(f"batch {batch.seq}: a {item.kind} mark at {item.position.encoded} needs detail 'lost' "
                                f"and 'to' (text), got {detail!r}; this is a bug of the source: report it")
            out.append(PositionLostRecord(detail["lost"], detail.get("from"), detail["to"]))
    return out


def schema_changes(batch: Batch) -> list[SchemaChangeRecord]:
    """The manifest records of the batch's schema-change marks (``MarkKind.SCHEMA`` with ``detail["change"]``, the
    table's new ``TableSchema``, and ``detail["ddl"]``, the statement where the source has one), in batch order."""
    out = []
    for item in batch.items:
        if type(item) is Mark and is_schema_change(item):
            new, ddl = item.detail["change"], item.detail.get("ddl")
            if not isinstance(new, TableSchema) or not (ddl is None or isinstance(ddl, str)):
                raise SinkFatal(
                    f"batch {batch.seq}: a {item.kind} mark at {item.position.encoded} needs detail 'change' (the "
                    f"table's new schema) and 'ddl' (the statement or None), got {item.detail!r}; this is a bug of "
                    "the source: report it"
                )
            out.append(SchemaChangeRecord.of(new, item.position.encoded, ddl))
    return out


#: The dictionary page limit of landed files: a column whose dictionary outgrows it (a key, ``_cdc_pos``,
#: free text) falls back to plain encoding after 64 KB instead of 1 MB of dictionary built and dropped,
#: while low-cardinality columns (``_cdc_op``, status codes) keep their dictionary. On a 50,000-row
#: narrow batch: 19.5 -> 10.7 ms to encode, 2.35 -> 1.96 MB (docs/benchmarks-history.md, "Snapshots").
DICTIONARY_PAGE_LIMIT = 64 << 10


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy", dictionary_pagesize_limit=DICTIONARY_PAGE_LIMIT)
    return bytes(sink.getvalue().to_pybytes())
