#!/usr/bin/env bash
# The whole cdcd pipeline on throwaway local databases, in a few minutes:
# PostgreSQL and MariaDB in temporary directories, a small shop schema, one cdcd
# daemon per database (snapshot, then streaming while a workload writes), the
# Spark consumer, `cdcd verify`, a summary. Everything it starts is stopped.
#   scripts/demo.sh [--workload-seconds N] [--no-spark] [--clean] [--object-store]
# --object-store: the landing zones and the tables on a throwaway S3 server, the consumer on a throwaway Spark
# standalone cluster; the tables are copied into the work directory before the server stops.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m devtools.demo "$@"
