"""ropescale's rope types in transformers, registered by ``import ropescale.hf``.

A rope type names the frequency table. transformers has ``default``, ``linear``, ``dynamic``,
``yarn``, ``llama3`` and ``longrope``; ropescale adds, by rule:

- ``dynamic_ntk`` (what ``hf.patch`` writes for Dynamic NTK: stock vLLM serves transformers' ``dynamic``
  wrongly), ``dynamic_yarn``, and ``ntk`` (static NTK-aware, as ropescale wrote it before it wrote
  ``default`` with the scaled ``rope_theta``: such checkpoints still load);
- ``resonance`` (Resonance RoPE on plain RoPE) and ``resonance_<type>`` for Resonance on top of
  ``linear``, ``ntk``, ``dynamic``, ``yarn``, ``dynamic_yarn`` and ``llama3``. (Resonance on
  ``longrope`` is written as a plain ``longrope`` whose per-pair factors hold the rounded table:
  transformers and vLLM run it natively);
- ``rerope`` and ``rerope_<table type>``: a checkpoint trained with ReRoPE attention, whose table is
  ``<table type>`` (``default`` for ``rerope``); ``self_extend[_<table type>]`` and ``dual_chunk`` likewise for
  Self-Extend and Dual Chunk Attention. The window and the rest of the attention side are in
  the config's ``ropescale`` entry (see ``ropescale.hf.checkpoint``). The marker exists so that
  a ReRoPE checkpoint never loads silently as a plain-attention model: without ropescale it fails,
  and with it the model warns until ``ropescale.hf.patch(model)`` puts the attention back.

Registering them in ``ROPE_INIT_FUNCTIONS`` (and giving the config mixin a validator for each) lets a
config such as ``rope_parameters={"rope_type": "resonance_yarn", "factor": 8,
"original_max_position_embeddings": 4096}`` load and run in an unpatched transformers model. The
tables come from ropescale's ops, through ``ropescale.config.read``. Without ``import
ropescale.hf`` transformers refuses such a config (``KeyError`` naming the type when the model is
built), so a checkpoint never loads silently as default RoPE.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from transformers import modeling_rope_utils as rope_utils

from .. import config as config_lib, scaling
from ..config import rotary_dim_of, table_parameters
from ..scaling import RopeType


#: Every rope type ``import ropescale.hf`` registers in transformers (from the method registry).
ROPESCALE_ROPE_TYPES = scaling.ropescale_rope_types()


def _init_function(config, device=None, seq_len=None, layer_type=None):
    """A ``ROPE_INIT_FUNCTIONS`` entry: (inv_freq, attention_factor) from ropescale's ops."""
    config.standardize_rope_params()
    params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
    table, marker = table_parameters(params)
    if seq_len is None:  # model build: the entry's values refused here too (as hf.patch and the vLLM plugin do)
        try:
            config_lib.read(params, config.max_position_embeddings, getattr(config, config_lib.CONFIG_KEY, None),
                            None, getattr(config, config_lib.DUAL_CHUNK_KEY, None))
        except ValueError as err:
            raise ValueError(f"ropescale: {err}") from None
    if marker and seq_len is None:
        warnings.warn(
            f"ropescale: rope_type {params['rope_type']!r} marks a checkpoint trained with "
            f"{config_lib.ATTENTION_NAMES[marker]} "
            f"(config.ropescale = {getattr(config, 'ropescale', None)}); call ropescale.hf.patch(model) to run it "
            "as trained: unpatched, it attends with plain RoPE",
            stacklevel=2,
        )
    # The table only: the attention side is hf.patch's business (and the warning above).
    method = config_lib.read(table, config.max_position_embeddings).method
    seq_len = None if seq_len is None else int(seq_len)
    inv_freq = method.inv_freq(rotary_dim_of(config, params, layer_type), params["rope_theta"], seq_len=seq_len)
    return inv_freq.to(device), method.attention_factor_for(seq_len)


def _make_validator(rope_type: str):
    parsed = RopeType.parse(rope_type)
    method = parsed.method
    required, optional = scaling.HF_KEYS[method.rope_type]

    def validate(self, rope_parameters, ignore_keys=None):
        if not method.transformers_native:  # the registry's keys
            self._check_received_keys(rope_type, set(rope_parameters.keys()), {"rope_type", *required},
                                      optional_keys={"rope_theta", *optional}, ignore_keys=ignore_keys)
        else:  # transformers' own checks for the underlying type (keys, value warnings)
            checked = dict(rope_parameters)
            if method.stock_length_is_scaled:  # what standardize_rope_params does for those
                checked.setdefault("original_max_position_embeddings", getattr(self, "max_position_embeddings", None))
            own = {p.hf_key for p in method.parameters() if p.ropescale_key and p.hf_key}  # checked below
            getattr(rope_utils.RotaryEmbeddingConfigMixin, f"_validate_{method.rope_type}_rope_parameters")(
                self, checked, ignore_keys=set(ignore_keys or ()) | own)
        # Build the method once: bad values get ropescale's own clear errors at load time.
        table, _ = table_parameters(rope_parameters)
        config_lib.read(table, getattr(self, "max_position_embeddings", None))

    validate.__name__ = f"_validate_{rope_type}_rope_parameters"
    return validate


def _taking_sglang_attn_factor(own):
    """transformers' ``yarn`` validator, which takes the ``attn_factor`` ropescale writes beside ``attention_factor``
    for stock SGLang (``config.write``) where the two agree, rather than log it as an unrecognized key on every load;
    one that disagrees is still logged (``config.read`` refuses it)."""

    def validate(self, rope_parameters, ignore_keys=None):
        if config_lib.SGLANG_YARN_KEY in rope_parameters:
            with warnings.catch_warnings():  # the table's own notes come from transformers' validator, once
                warnings.simplefilter("ignore")
                agrees = config_lib.stock_sglang_misreads(
                    rope_parameters, getattr(self, "max_position_embeddings", None)) is None
            if agrees:
                ignore_keys = set(ignore_keys or ()) | {config_lib.SGLANG_YARN_KEY}
        return own(self, rope_parameters, ignore_keys=ignore_keys)

    validate.__name__, validate.ropescale_wraps = own.__name__, own
    return validate


def register_rope_types() -> None:
    """Idempotent: adds ropescale's rope types to transformers (done on ``import ropescale.hf``), and makes its
    ``yarn`` validator take the ``attn_factor`` ropescale writes (:func:`_taking_sglang_attn_factor`)."""
    mixin = rope_utils.RotaryEmbeddingConfigMixin
    yarn = mixin._validate_yarn_rope_parameters
    mixin._validate_yarn_rope_parameters = _taking_sglang_attn_factor(getattr(yarn, "ropescale_wraps", yarn))
    for rope_type in scaling.ropescale_rope_types():  # the registry now: a method registered later is added too
        rope_utils.ROPE_INIT_FUNCTIONS[rope_type] = _init_function
        setattr(rope_utils.RotaryEmbeddingConfigMixin, f"_validate_{rope_type}_rope_parameters",
                _make_validator(rope_type))
