"""Range checksums computed in PostgreSQL, for `cdcd verify` (docs/operations.md, "Verifying a mirror").

Every row's columns are written as one canonical text, the same text the mirror's side writes in Spark
(``cdcd.verify.mirror_sums``): integers in decimal, decimals without trailing zeros, instants as
microseconds since 1970 UTC, dates as YYYY-MM-DD, bytes as lower-case hex, each value prefixed by its
length (``v<len>:<text>``, ``n`` for NULL) so no two rows write the same text. A key's text picks its
bucket (the first 28 bits of its md5, modulo the number of buckets); a bucket's checksum is its row
count and two sums of 28 bits of each row text's md5. A column of a type without a canonical text here
gives None: verify then compares that table's buckets row by row.
"""

from __future__ import annotations


def _qi(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def canonical(column: str, typname: str, typmod: int) -> str | None:
    """The canonical text of a column as SQL, or None when its type has none here."""
    c = _qi(column)
    if typname in ("int2", "int4", "int8", "uuid"):
        return f"{c}::text"
    if typname in ("text", "varchar"):
        return c
    if typname == "bool":
        return f"CASE WHEN {c} THEN 'true' ELSE 'false' END"
    if typname == "bytea":
        return f"encode({c}, 'hex')"
    if typname == "date":  # ±infinity land as the largest and smallest dates Arrow holds (docs/postgres.md)
        return (f"CASE WHEN {c} = 'infinity' THEN '9999-12-31' WHEN {c} = '-infinity' THEN '0001-01-01' "
                f"ELSE to_char({c}, 'YYYY-MM-DD') END")
    if typname in ("timestamp", "timestamptz"):
        return (f"CASE WHEN {c} = 'infinity' THEN '253402300799999999' "
                f"WHEN {c} = '-infinity' THEN '-62135596800000000' "
                f"ELSE (extract(epoch FROM {c}) * 1000000)::bigint::text END")
    if typname == "numeric" and typmod > 0 and ((typmod - 4) >> 16) <= 38:  # landed as a decimal
        return f"CASE WHEN {c} = 'NaN' THEN NULL ELSE trim_scale({c})::text END"  # NaN lands as NULL
    return None


def _text(exprs: list[str]) -> str:
    parts = [f"COALESCE('v' || length({e})::text || ':' || {e}, 'n')" for e in exprs]
    return " || ".join(parts) if parts else "''"


def bucket_expr(key_exprs: list[str], buckets: int) -> str:
    """The bucket of a row, from its key columns' canonical texts."""
    return f"(('x' || substr(md5({_text(key_exprs)}), 1, 7))::bit(28)::int % {buckets})"


def digest_sql(table: str, exprs: list[str], key_exprs: list[str], buckets: int) -> str:
    """One row per non-empty bucket: bucket, rows, two checksums (``table`` quoted already)."""
    h = f"md5({_text(exprs)})"
    return (f"SELECT b, count(*), sum(h1), sum(h2) FROM (SELECT {bucket_expr(key_exprs, buckets)} AS b, "
            f"('x' || substr({h}, 1, 7))::bit(28)::int AS h1, ('x' || substr({h}, 8, 7))::bit(28)::int AS h2 "
            f"FROM {table}) s GROUP BY b")
