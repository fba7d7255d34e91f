"""Pre-RoPE models in vLLM: a pass-through rotary and an attention backend over vLLM's paged cache of RAW keys.

ReRoPE, Leaky ReRoPE, log-n and the dynamic methods (Dynamic NTK, Dynamic YaRN, Resonance on them) rotate at
attention time: ReRoPE clips the relative position at its window, a dynamic table changes with each
request's length. So the keys vLLM caches must be the un-rotated ones (docs/DESIGN.md, "Engines"):

- :func:`pass_through` is what ``get_rope`` (``rotary.py``) gives the layers of such a checkpoint: it leaves
  q and k as they are, so vLLM's paged cache holds raw keys (one cache, no second copy). It is built only
  when ropescale's backend is the one that will run (:func:`check_backend`): raw keys never meet a stock
  backend, which would attend them un-rotated without a word;
- the backend, registered over the platform's (``register_backend``: ``CPU_ATTN`` on CPU, which the CPU
  platform always picks, and ``CUSTOM`` on CUDA, picked with ``--attention-backend CUSTOM``), runs the
  layers of a pre-RoPE model with ``ops.rerope_cache_write_`` (raw K/V into the pages) and
  ``ops.rerope_attention_paged`` (prefill, chunked prefill and decode rows in one call); on CPU every other
  model's layers go to vLLM's own implementation unchanged;
- the metadata builder computes, once per step, the table and attention factor each query row takes (what
  ``hf.patch``'s ``state.table(seq_len)`` gives transformers: see below), cached by length: a step computes
  each distinct length once, every layer reuses it. Lengths are read from vLLM's host copy (no host sync), and
  every tensor the forward reads stays at one address across steps (the tables in the builder's own
  buffers), so the CUDA backend declares full CUDA graphs for decode batches.

The cache of a layer is vLLM's ``[num_blocks, Hkv, block_size, 2*D]`` (the KV spec's page). This backend owns
what a page holds: per (block, head), ``block_size`` raw keys then ``block_size`` raw values, so
``kv_cache.view(num_blocks, Hkv, 2*block_size, D)`` splits into the op's ``key_cache`` / ``value_cache``
``[num_blocks, Hkv, block_size, D]``.

A length-dependent method (the dynamic ones, a LongRoPE with distinct factors) computes every row as
``hf.patch`` does in transformers, however vLLM schedules the request (:func:`cut_segments`): each prompt row
under the table of the whole prompt (one forward over the prompt), each later row under the table of its own
length (one forward per generated token; the keys' rotation is redone at every step, values and deeper layers'
keys stay as computed). So a request served beside others, with its prompt chunked by the token budget or
recomputed after a preemption, equals the request served alone; and vLLM's prefix cache reuses a page only for
a prompt computed under the same table (:func:`install_block_hash_key`). A ``per="request"`` method takes one table
per request, at its prompt + ``max_tokens`` (:func:`step_request_lens`), for every row and step: the static model
of the request's scale, whose pages are shared only between requests of the same scale (the block hash carries
it). Under asynchronous speculative decoding
a decode row's length is vLLM's host-side upper bound (the length if every draft is accepted).

By role: the plan this process serves in :mod:`ropescale.vllm.attention_plan`, each step's per-request tables in
:mod:`ropescale.vllm.attention_steps`, one layer's attention in :mod:`ropescale.vllm.attention_layer`, prefix
caching in :mod:`ropescale.vllm.attention_prefix_cache`; here the pass-through rotary, the backends and their
registration. This module re-exports every public name of those (their documented home).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheLayout

from .. import config as config_lib
from . import engine
from ..serving import (NO_WINDOW, PreRopePlan, RequestRotaryTables, Segments, StepTables, TableCache,  # noqa: F401
                       cut_segments, needs_pre_rope)
from .attention_layer import (DUAL_CHUNK_LAYER_ARGUMENTS, PreRopeLayer, impl_options, layer_metadata,  # noqa: F401
                              pre_rope_layer, reserve_workspace, split_pages)
from .attention_plan import (check_temperature, current_plan, describe_plan, max_model_len,  # noqa: F401
                             record_plan, served_plan, serving_pre_rope, unset_max_tokens_default)
from .attention_prefix_cache import install_block_hash_key, prompt_table_tag  # noqa: F401
from .attention_steps import (StepTablesOwner, host_seq_lens, install_prompt_lengths,  # noqa: F401
                              prefer_v1_model_runner, request_length, request_rotary_tables, step_prompt_lens,
                              step_request_lens, update_request_rotary)

logger = logging.getLogger("vllm.ropescale")

__all__ = ["PreRopePlan", "PreRopeRotary", "StepTables", "TableCache", "host_seq_lens", "pass_through",
           "check_backend", "register_backends", "RopescaleCPUAttentionBackend", "PreRopeAttentionBackend"]

#: Where ``register_backends`` puts each backend (class paths, as vLLM resolves them).
CPU_BACKEND = f"{__name__}.RopescaleCPUAttentionBackend"
CUDA_BACKEND = f"{__name__}.PreRopeAttentionBackend"


_warned: set[str] = set()  # one-time log lines, per process


class PreRopeRotary(torch.nn.Module):
    """A rotary layer that rotates nothing: vLLM caches raw keys and ropescale's backend rotates (same
    contract as vLLM's rotary: ``forward(positions, query, key) -> (query, key)``; nothing to trace)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool,
                 plan: PreRopePlan) -> None:
        super().__init__()
        self.head_size, self.rotary_dim, self.max_position_embeddings = head_size, rotary_dim, max_position
        self.is_neox_style, self.plan = is_neox_style, plan

    def forward(self, positions, query, key=None):
        return query, key

    forward_native = forward_cpu = forward_cuda = forward

    def extra_repr(self) -> str:
        return f"pass-through (rotated by ropescale's attention backend), plan={self.plan}"


