"""rerope_attention_train, the ReRoPE training path (issue 26): forward and gradients against the
float64 two-matrix reference, low precision against PyTorch's own error, the kernels' arguments
(what a fused CUDA kernel takes: no mask, head dim a multiple of 8, square causal problems, no math
kernel, no L x L tensor) during training steps of a patched Llama, the CUDA kernels' conventions
emulated on CPU, non-finite inputs, and the fallback."""

import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ropescale import ops, rerope, rerope_train, rerope_train_kernels
from ropescale.rerope_train import rerope_attention_train, training_layout
from support.attention import (BASE, SDPA_ERROR_FACTOR, as_layout, logn_factor, make_inputs, poison, reference,
                               reference_ieee, sdpa_error)

transformers = pytest.importorskip("transformers")
from support.tiny_lm import VOCAB, tiny  # noqa: E402
from support.training import WithPositions  # noqa: E402

from ropescale import hf  # noqa: E402


def right_padded(kp, qp, lengths):
    """Positions with the last tokens of each row marked as padding keys (position -1): what a
    right-padded training batch hands the attention (queries keep counting up)."""
    kp = kp.clone()
    for b, n in enumerate(lengths):
        kp[b, n:] = -1
    return kp, qp


# batch, q heads, kv heads, q_len, k_len, dim, window, leaky_k, logn_length, padding (n: row b left-padded
# by n * b tokens at position -1, keys and queries; "right": the last 3 * b keys of row b at -1, queries
# counting on), layout, interleaved, rotary_dim (0: dim). Lengths not a multiple of the window, shorter
# than it, one past it, equal to it, twice it, window 1, fewer queries than keys (a cache), GQA.
CASES = [
    (2, 4, 2, 37, 37, 16, 7, 0.0, 0, 0, "contiguous", False, 0),
    (2, 4, 2, 37, 37, 16, 7, 16.0, 20, 3, "blhd", False, 0),
    (1, 4, 1, 9, 9, 8, 20, 0.0, 0, 0, "contiguous", False, 0),  # L < window: near band only
    (2, 2, 2, 8, 8, 8, 7, 4.0, 0, 2, "blhd", False, 0),  # L = window + 1
    (1, 2, 1, 12, 12, 10, 1, 0.0, 5, 0, "contiguous", False, 0),  # window 1: the near band is the diagonal
    (1, 2, 1, 12, 12, 8, 12, 0.0, 0, 0, "contiguous", False, 0),  # L = window
    (1, 2, 1, 12, 12, 8, 6, 8.0, 0, 0, "contiguous", False, 0),  # L = 2 window
    (2, 4, 1, 20, 30, 16, 5, 4.0, 10, 4, "contiguous", False, 0),  # the last 20 queries of 30 keys
    (2, 4, 2, 25, 25, 12, 4, 0.0, 0, "right", "blhd", True, 8),  # right padding, interleaved, partial rotary
    (3, 2, 1, 19, 19, 6, 3, 2.0, 3, "right", "contiguous", False, 0),
]


def case_inputs(case, dtype, seed=0):
    batch, q_heads, kv_heads, q_len, k_len, dim, window, leaky_k, logn, pad, layout, interleaved, rotary = case
    q, k, v, qp, kp = make_inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype,
                                  pad=pad if isinstance(pad, int) else 0, seed=seed)
    if pad == "right":
        kp, qp = right_padded(kp, qp, [k_len - 3 * b for b in range(batch)])
    inv_freq = ops.default_inv_freq(rotary or dim, BASE)
    kw = dict(leaky_k=leaky_k, logn_length=logn, interleaved=interleaved)
    return q, k, v, qp, kp, inv_freq, window, kw, layout


def test_training_layout():
    """Which positions take the fast path: counting up (any offset, fewer queries than keys), padding
    keys anywhere at negative positions; not: non-causal, restarting positions (packed documents),
    generate()-style left padding (padding queries at position 1), more queries than keys."""
    q, k, v, qp, kp = make_inputs(2, 2, 1, 5, 8, 4, pad=2)
    assert training_layout(qp, kp) is True  # row 1: two padding keys
    assert training_layout(qp + 100, kp.where(kp < 0, kp + 100)) is True
    assert training_layout(qp[:1], kp[:1]) is False
    assert training_layout(qp, kp, causal=False) is None
    assert training_layout(kp, qp) is None
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert training_layout(packed, packed) is None
    assert training_layout(torch.tensor([[1, 1, 0, 1, 2]]), torch.tensor([[-1, -1, 0, 1, 2]])) is None
    assert training_layout(torch.arange(5)[None], torch.tensor([[0, 1, -1, 3, 4]])) is True  # a hole


# ---------------------------------------------------------------------------------------------
# float64: equal to the two-matrix reference, out, lse and gradients through both.


def grads_of(fn, q, k, v, g_out, g_lse):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    finite = torch.isfinite(lse)
    loss = (out * g_out).sum() + (torch.where(finite, lse, 0) * g_lse).sum()
    return (out, lse), torch.autograd.grad(loss, (q, k, v))


