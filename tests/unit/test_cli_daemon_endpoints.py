"""The daemon's HTTP server and the metrics it renders from a runtime status document."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cdcd.daemon.httpserver import HttpServer, Response
from cdcd.daemon.metrics import make_registry, render
from cdcd.errors import ConfigError


def _status(committed: int, lag_ms: int | None = 120) -> dict[str, Any]:
    return {
        "state": "running",
        "source_kind": "postgres",
        "stats": {
            "events_seen": committed + 5, "events_committed": committed, "events_skipped": 2,
            "batches_delivered": 9, "batches_inflight": 1, "max_inflight_batches": 4, "queue_size": 0,
            "queue_capacity": 1, "committed_batch_seq": 8, "checkpoint_saved_at": time.time() - 3,
            "checkpoint_failures": 0, "source_reconnects": 1, "last_error": "connection reset by postgresql://cdc:pw@db/",
            "last_tick": time.monotonic(), "table_events": {"public.orders": committed - 1, "public.customers": 1},
            "schema_changes": {"public.orders": {"version": 4, "position": "pg:1", "at": time.time(), "count": 3}},
        },
        "source": {
            "connected": True, "phase": "snapshot", "lag_ms": lag_ms, "slot_lag_bytes": 4096,
            "snapshot": {"public.orders": {"rows": 500, "total_estimate": 1000, "done": False},
                         "public.customers": {"rows": 10, "total_estimate": 10, "done": True}},
        },
        "checkpoint": None,
    }


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_render_and_parse() -> None:
    doc = _status(100)
    samples = _samples(render(make_registry(lambda: doc, lambda: True)).decode())
    assert samples[("cdcd_events_committed_total", ())] == 100
    assert samples[("cdcd_events_seen_total", ())] == 105
    assert samples[("cdcd_events_redelivered_skipped_total", ())] == 2
    assert samples[("cdcd_milliseconds_behind_source", ())] == 120
    assert samples[("cdcd_ready", ())] == 1
    assert samples[("cdcd_state", (("state", "running"),))] == 1
    assert samples[("cdcd_state", (("state", "stopped"),))] == 0
    assert samples[("cdcd_table_events_total", (("table", "public.orders"),))] == 99
    assert samples[("cdcd_schema_changes_total", (("table", "public.orders"),))] == 3
    assert samples[("cdcd_snapshot_running", ())] == 1
    assert samples[("cdcd_snapshot_remaining_tables", ())] == 1
    assert samples[("cdcd_snapshot_rows_scanned_total", (("table", "public.orders"),))] == 500
    assert samples[("cdcd_postgres_slot_lag_bytes", ())] == 4096
    assert 2 <= samples[("cdcd_checkpoint_age_seconds", ())] < 3600
    errors = [labels for (name, labels) in samples if name == "cdcd_last_error_info"]
    assert errors and "pw@" not in dict(errors[0])["message"]


def test_metrics_follow_the_status_at_scrape_time() -> None:
    doc = _status(100, lag_ms=None)
    registry = make_registry(lambda: doc, lambda: False)
    first = _samples(render(registry).decode())
    doc["stats"]["events_committed"] = 250
    doc["source"].update(phase="streaming", binlog_file="mysql-bin.000003", binlog_pos=1234)
    second = _samples(render(registry).decode())
    assert first[("cdcd_events_committed_total", ())] == 100
    assert second[("cdcd_events_committed_total", ())] == 250
    assert ("cdcd_milliseconds_behind_source", ()) not in second  # unknown lag is absent, not 0
    assert second[("cdcd_ready", ())] == 0
    assert second[("cdcd_snapshot_completed", ())] == 1
    assert second[("cdcd_mysql_binlog_position", ())] == 1234
    assert second[("cdcd_mysql_binlog_info", (("file", "mysql-bin.000003"),))] == 1


async def _get(port: int, request: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_http_server_routes() -> None:
    async def slow() -> Response:
        return Response.json(200, {"ok": True})

    server = HttpServer("127.0.0.1", 0, {"/healthz": lambda: Response(200, b"ok\n"), "/status": slow})
    await server.start()
    try:
        assert await _get(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b"ok\n")
        status, body = await _get(server.port, b"GET /status?x=1 HTTP/1.0\r\n\r\n")
        assert status == 200 and b'"ok": true' in body
        assert (await _get(server.port, b"HEAD /healthz HTTP/1.1\r\n\r\n")) == (200, b"")
        assert (await _get(server.port, b"GET /nope HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await _get(server.port, b"POST /healthz HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await _get(server.port, b"garbage\r\n\r\n"))[0] == 400
    finally:
        await server.close()


async def test_http_port_in_use_is_a_config_error() -> None:
    first = HttpServer("127.0.0.1", 0, {})
    await first.start()
    try:
        with pytest.raises(ConfigError, match=r"http\.listen"):
            await HttpServer("127.0.0.1", first.port, {}).start()
    finally:
        await first.close()


def test_metrics_report_failing_checkpoint_saves_and_landing_writes() -> None:
    doc = _status(100)
    registry = make_registry(lambda: doc, lambda: False)
    fine = _samples(render(registry).decode())
    assert fine[("cdcd_checkpoint_failing", ())] == 0 and fine[("cdcd_checkpoint_failing_seconds", ())] == 0
    doc["stats"].update(checkpoint_failures=3, checkpoint_failing_since=time.time() - 40)
    doc["sink"] = {"write_failures": 2, "failing_since": time.time() - 5}
    failing = _samples(render(registry).decode())
    assert failing[("cdcd_checkpoint_failures_total", ())] == 3
    assert failing[("cdcd_checkpoint_failing", ())] == 1
    assert 40 <= failing[("cdcd_checkpoint_failing_seconds", ())] < 3600
    assert failing[("cdcd_landing_write_failures_total", ())] == 2
    assert failing[("cdcd_landing_failing", ())] == 1
    assert 5 <= failing[("cdcd_landing_failing_seconds", ())] < 3600


def test_status_line_and_progress_log_name_a_storage_fault() -> None:
    from cdcd.daemon.progress import RateTracker, progress_fields, summary_line

    doc = _status(100)
    assert "PAUSED" not in summary_line(doc)
    doc["storage_fault"] = {"error": "checkpoint saves are failing: disk full", "failing_for_s": 12.0}
    assert "PAUSED for 12.0s: checkpoint saves are failing: disk full" in summary_line(doc)
    assert progress_fields(doc, RateTracker())["storage_fault"] == doc["storage_fault"]


async def test_http_server_post_endpoints_take_a_json_object_from_loopback_clients() -> None:
    from cdcd.daemon.httpserver import _is_loopback

    seen: list[dict[str, Any]] = []

    def take(doc: dict[str, Any]) -> Response:
        seen.append(doc)
        return Response.json(202, {"queued": doc})

    server = HttpServer("127.0.0.1", 0, {"/status": lambda: Response(200, b"{}")}, {"/snapshot": take}, "tok-1")
    await server.start()
    auth = b"Authorization: Bearer tok-1\r\n"
    try:
        body = b'{"table": "public.t", "where": "id > 5"}'
        status, answer = await _get(server.port, b"POST /snapshot HTTP/1.1\r\nContent-Type: application/json\r\n"
                                    b"%sContent-Length: %d\r\n\r\n%s" % (auth, len(body), body))
        assert status == 202 and b'"where": "id > 5"' in answer
        assert (await _get(server.port, b"POST /snapshot HTTP/1.1\r\n%s\r\n" % auth))[0] == 202  # no body: {}
        assert seen == [{"table": "public.t", "where": "id > 5"}, {}]
        # without the control token, or with another, nothing is done (a local process is not enough)
        for wrong in (b"", b"Authorization: Bearer tok-2\r\n", b"Authorization: tok-1\r\n"):
            status, answer = await _get(server.port, b"POST /snapshot HTTP/1.1\r\n%s\r\n" % wrong)
            assert status == 401 and b"control token" in answer and b"tok-1" not in answer
        assert len(seen) == 2
        assert (await _get(server.port, b"POST /snapshot HTTP/1.1\r\n%sContent-Length: 2\r\n\r\n[]" % auth))[0] == 400
        assert (await _get(server.port, b"POST /snapshot HTTP/1.1\r\n%sContent-Length: 3\r\n\r\n{x}" % auth))[0] == 400
        assert (await _get(server.port,
                           b"POST /snapshot HTTP/1.1\r\n%sContent-Length: 999999\r\n\r\n" % auth))[0] == 413
        assert (await _get(server.port, b"GET /snapshot HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await _get(server.port, b"POST /status HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await _get(server.port, b"POST /other HTTP/1.1\r\n\r\n"))[0] == 404
        assert len(seen) == 2
    finally:
        await server.close()
    # only clients on the daemon's host may ask (a request can make the daemon run SQL on the source)
    assert _is_loopback(("127.0.0.1", 5)) and _is_loopback(("::1", 5, 0, 0)) and _is_loopback(("::ffff:127.0.0.1", 5))
    assert not _is_loopback(("10.1.2.3", 5)) and not _is_loopback(("fe80::1%eth0", 5)) and not _is_loopback(None)


def test_metrics_report_incremental_snapshots_per_table() -> None:
    doc = {**_status(10), "incremental_snapshots": [
        {"table": "public.orders", "where": None, "state": "done", "chunks": 4, "rows": 400, "last_key": ["400"]},
        {"table": "public.items", "where": "id > 5", "state": "failed", "chunks": 0, "rows": 0, "error": "bad"},
        {"table": "public.orders", "where": None, "state": "running", "chunks": 2, "rows": 150, "last_key": ["150"]},
        {"table": "public.more", "where": None, "state": "queued", "chunks": 0, "rows": 0, "last_key": None},
    ]}
    samples = _samples(render(make_registry(lambda: doc, lambda: True)).decode())
    assert [samples[("cdcd_incremental_snapshots", (("state", s),))] for s in ("queued", "running", "done", "failed")
            ] == [1, 1, 1, 1]
    orders = (("table", "public.orders"),)
    assert samples[("cdcd_incremental_snapshot_running", orders)] == 1  # the newest request of the table
    assert samples[("cdcd_incremental_snapshot_rows", orders)] == 150
    assert samples[("cdcd_incremental_snapshot_chunks", orders)] == 2
    assert samples[("cdcd_incremental_snapshot_running", (("table", "public.items"),))] == 0
