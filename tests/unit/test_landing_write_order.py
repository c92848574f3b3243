"""The landing zone's write order, recorded from the real system calls on a real directory.

A crash between any two steps must leave the whole batch or nothing visible. That holds only if
every file is fsynced before its rename, the data files' renames are made durable (fsync of
``data/``) before the manifest is renamed into place, and the manifest's rename is durable
(fsync of ``manifests/``) before the batch is acked. These tests fail if a change reorders them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_landing import mixed_batch

from cdcd.checkpoint.store import Checkpoint, CheckpointStore
from cdcd.fsutil import is_temp
from cdcd.sinks.landing import LandingSink

Step = tuple[str, str, str]  # (call, path, target of a rename or "")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Every fsync and rename the process makes, in order, with the paths they touch."""
    seen: list[Step] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        real_fsync(fd)
        seen.append(("fsync", path, ""))

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def _index(calls: list[Step], call: str, path: Path | str, target: Path | str = "") -> int:
    want = (call, str(path), str(target))
    matches = [i for i, c in enumerate(calls) if c == want]
    assert len(matches) == 1, f"expected one {want} in {calls}"
    return matches[0]


async def test_every_step_of_a_landing_is_durable_before_the_next_depends_on_it(
    tmp_path: Path, calls: list[Step]
) -> None:
    sink = LandingSink(tmp_path)
    await sink.open()
    calls.clear()
    await sink.deliver(mixed_batch(7))
    acked_at = len(calls)  # deliver() returns and the ack is queued only after every call above
    assert sink._acks.get_nowait() == 7
    await sink.close()

    data, manifests = tmp_path / "data", tmp_path / "manifests"
    renames = [c for c in calls if c[0] == "rename"]
    manifest = manifests / "00000000000000000007.json"
    data_files = [Path(dst) for _, _, dst in renames if Path(dst).parent == data]
    assert sorted(p.name for p in data_files) == [f"{7:020d}-{n:04d}.parquet" for n in (0, 1)]
    data_dir_synced = _index(calls, "fsync", data)
    for _, src, dst in renames:
        assert is_temp(Path(src))
        # the temp file's contents are durable before its name can be seen
        assert _index(calls, "fsync", src) < _index(calls, "rename", src, dst)
    for final in data_files:
        src = next(s for _, s, d in renames if d == str(final))
        assert _index(calls, "rename", src, final) < data_dir_synced  # the data names are durable ...
    published = next(i for i, c in enumerate(calls) if c[0] == "rename" and c[2] == str(manifest))
    assert data_dir_synced < published  # ... before the manifest names them
    assert published < _index(calls, "fsync", manifests) < acked_at  # acked once the manifest's name is durable


def test_a_checkpoint_is_durable_before_save_returns(tmp_path: Path, calls: list[Step]) -> None:
    store = CheckpointStore(tmp_path / "state")
    store.lock()
    store.save(Checkpoint(source_kind="postgres", batch_seq=1))
    calls.clear()
    store.save(Checkpoint(source_kind="postgres", batch_seq=2))
    store.unlock()
    current = tmp_path / "state" / "checkpoint.json"
    (_, src, _), = [c for c in calls if c[0] == "rename"]
    assert _index(calls, "fsync", src) < _index(calls, "rename", src, current) < _index(
        calls, "fsync", tmp_path / "state")
    assert calls[-1] == ("fsync", str(tmp_path / "state"), "")  # the save returns once the rename is durable
