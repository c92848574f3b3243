"""The local session's JVM has room to keep compiling, and a JVM error inside a wrapper is named in the error line."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from cdcd.spark.failure import describe

pytestmark = pytest.mark.spark


def test_the_local_session_reserves_the_code_cache_c2_would(spark: SparkSession) -> None:
    # with C1 only the JVM reserves 48 MB for compiled code, which a long-lived session filled in six minutes
    pools = spark._jvm.java.lang.management.ManagementFactory.getMemoryPoolMXBeans()  # type: ignore[union-attr]
    reserved = sum(p.getUsage().getMax() for p in pools if "Code" in str(p.getName()))
    assert reserved >= 240 * 1024 * 1024, f"code cache reserved: {reserved // (1024 * 1024)} MB"


def test_a_jvm_error_boxed_in_a_future_is_named_with_its_fix(spark: SparkSession, tmp_path: Path) -> None:
    jvm = spark._jvm
    assert jvm is not None
    cause = jvm.java.lang.InternalError("Out of space in CodeCache for adapters")
    with pytest.raises(Exception) as raised:  # py4j's Py4JJavaError around ExecutionException(cause)
        jvm.java.util.concurrent.CompletableFuture.failedFuture(cause).get()
    failure = describe(raised.value, tmp_path / "landing", tmp_path / "target", "delta", [])
    assert failure.error.startswith("java.util.concurrent.ExecutionException")
    assert "(caused by java.lang.InternalError: Out of space in CodeCache for adapters)" in failure.error
    assert failure.fix is not None and "-XX:ReservedCodeCacheSize=240m" in failure.fix
