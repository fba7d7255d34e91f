"""The transformers model families ``hf.patch`` knows, declared once: how each one's rope is laid out and
which of ropescale's methods its layers can take.

``hf.patch`` works through transformers' own extension points, so a family needs no re-implemented forward:

- the rotary module: for a static method it returns ropescale's table (times the method's attention factor)
  in the family's own layout; for a pre-RoPE method (ReRoPE, Dynamic NTK / YaRN) it returns the identity
  rotation, so the model's own attention forward caches raw keys;
- the attention interface (``AttentionInterface``): the model's attention implementation is wrapped as
  ``ropescale_<implementation>``, which rotates q and the cached keys at attention time (or runs ReRoPE) and
  calls the implementation the model had;
- the base model's forward (a pre-hook): the cache's layers of extended attention layers become
  :class:`ropescale.hf.PreRopeLayer`.

No family in this table needs a forward of its own. A family is found from its text config's ``model_type``;
adding one is an entry here and a tiny config in ``tests/python/adapters/test_architectures.py``.
"""

from __future__ import annotations

import dataclasses

from .. import config as config_lib, scaling

# Why a layer kind cannot take pre-RoPE methods: each reason names the layer kind, and is the refusal's text.
SINKS = "its attention layers have attention sinks (a learned logit per head), which ropescale's ReRoPE kernels lack"
SHARED_SLIDING = ("its sliding-window layers share the one rope table of its full layers, so a length-dependent "
                  "table would change them too; ropescale leaves sliding layers native only where they have rope "
                  "parameters of their own (Gemma 3)")
MLA = ("its multi-head latent attention (MLA) rotates a decoupled rope head and caches the latent, not raw keys "
       "per head")
MROPE = ("its multimodal rope turns each rotary pair at one of three positions per token (time, height, width), "
         "so no one distance between a query and a key exists for ReRoPE's window")
MLA_SCALE = ("its multi-head latent attention's softmax scale is set from rope_parameters' factor and mscale_all_dim "
             "when the model is built, one scale for every request, while a per-request method's scale differs by "
             "request")
SOFTCAP = "attention logits soft-capped (attn_logit_softcapping), which ropescale's ReRoPE kernels lack"
BIDIRECTIONAL = ("its attention is bidirectional (use_bidirectional_attention='all'), and ropescale's ReRoPE kernels "
                 "are causal")
QK_NORM_AFTER_ROPE = ("its query and key norms (query_layernorm, key_layernorm: RMSNorm with a weight per feature) come "
                      "AFTER the rotation, and do not commute with it, so keys cannot be cached raw and rotated at "
                      "attention time")
CHUNKED = ("its rope layers attend within chunks (attention_chunk_size), their cache keeping the current chunk's keys "
           "only (a sliding-window cache layer), and its QK-norm (use_qk_norm) follows the rotation and so cancels a "
           "table's attention factor; ropescale's raw-key cache keeps every key, its ReRoPE kernels mask causally "
           "only, and a rotation at attention time would apply the factor after the norm")
DEEPSEEK_V4 = ("its layers have attention sinks, keys that are also values (K=V, the output rotated back at the "
               "query's position), and compressors and an indexer that rotate compressed entries at their windows' "
               "positions with rotary modules of their own: ropescale serves its static tables (in every rotary "
               "module), not raw keys nor a table per request")