def assert_float64_equals_naive(q, k, v, qp, kp, inv_freq, window, kw):
    """The training op's out, lse and gradients (through both, seeded cotangents) equal the naive reference's."""
    gen = torch.Generator().manual_seed(1)
    g_out, g_lse = torch.randn(q.shape, generator=gen, dtype=torch.float64), torch.randn(q.shape[:3], generator=gen,
                                                                                        dtype=torch.float64)
    (out, lse), grads = grads_of(lambda q, k, v: rerope_attention_train(q, k, v, qp, kp, inv_freq, window, **kw),
                                 q, k, v, g_out, g_lse)
    (ref_out, ref_lse), ref_grads = grads_of(
        lambda q, k, v: rerope.rerope_attention_naive(q, k, v, qp, kp, inv_freq, window, **kw), q, k, v, g_out, g_lse)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.where(ref_lse.isfinite(), lse, 0), torch.where(ref_lse.isfinite(), ref_lse, 0),
                               atol=1e-12, rtol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_float64_equals_two_matrix_reference(case):
    q, k, v, qp, kp, inv_freq, window, kw, layout = case_inputs(case, torch.float64, seed=CASES.index(case))
    inv_freq = inv_freq.double()
    gen = torch.Generator().manual_seed(7)
    g_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64)
    (out, lse), grads = grads_of(
        lambda q, k, v: rerope_attention_train(as_layout(q, layout), as_layout(k, layout), as_layout(v, layout),
                                               qp, kp, inv_freq, window, **kw), q, k, v, g_out, g_lse)
    (ref_out, ref_lse), ref_grads = grads_of(
        lambda q, k, v: rerope.rerope_attention_naive(q, k, v, qp, kp, inv_freq, window, **kw), q, k, v, g_out, g_lse)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    torch.testing.assert_close(lse[lse.isfinite()], ref_lse[ref_lse.isfinite()], atol=1e-12, rtol=1e-12)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-11, rtol=1e-11, msg=f"d{name}")
    # and the independent reference of the attention suite (Su's definition, its own rotation)
    ref = reference(q, k, v, qp, kp, inv_freq, window, kw["leaky_k"], None, kw["logn_length"], True,
                    kw["interleaved"])
    torch.testing.assert_close(out, ref[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[9]], ids=["left-pad-leaky-logn", "cache", "right-pad"])
def test_gradcheck(case):
    """Both outputs, through both sides of the window and the padding column (float64: the CPU flash
    kernel takes it)."""
    batch, q_heads, kv_heads, q_len, k_len, dim, window, leaky_k, logn, pad, *_ = case
    small = (min(batch, 2), q_heads, kv_heads, min(q_len, 7), min(k_len, 9), min(dim, 6), 2, leaky_k, logn, pad,
             "contiguous", False, 0)
    q, k, v, qp, kp, inv_freq, window, kw, _ = case_inputs(small, torch.float64, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq.double(), window, **kw)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


# ---------------------------------------------------------------------------------------------
# Low precision: the error against float64 (out, lse, dq, dk, dv) within SDPA_ERROR_FACTOR x the
# error PyTorch's own SDPA makes in that dtype on the same inputs (RoPE attention with the same
# visibility, q and k rotated by rerope.rotate with autograd, forward and backward).


def sdpa_errors(q, k, v, qp, kp, inv_freq, g_out, logn_length, interleaved):
    """Largest |error| against float64 of SDPA's (out, dq, dk, dv) in q's dtype on RoPE attention with
    the same inputs and visibility (rows with no visible key left out)."""
    group = q.shape[1] // k.shape[1]
    visible = (qp[:, :, None] >= 0) & (kp[:, None, :] >= 0) & (kp[:, None, :] <= qp[:, :, None])
    rows = visible.any(-1)[:, None].expand(-1, q.shape[1], -1)

    def run(q, k, v, g_out):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        factor = logn_factor(qp, logn_length).to(q.dtype)[:, None, :, None]
        q_rot = rerope.rotate(q * factor, qp, inv_freq, interleaved)
        k_rot = rerope.rotate(k, kp, inv_freq, interleaved)
        out = F.scaled_dot_product_attention(q_rot, k_rot.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=visible[:, None])
        out = torch.where(rows[..., None], out, 0)
        return out, torch.autograd.grad((out * g_out).sum(), (q, k, v))

    out, grads = run(q, k, v, g_out.to(q.dtype))
    ref, ref_grads = run(q.double(), k.double(), v.double(), g_out)
    errors = [(out.double() - ref).abs()[rows].max().item()]
    errors += [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    return errors


LOW_PRECISION_CASES = [
    (2, 4, 2, 67, 67, 32, 9, 0.0, 0, 0, "contiguous", False, 0),
    (2, 4, 2, 67, 67, 32, 16, 16.0, 30, 5, "blhd", False, 0),
    (1, 8, 1, 70, 90, 64, 40, 0.0, 50, 0, "contiguous", False, 0),
    (2, 4, 2, 70, 70, 24, 7, 8.0, 0, "right", "blhd", True, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=range(len(LOW_PRECISION_CASES)))
def test_low_precision_within_sdpa_error(dtype, case):
    """out, lse, dq, dk, dv against float64 within 2x PyTorch's own error in the dtype (measured:
    bf16/fp16 0.4x to 1.7x SDPA's, the composite up to 3.7x on lse; float32 see below)."""
    q, k, v, qp, kp, inv_freq, window, kw, layout = case_inputs(case, dtype, seed=LOW_PRECISION_CASES.index(case))
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    zero_lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    (out, lse), grads = grads_of(
        lambda q, k, v: rerope_attention_train(as_layout(q, layout), as_layout(k, layout), as_layout(v, layout),
                                               qp, kp, inv_freq, window, **kw), q, k, v, g_out.to(dtype), zero_lse)
    (ref_out, ref_lse), ref_grads = grads_of(
        lambda q, k, v: rerope.rerope_attention_naive(q, k, v, qp, kp, inv_freq.double(), window, **kw),
        q.double(), k.double(), v.double(), g_out, zero_lse)
    assert out.dtype == dtype and lse.dtype == torch.float32
    rows = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), rows)
    ours = [(out.double() - ref_out).abs()[rows].max().item()]
    ours += [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    lse_error = (lse.double() - ref_lse).abs()[rows].max().item()
    pytorch = sdpa_errors(q, k, v, qp, kp, inv_freq, g_out, kw["logn_length"], kw["interleaved"])
    if dtype == torch.float32:
        # float32: the largest error sits on a handful of elements and the ratio of two maxima spreads
        # wider (this path 0.3x to 2.9x SDPA's over 12 seeds of cases 0 and 3, the composite 0.6x to
        # 2.0x): the bound is 2x the larger of SDPA's error and the composite's (PyTorch's SDPA
        # computing this ReRoPE problem in float32).
        (c_out, _), c_grads = grads_of(
            lambda q, k, v: rerope.rerope_attention_composite(q, k, v, qp, kp, inv_freq, window, **kw), q, k, v,
            g_out.to(dtype), zero_lse)
        composite = [(c_out.double() - ref_out).abs()[rows].max().item()]
        composite += [(g.double() - r).abs().max().item() for g, r in zip(c_grads, ref_grads)]
        pytorch = [max(p, c) for p, c in zip(pytorch, composite)]
    for name, e, p in zip(("out", "dq", "dk", "dv"), ours, pytorch):
        assert 0 < p and e <= SDPA_ERROR_FACTOR * p, f"{name}: error {e:.3g}, PyTorch's {p:.3g}"
    sdpa_lse = sdpa_error(q, k, v, qp, kp, inv_freq, logn_length=kw["logn_length"], interleaved=kw["interleaved"])[1]
    assert 0 < sdpa_lse and lse_error <= SDPA_ERROR_FACTOR * sdpa_lse, (lse_error, sdpa_lse)


# ---------------------------------------------------------------------------------------------
# What the kernels are handed during training steps of a patched model: what a fused CUDA kernel
# takes, or the test fails. A TorchDispatchMode records every aten op of the step.

ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_scaled_dot_product_attention_math", "scaled_dot_product_attention",
}


