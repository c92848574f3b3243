"""One consumer per target on object storage: a lease made of conditional creates, renewed while the consumer runs.

A target on a file system is locked with ``flock`` (``cdcd.spark.state.lock_target``); object storage has no
locks and no rename, only the conditional create (``If-None-Match: *``) the landing zone already relies on. The
lease is a series of objects ``TARGET/state/lease/<generation>`` (20 digits): the newest generation is the lease,
its JSON says who holds it and until when (the holder's clock). Taking or renewing it is creating the next
generation, which exactly one writer can do: a holder that finds its renewal's generation taken has lost the
lease, and a second consumer is refused while the newest generation has not expired. Only generations, never an
overwrite, so the stores that honour ``If-None-Match`` on PUT (AWS S3, versitygw, MinIO) are enough; no
``If-Match``. The expiry (``--lease-seconds``) bounds how long a crashed consumer keeps the target; clocks of the
hosts must agree within a small part of it.

A lease alone does not stop a write already under way: a merge that began while the lease held can commit
minutes later, once S3A's retries succeed, after another consumer took the lease over. So the holder fences
itself: a watchdog calls ``on_lost`` (the job halts its Spark JVM: ``cdcd.spark.session.halt_jvm``) the moment
the lease is lost, or its expiry comes before a renewal succeeded, whatever the renewal is waiting for. Since the
holder's expiry is measured from before its renewal was sent, it comes no later than the one others read.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cdcd.errors import CdcdError, SinkError
from cdcd.landing.objstore import Location, ObjectStore, is_object_url
from cdcd.logging import get_logger
from cdcd.spark.args import DEFAULT_LEASE_S
from cdcd.spark.state import STATE_DIR, TargetLocked, lock_target

LEASE_DIR = f"{STATE_DIR}/lease"
#: Generations kept behind the newest (older ones are deleted: the listing stays short).
KEEP = 3

_log = get_logger("cdcd.spark")
#: The leases this process holds, by target URL (``check_held``).
_HELD: dict[str, Lease] = {}


class LeaseLost(TargetLocked):
    """This consumer's lease on the target was taken over, or not renewed in time: it must not commit again."""


@dataclass(frozen=True, slots=True)
class Holder:
    """A generation's content."""

    holder: str  # the lease id of one consumer run
    host: str
    pid: int
    expires: float  # epoch seconds on the holder's clock; 0: released

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def target_store(target: str | Path) -> ObjectStore:
    """The object store of a target URL (``s3a://bucket/prefix``), with boto3's usual credentials (the
    environment, the AWS credentials file), as the landing reader's."""
    return ObjectStore(Location.parse(target), role="target")


