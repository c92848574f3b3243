"""S3A works with the jars the bootstrap resolved: a Spark JVM with ``local_settings(object_store=True)`` creates
``s3a://`` file systems (hadoop-aws against the installed Spark's Hadoop, the AWS SDK bundle hadoop-aws was
built with: a mismatch fails here with NoSuchMethodError or ClassNotFoundException). Its own process: the
worker's shared session has no S3A jars. No request leaves the JVM (S3A does not probe the bucket at start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cdcd.spark import jars

pytestmark = pytest.mark.spark

PROGRAM = textwrap.dedent("""
    from pyspark.sql import SparkSession
    from cdcd.spark import jars
    settings = jars.local_settings("delta", object_store=True)
    assert settings, "no S3A jars in the cache"
    b = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
    for k, v in settings.items():
        b = b.config(k, v)
    for k, v in {"endpoint": "http://127.0.0.1:9", "path.style.access": "true", "access.key": "k",
                 "secret.key": "s"}.items():
        b = b.config(f"spark.hadoop.fs.s3a.{k}", v)
    spark = b.getOrCreate()
    jvm = spark._jvm
    fs = jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI("s3a://bucket/"), spark._jsc.hadoopConfiguration())
    print("FS", fs.getClass().getName(), jvm.org.apache.hadoop.util.VersionInfo.getVersion())
    spark.stop()
""")


def test_s3a_file_system_starts_with_the_cached_jars() -> None:
    assert jars.cached_jars(jars.OBJECT_STORE_PACKAGES), "run scripts/bootstrap.sh: it fetches the S3A jars"
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"FS org.apache.hadoop.fs.s3a.S3AFileSystem {jars.HADOOP}" in done.stdout
