#!/usr/bin/env bash
# Benchmarks: cdcd side by side with the raw tools, in one run. See docs/benchmarks.md.
# Usage: scripts/bench.sh [--quick] [--only pg_stream ...] [--no-spark]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/bootstrap.sh
exec .venv/bin/python -m bench "$@"
