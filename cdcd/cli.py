"""The ``cdcd`` command line (docs/cli.md).

Every command takes ``-c FILE`` (or ``CDCD_CONFIG``) where it needs the
configuration. Exit codes are those of :mod:`cdcd.daemon.exitcodes`; a
configuration error prints the ConfigError message and exits 78.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Before numpy is first imported (cdcd.config -> cdcd.events): numpy's import runs one small BLAS call, after
# which OpenBLAS's pool (a thread per core) spins waiting for more work; cdcd makes no BLAS calls, so those
# threads only took CPU from the readers and the landing (2-5% of the daemon's samples in a snapshot, perf).
# A value the environment sets is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

if sys.argv[1:3] == ["spark", "run"]:  # the Spark consumer takes SIGTERM/SIGINT before the rest loads (docs/spark.md)
    from cdcd.spark.stopping import GUARD

    GUARD.install()

from cdcd import __version__
from cdcd.config import Config, load_config
from cdcd.daemon.exitcodes import ExitCode, exit_code_for
from cdcd.errors import CdcdError, StateError
from cdcd.logging import configure_logging

Command = Callable[[argparse.Namespace], int]


def _config(args: argparse.Namespace, connects: bool = False) -> Config:
    """The config of ``args.config``; the source's secret is read only by the commands that connect to it."""
    return load_config(args.config, connects=connects)


def _quiet_logging(config: Config | None = None) -> None:
    """One-shot commands log to stderr (warnings and up) so stdout stays clean for output."""
    configure_logging("warning", config.log.format if config else "auto", stream="stderr")


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str, sort_keys=True))


# -- run / check -----------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    config = _config(args, connects=True)
    configure_logging(config.log.level, config.log.format, stream="stdout")
    from cdcd.daemon.lifecycle import run_daemon

    return run_daemon(config, Path(args.config))


def cmd_recover(args: argparse.Namespace) -> int:
    config = _config(args, connects=True)
    configure_logging(config.log.level, config.log.format, stream="stderr")
    from cdcd.daemon.recover import describe, recover

    print(describe(asyncio.run(recover(config))))
    return ExitCode.OK


def cmd_check(args: argparse.Namespace) -> int:
    config = _config(args, connects=True)
    _quiet_logging(config)
    print(f"ok    config: {args.config} is valid ({config.source.kind} source, {len(config.source.tables)} tables)")
    from cdcd.runtime.interfaces import CheckResult

    results: list[CheckResult]
    try:
        results = asyncio.run(_preflight(config))
    except CdcdError as exc:
        results = [CheckResult("connect", False, str(exc), "check source.host, port, user and the password")]
    for r in results:
        print(f"{'ok  ' if r.ok else 'FAIL'}  {r.name}: {r.detail}")
        if not r.ok and r.fix:
            print(f"      fix: {r.fix}")
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(results)} checks failed: {', '.join(failed)}")
        return ExitCode.FAILURE
    print(f"all {len(results)} checks passed")
    return ExitCode.OK


async def _preflight(config: Config) -> list[Any]:
    from cdcd.sources import make_source

    source = make_source(config)
    try:
        return list(await source.preflight())
    finally:
        with contextlib.suppress(Exception):
            await source.close()


# -- status / stop ---------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    config = _config(args)
    _quiet_logging(config)
    from cdcd.daemon.control import daemon_pid, fetch_status

    live = fetch_status(config)
    if live is not None:
        doc: dict[str, Any] = {"running": True, **live}
    else:
        from cdcd.checkpoint.store import CheckpointStore

        ckpt = CheckpointStore(config.state.path, config.state.keep_checkpoints).load()
        doc = {
            "running": daemon_pid(config) is not None,
            "pid": daemon_pid(config),
            "state": "unreachable" if daemon_pid(config) else "not running",
            "checkpoint": None if ckpt is None else {**ckpt.body(), "path": str(config.state.path / "checkpoint.json")},
        }
    if args.json:
        _print_json(doc)
    else:
        from cdcd.daemon.progress import status_lines

        print("\n".join(status_lines(doc)))
    return ExitCode.OK


