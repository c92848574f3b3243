"""The bulk snapshot reader (ADBC, binary COPY into Arrow) against the text COPY reader, value by value.

Both readers run on the same server and table: every landed value, every key text, every warning and the
resume state after each block must be the same. The text reader is the reference (its own tests pin the
values against the stream); the bulk one must not change a single value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from pg_helpers import Driver, marks
from test_pg_types_roundtrip import DDL, VALUES

from cdcd.config import Config
from cdcd.events import Item, RowBlock
from cdcd.sources.postgres import bulkread

pytestmark = pytest.mark.skipif(not bulkread.available(), reason="adbc-driver-postgresql is not installed")

# Every type of the round-trip table, keyed tables whose key types need the server's text, and the
# values that take the conversions' special paths: ±infinity, NaN, escapes, empty strings, BC dates.
EXTRA = """
CREATE TABLE e (
  id int8 PRIMARY KEY, d date, ts timestamp, tstz timestamptz, f4 float4, f8 float8, n numeric(10,2), nf numeric,
  tx text, by bytea, ch char(3), vc varchar, o oid, dm posint, bc date, tm time
);
INSERT INTO e VALUES
  (1, 'infinity', '-infinity', 'infinity', 'NaN', '-Infinity', 'NaN', 'NaN', E'a\\tb\\nc\\\\d', '\\x5c0a', 'a',
   'x\\N', 7, 3, '0044-03-15 BC', '12:00:00.000001'),
  (2, '2024-02-29', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05.5+05:30', 1.1, 0.1, 1.25, '1e-30', '',
   '\\x', '', '', 0, 1, '0001-01-01', '00:00:00'),
  (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
INSERT INTO e SELECT g, DATE '2000-01-01' + g, TIMESTAMP '2000-01-01' + g * INTERVAL '1 second',
  TIMESTAMPTZ '2000-01-01 00:00:00+00' + g * INTERVAL '1 ms', g / 7.0, g / 3.0, g / 100.0, g / 9.0,
  repeat('ü', g % 50), decode(md5(g::text), 'hex'), 'c', g::text, g, g, DATE '1999-12-31' - g, '23:59:59'
  FROM generate_series(4, 3000) g;
CREATE TABLE kf (id float4 PRIMARY KEY, v int);
INSERT INTO kf VALUES ('NaN', 1), ('-Infinity', 2), (0.1, 3), (1e-30, 4), (3.4e38, 5);
CREATE TABLE kb (id bytea PRIMARY KEY, v int);
INSERT INTO kb SELECT decode(md5(g::text), 'hex'), g FROM generate_series(1, 40) g;
INSERT INTO kb VALUES ('\\x', 0), ('\\x00', -1);
CREATE TABLE kt (a text, b timestamptz, c numeric, v int, PRIMARY KEY (a, b, c));
INSERT INTO kt SELECT chr(65 + g % 5) || E'\\t\\\\', TIMESTAMPTZ 'infinity', g / 3.0, g FROM generate_series(1, 30) g;
INSERT INTO kt VALUES ('z', '-infinity', 'NaN', 0);
CREATE TABLE kn (id numeric(12,3) PRIMARY KEY, j jsonb, v int);
INSERT INTO kn VALUES ('NaN', '{"b": 1, "a": "é"}', 1), (1.5, 'null', 2), (-0.001, '[1, 2.50]', 3),
  (123456789.123, '"x\\ty"', 4), (0, NULL, 5);
"""

TABLES = ["public.t", "public.e", "public.kf", "public.kb", "public.kt", "public.kn"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


async def _read(cfg: Config, bulk: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Item], set[Any], Any]:
    with monkeypatch.context() as m:
        m.setattr(bulkread, "available", lambda: bulk)
        async with Driver(cfg, expand_blocks=False) as d:
            items = await d.take(lambda got: bool(marks(got, "snapshot_done")))
            warned = set(d.source._t.warnings._seen)  # type: ignore[attr-defined]
            states = []
            state: dict[str, Any] = {}
            for item in items:  # the resume state (last key per table) after every block
                state = d.source.fold(state, [item])
                if isinstance(item, RowBlock):
                    states.append(state["snapshot"]["tables"][str(item.table)].get("last_key"))
    return items, warned, states


def _rows(items: list[Item]) -> dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Per table, every row with its key texts (None where the landed value is exact)."""
    out: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for b in items:
        if isinstance(b, RowBlock):
            names = b.schema.column_names
            texts = b.key_text or ()
            for r, row in enumerate(b.data.to_pylist()):
                keys = {str(i): (t[r].as_py() if t is not None else None) for i, t in enumerate(texts)}
                out.setdefault(str(b.table), []).append((row, keys))
            assert b.data.schema.names == list(names)
    return out


@pytest.mark.parametrize("chunk_rows", [7, 50000])
async def test_bulk_reader_lands_exactly_what_the_text_reader_lands(
        make_config: Callable[..., Config], sql: Callable[[str], str], monkeypatch: pytest.MonkeyPatch,
        chunk_rows: int) -> None:
    sql(DDL)
    sql(f"INSERT INTO t VALUES {VALUES}")
    sql(EXTRA)
    cfg = make_config(TABLES, snapshot={"chunk_rows": chunk_rows, "parallelism": 2})
    text_items, text_warned, text_states = await _read(cfg, False, monkeypatch)
    bulk_items, bulk_warned, bulk_states = await _read(cfg, True, monkeypatch)
    text, bulk = _rows(text_items), _rows(bulk_items)
    assert set(text) == set(bulk) == set(TABLES)
    for table in TABLES:
        assert len(text[table]) == len(bulk[table]) == int(sql(f"SELECT count(*) FROM {table}")), table
        for (want, want_keys), (got, got_keys) in zip(text[table], bulk[table], strict=True):
            assert want.keys() == got.keys()
            for name in want:
                assert _same(want[name], got[name]), (table, want.get("id"), name, want[name], got[name])
            assert want_keys == got_keys, (table, want.get("id"))
    # the landed schemas (types and source types) are the same
    schemas = {str(b.table): b.schema for b in text_items if isinstance(b, RowBlock)}
    assert schemas == {str(b.table): b.schema for b in bulk_items if isinstance(b, RowBlock)}
    assert text_warned == bulk_warned and text_warned  # ±infinity, NaN in numeric(10,2), BC date: each warned
    # the resume key after the last block of each table (blocks are cut differently: compare the ends)
    assert text_states[-1] is not None and bulk_states[-1] is not None
    assert _last_keys(text_items, text_states) == _last_keys(bulk_items, bulk_states)


def _last_keys(items: list[Item], states: list[Any]) -> dict[str, Any]:
    blocks = [b for b in items if isinstance(b, RowBlock)]
    return {str(b.table): s for b, s in zip(blocks, states, strict=True)}


@pytest.mark.parametrize("bulk", [True, False])
async def test_both_readers_resume_inside_a_table_from_the_checkpointed_key(
        make_config: Callable[..., Config], sql: Callable[[str], str], monkeypatch: pytest.MonkeyPatch,
        bulk: bool) -> None:
    monkeypatch.setattr(bulkread, "available", lambda: bulk)
    sql(DDL)
    sql(EXTRA)
    cfg = make_config(["public.kf", "public.kb", "public.kt", "public.kn"],
                      snapshot={"chunk_rows": 3, "parallelism": 1})
    order = {t: sql(f"SELECT v FROM {t} ORDER BY {k}").split()
             for t, k in (("public.kf", "id"), ("public.kb", "id"), ("public.kt", "a, b, c"), ("public.kn", "id"))}
    seen: dict[str, list[str]] = {t: [] for t in order}
    position, state = None, None
    for _ in range(100):  # one committed block per run, then a restart resumes after it
        async with Driver(cfg, position, state, expand_blocks=False) as d:
            items = await d.take(lambda got: bool(got) and (isinstance(got[-1], RowBlock)
                                                          or bool(marks(got, "snapshot_done"))))
            blocks = [i for i in items if isinstance(i, RowBlock)]
            if not blocks:
                break
            await d.commit()
            position, state = d.position, d.state
            for b in blocks:
                seen[str(b.table)].extend(str(v) for v in b.data.column("v").to_pylist())
    assert seen == order  # every row exactly once, in key order, across the restarts
