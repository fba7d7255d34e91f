"""PyTorch's context parallelism (ring attention) on CPU, for the tests.

``torch.distributed.tensor.experimental.context_parallel`` turns ``F.scaled_dot_product_attention`` into ring
attention by handing the fused CUDA kernels (flash, memory-efficient, cuDNN) to its ring loop; CPU SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, which the loop does not know, so on CPU it fails. Inside
:func:`cpu_ring_attention` that CPU kernel and its backward get what PyTorch gives its CUDA flash kernel: the same
sharding rule (q, k, v, out, lse sharded on the sequence) and a handler that runs PyTorch's own ring loop
(``_templated_ring_attention`` and its backward: the rotation of keys between ranks, the head-tail load balancing,
the log-sum-exp merge) with the CPU kernel at each step. Only the per-step kernel differs from a GPU run; what a
model computes before the attention (its positions, tables, rotation) is what runs there.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental._context_parallel import _attention as cp
from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as rules

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _forward_step(query, key, value, is_causal, dropout_p=0.0, attn_mask=None, scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                             attn_mask=attn_mask, scale=scale)


def _backward_step(grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0, attn_mask=None,
                   scale=None):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if attn_mask is not None:
        raise NotImplementedError("ring attention takes is_causal, not a mask")
    return cp._templated_ring_attention(mesh.get_group(), 2, _forward_step, query=query, key=key, value=value,
                                        is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                   scale=None):
    return cp._templated_ring_attention_backward(mesh.get_group(), 2, _backward_step, grad_out=grad_out,
                                                 grad_out_name="grad_out", query=query, key=key, value=value,
                                                 out=out, logsumexp=logsumexp, is_causal=is_causal,
                                                 dropout_p=dropout_p, scale=scale)


_RING = {FORWARD: _ring_forward, BACKWARD: _ring_backward}
#: ring attention calls per kernel (forward, backward) since import: a test checks the ring ran
calls = {FORWARD: 0, BACKWARD: 0}


def _handler(op_call, args, kwargs):
    """``cp._sdpa_handler`` for the CPU kernel: propagate (the rule below), run the ring on the local shards."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError(f"{op_call}: q, k, v must all be sharded on the sequence")
    calls[op_call] += 1
    local = _RING[op_call](info.compute_mesh, *info.local_args, **info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def _forward_rule(op, args_schema, kwargs_schema):
    seq = rules._cp_sharding()
    return [[seq, seq, seq, seq, seq]]  # out, lse; q, k, v


def _backward_rule(op, args_schema, kwargs_schema):
    seq = rules._cp_sharding()
    return [[seq] * 9]  # grad q, k, v; grad_out, q, k, v, out, lse


@contextlib.contextmanager
def cpu_ring_attention():
    """Within it, PyTorch's ``context_parallel`` runs CPU SDPA as ring attention (module docstring)."""
    contexts = [rules._single_dim_strategy_context(FORWARD, _forward_rule, RuntimeSchemaInfo(3, ["scale"])),
                rules._single_dim_strategy_context(BACKWARD, _backward_rule, RuntimeSchemaInfo(6, ["scale"]))]
    saved = dict(cp.custom_ops)
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        cp.custom_ops.update({FORWARD: _handler, BACKWARD: _handler})
        try:
            yield
        finally:
            cp.custom_ops.clear()
            cp.custom_ops.update(saved)