class KernelArguments(TorchDispatchMode):
    """Records violations of what PyTorch's fused CUDA attention kernels accept (flash: fp16/bf16, head
    dim % 8, <= 256, no mask; efficient: head dim % 8 for half types, % 4 for float32; both: causal
    only on square problems here) and every tensor with two dimensions >= ``quadratic`` made while
    ``self.watch`` is set (the ReRoPE attention forward, and the whole backward)."""

    def __init__(self, quadratic):
        super().__init__()
        self.quadratic, self.watch = quadratic, False
        self.violations, self.calls = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ATTENTION_OPS:
            self.check_attention(name, func, args, kwargs)
        if self.watch:
            inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                      if torch.is_tensor(a)}
            for t in torch.utils._pytree.tree_leaves(out):
                if (torch.is_tensor(t) and sum(s >= self.quadratic for s in t.shape) >= 2
                        and t.untyped_storage().data_ptr() not in inputs):  # a view allocates nothing
                    self.violations.append(f"{name} made a tensor of shape {tuple(t.shape)}")
        return out

    def check_attention(self, name, func, args, kwargs):
        bound = dict(zip((a.name for a in func._schema.arguments), args))
        bound.update(kwargs)
        self.calls.append(name)
        if name == "_scaled_dot_product_attention_math":
            self.violations.append("the math kernel")
        for mask in ("attn_mask", "attn_bias", "bias"):
            if bound.get(mask) is not None:
                self.violations.append(f"{name} got {mask} of shape {tuple(bound[mask].shape)}")
        q, k, v = bound["query"], bound["key"], bound["value"]
        dim = q.shape[-1]
        multiple = 8 if q.dtype in (torch.float16, torch.bfloat16) else 4
        if dim % multiple or v.shape[-1] % multiple:
            self.violations.append(f"{name} got head dim {dim} ({q.dtype}; a fused CUDA kernel needs % {multiple})")
        if not (q.dtype == k.dtype == v.dtype):
            self.violations.append(f"{name} got dtypes {q.dtype}, {k.dtype}, {v.dtype}")
        if bound.get("is_causal") and q.shape[-2] != k.shape[-2]:
            self.violations.append(f"{name}: is_causal on {q.shape[-2]} x {k.shape[-2]} (flash takes square only)")


LENGTH = 256  # > 2 x every other dimension of the tiny model (vocab 101, hidden 64, mlp 96)


def training_step(model, ids, mask, autocast_dtype, recorder):
    patch_module = importlib.import_module("ropescale.hf.pre_rope")  # where the raw-key attention calls _rerope
    rerope_forward = patch_module._rerope

    def watched(*args, **kwargs):
        recorder.watch = True
        try:
            return rerope_forward(*args, **kwargs)
        finally:
            recorder.watch = False

    patch_module._rerope = watched
    try:
        with recorder:
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(ids, attention_mask=mask, labels=ids).loss
            recorder.watch = True
            loss.backward()
            recorder.watch = False
    finally:
        patch_module._rerope = rerope_forward
    return loss


def padded_batch():
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # row 1 left-padded
    return ids, mask


@pytest.mark.parametrize("autocast_dtype,padding", [(None, False), (None, True), (torch.bfloat16, True),
                                                    (torch.float16, False)], ids=["fp32", "fp32-padded",
                                                                                 "bf16-padded", "fp16"])
def test_training_step_hands_kernels_what_fused_cuda_kernels_take(autocast_dtype, padding):
    """Forward + backward of a ReRoPE-patched Llama (plain fp32, CPU autocast bf16 / fp16): every
    attention kernel call is a flash / efficient one with no mask, a head dim a fused CUDA kernel
    takes and square causal problems; nothing in ReRoPE's forward or in the backward has two
    dimensions >= L. Gradients are finite, and under autocast the loss is the fp32 one to the dtype."""
    model = hf.patch(tiny("llama", layers=1, mpe=4 * LENGTH), None, attention="rerope", window=16, leaky_k=8.0,
                     logn_length=64).train()
    ids, mask = padded_batch() if padding else (padded_batch()[0], None)
    assert_step_takes_fused_kernels(model, model, ids, mask, autocast_dtype)