def _stop(args: argparse.Namespace, sig: signal.Signals, default_timeout: Callable[[Config], float]) -> int:
    config = _config(args)
    _quiet_logging(config)
    from cdcd.daemon.control import signal_and_wait

    timeout = args.timeout if args.timeout is not None else default_timeout(config)
    pid, exited = signal_and_wait(config, sig, timeout)
    if pid is None:
        print(f"no cdcd daemon runs on {config.state.path}")
        return ExitCode.OK
    if not exited:
        print(f"cdcd (pid {pid}) did not exit within {timeout:g}s", file=sys.stderr)
        return ExitCode.STOP_TIMEOUT
    print(f"cdcd (pid {pid}) stopped")
    return ExitCode.OK


def cmd_stop(args: argparse.Namespace) -> int:
    return _stop(args, signal.SIGTERM, lambda c: c.runtime.shutdown_grace_s + 30)


def cmd_force_stop(args: argparse.Namespace) -> int:
    return _stop(args, signal.SIGQUIT, lambda c: 30.0)


# -- snapshot / tables reload (requests to the running daemon, docs/operations.md) ------------------


def _request(config: Config, args: argparse.Namespace, path: str, doc: dict[str, Any]) -> dict[str, Any] | int:
    """POST to the running daemon; its answer, or the exit code after saying what is wrong."""
    from cdcd.daemon.control import Unreachable, daemon_pid, post

    try:
        status, answer = post(config, path, doc)
    except ValueError:
        print(f"cdcd: {args.config}: http.listen is off; `cdcd {args.command}` asks the running daemon over its "
              "HTTP listener: set http.listen (e.g. \"127.0.0.1:9187\") and restart the daemon", file=sys.stderr)
        return ExitCode.CONFIG
    except Unreachable as exc:
        pid = daemon_pid(config)
        if pid is None:
            print(f"cdcd: no cdcd daemon runs on {config.state.path}; start it with `cdcd run -c {args.config}` "
                  "(this request needs a running daemon)", file=sys.stderr)
        else:
            print(f"cdcd: the daemon (pid {pid}) holds {config.state.path} but its HTTP listener does not answer "
                  f"({exc}); is http.listen in {args.config} the daemon's?", file=sys.stderr)
        return ExitCode.FAILURE
    if status >= 300:
        print(f"cdcd: {answer.get('error', answer)}", file=sys.stderr)
        return ExitCode.FAILURE
    return answer


def cmd_snapshot(args: argparse.Namespace) -> int:
    config = _config(args)
    _quiet_logging(config)
    answer = _request(config, args, "/snapshot", {"table": args.table, "where": args.where})
    if isinstance(answer, int):
        return answer
    queued = answer["queued"]
    what = f"the rows of {queued['table']} where {queued['where']}" if queued.get("where") else queued["table"]
    print(f"queued: an incremental snapshot of {what}, read while the stream runs; follow it with "
          f"`cdcd status -c {args.config}`")
    return ExitCode.OK


def cmd_tables_reload(args: argparse.Namespace) -> int:
    config = _config(args)
    _quiet_logging(config)
    answer = _request(config, args, "/tables/reload", {})
    if isinstance(answer, int):
        return answer
    if "pending" in answer:  # not applied yet: never reported as added
        print(f"cdcd: {answer.get('error')}", file=sys.stderr)
        return ExitCode.FAILURE
    added, removed = answer.get("added") or [], answer.get("removed") or []
    if not added and not removed:
        print(f"reloaded: source.tables unchanged ({', '.join(answer.get('tables') or [])})")
    else:
        print(f"reloaded: added {', '.join(added) or 'none'} (snapshotted incrementally while streaming); "
              f"removed {', '.join(removed) or 'none'} (no longer captured; what was landed stays)")
    print(f"log level {answer.get('log_level')}")
    if answer.get("needs_restart"):
        print(f"changed settings that take effect on the next start only: {', '.join(answer['needs_restart'])}")
    return ExitCode.OK


# -- checkpoint ------------------------------------------------------------------------


def _store(config: Config) -> Any:
    from cdcd.checkpoint.store import store_for

    return store_for(config.state)


def cmd_checkpoint_show(args: argparse.Namespace) -> int:
    config = _config(args)
    _quiet_logging(config)
    ckpt = _store(config).load()
    if ckpt is None:
        if args.json:
            _print_json(None)
        else:
            print(f"no checkpoint in {config.state.path} yet")
        return ExitCode.OK
    _print_json({**ckpt.body(), "path": str(config.state.path / "checkpoint.json")})
    return ExitCode.OK


