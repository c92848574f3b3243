"""The mirror's side of the range checksums, computed in Spark where the mirror lives.

The same canonical row text, bucket and checksums as the sources' (``cdcd.sources.postgres.checksums``
says the text), written in Spark SQL from the mirror's column types. Only Delta Lake and Iceberg mirrors
(a Spark table); a column type without a canonical text here gives None.
"""

from __future__ import annotations

from typing import Any

# a decimal's trailing zeros, then a trailing point: 1.50 -> 1.5, 2.00 -> 2 (an integer's zeros stay)
_TRIM = r"regexp_replace(regexp_replace({s}, '(\\.[0-9]*?)0+$', '$1'), '\\.$', '')"


def _qi(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def canonical(column: str, spark_type: str | None) -> str | None:
    """The canonical text of a mirror column as Spark SQL (``spark_type``: its simpleString, None when the
    mirror lacks the column), or None when its type has none here."""
    if spark_type is None:
        return "CAST(NULL AS STRING)"
    c = _qi(column)
    if spark_type in ("tinyint", "smallint", "int", "bigint", "boolean", "date"):
        return f"CAST({c} AS STRING)"
    if spark_type.startswith("decimal("):
        s = f"CAST({c} AS STRING)"
        return s if spark_type.endswith(",0)") else _TRIM.format(s=s)
    if spark_type == "string":
        return c
    if spark_type == "binary":
        return f"lower(hex({c}))"
    if spark_type == "timestamp":
        return f"CAST(unix_micros({c}) AS STRING)"
    if spark_type == "timestamp_ntz":  # the session is UTC: the wall time as if UTC, as the sources write it
        return f"CAST(unix_micros(CAST({c} AS TIMESTAMP)) AS STRING)"
    return None


def _text(exprs: list[str]) -> str:
    parts = [f"COALESCE(concat('v', CAST(length({e}) AS STRING), ':', {e}), 'n')" for e in exprs]
    return f"concat({', '.join(parts)})" if parts else "''"


def bucket_expr(key_exprs: list[str], buckets: int) -> str:
    return f"(CAST(conv(substr(md5({_text(key_exprs)}), 1, 7), 16, 10) AS BIGINT) % {buckets})"


def digests(frame: Any, exprs: list[str], key_exprs: list[str], buckets: int) -> dict[int, tuple[int, int, int]]:
    """bucket -> (rows, checksum 1, checksum 2) of a mirror DataFrame, aggregated in Spark."""
    h = f"md5({_text(exprs)})"
    rows = frame.selectExpr(
        f"{bucket_expr(key_exprs, buckets)} AS b",
        f"CAST(conv(substr({h}, 1, 7), 16, 10) AS BIGINT) AS h1",
        f"CAST(conv(substr({h}, 8, 7), 16, 10) AS BIGINT) AS h2",
    ).groupBy("b").agg({"*": "count", "h1": "sum", "h2": "sum"}).collect()
    return {int(r["b"]): (int(r["count(1)"]), int(r["sum(h1)"]), int(r["sum(h2)"])) for r in rows}


def bucket_rows(frame: Any, key_exprs: list[str], buckets: int, chosen: list[int]) -> Any:
    """The mirror's rows of the buckets ``chosen``, as an Arrow table."""
    where = f"{bucket_expr(key_exprs, buckets)} IN ({', '.join(str(b) for b in chosen)})"
    return frame.where(where).toArrow()
