"""A throwaway Spark standalone cluster (a master and one worker from the installed pyspark) for the tests, the
demo and the bench, and the consumer's spark-submit line for it (the cached jars, the JVM flags)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.servers import BOOTSTRAP_HINT, ServerError, end_process, free_port, wait_port


@dataclass
class SparkCluster:
    """A Spark standalone cluster from the installed pyspark: one master and one worker on 127.0.0.1.

    Started as an operator would (``spark-class ...deploy.master.Master`` / ``...deploy.worker.Worker``), on free
    ports, with its work and log files in a temporary directory; the worker offers ``cores`` cores and ``memory``
    to executors (bounded: a test machine has two cores). ``url`` is the ``--master`` of spark-submit.
    """

    cores: int = 1
    memory: str = "2g"
    root: Path = field(init=False)
    port: int = field(init=False)
    web_port: int = field(init=False)
    procs: list[subprocess.Popen[bytes]] = field(init=False, default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> SparkCluster:
        spark_class = Path(sys.executable).with_name("spark-class")
        if not spark_class.is_file():
            raise ServerError(f"{spark_class} (pyspark's launcher) not found: {BOOTSTRAP_HINT}")
        self.root = Path(tempfile.mkdtemp(prefix="cdcd-spark-cluster-"))
        self.port, self.web_port = free_port(), free_port()
        # the daemons' own heap is small (they only schedule); C1 only: less CPU spent compiling on two cores
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_DAEMON_MEMORY": "256m",
               "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
               "PYSPARK_PYTHON": sys.executable}
        try:
            self._launch(spark_class, env, "master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                                      "--port", str(self.port), "--webui-port", str(self.web_port)])
            wait_port(self.port, self.procs[0], self.root / "master.log", timeout)
            work = self.root / "work"
            work.mkdir()
            self._launch(spark_class, env, "worker", [
                "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--port", str(free_port()),
                "--webui-port", str(free_port()), "--cores", str(self.cores), "--memory", self.memory,
                "--work-dir", str(work), self.url])
            self._wait_worker(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, spark_class: Path, env: dict[str, str], name: str, args: list[str]) -> None:
        with open(self.root / f"{name}.log", "wb") as log:
            # a session of its own: stop() ends the daemon with the executors it started
            self.procs.append(subprocess.Popen([str(spark_class), *args], stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, env=env, start_new_session=True))

    def submit_command(self, landing: str, target: str, fmt: str = "delta", name: str = "cdcd",
                       settings: dict[str, str] | None = None, driver_jars: tuple[Path, ...] = (),
                       args: tuple[str, ...] = ()) -> list[str]:
        """``spark-submit --master spark://...`` of the consumer with the bootstrap's cached jars: the format's as
        ``--jars``, S3A's on the class paths (driver and worker share this host: the 640 MB SDK bundle is not
        shipped), shuffle and Delta state partitions for one core, and the local session's JVM flags (the
        merge took 24 s instead of 123 s with them on a loaded two-core machine; docs/spark.md). ``settings``:
        more ``--conf``s, ``driver_jars`` on the driver's class path too, ``args`` the consumer's own."""
        from cdcd.spark import jars
        from cdcd.spark.session import JAVA_OPTIONS

        packages = {"delta": jars.DELTA_PACKAGES, "iceberg": jars.ICEBERG_PACKAGES}.get(fmt, ())
        found, s3a = jars.cached_jars(packages), jars.cached_jars(jars.OBJECT_STORE_PACKAGES)
        if found is None or s3a is None:
            raise ServerError(f"the Spark jars are not cached in {jars.cache_dir()}: {BOOTSTRAP_HINT}")
        classpath = os.pathsep.join(str(p) for p in s3a)
        driver_classpath = os.pathsep.join(str(p) for p in (*s3a, *driver_jars))
        extension = {"delta": [f"spark.sql.extensions={jars.DELTA_EXTENSION}",
                               f"spark.sql.catalog.spark_catalog={jars.DELTA_CATALOG}"],
                     "iceberg": [f"spark.sql.extensions={jars.ICEBERG_EXTENSION}"]}.get(fmt, [])
        conf = [*extension, "spark.sql.shuffle.partitions=2", "spark.databricks.delta.snapshotPartitions=2",
                "spark.ui.enabled=false", f"spark.executor.extraJavaOptions={JAVA_OPTIONS}",
                f"spark.executor.extraClassPath={classpath}", *(f"{k}={v}" for k, v in (settings or {}).items())]
        consumer = Path(__file__).resolve().parents[1] / "cdcd" / "spark" / "consumer.py"
        return [str(Path(sys.executable).with_name("spark-submit")), "--master", self.url, "--name", name,
                *(["--jars", ",".join(str(p) for p in found)] if found else []),
                "--driver-memory", "1g", "--executor-memory", "1g", "--driver-java-options", JAVA_OPTIONS,
                "--driver-class-path", driver_classpath, *(a for c in conf for a in ("--conf", c)),
                str(consumer), "--landing", landing, "--target", target, "--format", fmt, "--once", *args]

    def status(self) -> dict[str, Any]:
        """The master's view of the cluster (its web UI's ``/json``): workers, cores, applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/json/", timeout=10) as r:
            doc: dict[str, Any] = json.loads(r.read())
        return doc

    def _wait_worker(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc, name in zip(self.procs, ("master", "worker"), strict=False):
                if proc.poll() is not None:
                    log = (self.root / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise ServerError(f"Spark {name} exited with {proc.returncode}; log:\n{log}")
            with contextlib.suppress(OSError, ValueError):
                if self.status().get("aliveworkers", 0) >= 1:
                    return
            time.sleep(0.5)
        raise ServerError(f"no Spark worker registered with the master {self.url} within {timeout}s; logs in "
                          f"{self.root} (master.log, worker.log)")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the worker first: it ends its executors
            end_process(proc)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # an executor the worker left behind
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


