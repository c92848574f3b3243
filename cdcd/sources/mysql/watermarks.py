"""The low watermark of a MariaDB/MySQL incremental snapshot chunk: pure decisions, no I/O.

Two strategies feed the same window rule (``cdcd.capture.incremental.Window``: a streamed change supersedes a
chunk row when it lies after the LW); both make every transaction before the LW visible to the chunk's read:

* ``exact`` (MariaDB only): inside ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` MariaDB reports the binlog
  position the snapshot corresponds to (``binlog_snapshot_position``). The read sees every transaction before it
  and none after it.
* ``bracketing`` (MySQL, which has no such status; MariaDB on request): the binlog's end P read before the read
  starts (``SHOW MASTER STATUS``; ``SHOW BINARY LOG STATUS`` from MySQL 8.2, the only one in 8.4). A transaction
  is written to the binlog before its engine commit, so one just before P may not be visible yet: a fence waits
  until the server's set of engine-committed GTIDs (MySQL: ``@@GLOBAL.gtid_executed``, extended after the engine
  commits of a commit group; MariaDB: the GTID position at ``binlog_snapshot_position`` read outside a
  transaction, the binlog position of its last engine commit) covers every transaction before P, as the binlog
  reader has read them. A transaction after P may or may not be visible to the read: it lies after the LW and
  supersedes the chunk's rows either way.

The I/O is in ``chunks.py``; the proof sketch in docs/runtime.md.
"""

from __future__ import annotations

import re
from typing import Literal

from cdcd.errors import SourceFatal
from cdcd.sources.mysql.gtid import GtidSet, MariaGtidSet, MySqlGtidSet

Strategy = Literal["exact", "bracketing"]

#: MySQL 8.2 added ``SHOW BINARY LOG STATUS`` and deprecated ``SHOW MASTER STATUS``; 8.4 removed the latter.
BINARY_LOG_STATUS_SINCE = (8, 2)

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def server_version(version: str) -> tuple[int, int, int] | None:
    """``8.4.3``, ``8.0.36-0ubuntu0.22.04.1``, ``10.11.6-MariaDB-0+deb12u1`` -> (major, minor, patch); None when
    the text does not start with a version number."""
    m = _VERSION.match(version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def binlog_status_statement(flavor: str, version: str) -> str:
    """The statement that reports the binlog's end position on this server.

    MariaDB keeps ``SHOW MASTER STATUS`` (``SHOW BINLOG STATUS`` is its alias from 10.5.2). MySQL from 8.2 takes
    ``SHOW BINARY LOG STATUS`` (8.4 removed ``SHOW MASTER STATUS``); before 8.2 only ``SHOW MASTER STATUS`` exists.
    A MySQL version that cannot be read is taken as a new one: the old statement is the one that went away.
    """
    if flavor == "mariadb":
        return "SHOW MASTER STATUS"
    parsed = server_version(version)
    if parsed is not None and parsed[:2] < BINARY_LOG_STATUS_SINCE:
        return "SHOW MASTER STATUS"
    return "SHOW BINARY LOG STATUS"


def choose_strategy(flavor: str, setting: str) -> Strategy:
    """The LW strategy for this server and ``source.mysql.incremental_watermark`` (auto, exact, bracketing)."""
    if setting == "bracketing":
        return "bracketing"
    if flavor == "mariadb":
        return "exact"
    if setting == "exact":
        raise SourceFatal("source.mysql.incremental_watermark = \"exact\" needs MariaDB (binlog_snapshot_position); "
                          "this server is MySQL: set it to \"auto\" or \"bracketing\"")
    return "bracketing"


def covers(committed: GtidSet, delivered: GtidSet) -> bool:
    """True when every delivered transaction is in ``committed`` (a MariaDB position per domain, a MySQL set)."""
    if isinstance(committed, MariaGtidSet) and isinstance(delivered, MariaGtidSet):
        return committed.contains(delivered)
    if isinstance(committed, MySqlGtidSet) and isinstance(delivered, MySqlGtidSet):
        return committed.contains(delivered)
    raise TypeError(f"GTID sets of two flavors: {type(committed).__name__} and {type(delivered).__name__}")
