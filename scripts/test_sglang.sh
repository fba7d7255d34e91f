#!/usr/bin/env bash
# The SGLang leg (opt-in: not in ./scripts/test.sh, see docs/engines/sglang.md): sets up .venv-sglang with
# scripts/setup_sglang.sh (SGLang 0.5.23 on torch 2.14.1, ropescale from this checkout), then runs
# tests/python/engines/test_sglang*.py there: ropescale's SGLang plugin and `ropescale verify --engine sglang` against
# SGLang's own engine (its CPU engine where there is no GPU: torch_native attention, float32).
#   ./scripts/test_sglang.sh [PYTEST ARGS...]        e.g. -k yarn
# Needs the main build (./scripts/setup.sh) first: the leg imports ropescale's ops from this checkout.
# Opt-in because it does not fit CI's budget: its setup downloads and installs about 60 packages beside a second
# torch (several GB), and each case starts an engine (30-50 s on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-$PWD/.venv-sglang}
./scripts/setup_sglang.sh
start=$SECONDS
status=0
ROPESCALE_SGLANG_LEG=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 \
  tests/python/engines/test_sglang*.py "$@" || status=$?
echo "sglang: leg exit $status ($((SECONDS - start)) s)"
exit $status
