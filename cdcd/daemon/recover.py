"""`cdcd recover`: recovery from a lost source position while the daemon is stopped (docs/operations.md, "A lost
position").

It runs the daemon's own runtime once, so nothing here is a second mechanism: the state directory's lock (refused
beside a running daemon, exit 7), the checkpoint, and the source's planner told to recover (``Source.recover_only``).
The planner says what was lost, takes a new slot or the current binlog position, and its first items record the gap
(the landing zone's ``position_lost`` record) and start a whole-table incremental re-snapshot of every table
(cdcd/capture/recovery.py). Once they are landed and checkpointed the runtime stops gracefully; the next `cdcd run`
streams from the new position and runs the re-snapshots, whose covered records reconcile the mirror.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from typing import Any

import structlog

from cdcd.config import Config
from cdcd.errors import StateError, StateFatal
from cdcd.runtime.runtime import Runtime

_log = structlog.get_logger("cdcd.recover")

#: How long the recovery's first batch may take to be landed and checkpointed.
SAVED_WITHIN_S = 120.0


async def recover(config: Config) -> dict[str, Any]:
    """Recover the lost position; the gap's record (what was lost, from, to, the tables re-snapshotted). Raises
    ``NothingToRecover`` when the position is not lost, the source's error when it cannot be recovered."""
    from cdcd.sources import make_source

    # Acked once landed, also with landing.ack = "consumed": the recovery must not wait for a consumer, and the
    # landing zone keeps every batch until a consumer marked it consumed either way.
    config = config.model_copy(update={"landing": config.landing.model_copy(update={"ack": "landed"})})
    source = make_source(config)
    source.recover_only()
    rt = Runtime(config, source=source, sink=importlib.import_module("cdcd.sinks").make_sink(config))
    rt.store.lock()  # before anything connects: a running daemon holds it (StateDirLocked, exit 7)
    try:
        await rt.start()
        record = source.recovered()
        if record is None:  # the planner raises NothingToRecover instead: a source that cannot recover
            raise StateFatal(f"the {source.kind} source planned no recovery; report this as a bug")
        ended = asyncio.ensure_future(rt.wait())
        try:
            await _until_saved(rt, record, ended)
        finally:
            ended.cancel()
        try:
            await rt.stop()
        except StateError as exc:  # acks missing after the grace period: the recovery itself is saved already
            _log.warning("the recovery is saved; its stop was incomplete", error=str(exc))
            await rt.force_stop()
        return record
    finally:
        rt.store.unlock()


async def _until_saved(rt: Runtime, record: dict[str, Any], ended: asyncio.Future[None]) -> None:
    """Wait until a checkpoint on disk holds the recovery ``record``; the pipeline's error if it fails first."""
    async with asyncio.timeout(SAVED_WITHIN_S):
        while True:
            ckpt = rt.store.load()
            held = ((ckpt.source_state.get("position_lost") or {}).get("last") or {}) if ckpt is not None else {}
            if held.get("to") == record["to"]:
                return
            await asyncio.wait({ended}, timeout=0.2)
            if ended.done():
                ended.result()  # the pipeline's error
                raise StateFatal("the pipeline ended before the recovery was checkpointed; run `cdcd recover` again")


def describe(record: dict[str, Any]) -> str:
    """What `cdcd recover` prints."""
    tables = ", ".join(record.get("tables") or [])
    return (f"lost: {record['lost']}\n"
            f"  last position captured: {record.get('from') or 'unknown'}\n"
            f"  new position: {record['to']}\n"
            f"  recorded in the landing zone as a position_lost record (docs/landing-format.md)\n"
            f"  re-snapshotted incrementally by the next `cdcd run`: {tables}\n"
            f"Start the daemon (`cdcd run -c CONFIG`); the mirror is whole again once `cdcd status` shows every "
            f"incremental snapshot done and the consumer applied it.\n"
            f"{json.dumps(record, default=str, sort_keys=True)}")
