"""The consumer's lease on a target on object storage (cdcd.spark.lease) and its commit record
(cdcd.spark.objtarget), against the real S3 server: one holder at a time, renewed while held, free after a
release at once and after an expiry, a holder that lost it refused at its next commit, a holder whose store
went silent fenced at its expiry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultproxy import FaultProxy
from support.s3 import keys
from support.waits import wait_for

from cdcd.spark.lease import _HELD, Lease, LeaseLost, check_held
from cdcd.spark.objtarget import ObjectTargetStore, read_state
from cdcd.spark.state import ConsumerState, TableState, TargetLocked
from devtools.s3server import S3Server


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The store in the environment, where boto3 (and so the consumer) finds it."""
    env = {"AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_REGION": s3_server.region,
           "AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield env


def test_one_holder_renewal_release_expiry_and_a_lost_lease(s3_env: dict[str, str], s3_server: S3Server,
                                                            s3_bucket: str) -> None:
    target = f"s3a://{s3_bucket}/target"
    first = Lease(target, seconds=1.5)
    first.acquire()
    with pytest.raises(TargetLocked, match=rf"in use by another cdcd spark consumer \(pid {os.getpid()} on "):
        Lease(target, seconds=1.5).acquire()
    # renewed while held: well past its first expiry it still holds, and a second consumer is still refused
    wait_for("two renewals", lambda: first.generation >= 2, 20)
    check_held(f"s3://{s3_bucket}/target")
    with pytest.raises(TargetLocked, match="in use"):
        Lease(target, seconds=1.5).acquire()
    first.release()  # free at once
    second = Lease(target, seconds=1.5)
    second.acquire()
    with pytest.raises(LeaseLost, match="expired"):  # the first one may not commit any more
        first.check()
    with pytest.raises(LeaseLost, match="holds no lease"):
        check_held("s3://other-bucket/target")

    # a holder that stops renewing (a paused process; a killed one is the e2e test's): free after its expiry
    second._stop.set()
    for thread in second._threads:
        thread.join(timeout=10)
    third = Lease(target, seconds=1.5)
    wait_for("the lease to expire", lambda: _acquired(third), 20)
    with pytest.raises(LeaseLost, match="another consumer took the lease"):
        second.renew()
    with pytest.raises(LeaseLost):
        second.check()
    _HELD[second.target] = second  # as in its process: its store's guard refuses the merge before any table write
    with pytest.raises(LeaseLost, match="expired"):
        ObjectTargetStore(Path(target)).guard()
    _HELD.pop(second.target)
    third.release()
    # the generations are pruned: a handful of objects, not one per renewal
    assert len(keys(s3_server, s3_bucket, "target/state/lease/")) <= 5


def test_a_holder_whose_store_goes_silent_fences_itself_at_its_expiry(
        s3_env: dict[str, str], s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store stops answering (new connections refused, open ones silent): the renewal hangs on the store, yet
    the holder's watchdog calls ``on_lost`` at the lease's expiry (the job halts its Spark JVM there), and the
    holder refuses to commit from then on."""
    with FaultProxy(s3_server.port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        lease = Lease(f"s3://{s3_bucket}/silent", seconds=1.5)
        fenced = threading.Event()
        lease.on_lost = fenced.set
        lease.acquire()
        proxy.refuse(120)
        proxy.blackhole()
        wait_for("the lease's watchdog fencing the holder", fenced.is_set, 30)
        assert lease.lost is not None and "the lease was not renewed within 1.5 s" in lease.lost
        with pytest.raises(LeaseLost, match="Nothing more is committed"):
            lease.check()
        proxy.refuse(0)
        lease.release()  # lost: nothing is handed back, the generation expires on its own


def _acquired(lease: Lease) -> bool:
    try:
        lease.acquire()
    except TargetLocked:
        return False
    return True


def test_a_killed_holder_keeps_the_target_until_its_lease_expires(s3_env: dict[str, str], s3_bucket: str,
                                                                  tmp_path: Path) -> None:
    target = f"s3://{s3_bucket}/t"
    code = (f"from cdcd.spark.lease import Lease; Lease({target!r}, seconds=2).acquire(); print('held', flush=True); "
            "import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(TargetLocked, match=f"pid {holder.pid} on"):
            Lease(target, seconds=2).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    taker = Lease(target, seconds=2)
    wait_for("the killed holder's lease to expire", lambda: _acquired(taker), 30)
    taker.release()


def test_commit_records_on_the_store(s3_env: dict[str, str], s3_server: S3Server, s3_bucket: str) -> None:
    target = Path(f"s3a://{s3_bucket}/tgt")  # as the job holds it: a Path of the URL
    store = ObjectTargetStore(target)
    assert store.load() == ConsumerState()
    state = ConsumerState(7, {"public.t": TableState("p7", "run1")})
    journal = {"state": state.to_json(), "files": [], "buckets": []}
    with pytest.raises(LeaseLost, match="holds no lease"):  # no commit without the lease
        store.commit(journal)
    lease = Lease(target, seconds=30)
    lease.acquire()
    try:
        for seq in range(7, 20):
            store.commit({**journal, "state": ConsumerState(seq, state.tables).to_json()})
        assert ObjectTargetStore(target).load().applied_seq == 19
        store.save(ConsumerState(19, state.tables))  # the same record again (a retried PUT): no error
        with pytest.raises(LeaseLost, match="written by another consumer"):
            store.save(ConsumerState(19, {}))
        with pytest.raises(Exception, match="--format parquet cannot write to object storage"):
            store.commit({**journal, "buckets": [["a", "b"]]})
        records = keys(s3_server, s3_bucket, "tgt/state/commits/")
        assert len(records) == 10 and records[-1].endswith(f"{19:020d}.json")  # older ones pruned
        store.bind_zone("zone-1", Path("/landing"))
        assert store.bound_zone() == "zone-1"
        assert json.loads(read_state(target, "zone.json") or "{}")["zone_id"] == "zone-1"
    finally:
        lease.release()


def test_rejected_keys_for_the_target_exit_1_naming_the_target_and_the_settings(
        s3_env: dict[str, str], s3_bucket: str, tmp_path: Path) -> None:
    (tmp_path / "landing").mkdir()
    env = {**os.environ, **s3_env, "AWS_SECRET_ACCESS_KEY": "not-the-secret-key"}
    done = subprocess.run([str(Path(sys.executable).with_name("cdcd")), "spark", "run", "--landing", "landing",
                           "--target", f"s3a://{s3_bucket}/target", "--once", "--log-format", "console"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 1, done.stderr  # before any JVM: the lease is taken first
    assert f"target s3://{s3_bucket}/target: the store refused the credentials" in done.stderr, done.stderr
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in done.stderr and "landing.s3" not in done.stderr
    assert "not-the-secret-key" not in done.stderr


def test_a_put_whose_answer_was_lost_is_still_the_holders(s3_env: dict[str, str], s3_bucket: str) -> None:
    """The store made the generation but its answer never came (boto3 retries, or the next renewal finds it):
    the lease is still this consumer's, not lost to "another consumer"."""
    lease = Lease(f"s3://{s3_bucket}/t", seconds=30)
    lease.acquire()
    lease._stop.set()  # renewed by hand below
    try:
        ours = json.dumps({"holder": lease.id, "host": "h", "pid": 1, "expires": time.time() + 30}).encode()
        gen = lease.generation
        assert lease.store.create(f"state/lease/{gen + 1:020d}", ours)  # a renewal's PUT, its answer lost
        lease.renew()  # finds it, and renews past it
        assert lease.generation == gen + 2
        assert lease.store.create(f"state/lease/{gen + 3:020d}", ours)
        assert lease._take(gen + 3, 30)  # a retried PUT refused by its own first attempt
        lease.check()
    finally:
        lease.release()
