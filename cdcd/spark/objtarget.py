"""A target on object storage (``--target s3a://bucket/prefix``, ``s3://`` too): its URLs and its commit record.

On a file system the consumer's record is ``TARGET/state/consumer.json`` behind a journal of renames
(``cdcd.spark.state``). Object storage has neither rename nor lock, so there:

* the record of each merge is one object ``TARGET/state/commits/<seq>.json`` (the segment's last batch seq, 20
  digits), written with a conditional create after the tables' commits; the newest one is the state. A record
  that exists already was written by another consumer (the lease makes that an error, ``cdcd.spark.lease``);
* the tables' own commits are what makes a batch apply once: every Delta and Iceberg statement records its
  step and batch in its commit (``cdcd.spark.lakehouse.CommitRecord``) and is skipped when the table holds it,
  so a crash between the tables' commits and the record re-applies the batch as a no-op;
* only Delta Lake and Iceberg: a Parquet mirror's commit swaps bucket directories by rename (refused);
* every commit checks first that this consumer still holds the target's lease.

Spark reaches the tables through S3A (``s3a://``, whatever scheme was given); the consumer's own objects
through boto3 with the same credentials as the landing reader (the environment, the AWS credentials file).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cdcd.errors import CdcdError
from cdcd.landing.objstore import Location, ObjectStore, is_object_url
from cdcd.spark import lease as leases
from cdcd.spark.state import STATE_DIR, ZONE_BINDING, ConsumerState, TargetStore

COMMITS = f"{STATE_DIR}/commits"
#: Commit records kept behind the newest (older ones are deleted after each commit).
KEEP = 10


class ParquetOnObjectStorage(CdcdError):
    """The Parquet target commits by renaming directories, which object storage cannot do."""


PARQUET_REFUSED = ("--format parquet cannot write to object storage: its mirror is committed by swapping bucket "
                   "directories with renames, which object storage does not have, so a crash could leave a "
                   "half-written mirror. Use --format delta or --format iceberg for an s3:// target, or give "
                   "a directory (docs/spark.md, Object storage)")


def spark_url(target: str | Path, *parts: str) -> str:
    """The target (or a path under it) as Spark reaches it: ``s3a://bucket/prefix/...`` for object storage,
    else the path as it is."""
    if not is_object_url(target):
        return str(Path(target, *parts))
    loc = Location.parse(target)
    return "/".join(["s3a://" + loc.bucket, *([loc.prefix] if loc.prefix else []), *parts])


def table_uri(path: Path) -> str:
    """A table's directory as a URI for Spark: ``s3a://...`` on object storage, ``file:///...`` else."""
    return spark_url(path) if is_object_url(path) else path.as_uri()


def read_state(target: str | Path, name: str) -> str | None:
    """``TARGET/state/<name>`` as text, None when absent, on a file system or on object storage."""
    if is_object_url(target):
        data = leases.target_store(target).get(f"{STATE_DIR}/{name}")
        return None if data is None else data.decode()
    path = Path(target, STATE_DIR, name)
    return path.read_text() if path.exists() else None


def write_state(target: str | Path, name: str, text: str) -> None:
    """Write ``TARGET/state/<name>`` (a small marker: the table format)."""
    if is_object_url(target):
        leases.target_store(target).put(f"{STATE_DIR}/{name}", text.encode())
        return
    path = Path(target, STATE_DIR, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def applied_seq(target: str | Path) -> int:
    """The last batch seq the target's record holds (0: none), for ``cdcd verify``'s re-check."""
    if is_object_url(target):
        return ObjectTargetStore(Path(target)).load().applied_seq
    text = read_state(target, "consumer.json")
    return int(json.loads(text)["applied_seq"]) if text is not None else 0


def open_store(target: Path) -> TargetStore:
    """The target's record: ``TargetStore`` on a file system, ``ObjectTargetStore`` on object storage."""
    return ObjectTargetStore(target) if is_object_url(target) else TargetStore(target)


class ObjectTargetStore(TargetStore):
    """The consumer's record in a target on object storage (module docstring); nothing is made on a disk."""

    def __init__(self, target: Path, store: ObjectStore | None = None) -> None:  # not super()'s: it makes dirs
        self.target = target
        self.url = Location.parse(target).url
        self.store = store if store is not None else leases.target_store(target)
        self.state_dir = target / STATE_DIR  # names only (``claim`` writes through ``write_state``)
        self.work_dir = target / "work"

    def _seqs(self) -> list[int]:
        return sorted(int(e.name[:-5]) for e in self.store.listdir(COMMITS)
                      if e.name.endswith(".json") and e.name[:-5].isdigit())

    def load(self) -> ConsumerState:
        for seq in reversed(self._seqs()):  # the newest readable one (pruned meanwhile: the one before)
            data = self.store.get(f"{COMMITS}/{seq:020d}.json")
            if data is not None:
                return ConsumerState.from_json(json.loads(data))
        return ConsumerState()

    def save(self, state: ConsumerState) -> None:
        name = f"{COMMITS}/{state.applied_seq:020d}.json"
        data = json.dumps(state.to_json(), indent=1).encode()
        if not self.store.create(name, data) and self.store.get(name) != data:  # equal: our own retried PUT
            raise leases.LeaseLost(
                f"target {self.url}: the commit record of batch {state.applied_seq} was written by another "
                "consumer: two consumers applied the same target. Stop the others (one consumer per target) and "
                "check the mirror with cdcd verify")
        old = self._seqs()[:-KEEP]
        if old:
            self.store.delete(f"{COMMITS}/{s:020d}.json" for s in old)

    def bound_zone(self) -> str | None:
        data = self.store.get(f"{STATE_DIR}/{ZONE_BINDING}")
        return None if data is None else str(json.loads(data)["zone_id"])

    def bind_zone(self, zone_id: str, landing: Path) -> None:
        self.store.put(f"{STATE_DIR}/{ZONE_BINDING}", json.dumps({"zone_id": zone_id, "landing": str(landing)})
                       .encode())

    def guard(self) -> None:
        """No table commit without the lease: one that lost it (taken over after an outage longer than its expiry)
        must not write to Delta's single-writer log."""
        leases.check_held(self.url)

    def commit(self, journal: dict[str, Any]) -> ConsumerState:
        """Record the merge the tables committed already (Delta, Iceberg: no files to move)."""
        if journal.get("files") or journal.get("buckets"):
            raise ParquetOnObjectStorage(PARQUET_REFUSED)
        leases.check_held(self.url)
        state = ConsumerState.from_json(journal["state"])
        self.save(state)
        return state

    def recover(self) -> ConsumerState:
        return self.load()
