"""ropescale's rotary layer for vLLM and the ``get_rope`` wrapper that hands it out.

vLLM's rotary contract (``vllm/model_executor/layers/rotary_embedding/base.py``): ``forward(positions
int64 [T], query [T, Hq*D], key [T, Hkv*D] | None) -> (query, key)``; ``cos_sin_cache`` ``[rows,
rotary_dim]`` holds ``[cos | sin]`` half-width per pair. Eager mode (custom ops enabled) calls
``forward_cpu`` / ``forward_cuda``, which rotate in place; compiled mode traces ``forward_native``,
which calls ropescale's functional op (its fake kernel lets Dynamo trace it).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import torch

import vllm.model_executor.layers.rotary_embedding as _rope_package
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

from .. import config as config_lib, ops, scaling, serving
from . import engine

logger = logging.getLogger("vllm.ropescale")
_stock_get_rope = getattr(_rope_package.get_rope, "__wrapped__", _rope_package.get_rope)
_layers: dict[tuple, RotaryEmbedding] = {}
#: vLLM's own rope type "ntk" (base b*s, frequencies divided by s^(2/d), with mixed_b its mixed variant): the same
#: name as ropescale's NTK-aware table before 0.2, another formula.
VLLM_OWN_NTK = "ntk"
_warned: set[str] = set()
# Why the plugin refused to go active in this process (vllm/__init__.py, missing_kernels): ropescale's
# checkpoints are then refused with it at model build; None when active.
_refusal: dict[str, str | None] = {"reason": None}


def _rotate(module, positions, query, key, in_place: bool):
    """query/key rotated by the rows of ``module.cos_sin_cache`` at ``positions`` with ropescale's kernel."""
    cos_sin = module.cos_sin_cache.index_select(0, positions.flatten())
    if cos_sin.dtype != query.dtype or cos_sin.device != query.device:
        cos_sin = cos_sin.to(query.device, dtype=query.dtype)
    cos, sin = cos_sin.chunk(2, dim=-1)
    tokens, head_size, interleaved = positions.numel(), module.head_size, not module.is_neox_style
    # [T, H*D] -> [1, H, T, D]: the ops' [batch, heads, seq, head_dim] with a unit last stride.
    q = query.view(1, tokens, -1, head_size).transpose(1, 2)
    if key is None:
        if in_place:
            ops.apply_rotary_(q, cos, sin, interleaved, half_width=True)
            return query, None
        return ops.apply_rotary(q, cos, sin, interleaved, half_width=True).transpose(1, 2).reshape(query.shape), None
    k = key.view(1, tokens, -1, head_size).transpose(1, 2)
    if in_place:
        ops.apply_rotary_qk_(q, k, cos, sin, interleaved, half_width=True)
        return query, key
    q, k = ops.apply_rotary_qk(q, k, cos, sin, interleaved, half_width=True)
    return q.transpose(1, 2).reshape(query.shape), k.transpose(1, 2).reshape(key.shape)


class _RopescaleKernel:
    """The three forwards of a vLLM rotary layer, through ropescale's rotation kernel."""

    def forward_native(self, positions, query, key=None):
        return _rotate(self, positions, query, key, in_place=False)

    def forward_cpu(self, positions, query, key=None):
        return _rotate(self, positions, query, key, in_place=True)

    forward_cuda = forward_cpu


class RopescaleRotaryEmbedding(_RopescaleKernel, serving.StaticTableRotary, RotaryEmbedding):
    """A ropescale method's static table (ropescale's ops, float32 inv_freq, angles in double, the
    attention factor on cos and sin: what ``hf.patch`` feeds transformers), ``rows`` positions long."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}"


class RopescaleMRotaryEmbedding(MRotaryEmbedding):
    """A static method's table under a multimodal rope: vLLM's ``MRotaryEmbedding`` (three position streams, its
    sections, plain or interleaved) over ropescale's cos/sin cache. vLLM's own computes YaRN with its correction
    range at ``positions_factor`` times the original length (the cache's length; 4 by default), which is not
    transformers' table."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, method, mrope_section, mrope_interleaved: bool, positions_factor: int) -> None:
        self.method = method
        super().__init__(head_size, rotary_dim, max_position, base, is_neox_style, dtype,
                         mrope_section=list(mrope_section), mrope_interleaved=bool(mrope_interleaved),
                         positions_factor=positions_factor)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return serving.cos_sin_cache(self.method, self.rotary_dim, self.base, self.max_position_embeddings)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}"


