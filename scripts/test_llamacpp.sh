#!/usr/bin/env bash
# The opt-in llama.cpp leg (docs/engines/llamacpp.md): llama.cpp itself runs what `ropescale extend` writes and
# `ropescale verify --engine llama.cpp` probes it. PyPI has no llama-cpp-python wheel for this machine: the source
# build (about 11 min of CPU on 2 cores) happens once, into a wheel cache reused by every later run; the same cache
# holds the sdist, whose llama.cpp copy has the converter `ropescale extend DIR DST.gguf` runs.
#   scripts/test_llamacpp.sh                 # build or reuse the wheel, install it, run the leg
#   ROPESCALE_WHEEL_CACHE=DIR scripts/test_llamacpp.sh -k verify     # another cache; pytest's options after
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CACHE=${ROPESCALE_WHEEL_CACHE:-$HOME/.cache/ropescale/wheels}
VERSION=0.3.36
if ! "$PY" -c "import llama_cpp" 2>/dev/null; then
  wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    mkdir -p "$CACHE"
    echo "building llama-cpp-python $VERSION from source into $CACHE (once)"
    # AVX2 and FMA, not -march=native: the wheel runs on every machine here (AMD or Intel)
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
      "$PY" -m pip wheel --no-deps -w "$CACHE" "llama-cpp-python==$VERSION"
    wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n 1)
  fi
  "$PY" -m pip install -q "$wheel" diskcache
fi
# llama.cpp's converter (`ropescale extend DIR DST.gguf`): the copy in the llama-cpp-python sdist, unpacked once
if [ -z "${LLAMA_CPP_CONVERTER:-}" ]; then
  converter="$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py"
  if [ ! -f "$converter" ]; then
    mkdir -p "$CACHE"
    [ -f "$CACHE/llama_cpp_python-$VERSION.tar.gz" ] || \
      "$PY" -m pip download -q --no-deps --no-binary :all: -d "$CACHE" "llama-cpp-python==$VERSION"
    tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
  fi
  export LLAMA_CPP_CONVERTER="$converter"
fi
"$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q sentencepiece  # the converter imports it
ROPESCALE_LLAMACPP=1 "$PY" -m pytest -n 2 --dist loadfile tests/python/engines/test_llamacpp_engine.py "$@"