def assert_step_takes_fused_kernels(model, call, ids, mask, autocast_dtype):
    """A training step of ``call`` (``model``, or it with fixed positions): every attention kernel call is what a fused
    CUDA kernel takes, gradients finite, and under autocast the loss the fp32 one to the dtype."""
    recorder = KernelArguments(LENGTH // 2)
    loss = training_step(call, ids, mask, autocast_dtype, recorder)
    assert recorder.calls, "no attention kernel ran"
    assert not recorder.violations, "\n".join(sorted(set(recorder.violations)))
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    if autocast_dtype is not None:
        with torch.no_grad():
            reference_loss = call(ids, attention_mask=mask, labels=ids).loss
        assert abs(loss.item() - reference_loss.item()) <= 0.05 * reference_loss.item()


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_check_fails_on_the_composite(monkeypatch, autocast_dtype):
    """The test above can fail: the composite path (the training path before issue 26) hands SDPA an
    [L, L + 1] mask and head dim D + 2 and makes [B, H, L, L + 1] tensors, and the recorder says so."""
    monkeypatch.setattr(ops, "rerope_attention_train", ops.rerope_attention_composite)
    model = hf.patch(tiny("llama", layers=1, mpe=4 * LENGTH), None, attention="rerope", window=16).train()
    recorder = KernelArguments(LENGTH // 2)
    training_step(model, padded_batch()[0], None, autocast_dtype, recorder)
    found = "\n".join(recorder.violations)
    assert "got attn_mask of shape" in found and "head dim 18" in found and f"{LENGTH}, {LENGTH + 1})" in found


def test_patched_model_gradients_equal_float64_reference(monkeypatch):
    """A float64 ReRoPE-patched Llama (Leaky, log-n, a left-padded and a right-padded row): loss and
    every parameter's gradient equal those of the same model whose attention is Su's two-matrix
    form, to float64 rounding."""
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, 31:] = 0
    results = []
    for attention in ("train", "naive"):
        if attention == "naive":
            monkeypatch.setattr(ops, "rerope_attention_train", rerope.rerope_attention_naive)
        model = hf.patch(tiny("llama").double(), None, attention="rerope", window=6, leaky_k=4.0,
                         logn_length=16).train()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results.append((loss, {name: p.grad for name, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-12, rtol=1e-12)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], atol=1e-10, rtol=1e-10, msg=name)


def largest_output_of_a_step(q, k, v, qp, kp):
    """A Leaky (window 32) forward + backward of the op: (the largest aten op output, in elements, of forward and
    backward; the kernels' calls and their violations of what fused CUDA kernels take)."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    recorder = KernelArguments(128)
    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t))
            return out

    with recorder, Sizes():
        recorder.watch = True
        out, lse = rerope_attention_train(q, k, v, qp, kp, ops.default_inv_freq(32, BASE), 32, leaky_k=8.0)
        (out.float().sum() + lse.sum()).backward()
    return max(largest), recorder


def test_no_tensor_grows_with_l_squared():
    """The op alone at L = 512 (window 32, Leaky, GQA, padding): no aten op output in forward or
    backward has two dimensions >= L / 4, and the largest one is a few times q."""
    q, k, v, qp, kp = make_inputs(1, 4, 2, 512, 512, 32, pad=0, seed=1)
    kp = kp.clone()
    kp[0, :100] = -1
    largest, recorder = largest_output_of_a_step(q, k, v, qp, kp)
    assert not recorder.violations, "\n".join(sorted(set(recorder.violations)))
    assert largest <= 4 * q.numel() * 40 // 32, largest  # fp32 copies of q with a padded head dim


# ---------------------------------------------------------------------------------------------
# The CUDA kernels' conventions, emulated on CPU (this machine has no GPU): flash takes GQA and
# returns an lse [B, H, L]; efficient takes no GQA and pads its lse to a multiple of 32 queries,
# which its backward reads back; both need head dims that are multiples of 8 and square causal
# problems. The emulations check that and compute with the CPU kernel.


def _check_cuda_arguments(q, k, v, is_causal, gqa):
    assert q.dtype == k.dtype == v.dtype
    assert q.shape[-1] % 8 == 0 and q.shape[-1] == k.shape[-1] == v.shape[-1], q.shape
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert is_causal and q.shape[2] == k.shape[2]
    assert k.shape[1] == q.shape[1] or (gqa and q.shape[1] % k.shape[1] == 0)


def _flash_forward(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
    _check_cuda_arguments(q, k, v, is_causal, gqa=True)
    assert dropout_p == 0 and not return_debug_mask
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    seed, offset = torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    return out, lse.contiguous(), None, None, q.shape[2], k.shape[2], seed, offset, torch.empty(0, dtype=q.dtype)


def _flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                    scale):
    _check_cuda_arguments(q, k, v, is_causal, gqa=True)
    assert lse.shape == q.shape[:3] and lse.is_contiguous() and (max_q, max_k) == (q.shape[2], k.shape[2])
    assert seed.shape == (2,) and cum_q is None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, True,
                                                                               scale=scale)


def _efficient_forward(q, k, v, bias, compute_log_sumexp, dropout_p, is_causal, *, scale):
    _check_cuda_arguments(q, k, v, is_causal, gqa=False)
    assert bias is None and compute_log_sumexp and dropout_p == 0
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    width = -(-q.shape[2] // 32) * 32
    padded = torch.full((*lse.shape[:2], width), math.nan, dtype=lse.dtype)  # float32 on CUDA; past L: never read
    padded[..., : q.shape[2]] = lse
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, *, scale):
    _check_cuda_arguments(q, k, v, is_causal, gqa=False)
    assert bias is None and list(grad_input_mask) == [True, True, True, False]
    assert lse.shape == (*q.shape[:2], -(-q.shape[2] // 32) * 32) and lse.is_contiguous()
    assert out.stride(2) == out.shape[1] * out.shape[3]  # its kernel takes out's row stride as H * D
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse[..., : q.shape[2]], 0.0, True, scale=scale)
    return dq, dk, dv, None


class EmulatedFlash(rerope_train_kernels.CudaFlash):
    fwd, bwd = staticmethod(_flash_forward), staticmethod(_flash_backward)


class EmulatedEfficient(rerope_train_kernels.CudaEfficient):
    fwd, bwd = staticmethod(_efficient_forward), staticmethod(_efficient_backward)


@pytest.mark.parametrize("kernel", [EmulatedFlash(), EmulatedEfficient()], ids=["flash", "efficient"])
@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[8]], ids=["left-pad", "cache", "right-pad"])
def test_cuda_kernel_conventions_emulated(monkeypatch, kernel, case):
    """The CUDA kernels' calls (argument order, lse layouts, GQA expansion for efficient, head dims
    padded to 8) run through CPU emulations that check them; float64 results equal the reference."""
    monkeypatch.setattr(rerope_train, "kernel_for", lambda q, head_dim: kernel)
    q, k, v, qp, kp, inv_freq, window, kw, layout = case_inputs(case, torch.float64, seed=4)
    inv_freq = inv_freq.double()
    assert_float64_equals_naive(q, k, v, qp, kp, inv_freq, window, kw)


def test_cuda_kernel_calls_on_meta_tensors():
    """The real CUDA ops' schemas take the calls as made (their meta kernels run on any machine)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(2, 40, 4, 24, **meta).transpose(1, 2)
    k = torch.empty(2, 40, 2, 24, **meta).transpose(1, 2)
    for kernel in (rerope_train_kernels.CUDA_FLASH, rerope_train_kernels.CUDA_EFFICIENT):
        kk = k if kernel.gqa else k.repeat_interleave(2, 1)
        out, lse, state = kernel.forward(q, kk, kk, 0.2)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(torch.empty_like(out), q, kk, kk, out, lse, state, 0.2)
        assert dq.shape == q.shape and dk.shape == kk.shape and dv.shape == kk.shape


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: the rule every path shares (DESIGN.md, "Input rules").


