#!/usr/bin/env bash
# Sets up ropescale from nothing: system packages (Catch2, ccache, ninja), a virtual environment
# with the pinned Python packages, and an in-place build of the native library and its C++ tests.
# Re-running it is cheap (ccache and the persistent build directory make it incremental).
#   VENV=.venv BUILD_DIR=build ROPESCALE_CUDA=AUTO|ON|OFF ./scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BUILD_DIR=${BUILD_DIR:-build}

need_apt=()
dpkg -s catch2 >/dev/null 2>&1 || need_apt+=(catch2)
command -v ccache >/dev/null 2>&1 || need_apt+=(ccache)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]} from Debian"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2>&1 \
  | { grep -v "^WARNING: Location" || true; }

cmake -S . -B "$BUILD_DIR" -G Ninja \
  -DPython_EXECUTABLE="$PWD/$VENV/bin/python" \
  -DROPESCALE_CUDA="${ROPESCALE_CUDA:-AUTO}" \
  -DROPESCALE_BUILD_TESTS=ON -DROPESCALE_INPLACE=ON -DROPESCALE_PTXAS_VERBOSE=ON >/dev/null
cmake --build "$BUILD_DIR" 2>&1 | tee "$BUILD_DIR/build.log"
# Registers and spills per CUDA kernel and arch (from ptxas -v; empty when nothing was recompiled).
python3 scripts/ptxas_summary.py "$BUILD_DIR/build.log" || echo "setup: some CUDA kernels spill registers (see above)"

# Development install: the venv sees python/ (with the in-place _C) like an editable install.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD/python" > "$site/ropescale-dev.pth"
"$VENV/bin/python" -c "import ropescale; print('setup: ropescale', ropescale.__version__, ropescale.build_info())"
