"""One layer's pre-RoPE attention in vLLM: its pages (:func:`split_pages`), the shared scratch of the CUDA
tensor-core prefill (:func:`reserve_workspace`), raw K/V into the pages and ReRoPE / dynamic attention out
(:class:`PreRopeLayer`), built from the arguments vLLM passes an attention impl (:func:`pre_rope_layer`).
:mod:`ropescale.vllm.attention` is the public path of these names."""

from __future__ import annotations

import torch

from vllm.v1.attention.backend import AttentionType

from .. import ops, serving
from ..serving import PreRopePlan
from .attention_plan import current_plan


def split_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``[num_blocks, Hkv, block_size, 2*D]`` cache as ``(key_cache, value_cache)``, each
    ``[num_blocks, Hkv, block_size, D]`` with its last two dims contiguous (keys then values per page)."""
    num_blocks, kv_heads, block_size, both = kv_cache.shape
    pages = kv_cache.view(num_blocks, kv_heads, 2 * block_size, both // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


# The CUDA tensor-core prefill's scratch (rerope_attention_paged's workspace), one per process, device and
# size: every layer runs on the same stream, one after another, so they share it. It is reserved when the model
# is built, so vLLM's memory profiling (whose profile run skips attention) counts it before sizing the KV
# cache; without it the op would allocate up to ~256 MiB on each prefill step, past what vLLM measured.
WORKSPACES: dict[tuple, torch.Tensor] = {}


def reserve_workspace(vllm_config, num_kv_heads: int, head_size: int) -> torch.Tensor | None:
    """The shared workspace for this engine's largest step (``max_num_batched_tokens`` query rows), with room
    to pre-rotate 4x as many keys per step (a request past that rotates its key tiles inside the tensor-core
    kernel instead); None where the op needs none (float32, head sizes without a tensor-core kernel)."""
    model_config = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if model_config is None or scheduler is None:
        return None
    tokens = int(scheduler.max_num_batched_tokens)
    size = ops.rerope_paged_workspace_bytes(tokens, num_kv_heads, head_size, model_config.dtype, max_keys=4 * tokens)
    if size == 0:
        return None
    device = torch.device(vllm_config.device_config.device)
    key = (device, size)
    if key not in WORKSPACES:
        WORKSPACES[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return WORKSPACES[key]


def layer_metadata(layer):
    """This step's attention metadata of ``layer`` (vLLM's ``Attention``, by its ``layer_name``) from vLLM's forward
    context, as vLLM's own ``get_attention_context`` finds it; None outside a forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # speculative decoding: [0] is the base model's
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = metadata.get(getattr(layer, "layer_name", None))
    return metadata


