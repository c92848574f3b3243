"""The one error hierarchy of cdcd.

Every error says what was wrong, where, and how to fix it. ``Fatal`` variants
must not be retried: the runtime stops and the process exits non-zero.
"""

from __future__ import annotations


def reason(exc: BaseException) -> str:
    """What ``exc`` says, never empty: a timeout (``TimeoutError`` has no message) or another error without a
    message is named by its kind, so a wrapping error never ends in "...: " with nothing after it."""
    text = str(exc).strip()
    if text:
        return text
    if isinstance(exc, TimeoutError):
        return "timed out"
    return type(exc).__name__


class CdcdError(Exception):
    """Base of every error cdcd raises on purpose."""

    #: True for errors that must not be retried.
    fatal: bool = False


class ConfigError(CdcdError):
    """The configuration is invalid. Always fatal: retrying cannot fix it."""

    fatal = True


class SourceError(CdcdError):
    """A source failed in a way that a reconnect may cure."""


class SourceUnavailable(SourceError):
    """The source cannot be reached now (connection refused, lost or silent): retried with the backoff by
    whatever was asking (the stream, a snapshot chunk, a table reload) until runtime.source_retry_timeout_s."""


class SourceFatal(SourceError):
    """A source failed in a way no retry can cure (slot gone, binlog purged, auth)."""

    fatal = True


class PositionLost(SourceFatal):
    """The checkpoint's position is no longer in the source's history: the replication slot is gone or lost WAL
    it needs, binlogs were purged or reset, or the server is another history. Never resumed (a restart would
    either fail again or, worse, go on from the wrong place): its own exit code, which the service units and
    container files do not restart."""


class NothingToRecover(CdcdError):
    """`cdcd recover` found the checkpoint's position still in the source's history (or no checkpoint at all)."""

    fatal = True


class MirrorUnreadable(CdcdError):
    """`cdcd verify` could not read a table's mirror (pyarrow, Spark or the catalog failed): exit 2."""

    fatal = True


class CheckpointError(CdcdError):
    """The checkpoint could not be saved; the runtime retries the save on a timer."""


class CheckpointFatal(CheckpointError):
    """The checkpoint is corrupt or unusable."""

    fatal = True


class StateDirLocked(CheckpointFatal):
    """Another daemon holds the state directory's lock."""


class StateError(CdcdError):
    """A lifecycle call is not allowed in the current state."""


class StateFatal(StateError):
    fatal = True


class SinkError(CdcdError):
    """The sink failed to land a batch; the batch may be retried."""


class SinkFatal(SinkError):
    fatal = True
