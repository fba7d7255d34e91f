#!/usr/bin/env bash
# The one command for a lent GPU machine (offline, any torch >= 2.11, Python 3.12 there, nvcc):
# builds ropescale in place for the local GPU's arch only, runs `ropescale check` (every op on every
# device against float64; its failure is recorded, the rest still runs), the CUDA tests (which include
# the tensor-core prefill tests and the CPU-vs-CUDA parity tests) and the rotary and ReRoPE
# benchmarks, and writes one markdown report (device, torch, figures, failures) to
# OUT_DIR/gpu_report.md. Ends within 8 minutes: each step's time limit is cut to what is left of
# GPU_CHECK_SECONDS (default 470), and a step with no time left is recorded as not run.
#
#   scripts/gpu_check.sh OUT_DIR
#   PYTHON=python3 JOBS=16 scripts/gpu_check.sh OUT_DIR
#
# Without a GPU it builds the CPU library, says "no GPU" on stdout and in the report, and
# exits 0: so it can be tried on any machine. Python packages missing on the GPU machine (no network)
# travel as wheels in .whl/ (see CONTRIBUTING.md): they are installed into build-gpu/site, never into
# the machine's own environment. Exits non-zero only when the build or a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT="$OUT/gpu_report.md"
BUILD=build-gpu
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
JOBS=${JOBS:-$(nproc)}
BUDGET=${GPU_CHECK_SECONDS:-470}
export PYTHONPATH="$PWD/$BUILD/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
failures=()
started=$SECONDS

section() { printf '\n## %s\n\n' "$1" >>"$REPORT"; }
fenced() { { echo '```'; cat "$1"; echo '```'; } >>"$REPORT"; }
# run NAME TIMEOUT LOG COMMAND...: runs a step, records its time and failure. The time limit is cut
# to what is left of BUDGET; with nothing left the step is recorded as not run (a failure).
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - (SECONDS - started)))
  ((limit > left)) && limit=$left
  if ((limit <= 0)); then
    echo "gpu_check: $name NOT RUN (the ${BUDGET} s budget is spent)"
    echo "(not run: the ${BUDGET} s budget was spent)" >"$log"
    failures+=("$name: not run, out of time")
    echo "- $name: not run (out of time)" >>"$OUT/steps.md"
    return 124
  fi
  local start=$SECONDS rc=0
  timeout "$limit" "$@" >"$log" 2>&1 || rc=$?
  local took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    echo "gpu_check: $name ok (${took} s)"
  else
    [ $rc -eq 124 ] && echo "(timed out after ${limit} s)" >>"$log"
    echo "gpu_check: $name FAILED (exit $rc, ${took} s): $log"
    failures+=("$name (exit $rc): see $(basename "$log")")
  fi
  echo "- $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED, exit $rc"), ${took} s" >>"$OUT/steps.md"
  return $rc
}

