#!/usr/bin/env bash
# Sets up the virtual environment if missing and runs the whole test suite.
# Extra arguments go to pytest. MIRAGE_SLOW_TESTS=1 also runs the slow tests (marker `slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m pytest -v "$@"
