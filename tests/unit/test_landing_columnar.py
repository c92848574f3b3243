"""The bulk landing path lands exactly what the row-by-row path landed (issue 14).

``reference_group`` and ``reference_events_to_table`` are the grouping and
conversion of the landing sink before it built columns in bulk, kept here
verbatim as the oracle. Generated batches with every landed Arrow type, every
op, NULLs, unavailable values, key changes, interleaved tables, schema
versions and row blocks must give, table by table, the same Arrow table and
the same Parquet bytes, and the same manifest bounds.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from cdcd.errors import SinkFatal
from cdcd.events import ChangeEvent, Column, Item, Mark, MarkKind, Op, RowBlock, TableId, TableSchema
from cdcd.landing.columns import arrow_schema, before_key_type, key_columns
from cdcd.positions import MySqlPosition, PgPosition, Position
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.arrow import block_to_table, events_to_table
from cdcd.sinks.landing import LandingWriter, _group, _parquet_bytes

# --- the oracle: the row-by-row path as it was -------------------------------------------------------------


def _row_of(event: ChangeEvent) -> dict[str, Any]:
    if event.op is Op.TRUNCATE:
        return {}
    if event.op is Op.DELETE:
        return event.before or {}
    return event.after or {}


def reference_events_to_table(schema: TableSchema, batch_seq: int,
                              indexed: Sequence[tuple[int, ChangeEvent]]) -> pa.Table:
    columns: list[pa.Array] = []
    rows = [_row_of(e) for _, e in indexed]
    for col in schema.columns:
        values = [
            None if col.name in e.unavailable else row.get(col.name)
            for (_, e), row in zip(indexed, rows, strict=True)
        ]
        columns.append(pa.array(values, type=col.type))
    events = [e for _, e in indexed]
    columns.append(pa.array([e.op.value for e in events], pa.string()))
    columns.append(pa.array([e.position.encoded for e in events], pa.string()))
    columns.append(pa.array([e.tx_id for e in events], pa.string()))
    columns.append(
        pa.array([e.commit_ts.astimezone(UTC) if e.commit_ts else None for e in events], pa.timestamp("us", tz="UTC"))
    )
    columns.append(pa.array([e.snapshot for e in events], pa.bool_()))
    columns.append(pa.array([sorted(e.unavailable) for e in events], pa.list_(pa.string())))
    columns.append(pa.array([batch_seq] * len(events), pa.int64()))
    columns.append(pa.array([i for i, _ in indexed], pa.int64()))
    columns.append(pa.array([schema.version] * len(events), pa.int64()))
    keys = key_columns(schema)
    before_keys = []
    for e in events:
        old = e.before_key
        before_keys.append(None if old is None else dict(zip(keys, old, strict=True)) if schema.key else None)
    columns.append(pa.array(before_keys, before_key_type(schema)))
    return pa.Table.from_arrays(columns, schema=arrow_schema(schema))


def reference_group(batch: Batch, batch_seq: int) -> list[tuple[TableSchema, pa.Table, set[str]]]:
    """(schema, table, positions) per (table, schema version), in order of first appearance."""
    groups: dict[tuple[TableId, int], tuple[TableSchema, list[Any], set[str]]] = {}
    index = 0
    for item in batch.items:
        if type(item) is ChangeEvent:
            schema, parts, positions = groups.setdefault((item.table, item.schema.version), (item.schema, [], set()))
            if parts and isinstance(parts[-1], list):
                parts[-1].append((index, item))
            else:
                parts.append([(index, item)])
            positions.add(item.position.encoded)
            index += 1
        elif type(item) is RowBlock and item.rows:
            schema, parts, positions = groups.setdefault((item.table, item.schema.version), (item.schema, [], set()))
            parts.append((index, item))
            positions.add(item.position.encoded)
            index += item.rows
    out = []
    for schema, parts, positions in groups.values():
        tables = [reference_events_to_table(schema, batch_seq, p) if isinstance(p, list)
                  else block_to_table(schema, batch_seq, p[0], p[1]) for p in parts]
        out.append((schema, tables[0] if len(tables) == 1 else pa.concat_tables(tables), positions))
    return out


# --- generated workloads ------------------------------------------------------------------------------------

EVERY_TYPE = (
    Column("id", pa.int64(), "bigint", nullable=False),
    Column("i8", pa.int8(), "tinyint"),
    Column("i16", pa.int16(), "smallint"),
    Column("i32", pa.int32(), "integer"),
    Column("f32", pa.float32(), "real"),
    Column("f64", pa.float64(), "double precision"),
    Column("dec", pa.decimal128(12, 2), "numeric(12,2)"),
    Column("ubig", pa.decimal128(20, 0), "bigint unsigned"),
    Column("flag", pa.bool_(), "boolean"),
    Column("txt", pa.string(), "text"),
    Column("bin", pa.binary(), "bytea"),
    Column("day", pa.date32(), "date"),
    Column("tod", pa.time64("us"), "time"),
    Column("ts", pa.timestamp("us"), "timestamp"),
    Column("tstz", pa.timestamp("us", tz="UTC"), "timestamptz"),
    Column("span", pa.duration("us"), "time"),
    Column("tags", pa.list_(pa.string()), "text[]"),
    Column("nums", pa.list_(pa.int32()), "integer[]"),
)
WIDE = TableSchema(TableId("public", "wide"), EVERY_TYPE, ("id",), version=3)
WIDE_V4 = TableSchema(WIDE.table, (*EVERY_TYPE, Column("extra", pa.string(), "text")), ("id",), version=4)
TWO_KEY = TableSchema(TableId("app", "pairs"), (Column("a", pa.int32(), "int"), Column("b", pa.string(), "varchar"),
                                               Column("v", pa.float64(), "double")), ("a", "b"), version=1)
NO_KEY = TableSchema(TableId("app", "log"), (Column("msg", pa.string(), "text"), Column("n", pa.int64(), "bigint")),
                     (), version=1)


def _value(col: Column, rng: random.Random) -> Any:
    if rng.random() < 0.15:
        return None
    t = col.type
    if t == pa.int8():
        return rng.randint(-128, 127)
    if t == pa.int16():
        return rng.randint(-32768, 32767)
    if t in (pa.int32(),):
        return rng.randint(-2**31, 2**31 - 1)
    if t == pa.int64():
        return rng.randint(-2**63, 2**63 - 1)
    if t in (pa.float32(), pa.float64()):
        return rng.choice([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), rng.uniform(-1e9, 1e9)])
    if t == pa.decimal128(12, 2):
        return Decimal(rng.randint(-10**11, 10**11)) / 100
    if t == pa.decimal128(20, 0):
        return Decimal(rng.randint(0, 2**64 - 1))
    if t == pa.bool_():
        return rng.random() < 0.5
    if t == pa.string():
        return rng.choice(["", "plain", "ünïcode ✓", "x" * rng.randint(0, 300), "a\x00b"])
    if t == pa.binary():
        return bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 40)))
    if t == pa.date32():
        return date(1, 1, 1) + timedelta(days=rng.randint(0, 3_000_000))
    if t == pa.time64("us"):
        return time(rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59), rng.randint(0, 999_999))
    if t == pa.timestamp("us"):
        return datetime(1970, 1, 1) + timedelta(microseconds=rng.randint(-10**16, 10**16))
    if t == pa.timestamp("us", tz="UTC"):
        zone = timezone(timedelta(minutes=rng.choice([0, 60, -330, 545])))
        instant = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randint(-10**16, 10**16))
        return instant.astimezone(zone)
    if t == pa.duration("us"):
        return timedelta(microseconds=rng.randint(-10**12, 10**12))
    if t == pa.list_(pa.string()):
        return [rng.choice(["a", "", None, "ß"]) for _ in range(rng.randint(0, 4))]
    if t == pa.list_(pa.int32()):
        return [rng.choice([1, -7, None]) for _ in range(rng.randint(0, 4))]
    raise AssertionError(f"no generator for {t}")


def _row(schema: TableSchema, rng: random.Random, key: int) -> dict[str, Any]:
    row = {c.name: _value(c, rng) for c in schema.columns}
    if schema.key:
        row[schema.key[0]] = key if schema.column(schema.key[0]).type != pa.string() else str(key)
        for k in schema.key[1:]:
            row[k] = row[k] if row[k] is not None else ("k" if schema.column(k).type == pa.string() else 0)
    return row


def _position(kind: str, tx: int, seq: int) -> Position:
    return PgPosition(tx * 1000, seq) if kind == "pg" else MySqlPosition.at("mysql-bin.000003", tx * 1000, seq)


def generate_batch(seed: int, kind: str, seq: int = 5) -> Batch:
    rng = random.Random(seed)
    schemas = [WIDE, WIDE_V4, TWO_KEY, NO_KEY]
    items: list[Item] = []
    schema = WIDE
    commit_zone = timezone(timedelta(hours=rng.choice([-8, 0, 2])))
    for tx in range(1, rng.randint(2, 12)):
        commit_ts = None if rng.random() < 0.1 else datetime(2026, 11, 23, 12, 0, tx, tzinfo=commit_zone)
        tx_id = None if kind == "my" and rng.random() < 0.3 else str(tx)
        snapshot = rng.random() < 0.1
        for n in range(1, rng.randint(1, 40)):
            if rng.random() < 0.3:
                schema = rng.choice(schemas)
            if rng.random() < 0.05:  # an equal schema in another object (the group is the same)
                schema = dataclasses.replace(schema)
            pos = _position(kind, tx, 0 if snapshot else n)
            op = rng.choice([Op.CREATE, Op.CREATE, Op.UPDATE, Op.DELETE, Op.READ, Op.TRUNCATE])
            key = rng.randint(1, 50)
            before = after = None
            unavailable: tuple[str, ...] = ()
            if op in (Op.CREATE, Op.READ):
                after = _row(schema, rng, key)
            elif op is Op.UPDATE:
                after = _row(schema, rng, key)
                before = _row(schema, rng, rng.choice([key, key + 1])) if rng.random() < 0.7 else None
                if rng.random() < 0.3:  # unchanged TOAST: the source did not send these
                    others = [c.name for c in schema.columns if c.name not in schema.key]
                    unavailable = tuple(rng.sample(others, min(2, len(others))))
                    for name in unavailable:  # a source may leave a stale value there: it must not land
                        after[name] = after[name] if rng.random() < 0.5 else None
            elif op is Op.DELETE:
                before = (_row(schema, rng, key) if rng.random() < 0.5
                          else {k: _row(schema, rng, key)[k] for k in schema.key} or _row(schema, rng, key))
            items.append(ChangeEvent(op, schema, pos, before=before, after=after, tx_id=tx_id, commit_ts=commit_ts,
                                     snapshot=snapshot, unavailable=unavailable))
            if rng.random() < 0.05:
                items.append(Mark(MarkKind.HEARTBEAT, pos))
            if rng.random() < 0.04:  # a bulk snapshot chunk between the events
                rows = [_row(WIDE, rng, k) for k in range(rng.randint(0, 6))]
                data = pa.Table.from_pylist(rows, schema=pa.schema([pa.field(c.name, c.type) for c in WIDE.columns]))
                items.append(RowBlock(WIDE, pos, data, commit_ts=commit_ts, tx_id=tx_id))
        items.append(Mark(MarkKind.COMMIT, _position(kind, tx, 10_000)))
    return Batch(seq, items)


# --- the comparison -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pg", "my"])
@pytest.mark.parametrize("seed", range(40))
def test_bulk_path_lands_what_the_row_path_landed(seed: int, kind: str) -> None:
    batch = generate_batch(seed, kind)
    expected = reference_group(batch, batch.seq)
    got = _group(batch)
    assert [g.schema for g in got] == [s for s, _, _ in expected]
    for group, (schema, table, positions) in zip(got, expected, strict=True):
        new = group.to_table(batch.seq)
        assert new.schema == table.schema, schema.table
        # Parquet bytes, not Table.equals: NaN never equals itself, and the file is what consumers read
        differ = [name for name in table.column_names
                  if _parquet_bytes(new.select([name])) != _parquet_bytes(table.select([name]))]
        assert not differ, f"{schema.table} v{schema.version}: columns {differ} differ"
        assert _parquet_bytes(new) == _parquet_bytes(table)
        assert group.rows == table.num_rows
        landed = new["_cdc_pos"].to_pylist()
        assert (min(landed), max(landed)) == (min(positions), max(positions))


def test_generated_batches_cover_what_the_comparison_claims() -> None:
    """The workloads above hold every op, unavailable values, changed keys, blocks and interleaved tables."""
    items = [i for seed in range(40) for kind in ("pg", "my") for i in generate_batch(seed, kind).items]
    events = [i for i in items if type(i) is ChangeEvent]
    assert {e.op for e in events} == set(Op)
    assert any(e.unavailable for e in events)
    assert any(e.before_key is not None for e in events)
    assert any(type(i) is RowBlock and i.rows for i in items)
    assert {e.schema.version for e in events} == {1, 3, 4}
    switches = sum(a.schema is not b.schema for a, b in itertools.pairwise(events))
    assert switches > 100


def test_landed_files_and_manifest_match_the_row_path(tmp_path: Path) -> None:
    batch = generate_batch(7, "pg", seq=9)
    writer = LandingWriter(tmp_path, "run")
    writer.prepare()
    manifest = writer.land(batch)
    expected = reference_group(batch, batch.seq)
    blobs = [(tmp_path / f.path).read_bytes() for f in manifest.files]
    assert blobs == [_parquet_bytes(t) for _, t, _ in expected]
    every = set().union(*(p for _, _, p in expected))
    assert (manifest.first_position, manifest.last_position) == (min(every), max(every))
    for f, (_, _, positions) in zip(manifest.files, expected, strict=True):
        assert (f.first_position, f.last_position) == (min(positions), max(positions))


def test_a_value_that_does_not_fit_names_its_column() -> None:
    bad = ChangeEvent(Op.CREATE, TWO_KEY, PgPosition(1, 1), after={"a": 1, "b": "x", "v": "not a number"})
    with pytest.raises(SinkFatal, match=r"column 'v' \(double\): values do not fit Arrow type double"):
        events_to_table(TWO_KEY, 1, [bad], [0])