def check_backend(vllm_config, what: str) -> None:
    """Raise unless the attention backend that will run this model is ropescale's, and the parallel layout
    keeps "cache slot j holds position j"."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise NotImplementedError(
                f"ropescale.vllm: {what} is served over a cache where slot j holds position j; {name}="
                f"{getattr(parallel, name)} shards the cache by token and breaks that: serve it without context "
                "parallelism (tensor parallelism works)")
    if current_platform.is_cpu():
        selected, path, wanted = AttentionBackendEnum.CPU_ATTN, None, CPU_BACKEND
    else:
        selected, path, wanted = vllm_config.attention_config.backend, None, CUDA_BACKEND
    try:
        path = selected.get_path() if selected is not None else None
    except ValueError:  # CUSTOM selected but nothing registered there
        path = None
    if path != wanted:
        hint = ("on CPU the plugin overrides CPU_ATTN: something replaced that override" if current_platform.is_cpu()
                else "select it with `--attention-backend CUSTOM` (LLM(..., attention_backend='CUSTOM'))")
        raise NotImplementedError(
            f"ropescale.vllm: {what} keeps keys un-rotated in vLLM's cache, which only ropescale's attention "
            f"backend reads correctly; the backend that would run is "
            f"{path or (selected.name if selected is not None else 'vLLM automatic choice')}: {hint}")


def pass_through(head_size: int, rotary_dim: int, max_position: int, is_neox_style: bool,
                 parsed: config_lib.RopeConfig, vllm_config) -> PreRopeRotary:
    """``get_rope``'s answer for a pre-RoPE checkpoint (refused unless ropescale's backend will run)."""
    what = config_lib.ATTENTION_NAMES.get(parsed.attention) or f"a dynamic method ({type(parsed.method).__name__})"
    # DCA's temperature is 1 at every length an engine serving at most L0 tokens reaches: then not served at all.
    plan = PreRopePlan.of(parsed, rotary_dim, is_neox_style).served_within(max_model_len(vllm_config))
    check_backend(vllm_config, what)
    check_temperature(plan, vllm_config)
    record_plan(plan, vllm_config)
    if plan.prompt_dependent:
        install_prompt_lengths()
    if "active" not in _warned:
        _warned.add("active")
        default = unset_max_tokens_default(vllm_config) if plan.per_request else None
        logger.info("ropescale: %s served pre-RoPE: raw keys in vLLM's paged cache, rotated by ropescale's "
                    "attention backend; %s", what, describe_plan(plan, default))
        length = max_model_len(vllm_config)
        reduced = plan.self_extend_reduces_within(length)
        if reduced is not None:
            logger.warning("ropescale: %s (max_model_len %s)", reduced, length)
        if plan.per_request and default is None:
            logger.warning(
                "ropescale: per='request': a chat request without max_tokens is planned at max_model_len (%s "
                "tokens), so even a short question runs the model scaled for that length; give the checkpoint a "
                "planning budget (generation_config.json max_new_tokens: `ropescale extend --max-new-tokens N`, or "
                "--override-generation-config '{\"max_new_tokens\": N}'), or send max_tokens", length)
    return PreRopeRotary(head_size, rotary_dim, max_position, is_neox_style, plan)


# ---------------------------------------------------------------------------------------------
# CPU: over CPU_ATTN; pre-RoPE models take ropescale's path, every other model vLLM's own


@dataclasses.dataclass
class RopescaleCPUAttentionMetadata(CPUAttentionMetadata):
    rope_tables: StepTables | None = None


class RopescaleCPUAttentionMetadataBuilder(StepTablesOwner, CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata, plus this step's per-request tables when a pre-RoPE model is served."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_tables(vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> CPUAttentionMetadata:
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        tables = self.step_tables(common_attn_metadata)
        if tables is None:
            return metadata
        fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(CPUAttentionMetadata)}
        return RopescaleCPUAttentionMetadata(**fields, rope_tables=tables)


class RopescaleCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, or ropescale's pre-RoPE attention for the layers of a pre-RoPE model."""

    @engine.reported
    def __init__(self, *args, **kwargs) -> None:
        pre_rope = serving_pre_rope()
        if pre_rope:  # vLLM's Qwen models pass DCA's config to the layer (for its DUAL_CHUNK backend): read already
            for name in DUAL_CHUNK_LAYER_ARGUMENTS:
                kwargs.pop(name, None)
        super().__init__(*args, **kwargs)
        self.pre_rope = pre_rope_layer(impl_options(args, kwargs)) if pre_rope else None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.pre_rope is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ropescale.vllm: pre-RoPE attention does not fuse output quantization")
        if attn_metadata is None:  # warm-up
            return output
        return self.pre_rope.attend(query, kv_cache, attn_metadata, output)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.pre_rope is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        self.pre_rope.write(key, value, kv_cache, slot_mapping, layer_metadata(layer))


class RopescaleCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with ropescale's pre-RoPE path (the name stays ``CPU_ATTN``: vLLM's CPU code keys on it)."""

    @staticmethod
    def get_impl_cls():
        return RopescaleCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RopescaleCPUAttentionMetadataBuilder


# ---------------------------------------------------------------------------------------------
# CUDA (and any other platform): the CUSTOM slot, pre-RoPE models only


@dataclasses.dataclass
class PreRopeMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    rope_tables: StepTables | None = None


class PreRopeMetadataBuilder(StepTablesOwner, AttentionMetadataBuilder[PreRopeMetadata]):
    """vLLM's metadata as the op takes it, plus this step's tables; no host sync, nothing the forward reads at
    an address that changes between steps: full CUDA graphs for uniform batches (decode, and speculative
    decoding's verification rows), the level vLLM calls ``UNIFORM_BATCH``.

    Not ``ALWAYS`` (full graphs for batches with prefill rows too): the op sizes its launch from shapes and reads
    every length on the device, and vLLM pads a mixed batch's requests to the captured count, so it may qualify;
    but nothing here has run on a GPU, and graphs pay on decode (prefill is compute-bound): mixed batches stay
    piecewise until ``scripts/gpu_check.sh`` shows a captured mixed batch equal to an eager one."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # A per-step method cuts a request with several rows past its prompt (speculative tokens) into one segment
        # per row, fresh tensors each step: full graphs for single-token decode batches only. A per-request method
        # never cuts (one table per request): uniform batches, as a static table.
        plan = served_plan(vllm_config)
        if plan is not None and plan.length_dependent and not plan.per_request:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_tables(vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PreRopeMetadata:
        m = common_attn_metadata
        return PreRopeMetadata(m.num_actual_tokens, m.query_start_loc, m.seq_lens, m.block_table_tensor,
                               m.slot_mapping, self.step_tables(m))


class PreRopeAttentionImpl(AttentionImpl[PreRopeMetadata]):
    @engine.reported
    def __init__(self, *args, **kwargs) -> None:
        options = impl_options(args, kwargs)
        if not serving_pre_rope():
            raise NotImplementedError(
                "ropescale.vllm: the CUSTOM attention backend is ropescale's pre-RoPE backend (ReRoPE, dynamic "
                "methods); this model is not one: serve it without --attention-backend CUSTOM")
        self.pre_rope = pre_rope_layer(options)
        self.num_heads, self.head_size, self.scale = options["num_heads"], options["head_size"], float(options["scale"])
        self.num_kv_heads = options.get("num_kv_heads") or self.num_heads
        # Built with the model, inside what vLLM's memory profiling counts (see reserve_workspace).
        from vllm.config import get_current_vllm_config_or_none

        self.pre_rope.workspace = reserve_workspace(get_current_vllm_config_or_none(), self.num_kv_heads,
                                                    self.head_size)
        self.kv_cache_dtype = options.get("kv_cache_dtype", "auto")
        self.attn_type = options.get("attn_type", AttentionType.DECODER)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ropescale.vllm: pre-RoPE attention does not fuse output quantization")
        if attn_metadata is None:
            return output
        return self.pre_rope.attend(query, kv_cache, attn_metadata, output)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.pre_rope.write(key, value, kv_cache, slot_mapping, layer_metadata(layer))


class PreRopeAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update = False
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return PreRopeAttentionImpl

    @staticmethod
    def get_builder_cls():
        return PreRopeMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256]

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)  # [blocks, heads, slots, 2*D] per layer: what split_pages reads


def register_backends() -> None:
    """Put ropescale's backends in vLLM's registry (this process): over ``CPU_ATTN`` (the CPU platform's
    only choice; ordinary models still get vLLM's implementation) and in the ``CUSTOM`` slot."""
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND)
