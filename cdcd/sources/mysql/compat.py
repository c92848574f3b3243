"""Corrections to mysql-replication's row decoding, applied once on import.

mysql-replication 1.0.x decodes negative TIME values with a fractional part
wrongly (it negates the integer part and the fraction separately, so
``-838:59:58.999999`` comes out as ``-838:59:58`` plus 0.999999 s). MySQL
stores TIME2 as one big-endian offset integer over the integer and fraction
bytes together; this decodes it the way the server's
``my_time_packed_from_binary`` does.

It also raises ValueError for a DATE or an old-format DATETIME whose day the month does not have
(``2024-02-31``, stored under ``ALLOW_INVALID_DATES``); those read as None, like its zero dates.
"""

from __future__ import annotations

import datetime
from typing import Any

from pymysqlreplication import row_event

_FRAC_BYTES = {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3}
_FRAC_SCALE = {0: 0, 1: 10000, 2: 10000, 3: 100, 4: 100, 5: 1, 6: 1}
_TIMEF_INT_OFS = 0x800000


def decode_time2(int_bytes: bytes, frac_bytes: bytes, fsp: int) -> datetime.timedelta:
    """Decode the TIME2 binary form (3 bytes + 0..3 fraction bytes) exactly."""
    intpart = int.from_bytes(int_bytes, "big") - _TIMEF_INT_OFS
    frac = int.from_bytes(frac_bytes, "big") if frac_bytes else 0
    if intpart < 0 and frac:
        # negative values borrow one from the integer part
        intpart += 1
        frac -= 1 << (8 * len(frac_bytes))
    packed = (intpart << 24) + frac * _FRAC_SCALE[fsp]
    sign = -1 if packed < 0 else 1
    packed = abs(packed)
    hms, micro = packed >> 24, packed % (1 << 24)
    hours, minutes, seconds = (hms >> 12) & 0x3FF, (hms >> 6) & 0x3F, hms & 0x3F
    return sign * datetime.timedelta(hours=hours, minutes=minutes, seconds=seconds, microseconds=micro)


def _read_time2(self: Any, column: Any) -> datetime.timedelta:
    fsp = int(getattr(column, "fsp", 0) or 0)
    int_bytes = self.packet.read(3)
    frac_bytes = self.packet.read(_FRAC_BYTES[fsp]) if _FRAC_BYTES[fsp] else b""
    return decode_time2(int_bytes, frac_bytes, fsp)


def _or_none(read: Any) -> Any:
    """A DATE / old-format DATETIME reader whose invalid dates (a day the month does not have, which
    ``ALLOW_INVALID_DATES`` stores) are None, as its zero dates are: the caller records the column as out of
    range and it lands as NULL with the zero-date warning (the library raised ValueError)."""
    def reader(self: Any) -> Any:
        try:
            return read(self)
        except ValueError:  # raised by date()/datetime() after the value's bytes were read
            return None
    return reader


def apply() -> None:
    row_event.RowsEvent._RowsEvent__read_time2 = _read_time2
    row_event.RowsEvent._RowsEvent__read_date = _or_none(row_event.RowsEvent._RowsEvent__read_date)
    row_event.RowsEvent._RowsEvent__read_datetime = _or_none(row_event.RowsEvent._RowsEvent__read_datetime)


apply()
