"""Structured logging for cdcd (structlog).

JSON lines when the log stream is not a TTY (systemd, containers), a coloured
console renderer when it is; ``log.format`` forces either. Every line carries
the context bound with :func:`bind_context` (source, batch, position). The
level can change at runtime (:func:`set_level`, used by SIGHUP). Secrets are
scrubbed by a processor: keys that look like passwords are replaced, and
passwords inside connection URLs are masked.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, TextIO


def _import_structlog_without_rich() -> None:
    """``import structlog``, leaving out rich unless something loaded it already.

    structlog imports rich and pygments as it is imported, only to draw exceptions on a console: about
    60 ms of every daemon start. Without them its console renderer prints plain tracebacks. The daemon's
    entry point imports this module before anything else imports structlog.
    """
    if "rich" in sys.modules or "structlog" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # an import of rich now fails: structlog skips it
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]


_import_structlog_without_rich()

import structlog  # noqa: E402
from structlog.typing import EventDict, Processor, WrappedLogger  # noqa: E402

Format = Literal["auto", "json", "console"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_SECRET_KEY = re.compile(r"pass(word|wd)?|secret|token|credential", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://[^:/@\s]+):[^@\s]+@", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(?P<key>password\s*[=:]\s*)('[^']*'|\"[^\"]*\"|\S+)", re.IGNORECASE)
REDACTED = "<redacted>"

_state: dict[str, int] = {"level": logging.INFO}


class _Stream:
    """A file that always writes to the current ``sys.stdout``/``sys.stderr``.

    rich's live display swaps ``sys.stdout`` for a redirecting proxy; writing
    through this indirection keeps log lines above the display instead of
    tearing it.
    """

    def __init__(self, name: Literal["stdout", "stderr"]) -> None:
        self.name = name

    def _target(self) -> TextIO:
        return sys.stdout if self.name == "stdout" else sys.stderr

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()


def level_number(level: str) -> int:
    try:
        return _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(_LEVELS)}") from None


def set_level(level: str) -> None:
    """Change the level of every cdcd logger (and of the standard library's) at once."""
    number = level_number(level)
    _state["level"] = number
    logging.getLogger().setLevel(number)


def get_level() -> str:
    return next(name for name, number in _LEVELS.items() if number == _state["level"])


_METHOD_LEVELS = {**_LEVELS, "warn": logging.WARNING, "exception": logging.ERROR, "critical": logging.CRITICAL,
                  "fatal": logging.CRITICAL}


def _filter_level(_: WrappedLogger, method: str, event: EventDict) -> EventDict:
    if _METHOD_LEVELS.get(method, logging.INFO) < _state["level"]:
        raise structlog.DropEvent
    return event


def scrub_text(text: str) -> str:
    """Mask passwords inside connection URLs and ``password=...`` fragments."""
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('scheme')}:{REDACTED}@", text)
    return _KV_PASSWORD.sub(lambda m: f"{m.group('key')}{REDACTED}", text)


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return scrub_text(value)
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(k, str) and _SECRET_KEY.search(k) else _scrub_value(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_scrub_value(v) for v in value]
    return value


def scrub_secrets(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    """Never let a password reach a log line, whatever a caller passed."""
    for key in list(event):
        if _SECRET_KEY.search(key):
            event[key] = REDACTED
        else:
            event[key] = _scrub_value(event[key])
    return event


def _scrub_exception(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
    if isinstance(event.get("exception"), str):
        event["exception"] = scrub_text(event["exception"])
    return event


def _renderer(fmt: Format, stream: _Stream) -> Processor:
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    if use_console:
        return structlog.dev.ConsoleRenderer(colors=stream.isatty())
    return structlog.processors.JSONRenderer()


def _shared_processors() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        scrub_secrets,
    ]


def configure_logging(
    level: str = "info", fmt: Format = "auto", stream: Literal["stdout", "stderr"] = "stdout"
) -> None:
    """Set up structlog and route the standard library's logging through it.

    The daemon logs to stdout (12-factor; journald and container runtimes
    collect it); the one-shot commands log to stderr so their output stays
    parseable.
    """
    out = _Stream(stream)
    renderer = _renderer(fmt, out)
    structlog.configure(
        processors=[
            _filter_level,
            *_shared_processors(),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _scrub_exception,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=out),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    # Libraries (asyncpg, pymysqlreplication) log through the standard library.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_shared_processors(),
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _scrub_exception, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_level(level)


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name) if name else structlog.get_logger()


def _context(source: str | None, batch: int | None, position: object | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The context keys to bind: the given ones of source / batch / position (as text), then ``extra``."""
    values = dict(extra)
    if source is not None:
        values["source"] = source
    if batch is not None:
        values["batch"] = batch
    if position is not None:
        values["position"] = str(position)
    return values


def bind_context(
    *, source: str | None = None, batch: int | None = None, position: object | None = None, **extra: Any
) -> None:
    """Bind source / batch / position (and any extra keys) to every following log line of this task."""
    structlog.contextvars.bind_contextvars(**_context(source, batch, position, extra))


def unbind_context(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)


@contextmanager
def log_context(
    *, source: str | None = None, batch: int | None = None, position: object | None = None, **extra: Any
) -> Iterator[None]:
    """Like :func:`bind_context` for the duration of a ``with`` block only."""
    with structlog.contextvars.bound_contextvars(**_context(source, batch, position, extra)):
        yield
