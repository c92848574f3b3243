#!/usr/bin/env bash
# The Spark lines cdcd supports (docs/spark.md, "Supported Spark lines"): the consumer's integration tests on
# the Spark 4.0 line and on 4.1, the line .venv pins. Not part of scripts/test.sh; prints one result line per
# Spark line and exits 1 when a line fails.
#
#   scripts/compat.sh [--all] [LINE ...]      LINE: 4.0, 4.1 (default: both, 4.0 first)
#
# By default the files that run the consumer's apply on every format and what differs between lines (CORE,
# about 15 minutes for both lines on 2 cores); --all runs every tests/integration/test_spark_*.py (over an hour
# for both lines on 2 cores: the format matrix of test_spark_formats.py alone is 12-16 minutes a line).
#
# The 4.0 line runs in .venv-spark40: pyspark 4.0.x alone (about 300 MB, installed by the first run), with
# everything else taken from .venv (a .pth file adds .venv's site-packages after its own, so its pyspark wins).
# Its jars (Delta Lake 4.0.x, the Iceberg runtime for 4.0, hadoop-aws of its Hadoop: cdcd/spark/jars.py LINES)
# go to .jars-spark40 (CDCD_SPARK_JARS), fetched from Maven Central by the first run, with the class-data
# sharing archive of that jar set. Tests run on one xdist worker: the machine is shared.
# A first run takes about 5 minutes more for the downloads and the archive's training run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

PYSPARK40=${CDCD_COMPAT_PYSPARK40:-4.0.5}
VENV40="$ROOT/.venv-spark40"
JARS40="$ROOT/.jars-spark40"
#: Seconds one line's tests may take (pytest's own per-test timeout still applies inside).
LINE_TIMEOUT=${CDCD_COMPAT_LINE_TIMEOUT:-900}
#: Every kind of change applied exactly once per format, key-range re-syncs per format, the Delta tables delta-rs
#: reads (Delta features differ between Delta releases), the Iceberg catalog, S3A with the line's hadoop-aws, the
#: target lock; and the unit tests of the line's jar versions. Left for --all: the longer format matrix
#: (test_spark_formats.py), schema changes, file pruning, the catalog-registered tables, the class-data sharing
#: archive (a start-up cache, not the consumer's behaviour).
CORE=(tests/unit/test_spark_jars.py tests/unit/test_spark_lines.py tests/integration/test_spark_consumer.py
      tests/integration/test_spark_covered.py tests/integration/test_spark_delta_readers.py
      tests/integration/test_spark_iceberg_catalog.py tests/integration/test_spark_s3a.py
      tests/integration/test_spark_target_lock.py)
TESTS=("${CORE[@]}")
if [ "${1:-}" = --all ]; then
    shift
    TESTS=(tests/unit/test_spark_jars.py tests/unit/test_spark_lines.py tests/integration/test_spark_*.py)
    LINE_TIMEOUT=${CDCD_COMPAT_LINE_TIMEOUT:-3600}
fi

fail() { echo "compat: $*" >&2; exit 2; }
[ -x "$ROOT/.venv/bin/python" ] || fail "no .venv: run scripts/bootstrap.sh first (the 4.1 line and the tools)"

lines=("$@")
[ ${#lines[@]} -gt 0 ] || lines=(4.0 4.1)
for line in "${lines[@]}"; do
    case "$line" in 4.0|4.1) ;; *) fail "unknown Spark line '$line': give 4.0 or 4.1 (or nothing for both)";; esac
done