def cmd_checkpoint_list(args: argparse.Namespace) -> int:
    config = _config(args)
    _quiet_logging(config)
    store = _store(config)
    rows = []
    for path, entry in store.entries():
        current = path == store.current_path
        if isinstance(entry, CdcdError):
            rows.append({"path": str(path), "current": current, "error": str(entry)})
        else:
            rows.append({"save_id": entry.save_id, "saved_at": entry.saved_at, "batch_seq": entry.batch_seq,
                         "event_count": entry.event_count, "current": current, "path": str(path),
                         "position": None if entry.position is None else str(entry.position)})
    if args.json:
        _print_json(rows)
        return ExitCode.OK
    if not rows:
        print(f"no checkpoints in {config.state.path}")
    for row in rows:
        mark = "*" if row["current"] else " "
        if "error" in row:
            print(f"{mark} CORRUPT {row['path']}: {row['error']}")
        else:
            print(f"{mark} save {row['save_id']:>6}  {row['saved_at']}  batch {row['batch_seq']:>8}  "
                  f"events {row['event_count']:>10}  {row['position']}")
    return ExitCode.OK


def cmd_checkpoint_rollback(args: argparse.Namespace) -> int:
    config = _config(args)
    _quiet_logging(config)
    try:
        ckpt = _store(config).rollback(args.to)
    except StateError as exc:
        print(f"cdcd: {exc}", file=sys.stderr)
        return ExitCode.STATE_DIR_LOCKED
    print(f"rolled back: the current checkpoint is now save {ckpt.save_id} (copy of save {args.to}), "
          f"batch {ckpt.batch_seq}, position {ckpt.position}")
    print("events after that position are delivered again when the daemon starts")
    return ExitCode.OK


# -- spark / verify (implemented in cdcd.spark and cdcd.verify) --------------------------


def cmd_spark_run(args: argparse.Namespace) -> int:
    # SIGTERM/SIGINT from here on end it with its documented exit code, also while pyspark loads (docs/spark.md)
    importlib.import_module("cdcd.spark.stopping").GUARD.install()
    run_args = importlib.import_module("cdcd.spark.job").run_args  # loaded on use: it imports pyspark

    return int(run_args(args))


def cmd_verify(args: argparse.Namespace) -> int:
    config = _config(args, connects=True)
    _quiet_logging(config)
    verify = importlib.import_module("cdcd.verify").verify
    with importlib.import_module("cdcd.verify.mirror").spark_ended_after():
        return int(verify(config, args.target, tables=args.table, settle_timeout_s=args.settle_timeout))


def cmd_repair(args: argparse.Namespace) -> int:
    config = _config(args, connects=True)
    _quiet_logging(config)
    repair = importlib.import_module("cdcd.repair").repair
    with importlib.import_module("cdcd.verify.mirror").spark_ended_after():
        return int(repair(config, args.target, tables=args.table, dry_run=args.dry_run,
                          settle_timeout_s=args.settle_timeout, wait_timeout_s=args.wait_timeout))


# -- parser ----------------------------------------------------------------------------


