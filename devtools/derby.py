"""A Derby network server: the tests' Hive metastore database that several Spark processes share, as a cluster's
metastore database is (a Spark job and the readers of its tables by name, each its own JVM). Embedded Derby, the
single-host default, serves one JVM at a time.

Derby's own server (``org.apache.derby.drda.NetworkServerControl``) on the Derby release pyspark ships
(``cdcd.spark.jars.METASTORE_DB_PACKAGES``, cached by the bootstrap), in a temporary directory on a free loopback
port. Spark sessions reach it with ``session_conf()``: Hive's client with DataNucleus creating the metastore's
schema on first use, which Derby takes (on PostgreSQL that on-the-fly creation hung: docs/spark.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from devtools.servers import BOOTSTRAP_HINT, ServerError, end_process, free_port, wait_port

#: The metastore database's user and password (Derby's client refuses an empty password).
USER, PASSWORD = "app", "app"


@dataclass
class DerbyServer:
    root: Path = field(init=False)
    port: int = field(init=False)
    proc: subprocess.Popen[bytes] | None = field(init=False, default=None)

    def start(self, timeout: float = 60) -> DerbyServer:
        import pyspark

        from cdcd.spark import jars

        found = jars.cached_jars(jars.METASTORE_DB_PACKAGES)
        if found is None:
            raise ServerError(f"the Derby network server's jars are not in {jars.cache_dir()}: {BOOTSTRAP_HINT}")
        spark_jars = Path(pyspark.__file__).resolve().parent / "jars"
        engine = [spark_jars / f"{name}-{jars.DERBY}.jar" for name in ("derby", "derbyshared", "derbytools")]
        missing = [str(p) for p in engine if not p.is_file()]
        if missing:
            raise ServerError(f"pyspark ships no Derby {jars.DERBY} ({', '.join(missing)}): set DERBY in "
                              "cdcd/spark/jars.py to the Derby of pyspark's jars/")
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-derby-"))
        self.port = free_port()
        classpath = os.pathsep.join(str(p) for p in [*found, *engine])
        with open(self.root / "server.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["java", "-cp", classpath, f"-Dderby.system.home={self.root}", "-Xmx256m",
                 "org.apache.derby.drda.NetworkServerControl", "start", "-h", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_port(self.port, self.proc, self.root / "server.log", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def client_jar(self) -> Path:
        from cdcd.spark import jars

        found = jars.cached_jars(jars.METASTORE_DB_PACKAGES)
        assert found is not None
        return next(p for p in found if "derbyclient" in p.name)

    def session_conf(self, database: str, warehouse: str) -> dict[str, str]:
        """The Spark settings of a session whose session catalog is a Hive metastore in ``database`` here (the
        client jar goes on the driver's class path separately: ``client_jar``)."""
        return {"spark.sql.catalogImplementation": "hive",
                "spark.hadoop.javax.jdo.option.ConnectionURL":
                    f"jdbc:derby://127.0.0.1:{self.port}/{database};create=true",
                "spark.hadoop.javax.jdo.option.ConnectionDriverName": "org.apache.derby.jdbc.ClientDriver",
                "spark.hadoop.javax.jdo.option.ConnectionUserName": USER,
                "spark.hadoop.javax.jdo.option.ConnectionPassword": PASSWORD,
                "spark.hadoop.datanucleus.schema.autoCreateAll": "true",
                "spark.hadoop.hive.metastore.schema.verification": "false",
                "spark.sql.warehouse.dir": warehouse}

    def stop(self) -> None:
        end_process(self.proc)
        shutil.rmtree(self.root, ignore_errors=True)
