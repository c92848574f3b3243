"""Binlog events as the decoder (``decode.py``) sees them besides their contents: where an event starts, the
bytes of a rows event's row images (its seqs), and the events pymysqlreplication cannot decode: passed over
when they carry no row changes, refused otherwise (skipping one that may hold rows would be a silent gap).
"""

from __future__ import annotations

from typing import Any

from cdcd.errors import SourceFatal

#: MariaDB's compressed binlog events (log_bin_compress = ON): pymysqlreplication cannot decode them,
#: and passing over them would lose the changes they hold.
COMPRESSED_EVENTS = {
    165: "QUERY_COMPRESSED_EVENT", 166: "WRITE_ROWS_COMPRESSED_EVENT_V1", 167: "UPDATE_ROWS_COMPRESSED_EVENT_V1",
    168: "DELETE_ROWS_COMPRESSED_EVENT_V1", 169: "WRITE_ROWS_COMPRESSED_EVENT", 170: "UPDATE_ROWS_COMPRESSED_EVENT",
    171: "DELETE_ROWS_COMPRESSED_EVENT",
}
#: MySQL 8's compressed transactions (binlog_transaction_compression = ON): one event holding the whole
#: transaction's events, which pymysqlreplication cannot unpack.
TRANSACTION_PAYLOAD_EVENT = 40
#: Event types that carry no row changes and that pymysqlreplication hands over undecoded: passed over.
#: Every other undecoded type is fatal (it may hold rows: skipping it would be a silent gap).
HARMLESS_EVENTS = frozenset({
    0, 1, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,  # legacy and statement context events
    27, 28, 29, 34, 35, 36, 37, 41,  # heartbeat, ignorable, rows query, anonymous/previous GTIDs, group repl.
    160, 161, 163, 164,  # MariaDB annotate rows, binlog checkpoint, GTID list, start encryption
})
_LOG_EVENT_IGNORABLE_F = 0x80  # header flag: a replica that does not know the event may skip it


def event_start(ev: Any) -> int:
    """Offset of the event in its binlog file (the header carries the end offset)."""
    return int(ev.packet.log_pos) - int(ev.packet.event_size)


def row_image_bytes(ev: Any) -> int:
    """The bytes of a rows event's row images: its body after the header and the columns-present bitmaps (what
    pymysqlreplication has not read of it before the rows are decoded). The same wherever the event is logged:
    the rows' values under the table's definition."""
    return max(0, int(ev.event_size) - int(ev.packet.read_bytes))


def refuse_undecoded(ev: Any, file: str) -> None:
    """An event pymysqlreplication hands over undecoded (``NotImplementedEvent``), read in binlog ``file``:
    passed over (return) when it carries no row changes, else the SourceFatal that says why and what to do."""
    code = int(ev.packet.event_type)
    kind = COMPRESSED_EVENTS.get(code)
    if kind is None:
        if code == TRANSACTION_PAYLOAD_EVENT:
            raise SourceFatal(
                f"the binlog holds a TRANSACTION_PAYLOAD_EVENT at {file}:{event_start(ev)}: the server "
                "compresses transactions (binlog_transaction_compression = ON), which cdcd cannot decode, and "
                "skipping it would lose those changes. SET GLOBAL binlog_transaction_compression = OFF "
                "(and in my.cnf), then re-snapshot: stop cdcd, move the state directory (state.path) and the "
                "landing zone aside and start again")
        if code in HARMLESS_EVENTS or int(ev.packet.flags) & _LOG_EVENT_IGNORABLE_F:
            return  # an event type that carries no row changes (annotations, checkpoints...)
        what = "an INCIDENT_EVENT (the server recorded that events were lost)" if code == 26 else \
            f"an event of type {code}, which cdcd does not know"
        raise SourceFatal(
            f"the binlog holds {what} at {file}:{event_start(ev)}; it may carry row changes, and passing over it "
            "would leave a silent gap in the mirror. Check the server's binlog settings against docs/mysql.md, then "
            "re-snapshot: stop cdcd, move the state directory (state.path) and the landing zone aside and "
            "start again")
    raise SourceFatal(
        f"the binlog holds a {kind} at {file}:{event_start(ev)}: the server compresses its binlog "
        "(log_bin_compress = ON), which cdcd cannot decode, and skipping it would lose those changes. "
        "SET GLOBAL log_bin_compress = OFF (and in my.cnf), then re-snapshot: stop cdcd, move the state "
        "directory (state.path) and the landing zone aside and start again"
    )