setup_40() {
    local site base
    site=$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    base=$("$ROOT/.venv/bin/python" -c 'import sys; print(sys._base_executable)')
    if ! "$VENV40/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('pyspark') != '$PYSPARK40')" \
            2>/dev/null; then
        echo "compat: installing pyspark $PYSPARK40 into $VENV40 (about 300 MB, first run only)" >&2
        "$base" -m venv "$VENV40" || fail "python -m venv $VENV40 failed"
        timeout 900 "$VENV40/bin/python" -m pip install -q --disable-pip-version-check "pyspark==$PYSPARK40" \
            || fail "pip could not install pyspark==$PYSPARK40 into $VENV40 (set CDCD_COMPAT_PYSPARK40 to another 4.0.x)"
    fi
    local own
    own=$("$VENV40/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # .venv's packages (cdcd itself, pytest, pyarrow, ...) after this environment's own: its pyspark comes first
    echo "import site; site.addsitedir('$site')" > "$own/cdcd-base-venv.pth"
    # the console script the tests start beside sys.executable (as pip writes it into .venv)
    printf '#!%s\nimport sys\nfrom cdcd.cli import main\nsys.exit(main())\n' "$VENV40/bin/python" > "$VENV40/bin/cdcd"
    chmod +x "$VENV40/bin/cdcd"
    "$VENV40/bin/python" -c "import pyspark, sys; sys.exit(not pyspark.__version__.startswith('4.0.'))" \
        || fail "$VENV40 does not import pyspark 4.0.x; remove $VENV40 and run again"
    echo "compat: jars of the 4.0 line in $JARS40 (the missing ones from Maven Central: 600 MB the first time)" >&2
    CDCD_SPARK_JARS="$JARS40" timeout 1800 "$VENV40/bin/python" -c '
import sys
from pathlib import Path
from cdcd.spark import jars
assert jars.SPARK_LINE == "4.0", jars.SPARK_LINE
everything = (*jars.PACKAGES, *getattr(jars, "CATALOG_PACKAGES", ()), *jars.OBJECT_STORE_PACKAGES)
try:
    jars.fetch(jars.cache_dir(), packages=everything)
except OSError as exc:
    sys.exit(f"compat: {exc}")
' || fail "the 4.0 line's jars could not be fetched (see above)"
    CDCD_SPARK_JARS="$JARS40" timeout 900 "$VENV40/bin/python" -m cdcd.sparkcds \
        || echo "compat: warning: no CDS archive for the 4.0 line (see above); its Spark sessions start slower" >&2
}

run_line() {  # LINE PYTHON JARS: the line's tests; prints its result line, returns pytest's status
    local line=$1 python=$2 jars=$3 log started rc summary versions
    log="$LOGS/spark-$line.log"
    versions=$(CDCD_SPARK_JARS="$jars" "$python" -c '
import pyspark
from cdcd.spark import jars
print(f"pyspark {pyspark.__version__}, Delta Lake {jars.DELTA}, Iceberg {jars.ICEBERG}, Hadoop {jars.HADOOP}")')
    echo "compat: Spark $line ($versions): running, log $log" >&2
    started=$(date +%s)
    rc=0
    CDCD_SPARK_JARS="$jars" timeout "$LINE_TIMEOUT" "$python" -m pytest -p no:randomly -p no:cacheprovider -n 1 \
        -q -rfEs --durations=10 "${TESTS[@]}" >"$log" 2>&1 || rc=$?
    # pytest's last line: "N passed in S s" under -q, "== N passed in S s ==" otherwise
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=' | xargs || true)
    [ "$rc" = 124 ] && summary="timed out after $LINE_TIMEOUT s"
    RESULTS+=("Spark $line ($versions): ${summary:-no pytest summary, exit $rc}; $(( $(date +%s) - started )) s")
    [ "$rc" = 0 ] || grep -E '^(FAILED|ERROR) ' "$log" | head -n 20 >&2 || true
    return "$rc"
}

LOGS=$(mktemp -d "${TMPDIR:-/tmp}/cdcd-compat.XXXXXX")
RESULTS=()
failed=()
all_started=$(date +%s)
for line in "${lines[@]}"; do
    if [ "$line" = 4.0 ]; then
        setup_40
        run_line 4.0 "$VENV40/bin/python" "$JARS40" || failed+=(4.0)
    else
        run_line 4.1 "$ROOT/.venv/bin/python" "${CDCD_SPARK_JARS:-$ROOT/.jars}" || failed+=(4.1)
    fi
done
echo "== compat: ${#TESTS[@]} test files per Spark line ($(( $(date +%s) - all_started )) s in all; logs in $LOGS)"
printf '%s\n' "${RESULTS[@]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "compat: FAILED on Spark ${failed[*]}"
    exit 1
fi
echo "compat: OK on Spark ${lines[*]}"
