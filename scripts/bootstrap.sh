#!/usr/bin/env bash
# Make this Debian machine ready for cdcd: database servers, Java, and .venv.
# Installs only what is missing; a second run on a ready machine takes seconds.
# It never starts, stops or reconfigures the machine's own database services.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.cdcd-installed"

step() { CURRENT_STEP="$1"; }
fail() { echo "bootstrap: step '$CURRENT_STEP' failed: $*" >&2; exit 1; }
trap 'fail "command exited with status $? (line $LINENO); see the messages above"' ERR

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        fail "needs root to install system packages ($*); run as root or install sudo"; fi
}

have_pg() { compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && compgen -G "/usr/lib/postgresql/*/bin/pg_recvlogical" >/dev/null; }
have_maria() { [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db >/dev/null && command -v mariadb >/dev/null && command -v mariadb-binlog >/dev/null; }
have_java() { command -v java >/dev/null; }

missing=()
step "check system packages"
have_pg || missing+=(postgresql postgresql-client)
have_maria || missing+=(mariadb-server mariadb-client)
have_java || missing+=(default-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
# mysqlclient (the MySQL/MariaDB snapshot's bulk reader) builds against libmariadb; pip finds it with pkg-config
[ -e /usr/include/mariadb/mysql.h ] || missing+=(libmariadb-dev)
command -v pkg-config >/dev/null || missing+=(pkg-config)

if [ ${#missing[@]} -gt 0 ]; then
    step "install ${missing[*]}"
    echo "bootstrap: installing ${missing[*]}" >&2
    # Keep package scripts from creating or starting the machine's own database services:
    # the tests start their own servers in temporary directories.
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
        as_root chmod +x "$policy"
        trap 'as_root rm -f "$policy"' EXIT
    fi
    as_root mkdir -p /etc/postgresql-common
    [ -e /etc/postgresql-common/createcluster.conf ] || \
        echo "create_main_cluster = false" | as_root tee /etc/postgresql-common/createcluster.conf >/dev/null
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq >/dev/null || fail "apt-get update could not reach the Debian package registry"
    as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || fail "apt-get install ${missing[*]} failed; run it by hand to see why"
fi

step "python"
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || fail "$PYTHON is older than 3.11; install Python 3.11+ or set PYTHON=/path/to/python3.11"

step "S3 server (versitygw) into .tools/bin/"
# A real S3-compatible server for the tests and the demo (devtools/s3server.py S3Server), built from its Go module
# with the installed Go toolchain; only where missing. The first build takes about 5 minutes on two cores, so it
# runs in the background while pip and Maven wait on the network; the bootstrap waits for it at the end.
VGW_VERSION=v1.8.0
TOOLS="$ROOT/.tools"
VGW_PID=
if [ ! -x "$TOOLS/bin/versitygw" ] || [ "$(cat "$TOOLS/versitygw.version" 2>/dev/null)" != "$VGW_VERSION" ]; then
    command -v go >/dev/null || [ -x /usr/local/go/bin/go ] \
        || fail "the Go toolchain (go) is missing: install Go 1.24+ to build the S3 server the tests use"
    GO=$(command -v go || echo /usr/local/go/bin/go)
    echo "bootstrap: building the S3 server versitygw $VGW_VERSION in the background (first time only, about 5 minutes)" >&2
    mkdir -p "$TOOLS/bin"
    (
        started=$(date +%s)
        GOBIN="$TOOLS/bin" timeout 1800 "$GO" install "github.com/versity/versitygw/cmd/versitygw@$VGW_VERSION" \
            >"$TOOLS/go-build.log" 2>&1 || { tail -n 20 "$TOOLS/go-build.log" >&2; exit 1; }
        echo "$VGW_VERSION" > "$TOOLS/versitygw.version"
        echo "bootstrap: versitygw built in $(( $(date +%s) - started )) s" >&2
    ) &
    VGW_PID=$!
fi

step "virtual environment"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
want=$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    step "pip install -e .[dev,spark]"
    log="$VENV/pip-install.log"
    { "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip &&
      "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[dev,spark]"; } >"$log" 2>&1 \
        || { tail -n 30 "$log" >&2; fail "pip could not install the project (full log: $log)"; }
    echo "$want" > "$STAMP"
fi

step "bytecode of cdcd"
# Python reads a module's cached bytecode even where PYTHONDONTWRITEBYTECODE keeps it from writing one (as on
# some CI machines and containers); then every daemon start would compile cdcd again (about 60 ms of each).
"$VENV/bin/python" -m compileall -q "$ROOT/cdcd" >/dev/null || fail "python -m compileall cdcd failed"

step "Spark jars (Delta Lake, Iceberg, SQLite JDBC, S3A, the tests' metastore database) into .jars/"
# Resolved once from Maven Central into a project-local cache; the Spark job passes them as
# spark.jars, so tests and the demo run offline afterwards. Versions: cdcd/spark/jars.py.
# S3A (s3a:// paths) is hadoop-aws of the installed pyspark's Hadoop and the AWS SDK bundle it was
# built with: 640 MB, about a minute from Maven Central the first time.
JARS="$ROOT/.jars"
mkdir -p "$JARS"
for coordinate in $("$VENV/bin/python" -m cdcd.spark.jars); do
    IFS=: read -r _ artifact version <<<"$coordinate"
    [ -f "$JARS/$artifact-$version.jar" ] && continue
    step "fetch $coordinate"
    mvn -q -B dependency:copy -Dartifact="$coordinate" -DoutputDirectory="$JARS" -Dmaven.repo.local="$JARS/.m2" \
        >"$JARS/mvn.log" 2>&1 || { tail -n 20 "$JARS/mvn.log" >&2;
        fail "Maven could not fetch $coordinate from Maven Central (full log: $JARS/mvn.log)"; }
done

step "CDS archive of the Spark job's classes (.jars/cds/)"
# A fresh Spark JVM spends a sixth of its CPU loading classes; the archive holds them parsed and
# verified (cdcd/sparkcds.py, cdcd/spark/cds.py). Built once (about a minute) per JDK and jar set; then a file check.
"$VENV/bin/python" -m cdcd.sparkcds \
    || echo "bootstrap: warning: no CDS archive (see above); Spark runs start slower without it" >&2

if [ -n "$VGW_PID" ]; then
    step "S3 server (versitygw) build"
    wait "$VGW_PID" || fail "go install of versitygw $VGW_VERSION failed (full log: $TOOLS/go-build.log)"
fi
