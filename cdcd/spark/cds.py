"""A class-data sharing (AppCDS) archive of the classes a local Spark job loads, built once per machine.

A fresh JVM of ``cdcd spark run --once`` loads some 20,000 classes from Spark's,
Delta Lake's and Iceberg's jars: it looks each one up in a few hundred jar files,
reads, parses and verifies it. That was the largest single cost in a profile of a
one-shot run (about a sixth of the JVM's CPU, and most of its start-up). JDK 13+
can write the classes a run loaded into an archive (``-XX:ArchiveClassesAtExit``)
that later JVMs map at start (``-XX:SharedArchiveFile``), already parsed and verified.

``scripts/bootstrap.sh`` runs ``python -m cdcd.sparkcds`` (``cdcd/sparkcds.py``, outside
the Spark package because its training run writes a landing zone with the daemon's
sink): a training run (a small landing zone applied to a Delta target by the real job) writes the archive into
``<jar cache>/cds/`` under a name that hashes the JVM and every jar on the local
session's class path, so a new JDK, pyspark or jar version gets a new archive and
never uses a stale one. A local session (``cdcd.spark.session``) passes the archive
to its JVM when it exists; nothing changes when it does not. ``CDCD_SPARK_CDS``: a
directory to keep archives in instead, or ``off``. Not used under spark-submit.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from cdcd.spark import jars

ENV = "CDCD_SPARK_CDS"
#: Set by ``cdcd.sparkcds.build`` for its training run: where that run's JVM writes the archive at exit.
DUMP_ENV = "CDCD_SPARK_CDS_DUMP"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = Path(home) / "bin" / "java" if home else (Path(w) if (w := shutil.which("java")) else None)
    return found.resolve() if found is not None and found.exists() else None


def _spark_jars() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "jars"


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path}:{st.st_size}:{int(st.st_mtime)}"


def archive() -> Path | None:
    """Where this machine's archive is (or goes); None when disabled or no JVM is found.

    The name hashes the JVM and each jar of the local session's class path (path, size,
    mtime): the JVM refuses an archive whose jars changed, and a new name builds a new one.
    """
    given = os.environ.get(ENV, "")
    java = _java()
    if given == "off" or java is None:
        return None
    parts = [_stamp(java), *sorted(_stamp(p) for p in _spark_jars().glob("*.jar"))]
    parts += [_stamp(p.resolve()) for p in jars.cached_jars() or []]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return (Path(given) if given else jars.cache_dir() / "cds") / f"spark-{digest}.jsa"


def java_options() -> str:
    """The JVM flags that use the archive (or, in a training run, write it); "" without one."""
    dump = os.environ.get(DUMP_ENV)
    if dump:
        return f"-XX:ArchiveClassesAtExit={dump} -Xlog:cds=off -Xlog:cds+dynamic=off"
    found = archive()
    if found is None or not found.is_file():
        return ""
    # -Xshare:auto, the default: an archive the JVM cannot use is ignored, the run goes on without it
    return f"-XX:SharedArchiveFile={found}"