# Why a table narrower than the head (a method under partial_rotary_factor < 1) is refused.
WHOLE_HEAD = ("its attention applies cos/sin to every feature of the head (no partial-rotary slice), so a narrower "
              "table does not fit (transformers' own model fails on it too); scaling.Proportional spans the head, "
              "its pairs past partial_rotary_factor at frequency 0 (the config's proportional, with a factor)")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How ``hf.patch`` handles one family.

    ``cat_layout``: the rotary module returns transformers' Llama layout, ``cat(angles, angles)`` over
    ``[batch, seq]`` positions (ropescale computes it, angles in double). False: another layout (multimodal
    sections, half width, MLA's rope head): the model's own rotary forward runs with ropescale's table and
    attention factor in its buffers. ``interleaved``: at attention time the pairs are ``(2i, 2i+1)`` (GLM),
    else ``(i, i + rotary_dim/2)``. ``half_width``: the rotary module returns cos/sin of the pairs only,
    ``[batch, seq, rotary_dim/2]`` (gpt-oss), not ``cat(angles, angles)``. ``pre_rope`` / ``rerope``: why those
    methods are refused (None: they run). ``per_request``: why a per-request method (each row's cos/sin from its
    request's table, keys rotated when cached) is refused (None: ropescale computes them in the family's layout).
    ``fixed_method``: why only the config's own method can be patched (the model derives more than the rope
    from ``rope_parameters`` when it is built). ``narrow_table``: why a table narrower than the extended layers'
    head is refused (None: the attention rotates the table's width). ``vllm_yarn_keys``: vLLM's model of the family
    builds a YaRN rotary from these ``rope_parameters`` whatever their ``rope_type`` says (a missing one fails its
    load with a KeyError), and ``vllm_yarn_defaulted`` from these where present (None: vLLM reads the config's type),
    so stock vLLM serves any other table that has those keys wrong, silently (:func:`stock_vllm_misreads`).
    ``rope_layers``: the config attribute that says per layer whether it rotates (SmolLM3's and Llama 4's
    ``no_rope_layers``: 1 rotates, 0 is a NoPE layer); only the layers that rotate are extended, NoPE layers run
    the model's own forward untouched (None: every layer rotates). ``complex_rotary``: the rotary module returns
    Llama 4's ``freqs_cis``, complex ``[batch, seq, rotary_dim/2]`` (``factor * exp(i * angle)``), which its attention
    multiplies into the pairs ``(2i, 2i+1)`` viewed as complex numbers. ``sliding_rope``: the ``rope_parameters``
    key of a per-layer-type config's sliding layers, which a patch leaves alone unless named (DeepSeek-V4 keys its
    tables by the rope its layers take: ``main`` on its sliding layers, ``compress`` on its compressed ones)."""

    name: str
    model_types: tuple[str, ...]
    cat_layout: bool = True
    interleaved: bool = False
    half_width: bool = False
    pre_rope: str | None = None
    per_request: str | None = None
    rerope: str | None = None
    fixed_method: str | None = None
    narrow_table: str | None = None
    vllm_yarn_keys: tuple[str, ...] | None = None
    vllm_yarn_defaulted: tuple[str, ...] = ()
    rope_layers: str | None = None
    complex_rotary: bool = False
    sliding_rope: str = "sliding_attention"

    def method_refusal(self, method: str, pre_rope: bool, rotated_at_write: bool) -> str | None:
        """Why the family's layers cannot take the method named ``method``: one that caches raw keys (``pre_rope``)
        or keeps one table per request (``rotated_at_write``); None where they can. ``hf.patch`` and ``ropescale
        extend`` (before it writes a checkpoint ``hf.patch`` would refuse) both refuse with it."""
        if pre_rope and self.pre_rope:
            return f"pre-RoPE methods (dynamic methods, ReRoPE) cannot patch {self.name}: {self.pre_rope}"
        if rotated_at_write and self.per_request:
            return f"per-request methods ({method}(per='request')) cannot patch {self.name}: {self.per_request}"
        return None

    def extended_layer_types(self, config, layer_types=None) -> tuple[str, ...] | None:
        """The ``rope_parameters`` keys a method extends in a per-layer-type config (None: a config with one rope
        for every layer): ``layer_types`` (a name or names), by default every type but the sliding layers'
        (``sliding_rope``), the layers that see past the window. ``hf.patch`` and ``ropescale extend`` both ask it."""
        if not config_lib.per_layer_type(config):
            if layer_types is not None:
                raise ValueError(f"layer_types={layer_types!r} is for configs whose rope_parameters are per layer "
                                 "type (Gemma 3, DeepSeek-V4); this model has one rope for every layer")
            return None
        known = tuple(config.rope_parameters)
        if layer_types is None:
            layer_types = tuple(t for t in known if t != self.sliding_rope)
        layer_types = (layer_types,) if isinstance(layer_types, str) else tuple(layer_types)
        unknown = [t for t in layer_types if t not in known]
        if not layer_types or unknown:
            raise ValueError(f"layer_types must name some of this config's layer types {list(known)}, "
                             f"got {list(layer_types)}")
        tables = {(config.rope_parameters[t].get("rope_theta"), config.rope_parameters[t].get("partial_rotary_factor"),
                   config_lib.head_dim_of(config, t)) for t in layer_types}
        if len(tables) > 1:
            raise ValueError(f"the layer types {list(layer_types)} have different rope_theta, "
                             "partial_rotary_factor or head dim; patch them one type at a time")
        return layer_types


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Llama", ("llama",)),
    Architecture("Mistral", ("mistral",)),
    Architecture("Ministral 3", ("ministral3",)),
    Architecture("Qwen2", ("qwen2",)),
    Architecture("Qwen3", ("qwen3",)),
    Architecture("Qwen3-MoE", ("qwen3_moe",)),
    Architecture("Phi-3 / Phi-4-mini", ("phi3",)),
    Architecture("GLM-4", ("glm4",), interleaved=True),
    Architecture("Gemma 3", ("gemma3_text",)),
    # Gemma 4: per-layer-type rope (proportional on the full layers), their own head dim (per_layer_config); its
    # KV-shared layers attend the keys of their source layer, rotated there at attention time with its positions.
    Architecture("Gemma 4", ("gemma4_text",), narrow_table=WHOLE_HEAD),
    # vLLM 0.32's gpt_oss.py: get_rope(rope_type "yarn", factor, original_max_position_embeddings, betas, truncate)
    Architecture("gpt-oss", ("gpt_oss",), cat_layout=False, half_width=True, pre_rope=f"{SINKS}, and {SHARED_SLIDING}",
                 vllm_yarn_keys=("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
                 vllm_yarn_defaulted=("truncate",)),
    Architecture("DeepSeek-V3", ("deepseek_v3",), cat_layout=False, pre_rope=MLA, per_request=MLA_SCALE,
                 fixed_method="MLA's softmax scale is set from rope_parameters' mscale_all_dim when the model is "
                              "built: write the method into the config (ropescale extend) and load the model from it"),
    # DeepSeek-V4 (transformers' deepseek_v4): rope_parameters {"main": sliding layers' table, "compress": the
    # compressed layers' (and their compressors' and indexers'), YaRN in its checkpoints}, each a trailing rope slice
    # (partial_rotary_factor) rotated in pairs (2i, 2i+1) from half-width cos/sin, in every rotary module.
    Architecture("DeepSeek-V4", ("deepseek_v4",), cat_layout=False, interleaved=True, half_width=True,
                 pre_rope=DEEPSEEK_V4, per_request=DEEPSEEK_V4, sliding_rope="main"),
    # HunYuan dense (transformers' hunyuan_v1_dense): Llama's layout, QK-norm after the rotation; its rope NTK-alpha.
    Architecture("HunYuan dense", ("hunyuan_v1_dense",), pre_rope=QK_NORM_AFTER_ROPE),
    Architecture("SmolLM3", ("smollm3",), rope_layers="no_rope_layers"),
    # Llama 4 (iRoPE): rope layers chunked with QK-norm after the rotation, freqs_cis (complex) on pairs (2i, 2i+1);
    # its NoPE layers' attention temperature (on q, from the position) is the model's own, untouched.
    Architecture("Llama 4 (text)", ("llama4_text",), cat_layout=False, interleaved=True, complex_rotary=True,
                 pre_rope=CHUNKED, rope_layers="no_rope_layers"),
    Architecture("Qwen2.5-VL (text)", ("qwen2_5_vl_text", "qwen2_5_vl"), cat_layout=False, rerope=MROPE),
    Architecture("Qwen3-VL (text)", ("qwen3_vl_text", "qwen3_vl"), cat_layout=False, rerope=MROPE),
)

_BY_MODEL_TYPE = {model_type: arch for arch in ARCHITECTURES for model_type in arch.model_types}


def find(config) -> Architecture | None:
    """The family of a (text) config, by ``model_type``; None when ropescale does not know it."""
    return _BY_MODEL_TYPE.get(getattr(config, "model_type", None))


def stock_vllm_misreads(config) -> str | None:
    """Why stock vLLM (no plugin) would serve ``config``'s rope other than as written, silently: its family's vLLM
    model builds YaRN from some keys whatever the type (``Architecture.vllm_yarn_keys``), and the config holds another
    type or a key that model does not read. None where stock vLLM reads the config's own type (and refuses a type it
    does not know)."""
    arch = find(config)
    keys = arch.vllm_yarn_keys if arch is not None else None
    params = getattr(config, "rope_parameters", None)
    if keys is None or not isinstance(params, dict) or not set(keys) <= set(params):
        return None  # not read as YaRN, or refused at load (a KeyError)
    rope_type = params.get("rope_type", "default")
    ignored = sorted(set(params) - set(keys) - set(arch.vllm_yarn_defaulted) - {"rope_type"})
    if rope_type == scaling.YaRN.rope_type and not ignored:
        return None
    what = f"rope_type {rope_type!r}" if rope_type != scaling.YaRN.rope_type else f"{', '.join(ignored)} (which it does not read)"
    return (f"stock vLLM's {arch.name} model builds YaRN from {', '.join(keys)} whatever rope_type says, so without "
            f"ropescale's plugin it would serve this config's {what} as plain YaRN: serve it with the plugin "
            "(pip install ropescale in vLLM's environment)")


def names() -> str:
    return ", ".join(arch.name for arch in ARCHITECTURES)
