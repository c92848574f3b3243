"""The checkpoint store: durable round trips, corruption refused, one daemon per state directory."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from cdcd.checkpoint.store import Checkpoint, CheckpointStore
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
    store = CheckpointStore(tmp_path, keep=3)
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
