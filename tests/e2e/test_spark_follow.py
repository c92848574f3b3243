"""A following `cdcd spark run` as an operator watches it (real Spark, real processes): Prometheus metrics and
/healthz scraped while it follows a landing zone the landing sink fills, one structured line per merge and no
Spark, log4j or py4j chatter; a failed run names the table, the batch and the fix, with the Java trace only at
debug; no `spark-warehouse/` left in the working directory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.waits import wait_for

from cdcd.events import ChangeEvent, Column, Op, TableId, TableSchema
from cdcd.landing.reader import read_manifest
from cdcd.positions import PgPosition
from cdcd.runtime.interfaces import Batch
from cdcd.sinks.landing import LandingSink
from devtools.servers import free_port

pytestmark = [pytest.mark.spark, pytest.mark.slow]

CDCD = str(Path(sys.executable).with_name("cdcd"))
ORDERS = TableSchema(TableId("public", "orders"), (Column("id", pa.int64(), "bigint", nullable=False),
                                                   Column("v", pa.string(), "text")), ("id",))
TS = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
#: What Spark, log4j, the JVM and py4j print when left alone (issue 31, 10).
CHATTER = ("Closing down clientserver", "log4j", "Setting default log level", "WARN ", "NativeCodeLoader",
           "incubator", "cdcd-spark:", "sc.setLogLevel")


def land(landing: Path, seq: int, ids: range) -> None:
    async def go() -> None:
        sink = LandingSink(landing)
        await sink.open()
        await sink.deliver(Batch(seq, [ChangeEvent(Op.CREATE, ORDERS, PgPosition(1000 * seq + i, 0), tx_id=str(seq),
                                                   commit_ts=TS, after={"id": i, "v": f"v{i}"}) for i in ids]))
        await sink.close()

    asyncio.run(go())


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def log_lines(path: Path, quiet: bool = True) -> list[dict[str, Any]]:
    """Every line of the consumer's output as a JSON object: no plain text in between, and (``quiet``, below
    debug) none of Spark's, the JVM's or py4j's chatter."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for line in lines:
        assert not (quiet and any(c in line for c in CHATTER)), line
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError as exc:
        pytest.fail(f"a line of the consumer's output is not JSON ({exc}):\n{path.read_text()[-4000:]}")


def test_following_consumer_serves_metrics_and_health_and_logs_one_line_per_merge(tmp_path: Path) -> None:
    landing, target, cwd = tmp_path / "landing", tmp_path / "target", tmp_path / "cwd"
    cwd.mkdir()
    land(landing, 1, range(1, 4))
    land(landing, 2, range(2, 6))  # keys 2 and 3 again: the merge marks their rows deleted (deletion vectors)
    port = free_port()
    log = tmp_path / "consumer.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([CDCD, "spark", "run", "--landing", str(landing), "--target", str(target),
                                 "--metrics-listen", f"127.0.0.1:{port}"], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, env=os.environ)
    base = f"http://127.0.0.1:{port}"
    try:
        def applied(seq: int) -> Callable[[], dict[Any, float] | None]:
            def check() -> dict[Any, float] | None:
                status, text = get(f"{base}/metrics")
                found = samples(text) if status == 200 else {}
                return found if found.get(("cdcd_spark_applied_batch_seq", ())) == seq else None
            return check

        wait_for("batch 2 applied", applied(2), 240, procs=proc, log=log)
        wait_for("a following consumer", lambda: "following" in get(f"{base}/healthz")[1], 240, procs=proc, log=log)
        # lands while it follows: the stream picks it up; keys 3..5 again, in files with deletion vectors, which
        # Delta reads with a filter it logs an ERROR about (nothing failed: the log4j settings keep it out)
        land(landing, 3, range(3, 10))
        m = wait_for("batch 3 applied", applied(3), 240, procs=proc, log=log)
        assert get(f"{base}/healthz")[0] == 200
        table = (("table", "public.orders"),)
        assert m[("cdcd_spark_table_applied_batch_seq", table)] == 3
        position = read_manifest(landing, 3).last_position
        assert m[("cdcd_spark_table_position_info", (("position", position), *table))] == 1
        assert m[("cdcd_spark_batches_applied_total", ())] == 3
        assert m[("cdcd_spark_events_applied_total", ())] == 14
        assert m[("cdcd_spark_merge_seconds_count", ())] == 3  # one merge per landing run
        assert m[("cdcd_spark_merge_seconds_sum", ())] > 0
        assert m[("cdcd_spark_lag_batches", ())] == 0 and m[("cdcd_spark_lag_seconds", ())] == 0
        assert m[("cdcd_spark_failures_total", ())] == 0
        assert m[("cdcd_spark_following", ())] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(180)
    assert code == 0, log.read_text()[-4000:]
    lines = log_lines(log)
    merges = [line for line in lines if line.get("event") == "merge applied"]
    assert [(m["batches"], m["events"], m["tables"]) for m in merges] == [
        ("1..1", 3, ["public.orders"]), ("2..2", 4, ["public.orders"]), ("3..3", 7, ["public.orders"])]
    for m in merges:
        assert m["level"] == "info" and m["seconds"] > 0 and m["format"] == "delta"
        assert m["files_added"] >= 1 and m["files_rewritten"] >= 0
    assert not [line for line in lines if line["level"] in ("warning", "error")], lines
    assert not (cwd / "spark-warehouse").exists() and not list(cwd.iterdir())


def test_failed_run_names_the_table_the_batch_and_the_fix_with_the_java_trace_only_at_debug(tmp_path: Path) -> None:
    landing, target, cwd = tmp_path / "landing", tmp_path / "target", tmp_path / "cwd"
    cwd.mkdir()
    land(landing, 1, range(1, 4))
    lost = landing / read_manifest(landing, 1).files[0].path
    lost.unlink()  # as a retention shorter than the consumer's lag would, or an operator's rm
    outputs = {}
    for level in ("info", "debug"):
        log = tmp_path / f"{level}.log"
        with log.open("wb") as out:
            done = subprocess.run([CDCD, "spark", "run", "--landing", str(landing), "--target", str(target),
                                   "--once", "--format", "parquet", "--log-level", level], cwd=cwd, stdout=out,
                                  stderr=subprocess.STDOUT, env=os.environ, timeout=300)
        assert done.returncode == 1, log.read_text()[-4000:]
        outputs[level] = log.read_text()
        errors = [line for line in log_lines(log, quiet=level != "debug") if line["level"] == "error"]
        assert len(errors) == 1, errors
        error = errors[0]
        assert error["event"] == "merge failed" and error["table"] == "public.orders" and error["batches"] == "1..1"
        assert str(lost.relative_to(landing)) in error["fix"] and "batch 1" in error["fix"]
    assert "\tat " not in outputs["info"] and "at org.apache" not in outputs["info"]
    assert "org.apache" in outputs["debug"] or "Traceback" in outputs["debug"]
    assert not (cwd / "spark-warehouse").exists() and not list(cwd.iterdir())
