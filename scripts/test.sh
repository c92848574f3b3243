#!/usr/bin/env bash
# Bootstrap, then run the whole test suite with the static checks.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
# Tests run in parallel on CDCD_TEST_WORKERS workers (default 3; 0 runs them in this process):
# three keep two cores busy (the suite is bound by Spark's CPU; four were no faster: docs/testing.md). Each worker
# starts its own PostgreSQL, MariaDB and local Spark session. A file stays on one worker (its module-scoped
# fixtures start once), except the long files listed in tests/conftest.py; slowest first (docs/testing.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/bootstrap.sh
echo "== ruff"; .venv/bin/ruff check cdcd tests bench devtools
echo "== mypy --strict cdcd"; .venv/bin/mypy cdcd
workers=${CDCD_TEST_WORKERS:-3}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
# --durations: the slowest tests at the end of every run, to keep the suite time in view (docs/testing.md)
echo "== pytest"; exec .venv/bin/pytest -p no:cacheprovider --durations=25 "${parallel[@]}" "${@:-tests}"
