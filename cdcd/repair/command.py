"""`cdcd repair -c CONFIG --target PATH [--table T] [--dry-run]`.

1. Compare as `cdcd verify` does (bucket checksums, the differing buckets' rows, the re-check on a live source).
2. Ask the running daemon for one key-list re-sync per drifting table (``cdcd.repair.plan``): the incremental
   snapshot path, no second slot; its covered record makes the next merge remove the listed keys the source
   no longer has.
3. Wait until the daemon reports those re-syncs done, then compare the re-synced tables again, waiting (the
   re-check's wait, ``--wait-timeout``) for the consumer, which the operator runs as usual, to merge them.
Exit 0 when the mirror equals the source at the end (or already did), 1 when drift remains, 2 when a side cannot
be read, and the daemon's request errors as `cdcd snapshot` reports them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from cdcd.config import Config
from cdcd.daemon.control import Unreachable, fetch_status, post
from cdcd.errors import CdcdError
from cdcd.events import TableId
from cdcd.repair.plan import Resync, plan
from cdcd.verify.command import chosen_tables, compare_tables
from cdcd.verify.report import report
from cdcd.verify.sides import source_side

POLL_S = 1.0


class RepairFailed(CdcdError):
    """The daemon refused or failed a re-sync, or it did not finish in time."""


async def _keys(config: Config, tables: list[TableId]) -> dict[str, list[str]]:
    async with source_side(config) as side:
        return {str(t): list((await side.shape(t)).key) for t in tables}


def _request(config: Config, r: Resync) -> str:
    """Queue the re-sync; the condition the daemon accepted. A text key is sent quoted, an integer key bare: the
    daemon knows the key's type and refuses the other form, so a numeric-looking text key is sent again quoted."""
    tries = [False, True] if r.numeric else [True]
    for quoted in tries:
        where = r.where(quoted)
        try:
            status, answer = post(config, "/snapshot", {"table": r.table, "where": where}, timeout_s=60)
        except ValueError:
            raise RepairFailed("http.listen is off: repair asks the running daemon over its HTTP listener") from None
        except Unreachable as exc:
            raise RepairFailed(f"no running daemon answers for {config.state.path} ({exc}): start it with "
                               "`cdcd run`, repair re-syncs through it") from None
        if status < 300:
            return where
        error = str(answer.get("error", answer))
        if not ("compare it with quoted text" in error and not quoted):
            raise RepairFailed(f"the daemon refused the re-sync of {r.table}: {error}")
    raise AssertionError("unreachable")


def _job(config: Config, table: str, where: str) -> dict[str, Any] | None:
    doc = fetch_status(config)
    found = [j for j in (doc or {}).get("incremental_snapshots") or [] if j["table"] == table and j["where"] == where]
    return found[-1] if found else None


def _wait_done(config: Config, queued: dict[str, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(queued)
    while pending:
        for table, where in list(pending.items()):
            job = _job(config, table, where)
            if job is not None and job["state"] == "done":
                del pending[table]
            elif job is not None and job["state"] in ("failed", "cancelled", "replaced"):
                raise RepairFailed(f"the re-sync of {table} is {job['state']}: {job.get('error') or ''} "
                                   "(`cdcd status` shows it); run repair again")
        if pending and time.monotonic() >= deadline:
            raise RepairFailed(f"the re-syncs of {', '.join(pending)} did not finish within --wait-timeout "
                               f"({timeout_s:.0f} s); `cdcd status` shows their progress")
        if pending:
            time.sleep(POLL_S)


def repair(config: Config, target: str, out: TextIO | None = None, tables: list[str] | None = None,
           dry_run: bool = False, settle_timeout_s: float = 60.0, wait_timeout_s: float = 600.0) -> int:
    out = out or sys.stdout
    path = Path(target)
    try:
        chosen = chosen_tables(config, tables)
        diffs = compare_tables(config, path, chosen, settle_timeout_s)
        drifting = [d for d in diffs if not d.ok]
        for d in diffs:
            checked = f"buckets={d.buckets} differing={d.differing_buckets}" if d.buckets is not None else "whole"
            print(f"repair: {d.table}: {checked} keys differing={len(d.missing) + len(d.extra) + len(d.changed)}",
                  file=out)
        if not drifting:
            print("repair: the mirror equals the source; nothing to re-sync", file=out)
            return 0
        keys = asyncio.run(_keys(config, [t for t in chosen if str(t) in {d.table for d in drifting}]))
        plans = [plan(d, keys[d.table]) for d in drifting]
        refused = [p for p in plans if isinstance(p, str)]
        resyncs = [p for p in plans if isinstance(p, Resync)]
        for why in refused:
            print(f"repair: not re-synced: {why}", file=out)
        for r in resyncs:
            print(f"repair: {r.table}: {'would re-sync' if dry_run else 're-syncing'} {len(r.keys)} keys", file=out)
        if dry_run:
            return 1
        queued = {r.table: _request(config, r) for r in resyncs}
        _wait_done(config, queued, wait_timeout_s)
        after = compare_tables(config, path, [t for t in chosen if str(t) in queued], max(settle_timeout_s,
                                                                                            wait_timeout_s))
    except CdcdError as exc:
        print(f"repair: {exc}", file=sys.stderr)
        return 2 if not isinstance(exc, RepairFailed) else 1
    report(after, out)
    left = [d for d in after if not d.ok]
    end = f"drift remains in {', '.join(d.table for d in left)}" if left else "the re-synced tables equal the source"
    print(f"repair: re-synced {sum(len(r.keys) for r in resyncs)} keys in {len(resyncs)} tables; {end}", file=out)
    return 1 if left or refused else 0

