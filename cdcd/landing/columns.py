"""The data files' columns (docs/landing-format.md, "Data files"): the ``_cdc_*`` metadata column names and the
Arrow schema of a table's landed file.

The table's columns come first, in the source's order and Arrow types, then the metadata columns in the order
of ``META_FIELDS``, then ``_cdc_before_key``. The sink writes files of ``arrow_schema``; the Spark job names
the columns with the constants below.
"""

from __future__ import annotations

import pyarrow as pa

from cdcd.events import TableSchema

CDC_OP = "_cdc_op"  # c insert, u update, d delete, r snapshot row, t truncate
CDC_POS = "_cdc_pos"  # the position, encoded so that string order is event order
CDC_TX = "_cdc_tx"  # the source transaction id
CDC_COMMIT_TS = "_cdc_commit_ts"  # the source commit time (UTC)
CDC_SNAPSHOT = "_cdc_snapshot"  # true for snapshot rows
CDC_UNAVAILABLE = "_cdc_unavailable"  # the columns whose value the source did not send
CDC_BATCH = "_cdc_batch"  # the batch seq
CDC_INDEX = "_cdc_index"  # the event's index in the batch
CDC_SCHEMA_VERSION = "_cdc_schema_version"  # the table schema version of the row
CDC_BEFORE_KEY = "_cdc_before_key"  # an update that changed the key: the old key (a struct of the key columns)
#: The prefix of every metadata column; source columns keep their own names.
CDC_PREFIX = "_cdc_"

META_FIELDS: tuple[pa.Field, ...] = (
    pa.field(CDC_OP, pa.string(), nullable=False),
    pa.field(CDC_POS, pa.string(), nullable=False),
    pa.field(CDC_TX, pa.string()),
    pa.field(CDC_COMMIT_TS, pa.timestamp("us", tz="UTC")),
    pa.field(CDC_SNAPSHOT, pa.bool_(), nullable=False),
    pa.field(CDC_UNAVAILABLE, pa.list_(pa.string()), nullable=False),
    pa.field(CDC_BATCH, pa.int64(), nullable=False),
    pa.field(CDC_INDEX, pa.int64(), nullable=False),
    pa.field(CDC_SCHEMA_VERSION, pa.int64(), nullable=False),
)


def key_columns(schema: TableSchema) -> tuple[str, ...]:
    """The merge key: the primary key, or every column for a table without one."""
    return schema.key or schema.column_names


def before_key_type(schema: TableSchema) -> pa.StructType:
    return pa.struct([pa.field(k, schema.column(k).type) for k in key_columns(schema)])


def arrow_schema(schema: TableSchema) -> pa.Schema:
    """The Arrow schema of a landed file of ``schema``."""
    fields = [pa.field(c.name, c.type) for c in schema.columns]
    fields.extend(META_FIELDS)
    fields.append(pa.field(CDC_BEFORE_KEY, before_key_type(schema)))
    return pa.schema(fields)
