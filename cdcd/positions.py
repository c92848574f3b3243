"""Totally ordered source positions.

Every item in the stream carries a position. Positions of one source kind
compare with ``<``; ``encoded`` is a plain string that sorts the same way (the
landing format's ``_cdc_pos``); ``to_json``/``position_from_json`` round-trip
them through the checkpoint.

Sequence numbers: stream events are numbered from 1 inside their
transaction; 0 is reserved for snapshot rows, which all sit at the snapshot
watermark and therefore sort before every streamed change after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cdcd.errors import CheckpointFatal


@dataclass(frozen=True, slots=True, order=True)
class PgPosition:
    """PostgreSQL: the transaction's commit LSN and the event's index in it."""

    lsn: int
    seq: int = 0

    kind: ClassVar[str] = "postgres"

    @property
    def encoded(self) -> str:
        return f"pg:{self.lsn:016x}:{self.seq:010d}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "lsn": format_lsn(self.lsn), "seq": self.seq}

    def __str__(self) -> str:
        return f"{format_lsn(self.lsn)}#{self.seq}"


@dataclass(frozen=True, slots=True)
class MySqlPosition:
    """MySQL/MariaDB: server epoch, binlog file index, transaction start offset, index in it.

    ``file`` is the binlog file name; ordering uses its numeric suffix
    (``file_index``) so ``mysql-bin.000010`` sorts after ``mysql-bin.000009``.
    ``gtid`` is the GTID set of completed transactions up to here, if any;
    it does not take part in ordering.

    ``epoch`` leads the order: (file, offset) pairs of two servers (after a
    GTID failover) or of one server before and after a binlog reset do not
    compare, so cdcd bumps the epoch whenever it continues on another binlog
    history, and every position of the new history sorts above the old ones.
    Epoch 0 encodes exactly as before epochs existed (``my:<file>:...``); a
    higher epoch encodes as ``my:e<epoch>:<file>:...``, and ``e`` sorts after
    every digit, so old and new strings keep one plain string order.
    """

    file_index: int
    pos: int
    seq: int = 0
    file: str = field(default="", compare=False)
    gtid: str = field(default="", compare=False)
    epoch: int = 0

    kind: ClassVar[str] = "mysql"

    @classmethod
    def at(cls, file: str, pos: int, seq: int = 0, gtid: str = "", epoch: int = 0) -> MySqlPosition:
        return cls(binlog_index(file), pos, seq, file, gtid, epoch)

    @classmethod
    def epoch_start(cls, epoch: int, gtid: str) -> MySqlPosition:
        """The lowest position of an epoch: "at GTID set ``gtid`` on the epoch's server", no file known."""
        return cls(0, 0, 0, "", gtid, epoch)

    def _key(self) -> tuple[int, int, int, int]:
        return (self.epoch, self.file_index, self.pos, self.seq)

    def __lt__(self, other: MySqlPosition) -> bool:
        return self._key() < other._key()

    def __le__(self, other: MySqlPosition) -> bool:
        return self._key() <= other._key()

    def __gt__(self, other: MySqlPosition) -> bool:
        return self._key() > other._key()

    def __ge__(self, other: MySqlPosition) -> bool:
        return self._key() >= other._key()

    @property
    def encoded(self) -> str:
        head = f"my:e{self.epoch:06d}:" if self.epoch else "my:"
        return f"{head}{self.file_index:010d}:{self.pos:020d}:{self.seq:010d}"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "file": self.file, "pos": self.pos, "seq": self.seq,
                               "gtid": self.gtid}
        if self.epoch:
            doc["epoch"] = self.epoch
        return doc

    def __str__(self) -> str:
        where = f"{self.file}:{self.pos}#{self.seq}" if self.file else f"GTID {self.gtid or '(empty)'}"
        return f"epoch {self.epoch} {where}" if self.epoch else where


Position = PgPosition | MySqlPosition

_BINLOG_SUFFIX = re.compile(r"\.(\d+)$")


def binlog_index(file: str) -> int:
    m = _BINLOG_SUFFIX.search(file)
    if m is None:
        raise ValueError(f"binlog file name {file!r} has no numeric suffix")
    return int(m.group(1))


def format_lsn(lsn: int) -> str:
    """The PostgreSQL text form of an LSN: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    hi, sep, lo = text.partition("/")
    if not sep:
        raise ValueError(f"LSN {text!r} must look like '16/B374D848'")
    return (int(hi, 16) << 32) | int(lo, 16)


def position_from_json(doc: dict[str, Any]) -> Position:
    try:
        kind = doc["kind"]
        if kind == PgPosition.kind:
            return PgPosition(parse_lsn(doc["lsn"]), int(doc["seq"]))
        if kind == MySqlPosition.kind:
            file, epoch = str(doc["file"]), int(doc.get("epoch", 0))
            if not file:  # an epoch's start: known by its GTID set only
                return MySqlPosition.epoch_start(epoch, str(doc.get("gtid", "")))
            return MySqlPosition.at(file, int(doc["pos"]), int(doc["seq"]), doc.get("gtid", ""), epoch)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointFatal(f"checkpoint position {doc!r} is malformed: {exc}") from exc
    raise CheckpointFatal(f"checkpoint position has unknown kind {kind!r}")
