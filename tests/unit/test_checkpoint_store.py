"""The checkpoint store: durable round trips, corruption refused, one daemon per state directory."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from cdcd.checkpoint.store import Checkpoint, CheckpointStore, HistoryTier, history_to_keep
from cdcd.errors import CheckpointFatal, StateError
from cdcd.positions import MySqlPosition, PgPosition


def _ckpt(seq: int) -> Checkpoint:
    return Checkpoint(
        source_kind="postgres",
        batch_seq=seq,
        event_count=seq * 10,
        position=PgPosition(0x16B374D848 + seq, seq),
        source_state={"slot": "cdcd", "snapshot": {"public.t": {"last_key": [seq], "done": False}}},
    )


def test_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    assert store.load() is None
    saved = store.save(_ckpt(3))
    loaded = CheckpointStore(tmp_path).load()
    assert loaded is not None
    assert loaded.position == PgPosition(0x16B374D848 + 3, 3)
    assert (loaded.batch_seq, loaded.event_count, loaded.save_id) == (3, 30, saved.save_id)
    assert loaded.source_state == _ckpt(3).source_state


def test_mysql_position_round_trip(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    pos = MySqlPosition.at("mysql-bin.000012", 4711, 3, "0-1-42")
    store.save(Checkpoint("mysql", 1, 1, pos, {}))
    loaded = store.load()
    assert loaded is not None and loaded.position == pos
    assert isinstance(loaded.position, MySqlPosition) and loaded.position.gtid == "0-1-42"


def test_stale_temp_from_power_cut_is_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    # A save that was cut off before its rename leaves only a temp file.
    (tmp_path / ".checkpoint.json.999.tmp").write_bytes(_ckpt(2).to_bytes()[:40])
    reader = CheckpointStore(tmp_path).load()
    assert reader is not None and reader.batch_seq == 1
    assert (tmp_path / ".checkpoint.json.999.tmp").exists()  # a reader leaves a running daemon's save alone
    owner = CheckpointStore(tmp_path)
    owner.lock()
    try:
        loaded = owner.load()
    finally:
        owner.unlock()
    assert loaded is not None and loaded.batch_seq == 1
    assert not (tmp_path / ".checkpoint.json.999.tmp").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupt_checkpoint_is_refused(tmp_path: Path, damage: str) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    current = tmp_path / "checkpoint.json"
    data = bytearray(current.read_bytes())
    if damage == "flip":
        i = data.index(b'"batch_seq": 2') + len('"batch_seq": ')
        data[i] = ord("7")
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    current.write_bytes(bytes(data))
    with pytest.raises(CheckpointFatal) as err:
        CheckpointStore(tmp_path).load()
    message = str(err.value)
    assert str(current) in message
    assert "cdcd checkpoint list" in message and "rollback" in message


def test_history_keeps_last_n_and_rollback(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3, tiers=())
    for seq in range(1, 7):
        store.save(_ckpt(seq))
    history = store.history()
    assert [p.stem for p in history] == ["000000000003", "000000000004", "000000000005"]
    rolled = store.rollback(4)
    assert rolled.batch_seq == 4 and rolled.save_id == 7
    loaded = CheckpointStore(tmp_path).load()
    assert loaded is not None and loaded.batch_seq == 4
    with pytest.raises(CheckpointFatal, match="no checkpoint with save id 1"):
        store.rollback(1)


def test_history_reaches_back_by_time(tmp_path: Path) -> None:
    """A quiet source saves a checkpoint on every heartbeat: the history keeps one a minute for an hour and one
    an hour for a day besides the newest few, so a rollback reaches back a day, not a hundred seconds."""
    store = CheckpointStore(tmp_path, keep=3)  # the default tiers
    now = time.time()
    # 30 hours of saves every 10 s would be 10,800 files: 300 saves with times of such a run (oldest first).
    ages = sorted({*range(0, 3600, 20), *range(3600, 30 * 3600, 900)}, reverse=True)
    for seq in range(1, len(ages) + 2):
        store.save(_ckpt(seq))  # moves save seq - 1 into the history and prunes
        previous = store.history_path / f"{seq - 1:012d}.json"
        if previous.exists():  # a history entry's time is its file's: when that save wrote it
            os.utime(previous, (now - ages[seq - 2], now - ages[seq - 2]))
    kept_ages = sorted(now - p.stat().st_mtime for p in store.history())
    assert len(kept_ages) <= 3 + 60 + 24 + 2
    assert max(kept_ages) >= 23 * 3600  # reaches back about a day
    assert max(kept_ages) <= 24 * 3600 + 60  # nothing older than the longest tier's span
    assert sum(1 for a in kept_ages if a < 3600) >= 55  # about one a minute in the last hour
    minutes = [int((now - a) // 60) for a in kept_ages if a < 3540]
    assert len(minutes) - len(set(minutes)) <= 3  # the newest 3 may share a minute, the rest do not


def test_history_tiers_keep_the_oldest_of_each_interval() -> None:
    saved = [(Path(f"{n}.json"), float(t)) for n, t in enumerate([0, 10, 59, 60, 61, 130, 3601, 3700])]
    kept = history_to_keep(saved, 1, (HistoryTier(60, 3650),), now=3700.0)
    # 0 and 10 are older than the span; 61 shares its minute with 60, which stays; 3700 is the newest
    assert sorted(p.stem for p in kept) == ["2", "3", "5", "6", "7"]


def test_rollback_after_corruption_recovers(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    (tmp_path / "checkpoint.json").write_text("{garbage")
    fresh = CheckpointStore(tmp_path)
    fresh.rollback(1)
    loaded = CheckpointStore(tmp_path).load()
    assert loaded is not None and loaded.batch_seq == 1


def _contend(path: str, result: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In another process: try to take the lock, then try a rollback."""
    for attempt in (lambda: CheckpointStore(path).lock(), lambda: CheckpointStore(path).rollback(1)):
        try:
            attempt()
            result.put("allowed")
        except (CheckpointFatal, StateError) as exc:
            result.put(str(exc))


def test_second_process_is_refused_naming_the_holder(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(_ckpt(1))
    store.save(_ckpt(2))
    store.lock()
    try:
        result: multiprocessing.Queue[str] = multiprocessing.Queue()
        proc = multiprocessing.get_context("fork").Process(target=_contend, args=(str(tmp_path), result))
        proc.start()
        proc.join(30)
        lock_message, rollback_message = result.get(timeout=5), result.get(timeout=5)
        assert f"locked by pid {os.getpid()}" in lock_message
        assert "cdcd stop" in lock_message
        assert f"while the daemon (pid {os.getpid()}) runs" in rollback_message
    finally:
        store.unlock()
    assert CheckpointStore(tmp_path).holder_pid() is None
