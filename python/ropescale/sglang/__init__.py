"""SGLang integration: serve the checkpoints ``ropescale.hf.patch`` and ``ropescale extend`` write (docs/DESIGN.md,
"Engines").

Activated by the entry point ``ropescale = "ropescale.sglang:register"`` in SGLang's group ``sglang.srt.plugins``
(``pip install "ropescale[sglang]"``): SGLang calls :func:`register` in every process it starts (front end,
scheduler, detokenizer), then applies the hooks it registered. What it does there, once per process:

- an AROUND hook on ``sglang.srt.layers.rotary_embedding.factory.get_rope``, SGLang's one dispatch point of rope
  types (its hook registry re-points every ``from ... import get_rope``): a layer of a checkpoint ropescale wrote
  (:func:`ropescale.serving.written_by_ropescale`) with a static table gets
  :class:`~ropescale.sglang.rotary.RopescaleRotaryEmbedding`, SGLang's own rotary layer over ropescale's table
  (YaRN's ``attention_factor``, which stock SGLang drops, included); a ``per="request"`` table gets
  :class:`~ropescale.sglang.rotary.RequestRotaryEmbedding` (each request rotated with the table of its planned
  length when its keys are written; SGLang's own attention serves them); a method that needs ropescale's attention
  (ReRoPE, Self-Extend, DCA, STRING, per-step dynamic tables) gets a pass-through rotary, SGLang's pool caches raw
  keys and ropescale's backend attends (:mod:`ropescale.sglang.attention`; a hook on ``_build_resolved_backend``
  picks it for such a model); what it cannot serve (a multimodal rope's) is refused at engine start, by name.
  Every other layer is SGLang's own, untouched;
- AFTER hooks on ``ForwardBatch.init_new`` (each step's per-request tables) and ``Req.__init__`` (a request's
  scale joins its radix-cache key);
- an AROUND hook on ``sglang.srt.model_loader.loader._initialize_model``, so that ``get_rope`` knows the config of
  the model being built (the ``ropescale`` entry, the served length), and one on SGLang's ``get_context_length``:
  a checkpoint ropescale wrote is served to the length it was written for (SGLang's rule for deriving it from
  ``factor`` is not vLLM's, which ropescale writes for);
- registers ropescale's rope types in transformers (``import ropescale.hf``), so the config loads.

``ROPESCALE_SGLANG=0`` switches the plugin off. Outside the tested SGLang range it warns once and does nothing.
Tested: SGLang 0.5.23 (its CPU engine, ``scripts/test_sglang.sh``).
"""

from __future__ import annotations

import logging

from .. import _plugin

__all__ = ["register", "TESTED_SGLANG", "is_active"]

#: SGLang releases the plugin was tested with (``[lower, upper)``, as in pyproject's ``ropescale[sglang]``).
TESTED_SGLANG = ((0, 5), (0, 6))
logger = logging.getLogger("sglang.ropescale")
_state: dict[str, bool] = {}

#: Where the hooks go (SGLang's dotted paths), for :func:`register` and the tests.
GET_ROPE = "sglang.srt.layers.rotary_embedding.factory.get_rope"
INITIALIZE_MODEL = "sglang.srt.model_loader.loader._initialize_model"
CONTEXT_LENGTH = "sglang.srt.utils.hf_transformers.common.get_context_length"
FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
REQUEST = "sglang.srt.managers.schedule_batch.Req.__init__"
ATTENTION_BACKEND = "sglang.srt.model_executor.model_runner_components.attention_backend_setup._build_resolved_backend"


def is_active() -> bool:
    """Whether :func:`register` installed the plugin in this process."""
    return _state.get("active", False)


def _attention_backend(original, *args, **kwargs):
    """AROUND hook of SGLang's ``_build_resolved_backend`` (every attention backend a model runner builds): a model
    whose rotary passes raw keys gets ropescale's (:mod:`ropescale.sglang.attention`), every other SGLang's."""
    from . import rotary

    if not rotary.serves_raw_keys():
        return original(*args, **kwargs)
    from . import attention

    return attention.RopescaleAttnBackend(kwargs["model_runner"] if "model_runner" in kwargs else args[0])


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: idempotent, cheap, one log line per process. SGLang logs and swallows
    an exception raised here, so nothing here may fail for a model that does not use ropescale."""
    version = _plugin.engine_to_serve(_state, "SGLang", "sglang", "ROPESCALE_SGLANG", TESTED_SGLANG, logger)
    if version is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .. import __version__ as ropescale_version, hf  # noqa: F401  (hf: ropescale's rope types in transformers)
    from . import rotary

    HookRegistry.register(GET_ROPE, rotary.get_rope, HookType.AROUND)
    HookRegistry.register(INITIALIZE_MODEL, rotary.initialize_model, HookType.AROUND)
    HookRegistry.register(CONTEXT_LENGTH, rotary.context_length, HookType.AROUND)
    HookRegistry.register(FORWARD_BATCH, rotary.step_tables, HookType.AFTER)
    HookRegistry.register(REQUEST, rotary.request_cache_key, HookType.AFTER)
    HookRegistry.register(ATTENTION_BACKEND, _attention_backend, HookType.AROUND)
    _state["active"] = True
    logger.info("ropescale %s: SGLang %s plugin active (ropescale's rope types served)", ropescale_version, version)
