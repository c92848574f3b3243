#!/usr/bin/env bash
# The soak: the real daemon and a following Spark consumer on throwaway servers under a steady mixed
# workload, while a seeded scheduler injects faults (kills, stops, network cuts, source restarts, tables
# added and re-synced, a full landing disk); then `cdcd verify` and the landing replay. docs/testing.md, "Soak".
#   scripts/soak.sh --minutes N [--source postgres|mariadb|both] [--seed S] [--format delta|iceberg|parquet] [--keep]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m devtools.soak "$@"
