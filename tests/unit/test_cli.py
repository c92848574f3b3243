"""The cdcd command line: help, version, config errors, checkpoint commands, stop and status.

Commands run as real subprocesses of the installed console script where the
process boundary matters (exit codes, signals); the rest call ``main``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd import __version__
from cdcd.checkpoint.store import Checkpoint, CheckpointStore
from cdcd.cli import build_parser, main
from cdcd.daemon.exitcodes import ExitCode
from cdcd.positions import PgPosition
from devtools.servers import free_port

CDCD = str(Path(sys.executable).with_name("cdcd"))


def _write_config(tmp_path: Path, **extra: str) -> Path:
    cfg = tmp_path / "cdcd.toml"
    cfg.write_text(textwrap.dedent(f"""
        [source]
        kind = "postgres"
        user = "cdc"
        password = "hunter2"
        database = "app"
        tables = ["public.orders"]
        [state]
        path = "{tmp_path / 'state'}"
        [landing]
        path = "{tmp_path / 'landing'}"
        [http]
        listen = "127.0.0.1:{extra.get('port', free_port())}"
    """))
    return cfg


def _save_history(cfg: Path, n: int) -> CheckpointStore:
    store = CheckpointStore(cfg.parent / "state")
    store.path.mkdir(exist_ok=True)
    for seq in range(1, n + 1):
        store.save(Checkpoint("postgres", seq, seq * 10, PgPosition(0x1000 + seq, 0), {}))
    return store


def _all_parsers() -> Iterator[list[str]]:
    def walk(parser: object, prefix: list[str]) -> Iterator[list[str]]:
        yield prefix
        for action in getattr(parser, "_actions", []):
            choices = getattr(action, "choices", None)
            for name, child in (choices.items() if isinstance(choices, dict) else []):
                if hasattr(child, "_actions"):
                    yield from walk(child, [*prefix, name])

    yield from walk(build_parser(), [])


def test_help_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    commands = list(_all_parsers())
    assert ["run"] in commands and ["checkpoint", "rollback"] in commands and ["spark", "run"] in commands
    for cmd in commands:
        with pytest.raises(SystemExit) as exit_:
            main([*cmd, "--help"])
        assert exit_.value.code == 0
        assert "usage: cdcd" in capsys.readouterr().out


def test_version() -> None:
    out = subprocess.run([CDCD, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"cdcd {__version__}"


def test_config_error_exits_with_the_config_code(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[source]\nkind = "postgres"\nuser = "u"\ndatabase = "d"\ntables = ["public.t"]\nbogus = 1\n')
    for cmd in (["run"], ["check"], ["status"], ["stop"], ["checkpoint", "list"]):
        proc = subprocess.run([CDCD, *cmd, "-c", str(bad)], capture_output=True, text=True)
        assert proc.returncode == ExitCode.CONFIG, (cmd, proc.stderr)
        assert "source.bogus: unknown key" in proc.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    proc = subprocess.run([CDCD, "run", "-c", str(tmp_path / "nope.toml")], capture_output=True, text=True)
    assert proc.returncode == ExitCode.CONFIG and "cannot read the config file" in proc.stderr


def test_checkpoint_show_list_rollback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write_config(tmp_path)
    assert main(["checkpoint", "show", "-c", str(cfg)]) == 0
    assert "no checkpoint" in capsys.readouterr().out
    _save_history(cfg, 3)
    assert main(["checkpoint", "show", "-c", str(cfg)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["batch_seq"] == 3 and shown["save_id"] == 3
    assert main(["checkpoint", "list", "-c", str(cfg), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["save_id"] for r in rows] == [1, 2, 3] and rows[-1]["current"]
    assert main(["checkpoint", "rollback", "-c", str(cfg), "--to", "1"]) == 0
    assert "rolled back" in capsys.readouterr().out
    ckpt = CheckpointStore(tmp_path / "state").load()
    assert ckpt is not None and ckpt.batch_seq == 1 and ckpt.save_id == 4


def test_corrupt_checkpoint_is_reported_by_list_and_refused_by_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _write_config(tmp_path)
    _save_history(cfg, 2)
    current = tmp_path / "state" / "checkpoint.json"
    current.write_bytes(current.read_bytes()[:30])
    assert main(["checkpoint", "list", "-c", str(cfg)]) == 0
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["checkpoint", "show", "-c", str(cfg)]) == ExitCode.CHECKPOINT_FATAL
    assert "checkpoint rollback" in capsys.readouterr().err


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the state directory's lock the way the daemon does, until SIGTERM."""
    code = textwrap.dedent(f"""
        import signal, sys, time
        from cdcd.checkpoint.store import CheckpointStore
        store = CheckpointStore({str(tmp_path / 'state')!r})
        store.lock()
        def bye(*_):
            store.unlock()
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("locked", flush=True)
        while True:
            time.sleep(0.05)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_rollback_refused_while_the_state_dir_is_held(
    tmp_path: Path, lock_holder: subprocess.Popen[str], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _write_config(tmp_path)
    _save_history(cfg, 2)
    assert main(["checkpoint", "rollback", "-c", str(cfg), "--to", "1"]) == ExitCode.STATE_DIR_LOCKED
    assert f"pid {lock_holder.pid}" in capsys.readouterr().err


def test_stop_signals_the_holder_and_waits(tmp_path: Path, lock_holder: subprocess.Popen[str]) -> None:
    cfg = _write_config(tmp_path)
    proc = subprocess.run([CDCD, "stop", "-c", str(cfg), "--timeout", "60"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"pid {lock_holder.pid}) stopped" in proc.stdout
    assert lock_holder.wait(10) == 0


def test_stop_times_out_when_the_holder_ignores_it(tmp_path: Path, lock_holder: subprocess.Popen[str]) -> None:
    cfg = _write_config(tmp_path)
    lock_holder.send_signal(signal.SIGSTOP)  # a wedged process: the signal stays pending
    try:
        proc = subprocess.run([CDCD, "stop", "-c", str(cfg), "--timeout", "0.5"], capture_output=True, text=True)
    finally:
        lock_holder.send_signal(signal.SIGCONT)
    assert proc.returncode == ExitCode.STOP_TIMEOUT and "did not exit" in proc.stderr


def test_stop_and_status_without_a_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write_config(tmp_path)
    assert main(["stop", "-c", str(cfg)]) == 0
    assert "no cdcd daemon runs" in capsys.readouterr().out
    _save_history(cfg, 2)
    assert main(["status", "-c", str(cfg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["running"] is False and doc["checkpoint"]["batch_seq"] == 2
    assert main(["status", "-c", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "not running" in out and "batch 2" in out and "hunter2" not in out


def test_config_from_environment(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    env = {**os.environ, "CDCD_CONFIG": str(cfg)}
    proc = subprocess.run([CDCD, "checkpoint", "show"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "no checkpoint" in proc.stdout


def test_commands_that_never_connect_do_not_need_the_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """status, stop, checkpoint and the daemon requests work where the password_file is not readable (an
    operator's shell, not the daemon's user); the commands that connect still refuse with exit 78."""
    cfg = _write_config(tmp_path)
    cfg.write_text(cfg.read_text().replace('password = "hunter2"', f'password_file = "{tmp_path / "absent"}"'))
    _save_history(cfg, 2)
    assert main(["status", "-c", str(cfg)]) == ExitCode.OK
    assert main(["checkpoint", "show", "-c", str(cfg)]) == ExitCode.OK
    assert main(["checkpoint", "list", "-c", str(cfg)]) == ExitCode.OK
    assert main(["stop", "-c", str(cfg)]) == ExitCode.OK
    assert "password_file" not in capsys.readouterr().err
    assert main(["check", "-c", str(cfg)]) == ExitCode.CONFIG
    assert main(["verify", "-c", str(cfg), "--target", str(tmp_path / "target")]) == ExitCode.CONFIG
    assert "source.password_file: cannot read" in capsys.readouterr().err


def test_status_shows_what_the_operator_acts_on() -> None:
    from cdcd.daemon.progress import status_lines

    out = "\n".join(status_lines({"running": True, "pid": 7, "stats": {"events_committed": 1, "schema_changes": {
        "public.a": {"version": 3, "position": "pg:1", "at": 0.0, "count": 2}}}, "storage_fault": {
        "error": "checkpoint saves are failing: No space left on device", "failing_for_s": 12.5},
        "source": {"phase": "snapshot", "tables": ["public.a", "public.b"], "last_error": "connection reset",
                   "table_reload_error": "table public.c has no primary key", "snapshot": {
                       "public.a": {"rows": 200, "total_estimate": 0, "done": False},
                       "public.b": {"rows": 5, "total_estimate": 1000, "done": True}}}}))
    assert "captured tables: public.a, public.b" in out and "source.last_error: connection reset" in out
    assert "last table reload FAILED: table public.c has no primary key" in out
    assert "STORAGE FAULT for 12.5 s: checkpoint saves are failing" in out
    assert "snapshot public.a: 200 rows (no row estimate" in out and "of ~0" not in out
    assert "snapshot public.b: 5 rows of ~1000 (done)" in out
    assert "schema changed: public.a: version 3 at pg:1, committed 1970-01-01T00:00:00+00:00 (2 since the start)" in out