class Lease:
    """The consumer's lease on an object-store target: ``acquire``, renewed by a thread, ``release``."""

    def __init__(self, target: str | Path, seconds: float = DEFAULT_LEASE_S, store: ObjectStore | None = None) -> None:
        if seconds <= 0:
            raise CdcdError(f"--lease-seconds {seconds:g}: give a number of seconds above 0 (default "
                            f"{DEFAULT_LEASE_S:g})")
        self.target = Location.parse(target).url
        self.store = store if store is not None else target_store(target)
        self.seconds = seconds
        self.id = uuid.uuid4().hex
        self.generation = -1
        self.valid_until = 0.0  # monotonic: the lease holds until then unless renewed
        self.lost: str | None = None
        #: Called once, from the lease's threads, when the lease is lost or expires unrenewed (``fence``).
        self.on_lost: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._fenced = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._last_error = "none: the store did not answer in time"

    def _newest(self) -> tuple[int, Holder | None]:
        gens = sorted(int(e.name) for e in self.store.listdir(LEASE_DIR) if e.name.isdigit())
        for gen in reversed(gens):  # the newest readable one (deleted meanwhile: the one before)
            data = self.store.get(f"{LEASE_DIR}/{gen:020d}")
            if data is not None:
                return gen, Holder(**json.loads(data))
        return (gens[-1] if gens else -1), None

    def _take(self, generation: int, expires_in: float) -> bool:
        started = time.monotonic()
        doc = Holder(self.id, socket.gethostname(), os.getpid(), time.time() + expires_in if expires_in else 0.0)
        name = f"{LEASE_DIR}/{generation:020d}"
        if not self.store.create(name, json.dumps(asdict(doc)).encode()):
            found = self.store.get(name)  # ours all the same: a PUT retried after its answer was lost
            if found is None or json.loads(found).get("holder") != self.id:
                return False
        self.generation, self.valid_until = generation, started + expires_in
        return True

    def acquire(self) -> None:
        """Take the lease, or raise TargetLocked naming the holder and when its lease expires."""
        gen, holder = self._newest()
        now = time.time()
        if holder is not None and holder.expires > now:
            raise TargetLocked(
                f"target {self.target} is in use by another cdcd spark consumer ({holder.describe()}; its lease "
                f"expires in {holder.expires - now:.0f} s unless renewed): one consumer per target. Stop that one "
                f"first, or give this one its own --target. A consumer that crashed frees the target when its lease "
                f"expires (--lease-seconds)")
        if not self._take(gen + 1, self.seconds):
            raise TargetLocked(f"target {self.target}: another cdcd spark consumer took the lease at the same moment "
                               f"(generation {gen + 1}): one consumer per target; give this one its own --target")
        if holder is not None and holder.expires:
            _log.warning("took over the target's expired lease", target=self.target, previous=holder.describe())
        self._prune()
        _HELD[self.target] = self
        self._threads = [threading.Thread(target=self._renew_loop, name="cdcd-target-lease", daemon=True),
                         threading.Thread(target=self._watch_expiry, name="cdcd-target-lease-expiry", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3) and self.lost is None:
            try:
                self.renew()
            except LeaseLost as exc:
                self.fence(str(exc))
                return
            except SinkError as exc:  # the store unreachable for now: the next round tries, the watchdog fences
                self._last_error = str(exc)
                _log.warning("renewing the target's lease failed", target=self.target, error=str(exc))

    def _watch_expiry(self) -> None:
        """Fence at the expiry unless a renewal moved it (a renewal may hang on the store for longer)."""
        while not self._stop.is_set() and self.lost is None:
            left = self.valid_until - time.monotonic()
            if left <= 0:
                self.fence(f"target {self.target}: the lease was not renewed within {self.seconds:g} s "
                           f"(--lease-seconds; last error: {self._last_error}); another consumer may take it")
                return
            self._stop.wait(left)

    def fence(self, why: str) -> None:
        """The lease is lost: nothing more may be committed; ``on_lost`` stops what may still be writing."""
        with self._fenced:
            if self.lost is not None:
                return
            self.lost = why
        _log.error("the target's lease is lost: this consumer stops writing to it", target=self.target, error=why)
        if self.on_lost is not None:
            self.on_lost()

    def renew(self) -> None:
        """Create the next generation; LeaseLost when another consumer created it first."""
        gen, holder = self._newest()  # a newer generation of ours: a renewal whose answer was lost
        if gen < self.generation or holder is None or holder.holder != self.id:
            raise LeaseLost(f"target {self.target}: another consumer took the lease "
                            f"({holder.describe() if holder else 'generation ' + str(gen)}) after this one's "
                            f"expired: this one stops without committing again")
        if not self._take(gen + 1, self.seconds):
            raise LeaseLost(f"target {self.target}: another consumer took the lease (generation {gen + 1}) "
                            "while this one renewed it: this one stops without committing again")
        self._prune()

    def check(self) -> None:
        """Before a commit: raise LeaseLost unless the lease is held (renewed in time, not taken over)."""
        if self.lost is None and time.monotonic() >= self.valid_until:
            self.lost = f"target {self.target}: the lease expired before the commit (--lease-seconds {self.seconds:g})"
        if self.lost is not None:
            raise LeaseLost(f"{self.lost}. Nothing more is committed; start the consumer again once the store "
                            "answers, or the other consumer stopped (one consumer per target)")

    def release(self) -> None:
        """Stop renewing and hand the target back at once (a released generation), when still held."""
        self._stop.set()
        _HELD.pop(self.target, None)
        for thread in self._threads:
            thread.join(timeout=30)
        if self.lost is None and self.generation >= 0:
            try:
                gen, holder = self._newest()
                if gen == self.generation and holder is not None and holder.holder == self.id:
                    self._take(gen + 1, 0.0)
            except SinkError as exc:  # the lease then expires on its own
                _log.warning("releasing the target's lease failed; it expires on its own", target=self.target,
                             error=str(exc), expires_in_s=round(max(0.0, self.valid_until - time.monotonic())))

    def _prune(self) -> None:
        old = [e.name for e in self.store.listdir(LEASE_DIR)
               if e.name.isdigit() and int(e.name) < self.generation - KEEP]
        if old:
            self.store.delete(f"{LEASE_DIR}/{n}" for n in old)



def check_held(url: str) -> None:
    """Before a commit to the target ``url``: raise LeaseLost unless this process holds its lease."""
    lease = _HELD.get(url)
    if lease is None:
        raise LeaseLost(f"target {url}: this process holds no lease on it, so it may not commit there; run the "
                        "consumer through cdcd spark run (or its spark-submit entry point), which takes the lease")
    lease.check()


def hold_target(target: Path, seconds: float = DEFAULT_LEASE_S,
                on_lost: Callable[[], None] | None = None) -> Callable[[], None]:
    """Take the target for this consumer (flock on a file system, the lease on object storage) and return what
    gives it back; TargetLocked when another consumer has it. ``on_lost``: what stops this process's writes the
    moment a lease is lost (``Lease.fence``); a lock is held until the process ends."""
    if not is_object_url(target):
        fd = lock_target(target)
        return lambda: os.close(fd)
    lease = Lease(target, seconds)
    lease.on_lost = on_lost
    lease.acquire()
    return lease.release
