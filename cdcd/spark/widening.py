"""Which type changes keep every value: a narrowed source column the target's wider one holds (``holds``), a
widening (``lossless``). Pure functions of Spark types."""

from __future__ import annotations

from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

_INT_RANK = {"tinyint": 1, "smallint": 2, "int": 3, "bigint": 4}


def holds(old: DataType, new: DataType) -> bool:
    """Whether a column of type ``old`` stores every value of ``new`` exactly (a narrowed source column)."""
    if isinstance(old, DecimalType) and isinstance(new, DecimalType):
        return old.precision - old.scale >= new.precision - new.scale and old.scale >= new.scale
    o, n = old.simpleString(), new.simpleString()
    if o in _INT_RANK and n in _INT_RANK:
        return _INT_RANK[o] >= _INT_RANK[n]
    return (o, n) == ("double", "float")


#: Decimal digits an integer type needs.
_INT_DIGITS = {"tinyint": 3, "smallint": 5, "int": 10, "bigint": 20}


def lossless(old: DataType, new: DataType) -> bool:
    """Whether every value of type ``old`` converts to ``new`` exactly (a widening): integers to wider integers, to
    decimals with enough digits and (up to int) to double; float to double; a decimal to one with as many integer
    digits and scale or more; a date to a timestamp; numbers, booleans, dates and timestamps to text."""
    plain = (ByteType, ShortType, IntegerType, LongType, FloatType, DoubleType, DecimalType, BooleanType, DateType,
             TimestampType, TimestampNTZType)
    if holds(new, old) or (isinstance(new, StringType) and isinstance(old, plain)):
        return True
    o = old.simpleString()
    if o in _INT_RANK:
        if isinstance(new, DecimalType):
            return new.precision - new.scale >= _INT_DIGITS[o]
        return isinstance(new, DoubleType) and _INT_RANK[o] <= _INT_RANK["int"]
    if isinstance(old, DateType):
        return isinstance(new, TimestampType | TimestampNTZType)
    return False
