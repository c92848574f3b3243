#!/usr/bin/env bash
# Bootstrap, then run the whole test suite with the static checks.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
scripts/bootstrap.sh
echo "== ruff"; .venv/bin/ruff check cdcd tests bench
echo "== mypy --strict cdcd"; .venv/bin/mypy cdcd
echo "== pytest"; exec .venv/bin/pytest -p no:cacheprovider "${@:-tests}"
