#!/usr/bin/env bash
# Builds BUILD_DIR (ninja through cmake; TARGET... when given), its output to stdout at the end, and every 15 s a
# line "build: N of M steps (S s)" from ninja's own counter, so a person sees a long build move: to file descriptor
# 3 where it is open (setup.sh's step: the terminal, while the output goes to a log), else to stderr.
#   scripts/build_with_progress.sh BUILD_DIR [TARGET...]
set -uo pipefail
if { true >&3; } 2>/dev/null; then exec 4>&3; else exec 4>&2; fi
build_dir=$1
shift
targets=()
for target in "$@"; do targets+=(--target "$target"); done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
cmake --build "$build_dir" "${targets[@]}" >"$log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; rm -f "$log"' EXIT INT TERM
while kill -0 "$pid" 2>/dev/null; do
  for _ in $(seq 15); do kill -0 "$pid" 2>/dev/null && sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then
    progress=$(grep -o '^\[[0-9]*/[0-9]*\]' "$log" | tail -1 | tr -d '[]')
    progress=${progress:-0/?}
    echo "build: ${progress/\// of } steps ($((SECONDS - start)) s)" >&4
  fi
done
wait "$pid"
rc=$?
cat "$log"
exit $rc