def _add_config(p: argparse.ArgumentParser) -> None:
    default = os.environ.get("CDCD_CONFIG")
    p.add_argument("-c", "--config", metavar="FILE", default=default, required=default is None,
                   help="the TOML config file (default: $CDCD_CONFIG)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdcd", description="Change-data-capture daemon: PostgreSQL and MySQL/MariaDB into Apache Spark.",
        epilog="Exit codes: 0 ok, 1 failed check, 2 usage, 3 force-stopped, 4 source fatal, 5 sink fatal, "
               "6 checkpoint unusable, 7 state directory held by another daemon, 8 stop timed out, "
               "9 source position lost (`cdcd recover`), 78 config error. "
               "See docs/cli.md.")
    parser.add_argument("--version", action="version", version=f"cdcd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, func: Command, help_: str, parent: Any = sub) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=help_, description=help_)
        p.set_defaults(func=func)
        return p

    _add_config(command("run", cmd_run, "run the daemon in the foreground (systemd Type=notify, containers)"))
    _add_config(command("check", cmd_check, "validate the config and preflight the source (settings, privileges)"))
    _add_config(command("recover", cmd_recover, "after a lost source position (exit 9), with the daemon stopped: say "
                        "what was lost, take a new slot or binlog position, record the gap in the landing zone and "
                        "make the next run re-snapshot every table incrementally"))
    p = command("status", cmd_status, "the daemon's state, positions, lag, snapshot progress and checkpoint")
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    for name, func, what in (("stop", cmd_stop, "SIGTERM: graceful stop"),
                             ("force-stop", cmd_force_stop, "SIGQUIT: drop pending batches and stop at once")):
        p = command(name, func, f"signal the daemon holding the state directory ({what}) and wait for it to exit")
        _add_config(p)
        p.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="how long to wait for the exit (default: stop: shutdown_grace_s + 30; force-stop: 30)")

    p = command("snapshot", cmd_snapshot, "ask the running daemon to snapshot a table again (incrementally, "
                "while streaming)")
    _add_config(p)
    p.add_argument("table", metavar="TABLE", help="a captured table, schema.table (MySQL: database.table)")
    p.add_argument("--where", metavar="SQL", help="only the rows of a key range or key list: KEY BETWEEN a AND b, "
                   "KEY >= a AND KEY < b, KEY = a, KEY IN (a, b); the mirror rows of it the source no longer has are "
                   "removed; other conditions are refused")
    tables = command("tables", lambda a: ExitCode.USAGE, "the captured tables of the running daemon")
    tables_sub = tables.add_subparsers(dest="tables_command", metavar="ACTION", required=True)
    _add_config(command("reload", cmd_tables_reload, "make the running daemon re-read source.tables (and "
                        "log.level) from its config file, as SIGHUP does, and say what changed", tables_sub))

    ckpt = command("checkpoint", lambda a: ExitCode.USAGE, "inspect the checkpoint history and roll back")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    p = command("show", cmd_checkpoint_show, "print the current checkpoint", ckpt_sub)
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print JSON (the output is JSON already; kept for symmetry)")
    p = command("list", cmd_checkpoint_list, "list the current and earlier checkpoints", ckpt_sub)
    _add_config(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p = command("rollback", cmd_checkpoint_rollback,
                "make an earlier checkpoint current (refused while the daemon runs)", ckpt_sub)
    _add_config(p)
    p.add_argument("--to", type=int, required=True, metavar="SAVE_ID", help="save id from `cdcd checkpoint list`")

    spark = command("spark", lambda a: ExitCode.USAGE, "the PySpark consumer of the landing zone")
    spark_sub = spark.add_subparsers(dest="spark_command", metavar="ACTION", required=True)
    from cdcd.spark import args as spark_args  # the consumer's own parser (no pyspark import)

    spark_args.add_arguments(command("run", cmd_spark_run, spark_args.DESCRIPTION, spark_sub))

    p = command("verify", cmd_verify, "compare every captured source table with its mirror; non-zero on drift")
    _add_config(p)
    p.add_argument("--target", required=True, type=spark_args.local_path, metavar="PATH",
                   help="the Spark consumer's --target")
    p.add_argument("--table", action="append", metavar="SCHEMA.TABLE",
                   help="compare only this captured table (repeatable; default: every captured table)")
    p.add_argument("--settle-timeout", type=float, default=60.0, metavar="S",
                   help="seconds to re-check differences where the mirror caught up with the source (0: do not)")

    p = command("repair", cmd_repair, "re-sync through the running daemon exactly the keys where the mirror differs "
                "from the source, then check again; non-zero if drift remains")
    _add_config(p)
    p.add_argument("--target", required=True, type=spark_args.local_path, metavar="PATH",
                   help="the Spark consumer's --target")
    p.add_argument("--table", action="append", metavar="SCHEMA.TABLE",
                   help="repair only this captured table (repeatable; default: every captured table)")
    p.add_argument("--dry-run", action="store_true", help="report what would be re-synced; change nothing")
    p.add_argument("--settle-timeout", type=float, default=60.0, metavar="S",
                   help="as for `cdcd verify`: seconds to re-check differences on a live source (0: do not)")
    p.add_argument("--wait-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the daemon's re-syncs, then for the consumer to merge them")
    return parser


#: The exit code when stdout's reader went away (``cdcd checkpoint list | head``): 128 + SIGPIPE, as a shell reports.
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    """The ``cdcd`` command; its exit code. Output into a closed pipe ends it quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe is reported with a traceback
    except BrokenPipeError:
        # what is still buffered cannot be written: point stdout at /dev/null so the final flush succeeds
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_PIPE_CLOSED
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
    except CdcdError as exc:
        print(f"cdcd: {exc}", file=sys.stderr)
        code = exit_code_for(exc)
    except KeyboardInterrupt:
        code = 130
    return code


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
