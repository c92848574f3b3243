"""The whole pipeline on throwaway local databases (run by scripts/demo.sh).

Starts a PostgreSQL and a MariaDB in temporary directories, creates a small
shop schema with data, runs one `cdcd run` per database (snapshot, then
streaming while a workload writes), stops them, runs the Spark consumer
once per landing zone and `cdcd verify`, prints a summary and stops
everything it started. Files stay in the work directory for a look.

``--object-store``: the landing zones and the tables on a throwaway S3 server (versitygw) and the consumer
submitted to a throwaway Spark standalone cluster (a master and a worker) with spark-submit; `cdcd verify` reads
the tables there, and they are copied into the work directory before the server stops.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from devtools.s3server import S3Server
from devtools.servers import MariaDBServer, PostgresServer, free_port
from devtools.sparkcluster import SparkCluster

CDCD = str(Path(sys.executable).with_name("cdcd"))
WAIT_S = 120.0
BUCKET = "cdcd-demo"

PG_SCHEMA = """
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, country char(2),
                        created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES customers (id),
                     amount numeric(12, 2) NOT NULL, status text NOT NULL, items jsonb,
                     updated_at timestamptz NOT NULL DEFAULT now());
INSERT INTO customers (id, name, email, country)
  SELECT g, 'Customer ' || g, 'c' || g || '@example.com', (ARRAY['DE','FR','US','JP','BR'])[1 + g % 5]
  FROM generate_series(1, 500) g;
INSERT INTO orders (id, customer_id, amount, status, items)
  SELECT g, 1 + g % 500, round((g * 7.31)::numeric % 900 + 5, 2), (ARRAY['new','paid','shipped'])[1 + g % 3],
         jsonb_build_object('sku', 'SKU-' || (g % 97), 'qty', 1 + g % 4)
  FROM generate_series(1, 2000) g;
"""

#: What docs/postgres.md tells an operator to create: a role with REPLICATION and SELECT on the captured tables,
#: and the publication made by the tables' owner (a role that does not own them cannot create it).
PG_ROLE = """
CREATE ROLE cdc LOGIN REPLICATION PASSWORD 'secret';
GRANT USAGE ON SCHEMA public TO cdc;
GRANT SELECT ON public.customers, public.orders TO cdc;
CREATE PUBLICATION cdcd FOR TABLE public.customers, public.orders WITH (publish_via_partition_root = true);
"""

MARIA_SCHEMA = """
CREATE TABLE customers (id BIGINT PRIMARY KEY, name VARCHAR(100) NOT NULL, email VARCHAR(200), country CHAR(2),
                        created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));
CREATE TABLE orders (id BIGINT PRIMARY KEY, customer_id BIGINT NOT NULL, amount DECIMAL(12, 2) NOT NULL,
                     status VARCHAR(20) NOT NULL, items JSON,
                     updated_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6));
INSERT INTO customers (id, name, email, country)
  SELECT seq, CONCAT('Customer ', seq), CONCAT('c', seq, '@example.com'), ELT(1 + seq % 5, 'DE','FR','US','JP','BR')
  FROM seq_1_to_500;
INSERT INTO orders (id, customer_id, amount, status, items)
  SELECT seq, 1 + seq % 500, ROUND(MOD(seq * 7.31, 900) + 5, 2), ELT(1 + seq % 3, 'new', 'paid', 'shipped'),
         JSON_OBJECT('sku', CONCAT('SKU-', seq % 97), 'qty', 1 + seq % 4)
  FROM seq_1_to_2000;
