"""The training path's kernels (:mod:`ropescale.rerope_train`): PyTorch's fused attention kernels, called causal,
square, without a mask, with the log-sum-exp, and which one takes given inputs."""

from __future__ import annotations

import torch

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# PyTorch's fused attention kernels, called causal, square, without a mask, with the log-sum-exp.


class Kernel:
    """One fused attention kernel: ``forward(q, k, v, scale) -> (out, lse [B, H, L] float, state)`` and
    ``backward(dout, q, k, v, out, lse, state, scale) -> (dq, dk, dv)`` over ``[B, H, L, D]`` views
    (unit last stride), ``is_causal`` on ``Lq == Lk``."""

    name = ""
    multiple = 8  # the head dim is padded with zero columns to a multiple of this
    gqa = True  # takes k / v with fewer heads than q


class CpuFlash(Kernel):
    """Takes any head dim; padded to a multiple of 8 all the same, so that what the CPU path hands
    its kernel is what a fused CUDA kernel takes (the CPU tests check the CUDA path's arguments)."""

    name = "aten._scaled_dot_product_flash_attention_for_cpu"
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward

    def forward(self, q, k, v, scale):
        out, lse = self.fwd(q, k, v, 0.0, True, scale=scale)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, state, scale):
        return self.bwd(dout, q, k, v, out, lse, 0.0, True, scale=scale)


class CudaFlash(Kernel):
    name = "aten._scaled_dot_product_flash_attention"
    fwd = aten._scaled_dot_product_flash_attention
    bwd = aten._scaled_dot_product_flash_attention_backward

    def forward(self, q, k, v, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = self.fwd(q, k, v, 0.0, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, state, scale):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        dq, dk, dv = self.bwd(dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, True, seed,
                              offset, scale=scale)
        return dq, dk, dv


class CudaEfficient(Kernel):
    """Its log-sum-exp is padded to a multiple of 32 queries (what its backward reads)."""

    name = "aten._scaled_dot_product_efficient_attention"
    gqa = False
    fwd = aten._scaled_dot_product_efficient_attention
    bwd = aten._scaled_dot_product_efficient_attention_backward

    def forward(self, q, k, v, scale):
        out, lse, seed, offset = self.fwd(q, k, v, None, True, 0.0, True, scale=scale)
        return out, lse[..., : q.shape[2]], (lse.shape[-1], seed, offset)

    def backward(self, dout, q, k, v, out, lse, state, scale):
        width, seed, offset = state
        padded = lse.new_zeros(*lse.shape[:-1], width)
        padded[..., : lse.shape[-1]] = lse
        dq, dk, dv, _ = self.bwd(dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], True,
                                 scale=scale)
        return dq, dk, dv


CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT = CpuFlash(), CudaFlash(), CudaEfficient()


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _flash_usable(device: torch.device, head_dim: int) -> bool:
    """PyTorch's flash kernel: sm80 and later; its backward takes head dims > 192 on sm80 / sm90 only."""
    available = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    capability = torch.cuda.get_device_capability(device)
    return (available and torch.backends.cuda.flash_sdp_enabled() and capability[0] >= 8
            and (head_dim <= 192 or capability in ((8, 0), (9, 0))))


def kernel_for(q: torch.Tensor, head_dim: int) -> Kernel | None:
    """The kernel for these inputs (``head_dim`` before padding), or None (the composite then)."""
    if q.device.type == "cpu":
        return CPU_FLASH
    if q.device.type != "cuda" or q.dtype not in (torch.float32, *_HALF):
        return None  # float64 on CUDA: no fused kernel takes it
    if q.dtype in _HALF and round_up(head_dim, 8) <= 256 and _flash_usable(q.device, round_up(head_dim, 8)):
        return CUDA_FLASH
    return CUDA_EFFICIENT
