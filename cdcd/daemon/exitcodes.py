"""The exit codes of ``cdcd``, documented in docs/operations.md.

systemd's ``RestartPreventExitStatus`` lists the codes a restart cannot cure
(configuration, a second daemon on the state directory, a corrupt
checkpoint, a lost source position).
"""

from __future__ import annotations

import enum

from cdcd.errors import CheckpointFatal, ConfigError, PositionLost, SinkError, SourceError, StateDirLocked


class ExitCode(enum.IntEnum):
    OK = 0  # graceful stop, or a one-shot command that succeeded
    FAILURE = 1  # a check failed (cdcd check, verify drift) or an unexpected error
    USAGE = 2  # bad command line (argparse)
    FORCE_STOPPED = 3  # force-stop: pending batches dropped, checkpoint at the last acked batch
    SOURCE_FATAL = 4  # the source failed beyond retry (slot gone, binlog purged, auth)
    SINK_FATAL = 5  # the landing zone failed beyond retry
    CHECKPOINT_FATAL = 6  # the checkpoint is corrupt or unusable
    STATE_DIR_LOCKED = 7  # another daemon holds the state directory
    STOP_TIMEOUT = 8  # cdcd stop / force-stop: the daemon did not exit within --timeout
    POSITION_LOST = 9  # the checkpoint's position is gone from the source (slot, purged/reset binlog, other history)
    CONFIG = 78  # EX_CONFIG from sysexits.h: the configuration is invalid


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code for the error that ended the daemon."""
    if isinstance(exc, ConfigError):
        return ExitCode.CONFIG
    if isinstance(exc, PositionLost):
        return ExitCode.POSITION_LOST
    if isinstance(exc, SourceError):
        return ExitCode.SOURCE_FATAL
    if isinstance(exc, SinkError):
        return ExitCode.SINK_FATAL
    if isinstance(exc, StateDirLocked):
        return ExitCode.STATE_DIR_LOCKED
    if isinstance(exc, CheckpointFatal):
        return ExitCode.CHECKPOINT_FATAL
    return ExitCode.FAILURE