class PreRopeLayer:
    """The pre-RoPE side of one attention layer: raw K/V into the pages, ReRoPE / dynamic attention out."""

    workspace: torch.Tensor | None = None  # the CUDA backend's reserved scratch (reserve_workspace)

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, *, sliding_window=None,
                 alibi_slopes=None, logits_soft_cap=None, kv_cache_dtype: str = "auto",
                 attn_type: str = AttentionType.DECODER, sinks=None) -> None:
        refused = [name for name, unsupported in (
            ("sliding_window", sliding_window not in (None, -1)), ("alibi_slopes", alibi_slopes is not None),
            ("logits_soft_cap", logits_soft_cap not in (None, 0, 0.0)), ("sinks", sinks is not None),
            (f"kv_cache_dtype={kv_cache_dtype!r}", kv_cache_dtype != "auto"),
            (f"attn_type={attn_type!r}", attn_type != AttentionType.DECODER)) if unsupported]
        if refused:
            raise NotImplementedError(f"ropescale.vllm: pre-RoPE attention does not support {', '.join(refused)}")
        self.num_heads, self.num_kv_heads, self.head_size, self.scale = num_heads, num_kv_heads, head_size, scale

    @staticmethod
    def plan() -> PreRopePlan:
        plan = current_plan()
        if plan is None:
            raise RuntimeError("ropescale.vllm: a pre-RoPE attention layer ran but get_rope recorded no plan "
                               "(the model's rotary layers were not built by ropescale's get_rope)")
        return plan

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
              metadata=None):
        """The step's raw keys and values into their slots; under DCA's temperature each key times its token's
        factor, from ``metadata`` (the step's: its tables hold the factors). vLLM gives none to a dummy run (profiling,
        warm-up, piecewise graph capture), whose slots it fills with -1: nothing is written there."""
        key_cache, value_cache = split_pages(kv_cache)
        n = slot_mapping.shape[0]
        key = key[:n]
        plan = current_plan()
        if plan is not None and plan.temperature_length and n and metadata is not None:
            tables = getattr(metadata, "rope_tables", None)
            if tables is None or tables.temperature is None:
                raise RuntimeError("ropescale.vllm: a Dual Chunk Attention layer writes keys without the step's "
                                   "temperature (its attention metadata carries no rope tables)")
            key = serving.times_rows(key, tables.temperature, n)
        ops.rerope_cache_write_(key_cache, value_cache, key, value[:n], slot_mapping.to(torch.int64))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata, output: torch.Tensor) -> torch.Tensor:
        plan = self.plan()
        tables = metadata.rope_tables
        if tables is None:
            raise RuntimeError("ropescale.vllm: a pre-RoPE attention layer got metadata without this step's "
                               "tables (its metadata builder saw no recorded plan)")
        key_cache, value_cache = split_pages(kv_cache)
        n = metadata.num_actual_tokens
        requests = metadata.seq_lens.shape[0]
        block_table, seq_lens = metadata.block_table[:requests], metadata.seq_lens
        query_start_loc = metadata.query_start_loc[: requests + 1]
        if tables.segments is not None:  # requests cut where their rows take different tables (cut_segments)
            block_table = block_table.index_select(0, tables.segments.request)
            seq_lens, query_start_loc = tables.segments.seq_lens, tables.segments.query_start_loc
        # The attention factor on the rotated dims only (transformers' rule): on a partial-rotary head it is folded
        # into a copy of the query, elsewhere it scales the whole score in the op (serving.PreRopePlan).
        q = query[:n]
        if tables.temperature is not None:  # DCA's temperature on the query (its keys took theirs when written)
            q = serving.times_rows(q, tables.temperature, n)
        q, scale, scale_factors = plan.attention_arguments(q, self.head_size, self.scale,
                                                           tables.scale_factor, tables.scale_factors, query_start_loc)
        out, _lse = ops.rerope_attention_paged(
            q, key_cache, value_cache, block_table, seq_lens,
            query_start_loc, tables.inv_freq, plan.window, leaky_k=plan.leaky_k,
            scale=scale, scale_factors=scale_factors,
            logn_length=plan.logn_length, interleaved=plan.interleaved, workspace=self.workspace,
            **plan.method_arguments())
        output[:n].copy_(out)
        return output


# What vLLM's Qwen-family attention layers pass an impl when the config has Qwen's dual_chunk_attention_config (for
# vLLM's own DCA backend): get_rope already read it into the plan.
DUAL_CHUNK_LAYER_ARGUMENTS = ("layer_idx", "dual_chunk_attention_config")


def impl_options(args, kwargs) -> dict:
    names = ("num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window", "kv_cache_dtype",
             "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name", "sinks")
    options = dict(zip(names, args))
    options.update(kwargs)
    return options


def pre_rope_layer(options: dict) -> PreRopeLayer:
    if options.get("kv_sharing_target_layer_name") is not None:
        raise NotImplementedError("ropescale.vllm: pre-RoPE attention does not support KV sharing across layers")
    return PreRopeLayer(options["num_heads"], options.get("num_kv_heads") or options["num_heads"],
                        options["head_size"], float(options["scale"]),
                        sliding_window=options.get("sliding_window"), alibi_slopes=options.get("alibi_slopes"),
                        logits_soft_cap=options.get("logits_soft_cap"),
                        kv_cache_dtype=options.get("kv_cache_dtype", "auto"),
                        attn_type=options.get("attn_type", AttentionType.DECODER), sinks=options.get("sinks"))
