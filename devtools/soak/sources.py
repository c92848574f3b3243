"""The throwaway source servers of the soak, the workload's connections to them, and their restarts."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.servers import MariaDBServer, PostgresServer, binary, service_user, wait_port
from devtools.soak.common import (
    BASE_TABLES,
    DB,
    EXTRA_TABLES,
    INITIAL_ROWS,
)


def stop_server(server: PostgresServer | MariaDBServer | None) -> None:
    """Stop a throwaway server, also one whose start was interrupted (no directory or process yet)."""
    if server is None:
        return
    if getattr(server, "root", None) is None:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
        return
    server.stop()


class Conn:
    """A workload connection: ``run`` runs statements in one transaction, committed or rolled back."""

    def __init__(self, run: Callable[[list[str], bool], None], close: Callable[[], None]) -> None:
        self.run, self.close = run, close


class Source:
    """A throwaway server, its schema and the SQL dialect of the workload."""

    kind: str
    port: int

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def admin(self, sql: str) -> None:
        raise NotImplementedError

    def table_id(self, name: str) -> str:
        raise NotImplementedError

    def sections(self, proxy_port: int, tables: list[str], work: Path) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def large(self, rng: random.Random) -> str:
        """An SQL expression of a large text value (3 to 10 KB)."""
        raise NotImplementedError

    def restart(self, rng: random.Random) -> str:
        """Stop the server (cleanly or as a crash), start it again on the same port; returns how."""
        raise NotImplementedError

    def connect(self) -> Conn:
        """A workload connection."""
        raise NotImplementedError


class PgSource(Source):
    kind = "postgres"

    def start(self) -> None:
        self.server = PostgresServer()  # assigned first: stop() ends a start that was interrupted
        self.server.start()
        self.port = self.server.port
        self.server.create_database(DB)
        # a short stall bound for a blackholed stream (tests/e2e/test_faults_network.py does the same)
        self.server.psql(f"ALTER DATABASE {DB} SET wal_sender_timeout = '5s'")
        for t in BASE_TABLES + EXTRA_TABLES:
            # big: out of line without compression, so every value of it above ~2 KB is TOASTed
            self.server.psql(
                f"CREATE TABLE {t} (id bigint PRIMARY KEY, v int NOT NULL, note text, big text);"
                f"ALTER TABLE {t} ALTER COLUMN big SET STORAGE EXTERNAL;"
                f"INSERT INTO {t} SELECT g, g, 'init', CASE WHEN g % 10 = 0 THEN {self.large(random.Random(1))} END"
                f" FROM generate_series(1, {INITIAL_ROWS}) g", DB)

    def stop(self) -> None:
        stop_server(getattr(self, "server", None))

    def admin(self, sql: str) -> None:
        self.server.psql(sql, DB)

    def table_id(self, name: str) -> str:
        return f"public.{name}"

    def sections(self, proxy_port: int, tables: list[str], work: Path) -> dict[str, dict[str, Any]]:
        return {"source": {"kind": "postgres", "port": proxy_port, "user": "postgres", "database": DB,
                           "tables": [self.table_id(t) for t in tables], "sslmode": "disable",
                           "connect_timeout_s": 3},
                "source.postgres": {"slot": "soak", "publication": "soak", "heartbeat_s": 1}}

    def large(self, rng: random.Random) -> str:
        return f"(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, {rng.randint(100, 320)}))"

    def restart(self, rng: random.Random) -> str:
        """A crash (immediate shutdown) or a fast shutdown, bounded: a fast shutdown waits for the walsenders
        to have sent everything and heard it confirmed; one that has not ended after 20 s becomes immediate."""
        proc = self.server.proc
        assert proc is not None
        how = "crash" if rng.random() < 0.5 else "fast"
        proc.send_signal(signal.SIGQUIT if how == "crash" else signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            how = "fast, not done after 20 s, then immediate"
            proc.send_signal(signal.SIGQUIT)
            proc.wait(60)
        self.server.proc = None
        time.sleep(rng.uniform(0, 5))
        self.server.restart()
        return how

    def connect(self) -> Conn:
        import asyncpg

        loop = asyncio.new_event_loop()
        try:
            conn = loop.run_until_complete(asyncpg.connect(host="127.0.0.1", port=self.port, user="postgres",
                                                           database=DB, timeout=10))
        except BaseException:
            loop.close()
            raise

        def run(statements: list[str], commit: bool) -> None:
            end = "COMMIT" if commit else "ROLLBACK"
            loop.run_until_complete(asyncio.wait_for(conn.execute(";".join(["BEGIN", *statements, end])), 60))

        def close() -> None:
            try:
                loop.run_until_complete(asyncio.wait_for(conn.close(), 10))
            finally:
                loop.close()

        return Conn(run, close)


class MariaSource(Source):
    kind = "mariadb"

    def start(self) -> None:
        self.server = MariaDBServer()  # assigned first: stop() ends a start that was interrupted
        self.server.start()
        self.port = self.server.port
        self.server.create_database(DB)
        for t in BASE_TABLES + EXTRA_TABLES:
            self.server.sql(
                f"CREATE TABLE {t} (id BIGINT PRIMARY KEY, v INT NOT NULL, note VARCHAR(100), big LONGTEXT);"
                f"INSERT INTO {t} SELECT seq, seq, 'init', IF(seq % 10 = 0, {self.large(random.Random(1))}, NULL)"
                f" FROM seq_1_to_{INITIAL_ROWS}", DB)

    def stop(self) -> None:
        stop_server(getattr(self, "server", None))

    def admin(self, sql: str) -> None:
        self.server.sql(sql, DB)

    def table_id(self, name: str) -> str:
        return f"{DB}.{name}"

    def sections(self, proxy_port: int, tables: list[str], work: Path) -> dict[str, dict[str, Any]]:
        return {"source": {"kind": "mariadb", "port": proxy_port, "user": "cdc", "password": "secret",
                           "database": DB, "tables": [self.table_id(t) for t in tables], "sslmode": "disable",
                           "connect_timeout_s": 3},
                "source.mysql": {"server_id": 7901}}

    def large(self, rng: random.Random) -> str:
        return f"REPEAT(MD5(RAND()), {rng.randint(100, 320)})"

    def restart(self, rng: random.Random) -> str:
        """As tests/e2e/test_faults_network.py restarts it: SIGTERM (clean) or SIGKILL (a crash)."""
        proc = self.server.proc
        assert proc is not None
        crash = rng.random() < 0.5
        proc.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
        proc.wait(120)
        time.sleep(rng.uniform(0, 5))
        owner = service_user()
        self.server.proc = subprocess.Popen(
            [binary("mariadbd"), f"--defaults-file={self.server.root / 'my.cnf'}",
             *([f"--user={owner}"] if owner else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.server.port, self.server.proc, self.server.root / "server.log", timeout=120)
        return "crash" if crash else "clean"

    def connect(self) -> Conn:
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root", password="", database=DB,
                               autocommit=False, connect_timeout=10, read_timeout=60, write_timeout=60)

        def run(statements: list[str], commit: bool) -> None:
            with conn.cursor() as cur:
                for s in statements:
                    cur.execute(s)
            if commit:
                conn.commit()
            else:
                conn.rollback()

        return Conn(run, conn.close)
