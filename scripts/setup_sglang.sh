#!/usr/bin/env bash
# Makes the venv in which SGLang's CPU engine serves tiny models on this machine (no GPU needed), with ropescale
# importable and its SGLang plugin discoverable, without building ropescale there:
#   ./scripts/setup_sglang.sh                      the venv .venv-sglang (SGLANG_VENV=DIR for another)
# What it holds: torch 2.14.1 and transformers 5.19.0 (SGLang 0.5.23's pins), the test packages of
# requirements-dev.txt, sglang 0.5.23 installed WITHOUT its dependencies (they pin the CUDA stack: flashinfer,
# sglang-kernel, flash-attn, ...; resolving them would replace torch), then only the pure-Python dependencies its
# CPU engine imports (the list below, each checked by blocking it), and an import stub of the kernel library
# (scripts/sglang_cpu_stub: the CUDA wheel of sglang-kernel needs libcuda.so.1 to import and no CPU build is on
# PyPI). ropescale comes from this checkout: a .pth file puts python/ on the path (the _C extension that
# scripts/setup.sh built in place, against the same torch 2.14.1), and a minimal dist-info (ropescale_checkout)
# carries pyproject's entry points of the group sglang.srt.plugins, which is how SGLang finds the plugin.
# Run an engine with SGLANG_USE_CPU_ENGINE=1 (and SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 to serve past the
# config's length), under `if __name__ == "__main__":` (SGLang spawns processes), e.g.
#   sglang.Engine(model_path=DIR, device="cpu", attention_backend="torch_native", dtype="float32",
#                 mem_fraction_static=0.05, max_total_tokens=4096, context_length=1024, disable_cuda_graph=True)
# Incremental: a step whose inputs are unchanged since it last passed is skipped (stamps in $VENV/.setup_sglang);
# every pip step checks that torch stayed the same. The log is build/sglang/setup.log (printed on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SGLANG_VENV:-$ROOT/.venv-sglang}
SGLANG=0.5.23
TORCH=2.14.1
TRANSFORMERS=5.19.0  # sglang 0.5.23's pin
BUILD=build/sglang
mkdir -p "$BUILD"
LOG=$ROOT/$BUILD/setup.log
: >"$LOG"
PY=$VENV/bin/python
STAMPS=$VENV/.setup_sglang

# SGLang 0.5.23's dependencies that its CPU engine imports (sglang/srt, at import time or while serving a Llama):
# each one was blocked in turn and the engine failed without it. The others in its metadata are CUDA kernels,
# multimodal or API-server extras the engine does not import (xxhash, zstandard, tiktoken, scipy, blobfile,
# anthropic, openai-harmony, llguidance, nvidia-ml-py, prometheus-client, ... were checked: not needed).
SGLANG_DEPS=(
  aiohttp==3.14.5              # sglang/lang/backend/runtime_endpoint.py (imported by `import sglang`)
  einops==0.8.2                # sglang/srt/eplb/expert_distribution.py
  ipython==9.19.1              # sglang/utils.py: IPython.display
  setproctitle==1.3.8          # sglang/srt/managers/data_parallel_controller.py (names the engine's processes)
  msgspec==0.23.0              # sglang/srt/platforms/interface.py
  uvloop==0.23.0               # sglang/srt/entrypoints/engine.py
  pyzmq==27.3.0                # sglang/srt/utils/network.py: the engine's processes talk over ZeroMQ
  fastapi==0.165.0             # sglang/srt/entrypoints/engine_info_bootstrap_server.py
  uvicorn==0.55.0              # the same file (sglang pins uvicorn>=0.51)
  partial_json_parser==0.2.1.1.post7  # sglang/srt/function_call/base_format_detector.py
  dill==0.4.1                  # sglang/srt/sampling/custom_logit_processor.py
  xgrammar==0.2.7              # sglang/srt/function_call/inkling_detector.py (detokenizer process); sglang's pin
  compressed-tensors==0.18.0   # sglang/srt/layers/quantization/compressed_tensors (imported by the loader); sglang's pin
  apache-tvm-ffi==0.1.11       # sglang/kernels/ops/communication/all_reduce.py; sglang's pin
  openai==2.8.0                # sglang/srt/entrypoints/openai/protocol.py; sglang's pin
  pybase64==1.5.1              # sglang/srt/utils/common.py
  orjson==3.13.0               # sglang/srt/utils/common.py
  torchvision==0.29.1          # sglang/srt/multimodal/internvl_utils.py (the release built for torch 2.14)
  sentencepiece==0.2.1         # sglang/srt/configs/internvl.py; sglang's pin
  psutil==7.2.2                # sglang/srt/utils (memory, process tree); accelerate needs it too
)

