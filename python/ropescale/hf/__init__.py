"""Hugging Face integration: ``patch``/``unpatch`` Llama-family models, the pre-RoPE KV cache, and
ropescale's rope types (``ntk``, ``dynamic_yarn``, ``resonance``, ``resonance_<type>``, ``rerope_<type>``)
registered in transformers. A patch is recorded in ``model.config`` (``ropescale.hf.checkpoint``), so
``save_pretrained`` writes the model that was trained and ``patch(model)`` on a reload re-applies it.

Supported transformers: 5.x (CI tests 5.23.0).
"""

from . import checkpoint
from .cache import PreRopeCache
from .patch import SUPPORTED_ARCHITECTURES, is_patched, patch, request, unpatch
from .rope_types import ROPESCALE_ROPE_TYPES, register_rope_types

register_rope_types()

__all__ = ["patch", "unpatch", "is_patched", "request", "PreRopeCache", "SUPPORTED_ARCHITECTURES", "ROPESCALE_ROPE_TYPES",
           "register_rope_types", "checkpoint"]
