"""The SQL both snapshots share: the initial one (``snapshot.py``) and the incremental chunks (``chunks.py``).

A table's schema and primary key from information_schema, the select list, the keyset clause that resumes
after the last key (each key column compared in the order ``ORDER BY`` sorts it), and the binlog positions
the servers report (``SHOW MASTER STATUS`` / ``SHOW BINARY LOG STATUS``, MariaDB's ``binlog_snapshot_%``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiomysql

from cdcd.errors import SourceFatal
from cdcd.events import Column, TableId, TableSchema
from cdcd.positions import MySqlPosition
from cdcd.sources.mysql.types import (
    UNKNOWN_TYPE,
    arrow_type,
    is_float4,
    is_known_type,
    key_order_expr,
    key_order_value,
    normalize_source_type,
    to_query_param,
    warn_once,
)


@dataclass
class Watermark:
    file: str
    pos: int
    gtid: str = ""

    def position(self) -> MySqlPosition:
        return MySqlPosition.at(self.file, self.pos, 0, self.gtid)


TABLE_EXISTS_SQL = "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s"
#: A table's primary key columns in key order, with their types. KEY_COLUMN_USAGE, not TABLE_CONSTRAINTS: that one
#: shows MariaDB's least-privileged cdc user (SELECT, no table-level grants) nothing.
PRIMARY_KEY_SQL = (
    "SELECT k.COLUMN_NAME, c.DATA_TYPE FROM information_schema.KEY_COLUMN_USAGE k JOIN information_schema.COLUMNS c "
    "ON c.TABLE_SCHEMA = k.TABLE_SCHEMA AND c.TABLE_NAME = k.TABLE_NAME AND c.COLUMN_NAME = k.COLUMN_NAME "
    "WHERE k.TABLE_SCHEMA = %s AND k.TABLE_NAME = %s AND k.CONSTRAINT_NAME = 'PRIMARY' ORDER BY k.ORDINAL_POSITION")


def quote_ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def parse_binlog_status(row: dict[str, Any]) -> Watermark:
    """A ``SHOW MASTER STATUS`` / ``SHOW BINARY LOG STATUS`` row (dict cursor) → watermark.

    ``Executed_Gtid_Set`` (MySQL) may span several lines; it is kept as one set.
    """
    if not row or not row.get("File"):
        raise SourceFatal("the server reports no binlog position (SHOW MASTER STATUS is empty): enable the binlog "
                          "with log_bin and binlog_format=ROW, then restart the server")
    gtid = str(row.get("Executed_Gtid_Set") or "").replace("\n", "").replace(" ", "")
    return Watermark(str(row["File"]), int(row["Position"]), gtid)


def parse_snapshot_status(rows: list[tuple[Any, ...]]) -> tuple[str, int]:
    """``SHOW STATUS LIKE 'binlog_snapshot_%'`` rows → (file, position)."""
    values = {str(k).lower(): v for k, v in rows}
    file = values.get("binlog_snapshot_file")
    pos = values.get("binlog_snapshot_position")
    if not file or pos is None:
        raise SourceFatal("MariaDB did not report binlog_snapshot_file/binlog_snapshot_position: the binlog must "
                          "be enabled (log_bin) for a consistent snapshot")
    return str(file), int(pos)


async def load_table_schema(conn: aiomysql.Connection, table: TableId) -> tuple[TableSchema, tuple[str, ...]]:
    """The table's schema from information_schema, and its primary key in index order."""
    async with conn.cursor() as cur:
        await cur.execute(
            "SELECT COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = %s AND TABLE_NAME = %s ORDER BY ORDINAL_POSITION",
            (table.schema, table.name),
        )
        cols = await cur.fetchall()
        await cur.execute(
            "SELECT COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE WHERE TABLE_SCHEMA = %s "
            "AND TABLE_NAME = %s AND CONSTRAINT_NAME = 'PRIMARY' ORDER BY ORDINAL_POSITION",
            (table.schema, table.name),
        )
        pk = tuple(r[0] for r in await cur.fetchall())
    if not cols:
        raise SourceFatal(f"table {table} does not exist or the cdc user cannot see it: create it, fix "
                          "source.tables, or GRANT SELECT ON the database TO the cdc user")
    columns = []
    for name, ctype, nullable in cols:
        st = normalize_source_type(str(ctype))
        if not is_known_type(st):
            warn_once(table, str(name), UNKNOWN_TYPE, source_type=st)
        columns.append(Column(str(name), arrow_type(st), st, nullable == "YES"))
    names = [c.name for c in columns]
    key = tuple(n for n in names if n in pk)  # column order, as the binlog's table map gives it
    return TableSchema(table, tuple(columns), key), pk


def select_expr(col: Column) -> str:
    q = quote_ident(col.name)
    # FLOAT through the text protocol is printed with 6 significant digits; times a DOUBLE 1 it is a DOUBLE,
    # printed in full, and exact (every float value is a double): the landed float32 equals what the binlog
    # carries. (CAST(... AS DOUBLE) would do the same, but MySQL before 8.0.17 lacks it.)
    return f"({q} * 1E0)" if is_float4(col.source_type) else q


def after_clause(pk: tuple[str, ...], key_types: list[str], after: tuple[Any, ...] | None) -> tuple[str, list[Any]]:
    """``WHERE (k1 > a) OR (k1 = a AND k2 > b) ...`` (expanded so every server uses the index).

    Each column is compared in the order ``ORDER BY`` sorts it (ENUM/SET by number, key_order_expr).
    """
    if after is None:
        return "", []
    exprs = [key_order_expr(quote_ident(k), t) for k, t in zip(pk, key_types, strict=True)]
    values = [to_query_param(key_order_value(v, t)) for v, t in zip(after, key_types, strict=True)]
    ors = []
    params: list[Any] = []
    for i in range(len(pk)):
        parts = [f"{exprs[j]} = %s" for j in range(i)] + [f"{exprs[i]} > %s"]
        params.extend(values[j] for j in range(i + 1))
        ors.append("(" + " AND ".join(parts) + ")")
    return " WHERE " + " OR ".join(ors), params