class RequestRotaryEmbedding(RotaryEmbedding):
    """A ``per="request"`` table rotated at write (``serving.rotated_at_write``): every token's q and k turned with the
    table and attention factor of the request it belongs to (``ops.apply_rotary_per_request``, over the step's
    :class:`~ropescale.serving.RequestRotaryTables`, written by the model runner's hook before the step runs), so
    vLLM caches rotated keys and its own attention backend serves the request: the static model of the request's
    scale, on every platform, with vLLM's CUDA graphs and compiled mode (the tables sit at fixed addresses).

    A request whose table is the model's own (it fits the trained length) is rotated as vLLM rotates the native
    model: vLLM's float32 ``inv_freq`` and angles formed as its ``cos_sin_cache`` forms them (``native_angles``):
    such a request IS the native model as this engine serves it (ropescale's double-precision angles are 2.4e-4 rad
    from vLLM's at 8k, which moved SmolLM2's logprobs by 2e-4). ``cos_sin_cache`` is vLLM's own native table (not
    read here; for code that reads the attribute)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, method, tables: serving.RequestRotaryTables) -> None:
        self.method, self.request_tables = method, tables
        super().__init__(head_size, rotary_dim, max_position, base, is_neox_style, dtype)

    def _rotate(self, positions, query, key, in_place: bool):
        return self._rotate_per_request(positions, query, key, in_place)

    def _rotate_per_request(self, positions, query, key, in_place: bool):
        return serving.rotate_per_request(self.request_tables, positions, query, key, self.head_size,
                                          not self.is_neox_style, in_place)

    def forward_native(self, positions, query, key=None):
        return self._rotate(positions, query, key, in_place=False)

    def forward_cpu(self, positions, query, key=None):
        return self._rotate(positions, query, key, in_place=True)

    forward_cuda = forward_cpu

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method}, a table per request (rotated at write)"


class RequestMRotaryEmbedding(RequestRotaryEmbedding):
    """:class:`RequestRotaryEmbedding` under a multimodal rope (Qwen2.5-VL, Qwen3-VL: ``mrope_section``): pair i of a
    token turns at the position of its own stream (time, height, width: ``config.mrope_pair_streams``), with the
    table and attention factor of the token's request. Its cos/sin are formed per token (angles in double, as the
    static tables are) from the same fixed-address step tables, then ropescale's rotation; nothing reads the host."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, method, tables: serving.RequestRotaryTables, pair_streams: list[int]) -> None:
        super().__init__(head_size, rotary_dim, max_position, base, is_neox_style, dtype, method, tables)
        self.pair_streams = torch.tensor(pair_streams, dtype=torch.int64, device=tables.request_index.device)

    def _rotate(self, positions, query, key, in_place: bool):
        # Every token with its request's table (a native request's row: vLLM's float32 inv_freq; its angles here in
        # double, not as vLLM's multimodal table forms them).
        tables = self.request_tables
        if positions.dim() == 1:  # text only: every stream at the token's position
            positions = positions[None].expand(3, -1)
        tokens = positions.shape[-1]
        index = tables.request_index[:tokens].long()
        angles = (positions.index_select(0, self.pair_streams).T.to(torch.float64)
                  * tables.inv_freq.index_select(0, index).to(torch.float64))  # [T, P]
        factors = tables.attention_factors.index_select(0, index).to(torch.float64)[:, None]
        cos, sin = (angles.cos() * factors).float().contiguous(), (angles.sin() * factors).float().contiguous()
        q = query.view(tokens, -1, self.head_size).transpose(0, 1)[None]
        k = key.view(tokens, -1, self.head_size).transpose(0, 1)[None] if key is not None else None
        interleaved = not self.is_neox_style
        if in_place:
            if k is None:
                ops.apply_rotary_(q, cos, sin, interleaved, half_width=True)
            else:
                ops.apply_rotary_qk_(q, k, cos, sin, interleaved, half_width=True)
            return query, key
        if k is None:
            return ops.apply_rotary(q, cos, sin, interleaved, half_width=True)[0].transpose(0, 1).reshape(
                query.shape), None
        q, k = ops.apply_rotary_qk(q, k, cos, sin, interleaved, half_width=True)
        return q[0].transpose(0, 1).reshape(query.shape), k[0].transpose(0, 1).reshape(key.shape)