: >"$OUT/steps.md"
if compgen -G ".whl/*.whl" >/dev/null; then
  run "carried wheels (.whl/) into $BUILD/site" 120 "$OUT/wheels.log" \
    "$PYTHON" -m pip install --no-index --no-deps --upgrade --target "$BUILD/site" .whl/*.whl
fi

"$PYTHON" - >"$OUT/device.md" 2>&1 <<'EOF'
import platform, subprocess, torch
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}")
try:
    import transformers
    print(f"- transformers {transformers.__version__} (from {transformers.__file__.rsplit('/', 2)[0]})")
except ImportError:
    print("- transformers: not installed")
try:
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
except (OSError, IndexError):
    nvcc = "not found"
print(f"- nvcc: {nvcc}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"- GPU: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    print(f"- device-to-device copy: {2 * x.numel() / seconds / 1e9:.0f} GB/s (bytes read + written, 1 GiB)")
else:
    print("- GPU: none (torch.cuda.is_available() is False)")
EOF
ARCH=$("$PYTHON" -c "import torch; print('%d%d' % torch.cuda.get_device_capability() if torch.cuda.is_available() else '')" 2>/dev/null)

{
  echo "# ropescale GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPU cores"
  echo
  cat "$OUT/device.md"
} >"$REPORT"

CMAKE_ARGS=(-DPython_EXECUTABLE="$PYTHON" -DROPESCALE_INPLACE=ON -DROPESCALE_BUILD_TESTS=OFF -DROPESCALE_PTXAS_VERBOSE=ON)
if [ -n "$ARCH" ]; then
  CMAKE_ARGS+=(-DROPESCALE_CUDA=ON -DROPESCALE_CUDA_ARCHS="$ARCH")
else
  # Nothing could run CUDA code here; setup.sh / CI already compile the CUDA sources.
  echo "gpu_check: no GPU (torch.cuda.is_available() is False): building the CPU library only"
  CMAKE_ARGS+=(-DROPESCALE_CUDA=OFF)
fi
build_ok=0
run "configure ($BUILD${ARCH:+, sm_$ARCH})" 120 "$OUT/configure.log" cmake -S . -B "$BUILD" -G Ninja "${CMAKE_ARGS[@]}" &&
  run "build (-j$JOBS)" 480 "$OUT/build.log" cmake --build "$BUILD" -j "$JOBS" &&
  run "import" 60 "$OUT/import.log" "$PYTHON" -c "import ropescale; print(ropescale.build_info())" && build_ok=1

section "Build"
cat "$OUT/import.log" >>"$REPORT" 2>/dev/null
if [ -f "$OUT/build.log" ]; then
  "$PYTHON" scripts/ptxas_summary.py "$OUT/build.log" >"$OUT/ptxas.txt" 2>&1 || failures+=("CUDA kernels spill registers: see ptxas.txt")
fi
[ -s "$OUT/ptxas.txt" ] && { echo; echo "Registers and spills (ptxas -v):"; fenced "$OUT/ptxas.txt"; } >>"$REPORT"

# `ropescale check` first: every op on every device present against float64, one table. Its failure is
# recorded and the steps after it still run.
if [ "$build_ok" = 1 ]; then
  run "ropescale check" 90 "$OUT/check.log" "$PYTHON" -m ropescale check
  section "ropescale check"
  fenced "$OUT/check.log"
fi

if [ "$build_ok" = 1 ] && [ -z "$ARCH" ]; then
  echo "gpu_check: no GPU: built and imported; nothing on a GPU to test or measure"
  section "Result"
  echo "no GPU: the build, the import and \`ropescale check\` (CPU) ran; no CUDA test or benchmark." >>"$REPORT"
  if ((${#failures[@]})); then
    section "Failures"
    printf -- '- %s\n' "${failures[@]}" >>"$REPORT"
  fi
  section "Steps"
  cat "$OUT/steps.md" >>"$REPORT"
  echo "gpu_check: report in $REPORT ($((SECONDS - started)) s)"
  exit 0
fi

if [ "$build_ok" = 1 ]; then
  # (test_cuda_kernels.py includes rerope_attention_paged / rerope_cache_write_ against the float64 oracle.)
  run "pytest -m cuda (CUDA tests: tensor-core prefill, masking, paged attention, CPU-vs-CUDA parity)" 200 \
    "$OUT/pytest_cuda.log" \
    "$PYTHON" -m pytest tests/python -m cuda -q -p no:cacheprovider -rfE
  run "bench_rotary (GPU)" 60 "$OUT/bench_rotary.log" "$PYTHON" benchmarks/bench_rotary.py --device cuda --quick
  if "$PYTHON" benchmarks/bench_rerope.py --help 2>/dev/null | grep -q -- '--device'; then
    # bench_rerope.py's CUDA mode includes paged16 (rerope_attention_paged, one request in pages of 16
    # slots: tensor-core prefill rows, split-K decode rows) beside the dense kernels.
    run "bench_rerope (GPU)" 180 "$OUT/bench_rerope.log" "$PYTHON" benchmarks/bench_rerope.py --device cuda
  else
    echo "benchmarks/bench_rerope.py has no CUDA mode (--device) in this tree: not measured" >"$OUT/bench_rerope.log"
    failures+=("bench_rerope: no CUDA mode in this tree")
  fi
fi

section "Tests"
[ -f "$OUT/pytest_cuda.log" ] && fenced <(tail -n 40 "$OUT/pytest_cuda.log")
section "Benchmarks"
for b in bench_rotary bench_rerope; do
  [ -f "$OUT/$b.log" ] && { echo "### $b"; echo; fenced "$OUT/$b.log"; echo; } >>"$REPORT"
done
section "Steps"
cat "$OUT/steps.md" >>"$REPORT"
section "Failures"
if ((${#failures[@]})); then printf -- '- %s\n' "${failures[@]}" >>"$REPORT"; else echo "none" >>"$REPORT"; fi
echo "gpu_check: report in $REPORT ($((SECONDS - started)) s, ${#failures[@]} failures)"
((${#failures[@]} == 0))