"""


def _workload_sql(step: int, dialect: str) -> str:
    """One transaction of the workload: new orders, status changes, a delete, a customer update."""
    base = 10000 + step * 10
    now = "now()" if dialect == "pg" else "CURRENT_TIMESTAMP(6)"
    items = ("jsonb_build_object('sku', 'SKU-1', 'qty', 2)" if dialect == "pg"
             else "JSON_OBJECT('sku', 'SKU-1', 'qty', 2)")
    rows = ", ".join(f"({base + i}, {1 + (base + i) % 500}, {10 + i}.50, 'new', {items}, {now})" for i in range(10))
    begin = "BEGIN;" if dialect == "pg" else "START TRANSACTION;"
    return (f"{begin} INSERT INTO orders (id, customer_id, amount, status, items, updated_at) VALUES {rows};"
            f" UPDATE orders SET status = 'shipped', updated_at = {now}"
            f" WHERE id BETWEEN {step * 20 + 1} AND {step * 20 + 5};"
            f" DELETE FROM orders WHERE id = {1000 + step};"
            f" UPDATE customers SET email = 'new{step}@example.com' WHERE id = {1 + step % 500}; COMMIT;")


@dataclass
class Pipeline:
    name: str
    kind: str
    database: str
    tables: list[str]
    source: dict[str, Any]
    work: Path
    http_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    status: dict[str, Any] = field(default_factory=dict)
    verify_code: int | None = None
    spark_code: int | None = None
    s3: S3Server | None = None  # --object-store: the landing zone is s3://BUCKET/<name>/landing there

    @property
    def dir(self) -> Path:
        return self.work / self.name

    @property
    def config(self) -> Path:
        return self.dir / "cdcd.toml"

    @property
    def landing(self) -> str:
        return f"s3://{BUCKET}/{self.name}/landing" if self.s3 else str(self.dir / "landing")

    @property
    def target(self) -> str:
        """Where the consumer keeps the tables: beside the landing zone (--object-store: on the S3 server)."""
        return f"s3a://{BUCKET}/{self.name}/target" if self.s3 else str(self.dir / "target")

    def store_env(self) -> dict[str, str]:
        """The environment of a command that reads the store: its endpoint and keys where boto3 and S3A look."""
        if self.s3 is None:
            return dict(os.environ)
        return {**os.environ, "AWS_ENDPOINT_URL": self.s3.endpoint, "AWS_REGION": self.s3.region,
                "AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.s3.secret_key}

    def keep_tables(self) -> None:
        """--object-store: a copy of the tables in the demo's directory, as files (the S3 server's posix backend
        keeps an object as a file at its key), so that they can be read after the server is gone."""
        if self.s3 is not None:
            shutil.copytree(self.s3.root / "data" / BUCKET / self.name / "target", self.dir / "target")

    def landing_lines(self) -> list[str]:
        lines = ["[landing]", f'path = "{self.landing}"', "max_batch_events = 2000", "max_batch_delay_ms = 200"]
        if self.s3:
            secret = self.work / "s3-secret"
            lines += ["[landing.s3]", f'endpoint = "{self.s3.endpoint}"', f'region = "{self.s3.region}"',
                      f'access_key_id = "{self.s3.access_key}"', f'secret_access_key_file = "{secret}"']
        return lines

    def write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        source = {"kind": self.kind, "database": self.database, "tables": self.tables, **self.source}
        lines = ["[source]", *(f"{k} = {json.dumps(v)}" for k, v in source.items() if not isinstance(v, dict))]
        for sub, values in ((k, v) for k, v in source.items() if isinstance(v, dict)):
            lines += [f"[source.{sub}]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]
        lines += [
            *self.landing_lines(),
            "[state]", f'path = "{self.dir / "state"}"',
            "[runtime]", "shutdown_grace_s = 30",
            "[http]", f'listen = "127.0.0.1:{self.http_port}"',
            "[log]", 'format = "json"',
        ]
        self.config.write_text("\n".join(lines) + "\n")

    def get(self, path: str) -> tuple[int, str] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as resp:
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), ""
        except (urllib.error.URLError, OSError):
            return None

    def live_status(self) -> dict[str, Any]:
        got = self.get("/status")
        return json.loads(got[1]) if got and got[0] == 200 else {}


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def run_cli(*args: str, log: Path | None = None, timeout: float = 600, env: dict[str, str] | None = None) -> int:
    out = open(log, "ab") if log else None  # noqa: SIM115 - closed below
    try:
        return subprocess.run([CDCD, *args], stdout=out, stderr=subprocess.STDOUT if out else None,
                              timeout=timeout, env=env).returncode
    finally:
        if out:
            out.close()


def wait_until(what: str, predicate: Any, proc: subprocess.Popen[bytes] | None = None, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"cdcd exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


def start_daemon(p: Pipeline) -> None:
    log = open(p.dir / "cdcd.log", "wb")  # noqa: SIM115 - the child owns it; closed when the demo ends
    p.proc = subprocess.Popen([CDCD, "run", "-c", str(p.config)], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_until(f"{p.name}: /readyz", lambda: (p.get("/readyz") or (0, ""))[0] == 200, p.proc)


def caught_up(p: Pipeline) -> bool:
    """Everything read is committed, and nothing new arrived for a second."""
    first = p.live_status().get("stats", {})
    time.sleep(1.0)
    second = p.live_status().get("stats", {})
    keys = ("events_seen", "events_committed")
    return bool(first) and bool(second) and second.get("batches_inflight") == 0 and all(
        first.get(k) == second.get(k) for k in keys)


def workload(pg: PostgresServer, maria: MariaDBServer, seconds: float) -> int:
    steps = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pg.psql(_workload_sql(steps, "pg"), "shop")
        maria.sql(_workload_sql(steps, "maria"), "shop")
        steps += 1
    return steps


def start_object_store(work: Path, spark: bool, servers: list[Any]) -> S3Server:
    """--object-store: the S3 server with the demo's bucket, its secret key in a file only the demo may read, and
    (for the consumer) the Spark cluster, appended to ``servers`` so that they are stopped at the end."""
    say("starting a throwaway S3 server (versitygw)" + (" and a Spark standalone cluster" if spark else ""))
    s3 = S3Server().start()
    servers.append(s3)
    s3.create_bucket(BUCKET)
    with os.fdopen(os.open(work / "s3-secret", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(s3.secret_key + "\n")
    if spark:
        servers.append(SparkCluster().start())
    return s3


def submit_to_cluster(p: Pipeline, cluster: SparkCluster) -> int:
    """The consumer on the cluster with spark-submit (docs/spark.md, Object storage): the store's endpoint and
    keys in the environment, where the landing reader and Spark's S3A find them."""
    env = {**p.store_env(), "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    with open(p.dir / "spark.log", "wb") as log:
        return subprocess.run(cluster.submit_command(p.landing, p.target, name=f"cdcd-{p.name}"),
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900).returncode


def run_demo(work: Path, workload_s: float, spark: bool, object_store: bool = False) -> int:
    servers: list[Any] = []
    pipelines: list[Pipeline] = []
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        say("starting throwaway PostgreSQL and MariaDB")
        pg = PostgresServer().start()
        servers.append(pg)
        maria = MariaDBServer().start()
        servers.append(maria)
        pg.create_database("shop")
        pg.psql(PG_SCHEMA, "shop")
        maria.create_database("shop")
        maria.sql(MARIA_SCHEMA, "shop")
        pg.psql(PG_ROLE, "shop")  # MariaDB's role `cdc` (devservers.py) has the grants docs/mysql.md lists
        password = work / "cdc-password"
        with os.fdopen(os.open(password, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("secret\n")
        say("schema shop.customers (500 rows) and shop.orders (2000 rows) created in both")
        s3 = start_object_store(work, spark, servers) if object_store else None
        cluster = next((s for s in servers if isinstance(s, SparkCluster)), None)

        pipelines = [
            Pipeline("postgres", "postgres", "shop", ["public.customers", "public.orders"],
                     {"port": pg.port, "user": "cdc", "password_file": str(password)}, work),
            Pipeline("mariadb", "mariadb", "shop", ["shop.customers", "shop.orders"],
                     {"port": maria.port, "user": "cdc", "password_file": str(password),
                      "mysql": {"server_id": 5401}}, work),
        ]
        for p in pipelines:
            p.s3 = s3
        for p in pipelines:
            p.write_config()
            say(f"{p.name}: cdcd check")
            if run_cli("check", "-c", str(p.config)) != 0:
                say(f"{p.name}: the preflight failed (see above)")
                return 1
        for p in pipelines:
            start_daemon(p)
            say(f"{p.name}: cdcd run is ready (metrics on http://127.0.0.1:{p.http_port}/metrics)")
        for p in pipelines:
            wait_until(f"{p.name}: snapshot committed",
                       lambda p=p: p.live_status().get("stats", {}).get("events_committed", 0) >= 2500, p.proc)
        say(f"snapshots committed; writing for {workload_s:g}s while cdcd streams")
        steps = workload(pg, maria, workload_s)
        say(f"workload: {steps} transactions per database (inserts, updates, deletes)")
        for p in pipelines:
            wait_until(f"{p.name}: caught up", lambda p=p: caught_up(p), p.proc)
            p.status = p.live_status()
        for p in pipelines:
            code = run_cli("stop", "-c", str(p.config))
            assert p.proc is not None
            p.proc.wait(60)
            say(f"{p.name}: cdcd stop -> daemon exit {p.proc.returncode}")
            if code != 0 or p.proc.returncode != 0:
                return 1
        if spark and cluster is not None:
            say(f"spark-submit --master {cluster.url}: the consumer merges both landing zones on the S3 server "
                "into Delta Lake tables on the same server")
            for p in pipelines:
                p.spark_code = submit_to_cluster(p, cluster)
                say(f"{p.name}: spark exit {p.spark_code}; cdcd verify --target {p.target}")
                p.verify_code = run_cli("verify", "-c", str(p.config), "--target", p.target, env=p.store_env())
                p.keep_tables()
        elif spark:
            say("cdcd spark run --once --format delta for both landing zones (Spark merges the landed batches "
                "into Delta Lake tables)")
            for p in pipelines:
                log = open(p.dir / "spark.log", "wb")  # noqa: SIM115 - closed right after the start
                jobs.append(subprocess.Popen([CDCD, "spark", "run", "--landing", str(p.dir / "landing"), "--target",
                                              str(p.dir / "target"), "--once", "--format", "delta"],
                                             stdout=log, stderr=subprocess.STDOUT))
                log.close()
            for p, job in zip(pipelines, jobs, strict=True):
                p.spark_code = job.wait(600)
                say(f"{p.name}: spark exit {p.spark_code}; cdcd verify")
                p.verify_code = run_cli("verify", "-c", str(p.config), "--target", str(p.dir / "target"))
        summary(pipelines, work)
        ok = all(p.spark_code in (0, None) and p.verify_code in (0, None) for p in pipelines)
        return 0 if ok else 1
    finally:
        for proc in [*(p.proc for p in pipelines if p.proc is not None), *jobs]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in reversed(servers):
            server.stop()
        say("stopped everything the demo started")


def summary(pipelines: list[Pipeline], work: Path) -> None:
    print("\n== cdcd demo summary ==")
    for p in pipelines:
        stats, source = p.status.get("stats", {}), p.status.get("source", {})
        snap_rows = sum(int(t.get("rows") or 0) for t in (source.get("snapshot") or {}).values())
        lag = source.get("lag_ms")
        print(f"{p.name:9} snapshot rows {snap_rows:>6}  events committed {stats.get('events_committed', 0):>6}  "
              f"batches {stats.get('committed_batch_seq', 0):>4}  lag {'-' if lag is None else f'{lag:.0f} ms':>8}  "
              f"spark {'-' if p.spark_code is None else ('ok' if p.spark_code == 0 else 'FAILED')}  "
              f"verify {'-' if p.verify_code is None else ('ok' if p.verify_code == 0 else 'DRIFT/FAILED')}")
    print(f"\nwhere to look ({work}):")
    for p in pipelines:
        kept = f" (kept as files in {p.dir / 'target' / 'tables'})" if p.s3 else ""
        print(f"  {p.name}: config {p.config}, daemon log {p.dir / 'cdcd.log'}, landing zone {p.landing}, "
              f"Delta Lake mirrors {p.target}/tables{kept}")
    print('  read a mirror: spark.read.format("delta").load("<mirrors>/<schema>.<table>") in a session with the '
          "Delta jars (docs/spark.md)")
    if any(p.s3 for p in pipelines):
        print("  the landing zones and the tables were on the throwaway S3 server and the consumer ran on the "
              "throwaway Spark cluster, both stopped at the end (the landing zones go with the server; the tables "
              "were copied out first)")
    print("  cdcd checkpoint list -c <config> shows the checkpoints; docs/operations.md explains the rest\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__)
    parser.add_argument("--workload-seconds", type=float, default=5.0, help="how long the workload writes")
    parser.add_argument("--no-spark", action="store_true", help="skip the Spark consumer and verify")
    parser.add_argument("--clean", action="store_true", help="remove the work directory at the end")
    parser.add_argument("--object-store", action="store_true",
                        help="land on a throwaway S3 server and run the consumer on a throwaway Spark standalone "
                             "cluster (spark-submit)")
    args = parser.parse_args(argv)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop everything

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="cdcd-demo-"))
    os.chmod(work, 0o755)
    try:
        return run_demo(work, args.workload_seconds, not args.no_spark, args.object_store)
    finally:
        if args.clean:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