@pytest.mark.parametrize("where", ["q", "k", "v", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_finite_inputs_follow_the_rule(where, dtype):
    """NaN / +-inf in q, k or v (visible or masked), or only in padding keys: the finite pattern of out
    and lse is the float64 IEEE reference's, with one documented difference: a row with a VISIBLE
    key whose k holds a non-finite value is NaN (the reference keeps a row finite where every such
    score is -inf). Padding keys change nothing."""
    gen = torch.Generator().manual_seed(len(where))
    q, k, v, qp, kp = make_inputs(2, 4, 2, 150, 150, 16, dtype, pad=40, seed=3)
    inv_freq = ops.default_inv_freq(16, BASE)
    clean_out, _ = rerope_attention_train(q, k, v, qp, kp, inv_freq, 5, 8.0)
    if where == "masked":  # padding keys hold NaN / inf
        k, v = k.clone(), v.clone()
        k[1, :, :40] = math.nan
        v[1, :, :40] = math.inf
    else:
        t = {"q": q, "k": k, "v": v}[where]
        t = poison(t, gen, max(2, t.numel() // 4000))
        q, k, v = (t if name == where else x for name, x in zip("qkv", (q, k, v)))
    ref_out, ref_lse = reference_ieee(q, k, v, qp, kp, inv_freq, 5, 8.0)
    out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq, 5, 8.0)
    bad_key = ~torch.isfinite(k).all(-1).repeat_interleave(2, 1)  # [B, Hq, Lk]
    visible = (kp[:, None, :] >= 0) & (kp[:, None, :] <= qp[:, :, None]) & (qp[:, :, None] >= 0)  # [B, Lq, Lk]
    poisoned = (visible[:, None] & bad_key[:, :, None]).any(-1)  # [B, Hq, Lq]
    assert torch.equal(out.isfinite(), ref_out.isfinite() & ~poisoned[..., None])
    assert torch.equal(lse.isfinite(), ref_lse.isfinite() & ~poisoned)
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    if where == "k":
        assert poisoned.any() and (poisoned & ref_lse.isfinite()).any()  # the difference is exercised
    if dtype == torch.float32:
        finite = out.isfinite()
        torch.testing.assert_close(out.double()[finite], ref_out[finite], atol=2e-5, rtol=1e-4)
    if where == "masked":
        torch.testing.assert_close(out, clean_out, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Other inputs take the composite, and say so once.


def test_other_layouts_take_the_composite_with_a_warning():
    q, k, v, qp, kp = make_inputs(1, 2, 1, 9, 9, 8, seed=2)
    inv_freq = ops.default_inv_freq(8, BASE)
    q.requires_grad_()
    rerope_train._warned.clear()
    messages = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq, 3, causal=False)
        messages.append([str(w.message) for w in caught])
        c_out, c_lse = rerope.rerope_attention_composite(q, k, v, qp, kp, inv_freq, 3, causal=False)
        torch.testing.assert_close(out, c_out, atol=0, rtol=0)
        torch.testing.assert_close(lse, c_lse, atol=0, rtol=0)
    assert len(messages[0]) == 1 and "not the training layout" in messages[0][0] and not messages[1], messages
    with pytest.raises(RuntimeError, match="window must be > 0"):
        rerope_attention_train(q, k, v, qp, kp, inv_freq, 0)


# ---------------------------------------------------------------------------------------------
# Gapped positions (PoSE / CREAM position sampling: ropescale.training): strictly increasing positions with
# gaps take the fused path on an expanded layout (rerope_train_layout.Gaps), equal to the composite and to the
# float64 two-matrix reference in out, lse and both gradients, for every method of the family.


def gapped(rows):
    """Key positions ``[B, L]`` from per-row specs ``(left padding, [(first position, count), ...], right padding)``
    (or an explicit list of positions), every row the same length; with the query positions: as the keys', but where
    the right padding is given as ``+n`` the queries there count on past the last key (``-n``: at -1 too)."""
    keys, queries = [], []
    for row in rows:
        if isinstance(row, list):
            keys.append(torch.tensor(row))
            queries.append(keys[-1])
            continue
        left, segments, right = row
        body = torch.cat([torch.full((left,), -1)] + [torch.arange(s, s + n) for s, n in segments])
        keys.append(torch.cat([body, torch.full((abs(right),), -1)]))
        after = torch.arange(1, right + 1) + body.max() if right > 0 else torch.full((-right,), -1)
        queries.append(torch.cat([body, after]))
    assert len({len(r) for r in keys}) == 1, [len(r) for r in keys]
    return torch.stack(keys), torch.stack(queries)


METHODS = {  # the family's methods through the training path (Dual Chunk Attention has none)
    "rerope": lambda w: {},
    "leaky-logn": lambda w: dict(leaky_k=4.0, logn_length=12),
    "self-extend": lambda w: dict(group=3),
    "string": lambda w: dict(leaky_k=1.0, far_start=max(1, w // 2)),
}

# name: (key position rows, q heads, kv heads, q_len (0: every key), dim, window, interleaved, rotary_dim)
GAP_CASES = {
    # PoSE: two chunks, the second one shifted by a skip (row 1: another split and skip)
    "pose": ([(0, [(0, 11), (40, 14)], 0), (0, [(0, 5), (70, 20)], 0)], 4, 2, 0, 16, 8, False, 0),
    # CREAM: head, middle, tail (row 1: other gaps, one smaller than the window)
    "cream": ([(0, [(0, 7), (30, 9), (60, 7)], 0), (0, [(0, 7), (10, 9), (100, 7)], 0)], 4, 1, 0, 12, 6, False, 0),
    # gaps (missing positions) smaller than, one less than, equal to and larger than the window, a gap of 1
    "gap<window": ([(0, [(0, 10), (14, 12)], 0)], 2, 2, 0, 8, 9, False, 0),
    "gap=window-1": ([(0, [(0, 10), (18, 12)], 0)], 2, 1, 0, 8, 9, False, 0),
    "gap=window": ([(0, [(0, 10), (19, 12)], 0)], 2, 1, 0, 8, 9, False, 0),
    "gap>window": ([(0, [(0, 10), (40, 12)], 0)], 2, 1, 0, 8, 9, False, 0),
    "gap-1": ([(0, [(0, 6), (7, 15)], 0), (0, [(3, 4), (8, 1), (10, 16)], 0)], 2, 1, 0, 8, 5, False, 0),
    # left padding and gaps; a consecutive row with an offset next to a gapped one; odd sizes
    "left-pad": ([(3, [(0, 8), (20, 10)], 0), (0, [(5, 21)], 0), (7, [(2, 3), (9, 11)], 0)], 3, 1, 0, 10, 4,
                 False, 0),
    # right padding (row 0: the queries there count on, as transformers' position ids; row 2: at -1); padding rows
    # in the middle (the positions go on past them); interleaved, partial rotary
    "right-pad": ([(0, [(0, 9), (25, 8)], 4), [0, 1, 2, -1, 3, 4, 30, 31, -1, -1, 32] + list(range(40, 50)),
                   (2, [(0, 9), (12, 6)], -4)], 4, 2, 0, 12, 5, True, 8),
    # fewer queries than keys (a cache): the last 13 queries of 24 keys, gaps among both
    "cache": ([(0, [(0, 6), (20, 6), (50, 12)], 0), (4, [(0, 3), (9, 17)], 0)], 4, 2, 13, 16, 4, False, 0),
    # a window past the training length with a far pair across the gap; and every pair near (no expansion)
    "wide-window": ([(0, [(0, 7), (40, 9)], 0)], 2, 1, 0, 8, 12, False, 0),
    "all-near": ([(0, [(0, 5), (9, 6)], 0)], 2, 1, 0, 8, 20, False, 0),
    # a row of padding only next to a gapped one
    "padded-row": ([(0, [(0, 7), (30, 9)], 0), [-1] * 16], 2, 1, 0, 8, 4, False, 0),
}


def gap_inputs(name, dtype, seed=0):
    rows, q_heads, kv_heads, q_len, dim, window, interleaved, rotary = GAP_CASES[name]
    kp, qp = gapped(rows)
    batch, k_len = kp.shape
    q_len = q_len or k_len
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, n, dim, generator=g).to(dtype)
               for h, n in ((q_heads, q_len), (kv_heads, k_len), (kv_heads, k_len)))
    qp = qp[:, k_len - q_len :].clone()
    inv_freq = ops.default_inv_freq(rotary or dim, BASE)
    return q, k, v, qp, kp, inv_freq.to(dtype if dtype == torch.float64 else torch.float32), window, interleaved


def no_composite(monkeypatch):
    """The composite raises if called: the fused path ran."""
    def composite(*args, **kwargs):
        raise AssertionError("rerope_attention_train took the composite")
    monkeypatch.setattr(rerope_train, "rerope_attention_composite", composite)


def test_training_layout_gapped():
    """Strictly increasing positions with gaps take the fused path (padding keys anywhere, padding queries at
    negative positions anywhere, queries at padding keys' rows if their positions go on increasing); not:
    repeated or decreasing positions, a query at another position than its key's, the authors' collator's
    padding (queries at position 0 after the text); with the window, not where the expansion would cost more
    than twice the composite's scores."""
    pose, _ = gapped([(0, [(0, 11), (40, 14)], 0), (0, [(0, 5), (70, 20)], 0)])
    assert training_layout(pose, pose) is False
    assert training_layout(pose, pose, window=8) is False
    assert training_layout(pose[:, 5:], pose) is False
    keys, queries = gapped([(3, [(0, 8), (20, 10)], 0), (0, [(0, 8), (30, 10)], 3), (0, [(0, 8), (30, 10)], -3)])
    assert training_layout(queries, keys) is True
    assert training_layout(pose, pose, causal=False) is None
    assert training_layout(torch.tensor([[0, 1, 2, 2, 5]]), torch.tensor([[0, 1, 2, 2, 5]])) is None  # repeated
    assert training_layout(torch.tensor([[0, 1, 9, 5, 6]]), torch.tensor([[0, 1, 9, 5, 6]])) is None  # decreasing
    assert training_layout(torch.tensor([[0, 1, 5, 6]]), torch.tensor([[0, 1, 4, 6]])) is None  # query elsewhere
    assert training_layout(torch.tensor([[0, -1, 5, 6]]), torch.tensor([[0, 1, 5, 6]])) is False  # padding query
    assert training_layout(torch.tensor([[0, 1, 5, 6]]), torch.tensor([[0, 1, -1, 6]])) is True  # a padding key
    assert training_layout(torch.tensor([[0, 1, 5, 3]]), torch.tensor([[0, 1, 5, -1]])) is None  # ... going back
    collated = torch.tensor([[0, 1, 5, 6, 0, 0]]), torch.tensor([[0, 1, 5, 6, -1, -1]])
    assert training_layout(*collated) is None
    sparse = torch.arange(0, 160, 10)[None]  # 15 gaps of 9 (16 keys)
    assert training_layout(sparse, sparse) is False
    assert training_layout(sparse, sparse, window=8) is None  # 16 + 15 * 7 rows
    assert training_layout(sparse, sparse, window=40) is None  # gaps of 9 < 40 kept whole: 151 rows
    assert training_layout(sparse, sparse, window=151) is False  # every pair near: 16 rows


@pytest.mark.parametrize("method", METHODS, ids=str)
@pytest.mark.parametrize("name", GAP_CASES, ids=str)
def test_gapped_float64_equals_composite_and_reference(monkeypatch, name, method):
    """float64: out, lse, dq, dk, dv (through out and lse) of the fused path on gapped positions equal the
    composite's and the two-matrix reference's, to float64 rounding; the composite is never called."""
    q, k, v, qp, kp, inv_freq, window, interleaved = gap_inputs(name, torch.float64, seed=len(name))
    kw = dict(interleaved=interleaved, **METHODS[method](window))
    gen = torch.Generator().manual_seed(7)
    g_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(q.shape[:3], generator=gen, dtype=torch.float64)
    composite = rerope_train.rerope_attention_composite
    expected = [grads_of(lambda q, k, v: fn(q, k, v, qp, kp, inv_freq, window, **kw), q, k, v, g_out, g_lse)
                for fn in (composite, rerope.rerope_attention_naive)]
    no_composite(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (out, lse), grads = grads_of(lambda q, k, v: rerope_attention_train(q, k, v, qp, kp, inv_freq, window, **kw),
                                     q, k, v, g_out, g_lse)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    for (ref_out, ref_lse), ref_grads in expected:
        torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
        assert torch.equal(lse.isneginf(), ref_lse.isneginf())
        torch.testing.assert_close(lse[lse.isfinite()], ref_lse[ref_lse.isfinite()], atol=1e-12, rtol=1e-12)
        for n, g, r in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-11, rtol=1e-11, msg=f"d{n}")
    if method in ("rerope", "leaky-logn"):  # the attention suite's own reference (Su's definition)
        ref = reference(q, k, v, qp, kp, inv_freq, window, kw.get("leaky_k", 0.0), None, kw.get("logn_length", 0),
                        True, interleaved)
        torch.testing.assert_close(out, ref[0], atol=1e-12, rtol=1e-12)


def test_gapped_cases_cross_the_window():
    """The grid exercises what it is meant to: in each case but "all-near", some pair at index distance < window
    is far by its positions (the misclassification the expansion prevents), and "gap=window-1" has pairs at
    position distance exactly the window."""
    for name, case in GAP_CASES.items():
        kp, window = gapped(case[0])[0], case[5]
        real = (kp[:, :, None] >= 0) & (kp[:, None, :] >= 0)
        index = torch.arange(kp.shape[1])
        by_index = (index[:, None] - index[None, :]).abs() < window
        by_position = (kp[:, :, None] - kp[:, None, :]).abs() < window
        assert (real & by_index & ~by_position).any() == (name != "all-near"), name
    kp = gapped(GAP_CASES["gap=window-1"][0])[0]
    assert ((kp[:, :, None] - kp[:, None, :]) == GAP_CASES["gap=window-1"][5]).any()


@pytest.mark.parametrize("name,method", [("left-pad", "leaky-logn"), ("cache", "rerope"), ("right-pad", "self-extend"),
                                         ("cream", "string")])
def test_gapped_gradcheck(name, method):
    """Both outputs on gapped positions, through the gathers, both sides of the window and the padding column."""
    q, k, v, qp, kp, inv_freq, window, interleaved = gap_inputs(name, torch.float64, seed=3)
    q, k, v = (t[..., :6].contiguous().requires_grad_() for t in (q, k, v))
    inv_freq = ops.default_inv_freq(6, BASE).double()
    kw = dict(interleaved=interleaved, **METHODS[method](window))

    def f(q, k, v):
        out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq, window, **kw)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("kernel", [EmulatedFlash(), EmulatedEfficient()], ids=["flash", "efficient"])
@pytest.mark.parametrize("name", ["pose", "cache", "right-pad"])
def test_gapped_cuda_kernel_conventions_emulated(monkeypatch, kernel, name):
    """The expanded layout's calls meet the CUDA kernels' conventions (emulated); float64 equals the reference."""
    monkeypatch.setattr(rerope_train, "kernel_for", lambda q, head_dim: kernel)
    q, k, v, qp, kp, inv_freq, window, interleaved = gap_inputs(name, torch.float64, seed=4)
    kw = dict(leaky_k=4.0, interleaved=interleaved)
    no_composite(monkeypatch)
    assert_float64_equals_naive(q, k, v, qp, kp, inv_freq, window, kw)


# name: (key position rows, q heads, kv heads, dim, window, method); at least 64 rows (SDPA_ERROR_FACTOR's rule)
GAP_LOW_PRECISION_CASES = {
    "pose": ([(0, [(0, 30), (200, 37)], 0), (0, [(0, 9), (90, 58)], 0)], 4, 2, 32, 9, "rerope"),
    "cream": ([(0, [(0, 22), (60, 26), (300, 22)], 0), (5, [(0, 20), (25, 20), (47, 25)], 0)], 4, 2, 32, 16,
              "leaky-logn"),
    "self-extend": ([(0, [(0, 35), (120, 35)], 0), (3, [(0, 12), (13, 30), (200, 25)], 0)], 8, 2, 64, 12,
                    "self-extend"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", GAP_LOW_PRECISION_CASES, ids=str)
def test_gapped_low_precision_within_sdpa_error(monkeypatch, dtype, name):
    """Gapped positions in low precision: out, lse, dq, dk, dv against float64 within SDPA_ERROR_FACTOR x the larger
    of the error of PyTorch's SDPA (RoPE attention, same visibility) and of the composite in the dtype, as the
    consecutive grid above (float32 there takes the larger of the two too)."""
    rows, q_heads, kv_heads, dim, window, method = GAP_LOW_PRECISION_CASES[name]
    kp, qp = gapped(rows)
    g = torch.Generator().manual_seed(len(name))
    q, k, v = (torch.randn(kp.shape[0], h, kp.shape[1], dim, generator=g).to(dtype)
               for h in (q_heads, kv_heads, kv_heads))
    inv_freq = ops.default_inv_freq(dim, BASE)
    kw = METHODS[method](window)
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    zero_lse = torch.zeros(q.shape[:3], dtype=torch.float64)
    (ref_out, ref_lse), ref_grads = grads_of(
        lambda q, k, v: rerope.rerope_attention_naive(q, k, v, qp, kp, inv_freq.double(), window, **kw),
        q.double(), k.double(), v.double(), g_out, zero_lse)
    rows = torch.isfinite(ref_lse)

    def errors(fn):
        (out, lse), grads = grads_of(lambda q, k, v: fn(q, k, v, qp, kp, inv_freq, window, **kw), q, k, v,
                                     g_out.to(dtype), zero_lse)
        assert out.dtype == dtype and lse.dtype == torch.float32 and torch.equal(torch.isfinite(lse), rows)
        found = [(out.double() - ref_out).abs()[rows].max().item()]
        found += [(g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
        return found + [(lse.double() - ref_lse).abs()[rows].max().item()]

    composite = errors(rerope_train.rerope_attention_composite)
    no_composite(monkeypatch)
    ours = errors(rerope_attention_train)
    logn = kw.get("logn_length", 0)
    pytorch = sdpa_errors(q, k, v, qp, kp, inv_freq, g_out, logn, False)
    pytorch.append(sdpa_error(q, k, v, qp, kp, inv_freq, logn_length=logn)[1])
    for what, e, p, c in zip(("out", "dq", "dk", "dv", "lse"), ours, pytorch, composite):
        bound = max(p, c)
        assert 0 < bound and e <= SDPA_ERROR_FACTOR * bound, f"{what}: {e:.3g}, SDPA {p:.3g}, composite {c:.3g}"


@pytest.mark.parametrize("where", ["q", "v", "masked"])
def test_gapped_non_finite_inputs_as_the_composite(where):
    """NaN / inf in q or v, or in padding keys only, on gapped positions: the same finite pattern and values as the
    composite (non-finite k differs by design: see test_non_finite_inputs_follow_the_rule)."""
    q, k, v, qp, kp, inv_freq, window, _ = gap_inputs("left-pad", torch.float32, seed=2)
    gen = torch.Generator().manual_seed(len(where))
    clean_out, _ = rerope_attention_train(q, k, v, qp, kp, inv_freq, window, 4.0)
    if where == "masked":
        k, v = k.clone(), v.clone()
        k[0, :, :3], v[0, :, :3] = math.nan, math.inf
    else:
        t = poison({"q": q, "v": v}[where], gen, 3)
        q, v = (t if where == "q" else q), (t if where == "v" else v)
    out, lse = rerope_attention_train(q, k, v, qp, kp, inv_freq, window, 4.0)
    c_out, c_lse = rerope.rerope_attention_composite(q, k, v, qp, kp, inv_freq, window, 4.0)
    assert torch.equal(out.isfinite(), c_out.isfinite()) and torch.equal(lse.isfinite(), c_lse.isfinite())
    assert torch.equal(lse.isneginf(), c_lse.isneginf()) and out.isfinite().all() == (where == "masked")
    finite = out.isfinite()
    torch.testing.assert_close(out[finite], c_out[finite], atol=2e-5, rtol=1e-4)
    if where == "masked":
        torch.testing.assert_close(out, clean_out, atol=0, rtol=0)


def test_gapped_too_many_gaps_take_the_composite_with_a_warning():
    """Where the expansion (up to window rows per gap) would cost more than twice the composite's scores, the
    composite runs, and says why."""
    kp = torch.arange(0, 400, 10)[None]  # 39 gaps of 9 missing positions, window 8: 40 + 39 * 7 rows
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    inv_freq = ops.default_inv_freq(8, BASE)
    rerope_train._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = rerope_attention_train(q.requires_grad_(), k, v, kp, kp, inv_freq, 8)
    assert len(caught) == 1 and "gaps between these positions" in str(caught[0].message), caught
    c_out, c_lse = rerope.rerope_attention_composite(q, k, v, kp, kp, inv_freq, 8)
    torch.testing.assert_close(out, c_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, c_lse, atol=0, rtol=0)


def test_gapped_no_tensor_grows_with_l_squared():
    """PoSE at L = 512 (window 32, Leaky, GQA, padding, one skip of 3000 positions): no aten op output has two
    dimensions >= L / 4, and the largest one is a few times q at the expanded length (512 + 31 rows)."""
    q, k, v, _, _ = make_inputs(1, 4, 2, 512, 512, 32, pad=0, seed=1)
    kp, _ = gapped([(100, [(0, 200), (3200, 212)], 0)])
    largest, recorder = largest_output_of_a_step(q, k, v, kp, kp)
    assert not recorder.violations, "\n".join(sorted(set(recorder.violations)))
    assert recorder.calls
    expanded = 412 + 31  # the left padding dropped, one gap of more than the window: window - 1 more rows
    assert largest <= 4 * q.numel() * 40 // 32 * expanded // 512 + 1, largest


def gapped_batch():
    """Two rows of LENGTH tokens at PoSE-like positions (row 1: two skips, CREAM-like)."""
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(5))
    positions, _ = gapped([(0, [(0, 100), (700, LENGTH - 100)], 0),
                           (0, [(0, 60), (300, 90), (900, LENGTH - 150)], 0)])
    return ids, positions


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gapped_training_step_hands_kernels_what_fused_cuda_kernels_take(monkeypatch, autocast_dtype):
    """A training step of a ReRoPE-patched Llama on PoSE / CREAM-like position ids (plain fp32, CPU autocast bf16 /
    fp16) runs the fused path (never the composite): the kernels get what a fused CUDA kernel takes, nothing has two
    dimensions >= L, gradients are finite, and under autocast the loss is the fp32 one to the dtype."""
    model = hf.patch(tiny("llama", layers=1, mpe=4 * LENGTH), None, attention="rerope", window=16, leaky_k=8.0,
                     logn_length=64).train()
    ids, positions = gapped_batch()
    no_composite(monkeypatch)
    assert_step_takes_fused_kernels(model, WithPositions(model, positions), ids, None, autocast_dtype)