def request_rotary(head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool, dtype: torch.dtype,
                   parsed: config_lib.RopeConfig, multimodal: bool, vllm_config,
                   rope_parameters: dict | None = None) -> RotaryEmbedding:
    """``get_rope``'s answer for a per-request table rotated at write (no pass-through, no backend of ropescale's),
    for the engine of ``vllm_config``; its startup line once per process."""
    from . import attention

    plan = serving.PreRopePlan.of(parsed, rotary_dim, is_neox_style)
    tables = attention.request_rotary_tables(plan, vllm_config)
    if "request" not in _warned:
        _warned.add("request")
        default = attention.unset_max_tokens_default(vllm_config)
        logger.info("ropescale: %s; keys rotated when written, served by vLLM's own attention backend",
                    attention.describe_plan(plan, default))
        if default is None:
            logger.warning(
                "ropescale: per='request': a chat request without max_tokens is planned at max_model_len (%s "
                "tokens), so even a short question runs the model scaled for that length; give the checkpoint a "
                "planning budget (generation_config.json max_new_tokens: `ropescale extend --max-new-tokens N`, or "
                "--override-generation-config '{\"max_new_tokens\": N}'), or send max_tokens",
                attention.max_model_len(vllm_config))
    streams = config_lib.mrope_pair_streams(rope_parameters, rotary_dim // 2) if multimodal else None
    key = (head_size, rotary_dim, max_position, is_neox_style, parsed, dtype, id(tables),
           tuple(streams) if streams else None)
    if key not in _layers:
        arguments = (head_size, rotary_dim, max_position, parsed.base, is_neox_style,
                     dtype or torch.get_default_dtype(), parsed.method, tables)
        _layers[key] = (RequestMRotaryEmbedding(*arguments, streams) if streams
                        else RequestRotaryEmbedding(*arguments))
    return _layers[key]


def _model_config():
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().model_config


@engine.reported  # its refusals end the front end's error at engine start
def get_rope(head_size: int, max_position: int, is_neox_style: bool = True,
             rope_parameters: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
             *args, **kwargs) -> RotaryEmbedding:
    """vLLM's ``get_rope``, with ropescale's rotary for the layers of a checkpoint ropescale wrote."""
    params = rope_parameters or {}
    model_config = _model_config()
    hf_config = getattr(model_config, "hf_config", None)
    entry = getattr(hf_config, config_lib.CONFIG_KEY, None)
    # Qwen's Dual Chunk Attention (Qwen2.5-1M, Qwen3-2507): vLLM's Qwen models pass it, the config has it (and a
    # checkpoint ropescale wrote for any model); a config with it and no ropescale entry is DCA (config.read).
    dual_chunk = kwargs.get("dual_chunk_attention_config")
    if dual_chunk is None:
        dual_chunk = getattr(hf_config, config_lib.DUAL_CHUNK_KEY, None)
    if params.get(VLLM_DEEPSEEK_V4_MARKER) and serving.config_written_by_ropescale(hf_config):
        raise NotImplementedError(DEEPSEEK_V4_REFUSAL)
    params = _config_parameters(params, hf_config, entry)
    rope_type = params.get("rope_type", "default")
    ours = serving.ropescale_rotary(params, entry) or dual_chunk is not None
    if ours and _refusal["reason"] is not None:
        raise RuntimeError(_refusal["reason"])
    checkpoint_is_ours = ours or (config_lib.per_layer_type(hf_config) and any(
        serving.ropescale_rotary(p, entry) for p in hf_config.rope_parameters.values()))
    if ours and config_lib.per_layer_type(hf_config):
        ours = serving.extended_layer_type(params, hf_config, entry, max_position, "vLLM")
    if not ours:
        if checkpoint_is_ours:
            # A layer ropescale's checkpoint leaves to vLLM (a sliding layer's own table, Gemma 3 and 4): its table
            # must reach every position the engine serves, and a length-free checkpoint (per request, dynamic)
            # keeps its original max_position_embeddings, which vLLM builds that table to (then reads past it).
            max_position = max(int(max_position), int(getattr(model_config, "max_model_len", 0) or 0))
        if rope_type == VLLM_OWN_NTK and "mixed_b" not in params and VLLM_OWN_NTK not in _warned:
            _warned.add(VLLM_OWN_NTK)
            logger.warning(
                "ropescale: rope_type 'ntk' is served as vLLM's own NTK (base b*s, frequencies divided by "
                "s^(2/d)); a checkpoint written by ropescale before 0.2 meant NTK-aware scaling with it: "
                "rewrite it with `ropescale extend` (or hf.patch + save_pretrained)")
        return _stock_get_rope(head_size, max_position, is_neox_style, rope_parameters, dtype, *args, **kwargs)
    if args or any(v is not None for k, v in kwargs.items()
                   if k not in ("mrope_positions_factor", "dual_chunk_attention_config")):
        raise NotImplementedError(f"ropescale.vllm: rope_type {rope_type!r} with {sorted(kwargs)} is not supported")
    rotary_dim = int(params.get("rope_dim") or config_lib.rotary_dim(head_size, params))
    try:
        parsed = config_lib.read(params, max_position, entry, rotary_dim, dual_chunk)
    except ValueError as err:
        raise ValueError(f"ropescale.vllm: {err}") from None
    from . import attention

    multimodal = "mrope_section" in params
    if serving.rotated_at_write(parsed):
        from vllm.config import get_current_vllm_config

        return request_rotary(head_size, rotary_dim, max_position, is_neox_style, dtype, parsed, multimodal,
                              get_current_vllm_config(), params)
    if multimodal and attention.needs_pre_rope(parsed):
        raise NotImplementedError(
            f"ropescale.vllm: {type(parsed.method).__name__}"
            f"{'' if parsed.attention == 'sdpa' else ' with ' + config_lib.ATTENTION_NAMES[parsed.attention]} "
            "on a multimodal rope (mrope_section) is not served by vLLM: ropescale's pre-RoPE attention backend "
            "rotates each key at one position, a multimodal rope at three. Serve a static table (YaRN), or use "
            "transformers + ropescale.hf")
    if attention.needs_pre_rope(parsed):
        # Pre-RoPE: raw keys in vLLM's cache, rotated by ropescale's attention backend (attention.py).
        from vllm.config import get_current_vllm_config

        return attention.pass_through(head_size, rotary_dim, max_position, is_neox_style, parsed,
                                      get_current_vllm_config())
    dtype = dtype or torch.get_default_dtype()
    # Every position vLLM may serve: its max_model_len, derived from max_position_embeddings and factor.
    rows = max(int(max_position), int(getattr(model_config, "max_model_len", 0) or 0),
               int(math.ceil(max_position * float(params.get("factor", 1.0) or 1.0))))
    if multimodal:  # vLLM's layer over ropescale's table; its cache spans positions_factor x rows (video positions)
        positions_factor = int(kwargs.get("mrope_positions_factor") or 4)
        key = (head_size, rotary_dim, rows, is_neox_style, parsed, dtype, tuple(params["mrope_section"]),
               bool(params.get("mrope_interleaved")), positions_factor)
        if key not in _layers:
            _layers[key] = RopescaleMRotaryEmbedding(
                head_size, rotary_dim, rows, parsed.base, is_neox_style, dtype,
                parsed.method, params["mrope_section"], params.get("mrope_interleaved", False), positions_factor)
        return _layers[key]
    key = (head_size, rotary_dim, rows, is_neox_style, parsed, dtype)
    if key not in _layers:
        _layers[key] = RopescaleRotaryEmbedding(head_size, rotary_dim, rows, parsed.base, is_neox_style, dtype,
                                                parsed.method)
    return _layers[key]


#: The key vLLM 0.32's DeepSeek-V4 (``models/deepseek_v4/common/rope.py``) marks the rope parameters it rebuilt with.
VLLM_DEEPSEEK_V4_MARKER = "is_deepseek_v4"
DEEPSEEK_V4_REFUSAL = (
    "ropescale.vllm: a DeepSeek-V4 checkpoint ropescale wrote is not served by vLLM: vLLM 0.32's DeepSeek-V4 rebuilds "
    "its rope from a few keys (the theta of config.compress_rope_theta, every scaled type of the compressed layers "
    "as DeepSeek YaRN with attention factor 1), so another table than the checkpoint's would be served. Serve it "
    "with transformers + ropescale.hf")


def _config_parameters(params, hf_config, entry) -> dict:
    """The rope parameters a layer is built with: those vLLM's model passes, or the config's own where the model
    rebuilt them from a few keys of a ropescale checkpoint's config and lost its method (vLLM 0.32's gpt-oss always
    passes ``rope_type: "yarn"`` with the config's factor: a per-request or dynamic YaRN, or any ropescale type,
    would be served as static YaRN at that factor without a word)."""
    config_params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(config_params, Mapping) or config_lib.per_layer_type(hf_config):
        return params
    if serving.ropescale_rotary(params, entry) or not serving.ropescale_rotary(config_params, entry):
        return params
    return {**params, **config_params}


get_rope.__wrapped__ = _stock_get_rope  # type: ignore[attr-defined]


def install(refusal: str | None = None) -> None:
    """Put :func:`get_rope` where model modules import it from (idempotent), and ropescale's rope types
    into transformers (vLLM validates configs with transformers). With ``refusal``, the layers of a checkpoint
    ropescale wrote raise it instead of being served (the plugin refused to go active)."""
    from .. import hf  # noqa: F401  (registers the rope types)

    _refusal["reason"] = refusal
    _rope_package.get_rope = get_rope


def install_rotation() -> bool:
    """``CustomOp.register_oot``: vLLM's own rotary classes rotate with ropescale's kernel (their
    tables stay vLLM's). Idempotent."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    # vLLM's own rotary classes: each method's, where it declares one (scaling.RopeScaling.vllm_rotary_class).
    for name in dict.fromkeys(cls.vllm_rotary_class for cls in scaling.METHODS.values() if cls.vllm_rotary_class):
        if name in op_registry_oot:
            continue
        stock = getattr(_rope_package, name)
        replacement = CustomOp.register_oot(type(name, (_RopescaleKernel, stock), {"__module__": __name__}), name=name)
        # register_oot names it after the class; vLLM's custom_ops switches ("+rotary_embedding") use the op name.
        replacement.name = stock.name
    return True
