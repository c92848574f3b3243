"""Range checksums computed in MariaDB/MySQL, for `cdcd verify` (docs/operations.md, "Verifying a mirror").

The same canonical row text as PostgreSQL's (``cdcd.sources.postgres.checksums``, whose docstring says
it) and the mirror's in Spark: integers in decimal, decimals without trailing zeros, instants as
microseconds since 1970 UTC (the session is UTC), dates as YYYY-MM-DD, bytes as lower-case hex, each
value prefixed by its length. Zero and invalid dates land as NULL (docs/mysql.md) and are NULL here. A
column of a type without a canonical text here gives None: verify compares that table row by row.
"""

from __future__ import annotations


def _qi(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


_INTEGERS = ("tinyint", "smallint", "mediumint", "int", "integer", "bigint")
_STRINGS = ("varchar", "text", "tinytext", "mediumtext", "longtext")
_BYTES = ("binary", "varbinary", "blob", "tinyblob", "mediumblob", "longblob")


def canonical(column: str, data_type: str) -> str | None:
    """The canonical text of a column as SQL, or None when its type has none here."""
    c, t = _qi(column), data_type.lower()
    if t in _INTEGERS:
        return f"CAST({c} AS CHAR)"
    if t in _STRINGS:
        return f"CONVERT({c} USING utf8mb4)"
    if t in _BYTES:
        return f"LOWER(HEX({c}))"
    if t == "decimal":
        s = f"CAST({c} AS CHAR)"
        return f"IF(LOCATE('.', {s}) > 0, TRIM(TRAILING '.' FROM TRIM(TRAILING '0' FROM {s})), {s})"
    invalid = f"(YEAR({c}) = 0 OR DAYOFWEEK({c}) IS NULL)"  # zero and invalid dates land as NULL
    if t == "date":
        return f"IF({invalid}, NULL, DATE_FORMAT({c}, '%Y-%m-%d'))"
    if t in ("datetime", "timestamp"):
        return f"IF({invalid}, NULL, CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {c}) AS CHAR))"
    return None


def _text(exprs: list[str]) -> str:
    parts = [f"COALESCE(CONCAT('v', CHAR_LENGTH({e}), ':', {e}), 'n')" for e in exprs]
    return f"CONCAT({', '.join(parts)})" if parts else "''"


def bucket_expr(key_exprs: list[str], buckets: int) -> str:
    """The bucket of a row, from its key columns' canonical texts."""
    return f"(CAST(CONV(SUBSTR(MD5({_text(key_exprs)}), 1, 7), 16, 10) AS UNSIGNED) % {buckets})"


def digest_sql(table: str, exprs: list[str], key_exprs: list[str], buckets: int) -> str:
    """One row per non-empty bucket: bucket, rows, two checksums (``table`` quoted already)."""
    h = f"MD5({_text(exprs)})"
    return (f"SELECT b, COUNT(*), SUM(h1), SUM(h2) FROM (SELECT {bucket_expr(key_exprs, buckets)} AS b, "
            f"CAST(CONV(SUBSTR({h}, 1, 7), 16, 10) AS UNSIGNED) AS h1, "
            f"CAST(CONV(SUBSTR({h}, 8, 7), 16, 10) AS UNSIGNED) AS h2 FROM {table}) s GROUP BY b")
