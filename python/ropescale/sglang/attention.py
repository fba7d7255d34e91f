"""ropescale's raw-key attention for SGLang: ReRoPE, Leaky ReRoPE, log-n, Self-Extend, Dual Chunk Attention,
STRING and the per-step dynamic tables, over SGLang's own KV pool holding RAW (unrotated) keys.

- :class:`ropescale.sglang.rotary.PassThroughRotary`: the rotary ``get_rope`` gives such a model's layers (recording the model's
  :class:`~ropescale.serving.PreRopePlan`, one per model: ``rotary.raw_key_plan``): q and k leave it as they came,
  so the pool caches raw keys;
- :class:`RopescaleAttnBackend`: SGLang's torch_native backend with ``forward_extend``/``forward_decode`` through
  ``ops.rerope_attention_paged`` (prefill, chunked prefill and decode), the pool's per-layer key buffer ``[slots,
  Hkv, D]`` read as pages of one token (``[slots, Hkv, 1, D]``) and each request's row of SGLang's ``req_to_token``
  as its block table. The step's tables (a table per segment for the per-step methods, DCA's temperature) come
  from the engine-neutral :class:`~ropescale.serving.TableCache` with each request's prompt length, which the
  ``ForwardBatch.init_new`` hook records (:func:`ropescale.sglang.rotary.step_tables`). The hook on SGLang's
  ``_build_resolved_backend`` gives it to a model with a recorded plan, whatever ``--attention-backend`` says: no
  extra flags; every other model keeps SGLang's choice.

Positions alone decide every rule but a length-dependent table and DCA's temperature, whose rows take their
request's prompt length (``serving``'s rule, the same as the vLLM backend's): chunked prefill, batching, retraction
and the radix cache all serve them exactly.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from .. import ops, serving
from . import rotary

__all__ = ["RopescaleAttnBackend"]


@dataclasses.dataclass
class _Step:
    tables: serving.StepTables
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    tokens: int


class RopescaleAttnBackend(TorchNativeAttnBackend):
    """SGLang's torch_native backend (its pools, its KV writes) with ropescale's paged ReRoPE-family attention."""

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        plan = rotary.raw_key_plan()
        if plan is None:
            raise RuntimeError("ropescale.sglang: the raw-key attention backend was built for a model whose rotary "
                               "layers recorded no plan")
        self.plan = plan
        self.tables = serving.TableCache(plan, self.device)
        self.step: _Step | None = None

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_idle() or forward_batch.batch_size == 0:
            self.step = None
            return
        seq_lens = [int(n) for n in (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                                     else forward_batch.seq_lens.cpu()).tolist()]
        query_lens = rotary.step_query_lens(forward_batch, len(seq_lens), "raw-key attention")
        plan = self.plan
        prompt_lens = list(rotary.step_prompt_lens)
        if plan.prompt_dependent and len(prompt_lens) != len(seq_lens):
            raise RuntimeError(f"ropescale.sglang: this step has {len(seq_lens)} requests and {len(prompt_lens)} "
                               "prompt lengths (the ForwardBatch.init_new hook recorded another step)")
        if plan.length_dependent:
            tables = self.tables.step(seq_lens, query_lens, prompt_lens, None)
        else:
            tables = self.tables.step([])
        if plan.temperature_length:
            temperature = plan.temperature_factors(seq_lens, query_lens, prompt_lens).to(self.device)
            tables = dataclasses.replace(tables, temperature=temperature)
        longest = max(seq_lens)
        block_table = self.req_to_token_pool.req_to_token.index_select(
            0, forward_batch.req_pool_indices.to(torch.int64))[:, :longest].to(torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        self.step = _Step(tables, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                          torch.tensor(starts, dtype=torch.int32, device=self.device), starts[-1])

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        refused = [name for name, unsupported in (
            ("cross attention", layer.is_cross_attention),
            ("a sliding window", layer.sliding_window_size not in (None, -1)),
            ("logit capping", bool(getattr(layer, "logit_cap", 0))),
            ("a value head other than the query's", layer.qk_head_dim != layer.v_head_dim)) if unsupported]
        if refused:
            raise NotImplementedError(f"ropescale.sglang: raw-key attention does not support {', '.join(refused)}")
        step = self.step
        if step is None:
            raise RuntimeError("ropescale.sglang: a raw-key attention layer ran without this step's metadata")
        tables, n = step.tables, step.tokens
        heads, kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        if save_kv_cache and k is not None and v is not None:
            key = k.view(-1, kv_heads, head_dim)
            if tables.temperature is not None:  # DCA: each key times its token's temperature, as it is written
                key = serving.times_rows(key, tables.temperature, n)
            self.token_to_kv_pool.set_kv_buffer(layer, _write_loc(forward_batch.out_cache_loc, self.swa_out_cache_loc),
                                                key, v.view(-1, kv_heads, layer.v_head_dim))
        key_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        value_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        key_cache = key_cache.view(key_cache.shape[0], kv_heads, 1, head_dim)  # pages of one token
        value_cache = value_cache.view(value_cache.shape[0], kv_heads, 1, layer.v_head_dim)
        query = q.reshape(-1, heads, head_dim)[:n]
        if tables.temperature is not None:
            query = serving.times_rows(query, tables.temperature, n)
        block_table, seq_lens, query_start_loc = step.block_table, step.seq_lens, step.query_start_loc
        if tables.segments is not None:  # requests cut where their rows take different tables
            block_table = block_table.index_select(0, tables.segments.request)
            seq_lens, query_start_loc = tables.segments.seq_lens, tables.segments.query_start_loc
        plan = self.plan
        query, scale, scale_factors = plan.attention_arguments(query, head_dim, layer.scaling, tables.scale_factor,
                                                               tables.scale_factors, query_start_loc)
        out, _lse = ops.rerope_attention_paged(
            query, key_cache, value_cache, block_table, seq_lens, query_start_loc, tables.inv_freq, plan.window,
            leaky_k=plan.leaky_k, scale=scale, scale_factors=scale_factors, logn_length=plan.logn_length,
            interleaved=plan.interleaved, **plan.method_arguments())
        return out.reshape(n, heads * layer.v_head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)


def _write_loc(loc, swa_loc):
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    return KVWriteLoc(loc, swa_loc)