fail() { echo "setup_sglang: $1 FAILED; its output ($LOG):" >&2; cat "$LOG" >&2; exit 1; }
torch_of() { (cd /tmp && "$PY" -c 'import torch; print(torch.__version__)'); }
# pip with torch, torchvision and transformers held (a dependency that wanted another would fail, not replace them).
pip_install() {
  printf 'torch==%s\ntorchvision==0.29.1\ntransformers==%s\n' "$TORCH" "$TRANSFORMERS" >"$BUILD/constraints.txt"
  "$PY" -m pip install --disable-pip-version-check -c "$BUILD/constraints.txt" "$@"
}
# step NAME STAMP_TEXT COMMAND...: runs COMMAND unless the stamp NAME holds STAMP_TEXT; torch must not change.
step() {
  local name=$1 text=$2 start=$SECONDS before
  shift 2
  if [ -f "$STAMPS/$name" ] && [ "$(cat "$STAMPS/$name")" = "$text" ]; then
    echo "setup_sglang: $name: up to date (0 s)"
    return
  fi
  echo "== $name" >>"$LOG"
  before=$(torch_of 2>>"$LOG" || echo none)
  "$@" >>"$LOG" 2>&1 || fail "$name"
  if [ "$before" != none ] && [ "$(torch_of)" != "$before" ]; then
    echo "torch changed: $before -> $(torch_of)" >>"$LOG"
    fail "$name (it replaced torch)"
  fi
  mkdir -p "$STAMPS"
  printf '%s' "$text" >"$STAMPS/$name"
  echo "setup_sglang: $name ($((SECONDS - start)) s)"
}

start=$SECONDS
if [ -x "$PY" ]; then
  echo "setup_sglang: venv $VENV: exists (0 s)"
else
  python3 -m venv "$VENV" >>"$LOG" 2>&1 || fail "python3 -m venv $VENV"
  echo "setup_sglang: venv $VENV: created ($((SECONDS - start)) s)"
fi

# The test packages with SGLang's transformers instead of requirements-dev's (and torch pinned here).
grep -v -E '^(torch|transformers)([=<>~ ]|$)' requirements-dev.txt >"$BUILD/requirements.txt"
step "torch $TORCH, transformers $TRANSFORMERS, the test packages" \
  "$TORCH $TRANSFORMERS $(cat "$BUILD/requirements.txt")" \
  pip_install "torch==$TORCH" "transformers==$TRANSFORMERS" -r "$BUILD/requirements.txt"

step "sglang $SGLANG (no dependencies)" "$SGLANG" pip_install --no-deps "sglang==$SGLANG"

step "sglang's dependencies for the CPU engine (${#SGLANG_DEPS[@]})" "${SGLANG_DEPS[*]}" pip_install "${SGLANG_DEPS[@]}"

# ropescale from this checkout, the kernel-library stub, and the plugin's entry point (rewritten on every run: cheap,
# and it follows a moved checkout or a changed pyproject).
start=$SECONDS
link_checkout() {
  local site
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$ROOT/python" >"$site/ropescale_checkout.pth"
  # Appended to sys.path after site-packages: an installed (real) sgl_kernel would still come first.
  echo "$ROOT/scripts/sglang_cpu_stub" >"$site/ropescale_sglang_cpu_stub.pth"
  rm -rf "$site"/ropescale_checkout-*.dist-info
  "$PY" - "$ROOT/pyproject.toml" "$site" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
group = "sglang.srt.plugins"
points = project.get("entry-points", {}).get(group)
if not points:
    sys.exit(f"pyproject.toml has no [project.entry-points.\"{group}\"]")
info = pathlib.Path(sys.argv[2]) / f"ropescale_checkout-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ropescale-checkout\nVersion: {project['version']}\n"
                               "Summary: ropescale from a checkout (scripts/setup_sglang.sh): its SGLang entry point\n")
(info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
(info / "INSTALLER").write_text("scripts/setup_sglang.sh\n")
PY
}
echo "== ropescale from the checkout" >>"$LOG"
link_checkout >>"$LOG" 2>&1 || fail "ropescale from the checkout (.pth, dist-info)"
echo "setup_sglang: ropescale from $ROOT/python, the sgl_kernel stub, the sglang.srt.plugins entry point \
($((SECONDS - start)) s)"

start=$SECONDS
echo "== smoke check" >>"$LOG"
# The CPU engine's import path (SGLANG_USE_CPU_ENGINE=1 is what imports sgl_kernel), ropescale's op, the entry point.
(cd /tmp && SGLANG_USE_CPU_ENGINE=1 "$PY" -c "
import sglang
from sglang.srt.entrypoints.engine import Engine
from importlib.metadata import entry_points
import ropescale, torch, transformers
assert list(torch.ops.ropescale.yarn_inv_freq(128, 1e4, 4., 4096).shape) == [64]
points = [p.value for p in entry_points(group='sglang.srt.plugins') if p.name == 'ropescale']
assert points == ['ropescale.sglang:register'], points
print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__,
      'ropescale', ropescale.__file__)
") >>"$LOG" 2>&1 || fail "smoke check (import sglang's Engine, ropescale, the entry point)"
echo "setup_sglang: smoke check passed ($((SECONDS - start)) s): $(tail -1 "$LOG")"
