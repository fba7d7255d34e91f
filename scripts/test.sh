#!/usr/bin/env bash
# Runs every test: the C++ tests (Catch2 through ctest) and pytest. Exits non-zero on any failure.
# Extra arguments go to pytest (e.g. ./scripts/test.sh -k yarn).
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BUILD_DIR=${BUILD_DIR:-build}
status=0
echo "== C++ tests (ctest)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 || status=1
echo "== Python tests (pytest)"
"$VENV/bin/python" -m pytest "$@" || status=1
exit $status
