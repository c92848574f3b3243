"""cdcd.logging: JSON lines off a TTY, bound context, runtime level changes, secrets scrubbed."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from cdcd.logging import bind_context, configure_logging, get_level, log_context, scrub_text, set_level


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """Leave the process's logging as it was: other tests' caplog must not see our handlers or levels."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_lines_when_not_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "auto")
    structlog.get_logger("t").info("hello", rows=3)
    (line,) = _lines(capsys.readouterr().out)
    assert line["event"] == "hello" and line["rows"] == 3 and line["level"] == "info"
    assert "timestamp" in line


def test_console_format_is_not_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "console")
    structlog.get_logger("t").info("hello", rows=3)
    out = capsys.readouterr().out
    assert "hello" in out and "rows" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.splitlines()[0])


def test_context_carries_source_batch_and_position(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    bind_context(source="postgres:app")
    with log_context(batch=7, position="0/16B3748#2"):
        structlog.get_logger().info("landed")
    structlog.get_logger().info("after")
    inside, after = _lines(capsys.readouterr().out)
    assert inside["source"] == "postgres:app" and inside["batch"] == 7 and inside["position"] == "0/16B3748#2"
    assert after["source"] == "postgres:app" and "batch" not in after


def test_level_changes_at_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    log = structlog.get_logger("t")  # created before the change, as module-level loggers are
    log.debug("hidden")
    set_level("debug")
    log.debug("shown")
    assert get_level() == "debug"
    set_level("error")
    log.warning("hidden too")
    log.error("shown too")
    events = [line["event"] for line in _lines(capsys.readouterr().out)]
    assert events == ["shown", "shown too"]
    with pytest.raises(ValueError, match="unknown log level"):
        set_level("loud")


def test_standard_library_logging_goes_through_the_same_renderer(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    bind_context(source="mariadb:shop")
    logging.getLogger("asyncpg.pool").warning("pool %s closed", "p1")
    (line,) = _lines(capsys.readouterr().out)
    assert line["event"] == "pool p1 closed" and line["source"] == "mariadb:shop"


def test_passwords_never_reach_the_log(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("debug", "json")
    log = structlog.get_logger()
    log.info("connecting", password="hunter2", dsn="postgresql://cdc:hunter2@db:5432/app",
             options={"db_password": "hunter2", "host": "db"}, args=["password=hunter2 host=db"])
    try:
        raise RuntimeError("auth failed for postgresql://cdc:hunter2@db/app")
    except RuntimeError:
        log.exception("failed")
    out = capsys.readouterr().out
    assert "hunter2" not in out
    first = _lines(out)[0]
    assert first["dsn"] == "postgresql://cdc:<redacted>@db:5432/app"
    assert first["options"] == {"db_password": "<redacted>", "host": "db"}


def test_scrub_text_leaves_ordinary_text_alone() -> None:
    assert scrub_text("table public.orders at 0/16B3748") == "table public.orders at 0/16B3748"
    assert scrub_text("mysql://root:pw@127.0.0.1:3306") == "mysql://root:<redacted>@127.0.0.1:3306"
    assert scrub_text("password = 'x y'") == "password = <redacted>"
