"""The S3A jars the bootstrap resolves (cdcd.spark.jars.OBJECT_STORE_PACKAGES) belong to the installed Spark."""

from __future__ import annotations

import subprocess
import sys

from cdcd.spark import jars


def test_hadoop_aws_is_the_hadoop_of_the_installed_pyspark() -> None:
    # hadoop-aws calls Hadoop's internals: any other version fails at run time (NoSuchMethodError)
    assert jars.installed_hadoop() == jars.HADOOP
    assert jars.OBJECT_STORE_PACKAGES[0] == f"org.apache.hadoop:hadoop-aws:{jars.installed_hadoop()}"


def test_the_bootstrap_list_holds_the_s3a_jars_and_spark_submit_gets_its_own_line() -> None:
    listed = subprocess.run([sys.executable, "-m", "cdcd.spark.jars"], capture_output=True, text=True, check=True,
                            timeout=60).stdout.split()
    assert listed == [*jars.PACKAGES, *jars.CATALOG_PACKAGES, *jars.OBJECT_STORE_PACKAGES, *jars.METASTORE_DB_PACKAGES]
    line = subprocess.run([sys.executable, "-m", "cdcd.spark.jars", "--object-store-packages"], capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()
    assert line == "--packages " + ",".join(jars.OBJECT_STORE_PACKAGES)


def test_a_local_session_gets_the_s3a_jars_only_when_asked() -> None:
    plain = jars.local_settings("delta")
    wanted = jars.local_settings("delta", object_store=True)
    if not plain:
        return  # no cache at all: --format parquet only (the bootstrap fills it)
    assert "hadoop-aws" not in plain["spark.jars"]
    assert wanted, f"run scripts/bootstrap.sh: it fetches {jars.OBJECT_STORE_PACKAGES} into {jars.cache_dir()}"
    names = wanted["spark.jars"].split(",")
    assert [n.rsplit("/", 1)[1] for n in names[-2:]] == [jars.jar_name(c) for c in jars.OBJECT_STORE_PACKAGES]
