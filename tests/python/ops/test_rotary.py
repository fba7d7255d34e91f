"""Rotation ops (apply_rotary*, DESIGN.md "Rotation") against a float64 reference written here from
the definition, against transformers' own apply_rotary_pos_emb, opcheck, gradcheck, torch.compile,
accuracy at long positions, bad input, and what the build contains."""

from __future__ import annotations

import itertools
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import ropescale
from ropescale import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
OUT_OF_PLACE = ["apply_rotary", "apply_rotary_qk", "apply_rotary_pos", "apply_rotary_pos_qk"]
ALL_OPS = OUT_OF_PLACE + [name + "_" for name in OUT_OF_PLACE]
# Below this, an error is rounding of a zero (plain PyTorch may be exact where we are within eps).
ERROR_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


# ---------------------------------------------------------------------------------------------
# The reference: y = x * cos + rotate(x) * sin on the first rotary_dim features, the rest copied.


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """transformers' rotate_half: cat(-x2, x1); GPT-J's interleaved form: (-x1, x0, -x3, x2, ...)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def full_width(table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A half-width table (one entry per pair) spread over the pair's two features."""
    return table.repeat_interleave(2, dim=-1) if interleaved else torch.cat((table, table), dim=-1)


def reference_rotary(x, cos, sin, interleaved=False, half_width=False, conjugate=False, dtype=torch.float64):
    """In ``dtype`` (float64 for the reference; x's own dtype to see what plain PyTorch gets).
    x [B, H, S, D]; cos/sin [S, W] or [B or 1, S, W]. conjugate: the transposed map,
    x * cos - rotate(x * sin) (rotate's transpose is -rotate)."""
    x, cos, sin = x.to(dtype), cos.to(dtype), sin.to(dtype)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if half_width:
        cos, sin = full_width(cos, interleaved), full_width(sin, interleaved)
    cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
    r = cos.shape[-1]
    xr = x[..., :r]
    y = xr * cos - rotate(xr * sin, interleaved) if conjugate else xr * cos + rotate(xr, interleaved) * sin
    return torch.cat((y, x[..., r:]), dim=-1)


def position_tables(positions, inv_freq, scale, dtype=torch.float64):
    """Half-width cos/sin of positions * inv_freq: in float64 from the float32 inv_freq values (the
    reference), or in float32 as transformers does, then cast (what plain PyTorch gets)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(compute)[..., None] * inv_freq.to(compute)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def reference_rotary_pos(x, positions, inv_freq, scale=1.0, interleaved=False, conjugate=False, dtype=torch.float64):
    cos, sin = position_tables(positions, inv_freq, scale, dtype)
    return reference_rotary(x, cos, sin, interleaved, half_width=True, conjugate=conjugate, dtype=dtype)


def make_operand(batch, heads, seq, dim, dtype, layout, device="cpu", generator=None):
    """[B, H, S, D] in a given memory layout: contiguous, transformers' transposed view of
    [B, S, H, D], or a non-dense slice of a wider tensor."""
    if layout == "contiguous":
        return torch.randn(batch, heads, seq, dim, generator=generator).to(device, dtype)
    if layout == "transposed":
        return torch.randn(batch, seq, heads, dim, generator=generator).to(device, dtype).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(batch, heads, seq, dim + 6, generator=generator).to(device, dtype)[..., 3 : 3 + dim]
    raise ValueError(layout)


def tolerance(got, reference, plain, dtype):
    """Twice what plain PyTorch's own error is in this dtype, with a floor for exact cases."""
    plain_error = (plain.double() - reference).abs().max().item() if plain.numel() else 0.0
    return 2.0 * plain_error + ERROR_FLOOR[dtype]


def assert_matches_reference(got, reference, plain, dtype, what=""):
    assert got.dtype == dtype and got.shape == reference.shape
    error = (got.double() - reference).abs().max().item() if got.numel() else 0.0
    tol = tolerance(got, reference, plain, dtype)
    assert error <= tol, f"{what}: max error {error:.3g} > {tol:.3g} (plain PyTorch in {dtype}: {(tol - ERROR_FLOOR[dtype]) / 2:.3g})"


# ---------------------------------------------------------------------------------------------
# The grid: dtype x layout x partial rotary x q/k head counts x odd sizes x strided views, for
# every table kind (full-width, half-width, positions).


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 10], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("seq", [1, 3, 17, 257])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # non-dense slices: in-place test, opcheck
def test_matches_reference(dtype, interleaved, rotary_dim, seq, layout):
    gen = torch.Generator().manual_seed(seq * 31 + rotary_dim)
    head_dim = 16
    # q alone; GQA q/k (heads 4 and 2, per-batch tables); q/k with a shared table (batch 1)
    # and different batch sizes.
    for heads_q, heads_k, batch_q, batch_k, table_batch in [(3, None, 2, None, 2), (4, 2, 2, 2, 2), (3, 3, 2, 1, 1)]:
        q = make_operand(batch_q, heads_q, seq, head_dim, dtype, layout, generator=gen)
        k = None if heads_k is None else make_operand(batch_k, heads_k, seq, head_dim, dtype, layout, generator=gen)
        what = f"q{tuple(q.shape)} k{None if k is None else tuple(k.shape)}"

        # Arbitrary full-width and half-width tables: the op must apply exactly the entries given
        # (interleaved pairs take half-width tables only).
        for half_width in (True,) if interleaved else (False, True):
            width = rotary_dim // 2 if half_width else rotary_dim
            cos = torch.rand(table_batch, seq, width, generator=gen).to(dtype) * 2 - 1
            sin = torch.rand(table_batch, seq, width, generator=gen).to(dtype) * 2 - 1
            for conjugate in (False, True):
                kw = dict(half_width=half_width, conjugate=conjugate)
                label = f"{what} half_width={half_width} conjugate={conjugate}"
                if k is None:
                    got = (ops.apply_rotary(q, cos, sin, interleaved, **kw),)
                else:
                    got = ops.apply_rotary_qk(q, k, cos, sin, interleaved, **kw)
                for x, y in zip((q, k), got):
                    ref = reference_rotary(x, cos, sin, interleaved, **kw)
                    plain = reference_rotary(x, cos, sin, interleaved, **kw, dtype=dtype)
                    assert_matches_reference(y, ref, plain, dtype, label)

        # Positions (int32 per batch row, or int64 shared), inv_freq float32, an attention factor.
        inv_freq = ops.yarn_inv_freq(rotary_dim, 10000.0, 4.0, 64)
        for positions in (
            torch.randint(0, 100_000, (table_batch, seq), generator=gen, dtype=torch.int32),
            torch.randint(0, 100_000, (seq,), generator=gen),
        ):
            if positions.dim() == 2 and k is not None and batch_k != positions.shape[0]:
                continue
            for conjugate in (False, True):
                label = f"{what} positions {positions.dtype} {tuple(positions.shape)} conjugate={conjugate}"
                if k is None:
                    got = (ops.apply_rotary_pos(q, positions, inv_freq, 1.2, interleaved, conjugate=conjugate),)
                else:
                    got = ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 1.2, interleaved, conjugate=conjugate)
                for x, y in zip((q, k), got):
                    ref = reference_rotary_pos(x, positions, inv_freq, 1.2, interleaved, conjugate)
                    plain = reference_rotary_pos(x, positions, inv_freq, 1.2, interleaved, conjugate, dtype=dtype)
                    assert_matches_reference(y, ref, plain, dtype, label)


# ---------------------------------------------------------------------------------------------
# float32 tables with operands of another dtype (issue 26.1: autocast hands fp16/bf16 q and k with
# the float32 cos/sin of float32 hidden states; FlashInfer and vLLM take float32 tables too). The
# rotation is computed in fp32 (fp64 for float64 operands) from the float32 entries as they are and
# rounded once to the operands' dtype. PyTorch's own result on the same inputs is the promoted one:
# ``q * cos + rotate(q) * sin`` in float32, cast to q's dtype by what comes next (SDPA).

MIXED_DTYPES = [torch.float16, torch.bfloat16, torch.float64]


def promoted_rotary(x, cos, sin, interleaved=False, half_width=False, conjugate=False):
    """What plain PyTorch computes for x with float32 tables: type promotion to float32 (float64 for
    float64 x), then x's dtype."""
    compute = torch.promote_types(x.dtype, cos.dtype)
    return reference_rotary(x, cos, sin, interleaved, half_width, conjugate, dtype=compute).to(x.dtype)


@pytest.mark.parametrize("dtype", MIXED_DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 10], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("seq", [1, 17, 257])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_float32_tables_match_reference(dtype, interleaved, rotary_dim, seq, layout):
    gen = torch.Generator().manual_seed(seq * 7 + rotary_dim)
    head_dim = 16
    # q alone; GQA q/k with per-batch tables; q/k with a shared 2-D table and different batch sizes.
    for heads_q, heads_k, batch_q, batch_k, table_batch in [(3, None, 2, None, 2), (4, 2, 2, 2, 2), (3, 3, 2, 1, None)]:
        q = make_operand(batch_q, heads_q, seq, head_dim, dtype, layout, generator=gen)
        k = None if heads_k is None else make_operand(batch_k, heads_k, seq, head_dim, dtype, layout, generator=gen)
        what = f"q{tuple(q.shape)} k{None if k is None else tuple(k.shape)}"
        for half_width in (True,) if interleaved else (False, True):
            width = rotary_dim // 2 if half_width else rotary_dim
            shape = (seq, width) if table_batch is None else (table_batch, seq, width)
            # Arbitrary float32 entries, most of them not representable in the operands' dtype.
            cos = torch.rand(shape, generator=gen) * 2 - 1
            sin = torch.rand(shape, generator=gen) * 2 - 1
            for conjugate in (False, True):
                kw = dict(half_width=half_width, conjugate=conjugate)
                label = f"{what} float32 tables {tuple(cos.shape)} half_width={half_width} conjugate={conjugate}"
                if k is None:
                    got = (ops.apply_rotary(q, cos, sin, interleaved, **kw),)
                else:
                    got = ops.apply_rotary_qk(q, k, cos, sin, interleaved, **kw)
                for x, y in zip((q, k), got):
                    assert y.dtype == dtype and (layout == "sliced" or y.stride() == x.stride())
                    ref = reference_rotary(x, cos, sin, interleaved, **kw)
                    assert_matches_reference(y, ref, promoted_rotary(x, cos, sin, interleaved, **kw), dtype, label)
                # In place: the same values, written into the operands.
                copies = [t.clone() for t in (q, k) if t is not None]
                if k is None:
                    ops.apply_rotary_(copies[0], cos, sin, interleaved, **kw)
                else:
                    ops.apply_rotary_qk_(*copies, cos, sin, interleaved, **kw)
                for copy, y in zip(copies, got):
                    torch.testing.assert_close(copy, y, rtol=0, atol=0)


def test_float32_tables_are_rounded_once():
    """fp16/bf16 operands with float32 tables: as accurate as PyTorch's promoted float32 math rounded
    to the dtype (the same rounding, once), and more accurate than the old workaround of casting the
    tables to the operands' dtype first (two roundings more). Measured on a Llama-sized problem with
    real cos/sin (YaRN table, positions to 8k, attention factor)."""
    gen = torch.Generator().manual_seed(26)
    inv_freq = ops.yarn_inv_freq(128, 5e5, 8.0, 1024)
    positions = torch.randint(0, 8192, (2, 64), generator=gen)
    angles = positions.double()[..., None] * inv_freq.double()
    factor = ops.yarn_attention_factor(8.0)
    cos, sin = (torch.cat((angles.cos(), angles.cos()), -1) * factor).float(), (torch.cat((angles.sin(), angles.sin()), -1) * factor).float()
    errors = {}
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(2, 64, 8, 128, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(2, 64, 2, 128, generator=gen).to(dtype).transpose(1, 2)
        got = ops.apply_rotary_qk(q, k, cos, sin)
        back_q = ops.apply_rotary(got[0], cos, sin, conjugate=True)  # the backward's map, same tables
        for x, y in zip((q, k), got):
            ref = reference_rotary(x, cos, sin)
            ours = (y.double() - ref).abs().max().item()
            promoted = (promoted_rotary(x, cos, sin).double() - ref).abs().max().item()
            cast = (reference_rotary(x, cos.to(dtype), sin.to(dtype), dtype=dtype).double() - ref).abs().max().item()
            errors[dtype] = tuple(max(a, b) for a, b in zip(errors.get(dtype, (0.0,) * 3), (ours, promoted, cast)))
            # the same single rounding (fp32 arithmetic may round a few products differently)
            assert ours <= promoted + 1e-6 * ref.abs().max().item(), (dtype, ours, promoted)
            assert ours < cast, (dtype, ours, cast)
        ref_back = reference_rotary(got[0], cos, sin, conjugate=True)
        assert_matches_reference(back_q, ref_back, promoted_rotary(got[0], cos, sin, conjugate=True), dtype, "conjugate")
    print("\nmax abs error vs float64, float32 tables (ours, PyTorch promoted, tables cast to the dtype): " +
          ", ".join(f"{str(d)[6:]} {a:.3g} {b:.3g} {c:.3g}" for d, (a, b, c) in errors.items()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved,half_width", [(False, False), (False, True), (True, True)],
                         ids=["half_split-full_width", "half_split-half_width", "interleaved-half_width"])
def test_backward_with_float32_tables(dtype, interleaved, half_width):
    """Autograd with half q/k and float32 tables: gradients of q's dtype, equal to the transposed map
    applied to the incoming gradient in float64, within PyTorch's own error."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 37, 4, 24, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 2, 37, 24, generator=gen).to(dtype).requires_grad_()
    width = 8 if half_width else 16
    cos, sin = torch.randn(1, 37, width, generator=gen), torch.randn(1, 37, width, generator=gen)
    out_q, out_k = ops.apply_rotary_qk(q, k, cos, sin, interleaved, half_width=half_width)
    grad_q, grad_k = torch.randn(out_q.shape, generator=gen).to(dtype), torch.randn(out_k.shape, generator=gen).to(dtype)
    gq, gk = torch.autograd.grad((out_q, out_k), (q, k), (grad_q, grad_k))
    kw = dict(half_width=half_width, conjugate=True)
    for g, incoming in ((gq, grad_q), (gk, grad_k)):
        assert g.dtype == dtype
        ref = reference_rotary(incoming, cos, sin, interleaved, **kw)
        assert_matches_reference(g, ref, promoted_rotary(incoming, cos, sin, interleaved, **kw), dtype, "grad")


@pytest.mark.parametrize("interleaved,half_width", [(False, False), (False, True), (True, True)],
                         ids=["half_split-full_width", "half_split-half_width", "interleaved-half_width"])
@pytest.mark.parametrize("conjugate", [False, True])
def test_gradcheck_float64_operands_float32_tables(interleaved, half_width, conjugate):
    """float64 operands accept float32 tables too (the fp64 kernel reads them exactly), so the mixed
    tables' forward and backward are gradchecked."""
    q, k, cos, sin = _grad_inputs(interleaved, half_width)
    cos, sin = cos.float(), sin.float()
    kw = dict(half_width=half_width, conjugate=conjugate)
    assert torch.autograd.gradcheck(lambda x: ops.apply_rotary(x, cos, sin, interleaved, **kw), (q,))
    assert torch.autograd.gradcheck(lambda a, b: ops.apply_rotary_qk(a, b, cos, sin, interleaved, **kw), (q, k))
    assert torch.autograd.gradgradcheck(lambda a, b: ops.apply_rotary_qk(a, b, cos, sin, interleaved, **kw), (q, k))
    # The float32 entries are used as they are: equal to float64 tables holding the same values.
    exact = ops.apply_rotary_qk(q, k, cos.double(), sin.double(), interleaved, **kw)
    for a, b in zip(ops.apply_rotary_qk(q, k, cos, sin, interleaved, **kw), exact):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_in_place_equals_out_of_place_and_keeps_the_tail(dtype, interleaved, layout):
    gen = torch.Generator().manual_seed(3)
    q = make_operand(2, 4, 17, 24, dtype, layout, generator=gen)
    k = make_operand(2, 2, 17, 24, dtype, layout, generator=gen)
    width = 8 if interleaved else 16  # interleaved pairs take half-width tables
    cos = torch.randn(2, 17, width, generator=gen).to(dtype)
    sin = torch.randn(2, 17, width, generator=gen).to(dtype)
    positions = torch.randint(0, 5000, (2, 17), generator=gen)
    inv_freq = ops.default_inv_freq(16, 10000.0)

    expected_q, expected_k = ops.apply_rotary_qk(q, k, cos, sin, interleaved, half_width=interleaved)
    q2, k2 = q.clone(), k.clone()
    ops.apply_rotary_qk_(q2, k2, cos, sin, interleaved, half_width=interleaved)
    torch.testing.assert_close(q2, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k2, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(q2[..., 16:], q[..., 16:], rtol=0, atol=0)

    x = q.clone()
    ops.apply_rotary_(x, cos, sin, interleaved, half_width=interleaved, conjugate=True)
    expected = ops.apply_rotary(q, cos, sin, interleaved, half_width=interleaved, conjugate=True)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)

    expected_q, expected_k = ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 0.9, interleaved)
    q2, k2 = q.clone(), k.clone()
    ops.apply_rotary_pos_qk_(q2, k2, positions, inv_freq, 0.9, interleaved)
    torch.testing.assert_close(q2, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k2, expected_k, rtol=0, atol=0)
    x = k.clone()
    ops.apply_rotary_pos_(x, positions, inv_freq, 0.9, interleaved)
    torch.testing.assert_close(x, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(x[..., 16:], k[..., 16:], rtol=0, atol=0)


def test_output_keeps_the_input_layout():
    q = torch.randn(2, 9, 4, 16).transpose(1, 2)  # transformers' view: heads before seq
    cos, sin = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    assert ops.apply_rotary(q, cos, sin).stride() == q.stride()


def test_conjugate_undoes_a_rotation():
    x = torch.randn(2, 3, 33, 64, dtype=torch.float64)
    positions = torch.arange(33) * 1000
    inv_freq = ops.default_inv_freq(64, 10000.0)
    y = ops.apply_rotary_pos(x, positions, inv_freq)
    torch.testing.assert_close(ops.apply_rotary_pos(y, positions, inv_freq, conjugate=True), x, rtol=0, atol=1e-12)


def test_empty_inputs():
    cos = torch.randn(1, 0, 8)
    x = torch.randn(2, 3, 0, 8)
    assert ops.apply_rotary(x, cos, cos).shape == x.shape
    q, k = ops.apply_rotary_qk(torch.randn(2, 0, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    assert q.shape == (2, 0, 5, 8) and k.shape == (2, 2, 5, 8)
    ops.apply_rotary_pos_(torch.randn(0, 3, 4, 8), torch.arange(4), ops.default_inv_freq(8, 1e4))


# ---------------------------------------------------------------------------------------------
# The CPU kernel is built once per instruction set; each variant, forced with ATEN_CPU_CAPABILITY
# in a fresh process, against the reference (vector bodies and scalar remainders: 40 pairs).

_VARIANT_SCRIPT = """
import sys, torch, ropescale
from ropescale import ops
gen = torch.Generator().manual_seed(0)
results = {"torch": torch.backends.cpu.get_cpu_capability(), "ropescale": ropescale._C.rotary_cpu_isa(), "cases": [],
           "float32_tables": []}
inv_freq = ops.default_inv_freq(80, 10000.0)
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for interleaved in (False, True):
        q = torch.randn(2, 9, 5, 88, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(2, 9, 2, 88, generator=gen).to(dtype).transpose(1, 2)
        width = 40 if interleaved else 80  # interleaved pairs take half-width tables
        cos = (torch.rand(2, 9, width, generator=gen) * 2 - 1).to(dtype)
        sin = (torch.rand(2, 9, width, generator=gen) * 2 - 1).to(dtype)
        positions = torch.randint(0, 70000, (2, 9), generator=gen)
        out = ops.apply_rotary_qk(q, k, cos, sin, interleaved, half_width=interleaved)
        out_pos = ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 1.3, interleaved, conjugate=True)
        results["cases"].append((q, k, cos, sin, positions, interleaved, out, out_pos))
        if dtype != torch.float32:  # float32 tables with the other operand types
            cos32, sin32 = torch.rand(2, 9, width, generator=gen) * 2 - 1, torch.rand(2, 9, width, generator=gen) * 2 - 1
            out = ops.apply_rotary_qk(q, k, cos32, sin32, interleaved, half_width=interleaved, conjugate=True)
            results["float32_tables"].append((q, k, cos32, sin32, interleaved, out))
torch.save(results, sys.argv[1])
"""


def _cpu_has(isa: str) -> bool:
    """Whether this CPU can run a variant (cpuinfo, through torch): forcing one it lacks with
    ATEN_CPU_CAPABILITY makes torch's own kernels die with SIGILL."""
    if isa == "default":
        return True
    return bool(getattr(torch.cpu, f"_is_{isa}_supported", lambda: False)())


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512"])
def test_every_cpu_instruction_set_variant(isa, tmp_path):
    import subprocess
    import sys

    if not _cpu_has(isa):
        pytest.skip(f"this CPU has no {isa.upper()} (torch.cpu._is_{isa}_supported() is False): its variant cannot run here")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "PYTHONPATH": str(Path(ropescale.__file__).parents[1])}
    subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT, str(tmp_path / "out.pt")], env=env, check=True)
    results = torch.load(tmp_path / "out.pt")
    # The variant torch uses for its own kernels under this setting is the one ropescale runs
    # (x86 builds have AVX2 and AVX512 variants; anything else runs the DEFAULT one).
    expected = results["torch"] if results["torch"] in ("AVX2", "AVX512") else "DEFAULT"
    assert results["ropescale"] == expected, results
    inv_freq = ops.default_inv_freq(80, 10000.0)
    for q, k, cos, sin, positions, interleaved, out, out_pos in results["cases"]:
        for x, y, y_pos in zip((q, k), out, out_pos):
            what = f"{results['ropescale']} {x.dtype} interleaved={interleaved}"
            plain = reference_rotary(x, cos, sin, interleaved, half_width=interleaved, dtype=x.dtype)
            ref = reference_rotary(x, cos, sin, interleaved, half_width=interleaved)
            assert_matches_reference(y, ref, plain, x.dtype, what)
            ref = reference_rotary_pos(x, positions, inv_freq, 1.3, interleaved, conjugate=True)
            plain = reference_rotary_pos(x, positions, inv_freq, 1.3, interleaved, conjugate=True, dtype=x.dtype)
            assert_matches_reference(y_pos, ref, plain, x.dtype, what + " positions")
    assert len(results["float32_tables"]) == 6
    for q, k, cos, sin, interleaved, out in results["float32_tables"]:
        for x, y in zip((q, k), out):
            kw = dict(half_width=interleaved, conjugate=True)
            what = f"{results['ropescale']} {x.dtype} float32 tables interleaved={interleaved}"
            ref = reference_rotary(x, cos, sin, interleaved, **kw)
            assert_matches_reference(y, ref, promoted_rotary(x, cos, sin, interleaved, **kw), x.dtype, what)


# ---------------------------------------------------------------------------------------------
# transformers parity: its own cos/sin and its own apply_rotary_pos_emb.


def _llama_rotary(head_dim=64, theta=10000.0, rope_parameters=None):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": theta, **(rope_parameters or {})}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=2048, rope_parameters=params)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_equals_transformers_apply_rotary_pos_emb(dtype, rope):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512} if rope == "yarn" else None
    rotary = _llama_rotary(rope_parameters=params)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 37, 8, 64, generator=gen).to(dtype).transpose(1, 2)  # as LlamaAttention has them
    k = torch.randn(2, 37, 2, 64, generator=gen).to(dtype).transpose(1, 2)
    position_ids = torch.stack([torch.arange(37), torch.arange(100, 137)])
    cos, sin = rotary(q, position_ids)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = ops.apply_rotary_qk(q, k, cos, sin)
    # fp32: the same products and sums. bf16: transformers rounds q*cos and rotate(q)*sin before
    # adding, ropescale once at the end: both are within a bf16 ulp or two of each other.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got_q, expected_q, **tol)
    torch.testing.assert_close(got_k, expected_k, **tol)
    # The positions op from transformers' inv_freq and attention factor gives the same.
    got_q, got_k = ops.apply_rotary_pos_qk(q, k, position_ids, rotary.inv_freq, rotary.attention_scaling)
    torch.testing.assert_close(got_q, expected_q, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else tol))
    torch.testing.assert_close(got_k, expected_k, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else tol))


def test_interleaved_equals_transformers_cohere():
    """Cohere's rotary is GPT-J style: interleaved pairs, tables repeat_interleave'd (c0 c0 c1 c1):
    one entry per pair is cos[..., ::2] (made contiguous), passed as a half-width table."""
    from transformers import CohereConfig
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding, apply_rotary_pos_emb

    config = CohereConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    rotary = CohereRotaryEmbedding(config)
    q = torch.randn(1, 4, 29, 64)
    k = torch.randn(1, 2, 29, 64)
    position_ids = torch.arange(29)[None] + 7
    cos, sin = rotary(q, position_ids)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    cos_pairs, sin_pairs = cos[..., ::2].contiguous(), sin[..., ::2].contiguous()
    got_q, got_k = ops.apply_rotary_qk(q, k, cos_pairs, sin_pairs, interleaved=True, half_width=True)
    torch.testing.assert_close(got_q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-6, atol=1e-6)
    # The full-width table itself is refused (its layout is ambiguous; before the fix the same call
    # with transformers' Llama tables rotated wrongly without a word).
    with pytest.raises(RuntimeError, match="interleaved=True takes a half-width table"):
        ops.apply_rotary_qk(q, k, cos, sin, interleaved=True)
    got_q, _ = ops.apply_rotary_pos_qk(q, k, position_ids, rotary.inv_freq, interleaved=True)
    torch.testing.assert_close(got_q, expected_q, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Accuracy at long context: positions up to 2^21, base 5e5, fp32.


def test_accuracy_at_long_positions_against_float64():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim, seq = 128, 512
    rotary = _llama_rotary(head_dim=head_dim, theta=5e5)
    inv_freq = rotary.inv_freq  # float32, as transformers has it
    gen = torch.Generator().manual_seed(21)
    positions = torch.randint(2**21 - 4096, 2**21 + 1, (1, seq), generator=gen)
    positions[0, :4] = torch.tensor([0, 1, 2**20, 2**21])
    q = torch.randn(1, 4, seq, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, seq, head_dim, generator=gen, dtype=torch.float64)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)  # unit norm per row

    # float64 reference from the float32 inv_freq values, cast to double.
    ref_q = reference_rotary_pos(q, positions, inv_freq)
    ref_k = reference_rotary_pos(k, positions, inv_freq)
    got_q, got_k = ops.apply_rotary_pos_qk(q.float(), k.float(), positions, inv_freq)
    ours = max((got_q.double() - ref_q).abs().max().item(), (got_k.double() - ref_k).abs().max().item())
    # transformers' own fp32 path on the same inputs: cos/sin from its rotary module, then
    # apply_rotary_pos_emb.
    cos, sin = rotary(q.float(), positions)
    hf_q, hf_k = apply_rotary_pos_emb(q.float(), k.float(), cos, sin)
    theirs = max((hf_q.double() - ref_q).abs().max().item(), (hf_k.double() - ref_k).abs().max().item())
    print(f"\nmax abs error vs float64 at positions up to 2^21, base 5e5 (fp32, unit-norm rows): "
          f"ropescale {ours:.2e}, transformers {theirs:.2e}")
    assert ours <= 1e-5
    assert theirs > 1e-3  # the float32 angle loses ~2^21 * 2^-24 rad: this test is not trivially passed
    # The in-place and single-tensor forms, and the conjugate, are as accurate.
    x = q.float().clone()
    ops.apply_rotary_pos_(x, positions[0], inv_freq)
    assert (x.double() - ref_q).abs().max().item() <= 1e-5
    back = ops.apply_rotary_pos(ref_q.float(), positions, inv_freq, conjugate=True)
    assert (back.double() - q).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------------
# Autograd, opcheck, torch.compile.


def _grad_inputs(interleaved, half_width, rotary_dim=6):
    gen = torch.Generator().manual_seed(5)
    # q in transformers' transposed layout, k with fewer heads (GQA) and a smaller batch.
    q = torch.randn(2, 4, 2, 8, dtype=torch.float64, generator=gen).transpose(1, 2)
    k = torch.randn(1, 1, 4, 8, dtype=torch.float64, generator=gen)
    width = rotary_dim // 2 if half_width else rotary_dim
    cos = torch.randn(1, 4, width, dtype=torch.float64, generator=gen)  # arbitrary: not a rotation
    sin = torch.randn(1, 4, width, dtype=torch.float64, generator=gen)
    return q.requires_grad_(), k.requires_grad_(), cos, sin


@pytest.mark.parametrize("interleaved,half_width", [(False, False), (False, True), (True, True)],
                         ids=["half_split-full_width", "half_split-half_width", "interleaved-half_width"])
@pytest.mark.parametrize("conjugate", [False, True])
def test_gradcheck_tables(interleaved, half_width, conjugate):
    q, k, cos, sin = _grad_inputs(interleaved, half_width)
    kw = dict(half_width=half_width, conjugate=conjugate)
    assert torch.autograd.gradcheck(lambda x: ops.apply_rotary(x, cos, sin, interleaved, **kw), (q,))
    assert torch.autograd.gradcheck(lambda a, b: ops.apply_rotary_qk(a, b, cos, sin, interleaved, **kw), (q, k))
    if not conjugate:  # the backward of the backward is the forward again
        assert torch.autograd.gradgradcheck(lambda x: ops.apply_rotary(x, cos, sin, interleaved, **kw), (q,))
    # Only one of q, k used downstream: the other output's gradient is None.
    assert torch.autograd.gradcheck(lambda a, b: ops.apply_rotary_qk(a, b, cos, sin, interleaved, **kw)[1], (q, k))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("conjugate", [False, True])
def test_gradcheck_positions(interleaved, conjugate):
    q, k, _, _ = _grad_inputs(interleaved, True)
    positions = torch.tensor([[5, 70, 900, 123456]])
    inv_freq = ops.default_inv_freq(6, 10000.0)
    kw = dict(conjugate=conjugate)
    assert torch.autograd.gradcheck(lambda x: ops.apply_rotary_pos(x, positions[0], inv_freq, 1.3, interleaved, **kw), (q,))
    assert torch.autograd.gradcheck(
        lambda a, b: ops.apply_rotary_pos_qk(a, b, positions, inv_freq, 0.7, interleaved, **kw), (q, k)
    )
    if not conjugate:
        assert torch.autograd.gradgradcheck(lambda x: ops.apply_rotary_pos(x, positions, inv_freq, 1.0, interleaved, **kw), (q,))
    assert torch.autograd.gradcheck(
        lambda a, b: ops.apply_rotary_pos_qk(a, b, positions, inv_freq, 0.7, interleaved, **kw)[0], (q, k)
    )


def _opcheck_samples(device="cpu"):
    gen = torch.Generator().manual_seed(11)
    inv_freq = ops.default_inv_freq(16, 10000.0).to(device)
    for dtype, layout, interleaved in [
        (torch.float32, "contiguous", False),
        (torch.bfloat16, "transposed", True),
        (torch.float16, "sliced", False),
    ]:
        q = make_operand(2, 4, 7, 24, dtype, layout, device, gen)
        k = make_operand(2, 2, 7, 24, dtype, layout, device, gen)
        cos = torch.randn(2, 7, 16, generator=gen).to(device, dtype)
        sin = torch.randn(2, 7, 16, generator=gen).to(device, dtype)
        half = (cos[..., :8].contiguous(), sin[..., :8].contiguous())
        positions = torch.randint(0, 4096, (2, 7), generator=gen, dtype=torch.int32).to(device)
        grad = dtype == torch.float32
        table, table_kw = (half, {"half_width": True}) if interleaved else ((cos, sin), {})
        yield "apply_rotary", (q.requires_grad_(grad), *table, interleaved), table_kw
        yield "apply_rotary", (q, *half, interleaved), {"half_width": True, "conjugate": True}
        yield "apply_rotary_", (q.detach().clone(), *table, interleaved), table_kw
        yield "apply_rotary_qk", (q, k.requires_grad_(grad), *table, interleaved), table_kw
        yield "apply_rotary_qk_", (q.detach().clone(), k.detach().clone(), *half, interleaved), {"half_width": True}
        yield "apply_rotary_pos", (q, positions, inv_freq, 1.5, interleaved), {}
        yield "apply_rotary_pos_", (q.detach().clone(), positions[0].long(), inv_freq, 1.0, interleaved), {}
        yield "apply_rotary_pos_qk", (q, k, positions, inv_freq, 0.5, interleaved), {"conjugate": True}
        yield "apply_rotary_pos_qk_", (q.detach().clone(), k.detach().clone(), positions, inv_freq), {}
        if dtype != torch.float32:  # float32 tables with half operands
            table32 = tuple(t.float() for t in table)
            yield "apply_rotary", (q, *table32, interleaved), table_kw
            yield "apply_rotary_qk", (q, k, *table32, interleaved), {**table_kw, "conjugate": True}
            yield "apply_rotary_", (q.detach().clone(), *table32, interleaved), table_kw
            yield "apply_rotary_qk_", (q.detach().clone(), k.detach().clone(), *table32, interleaved), table_kw
    # float64 operands with float32 tables, with gradients (the autograd registration's checks)
    q = make_operand(2, 4, 7, 24, torch.float64, "transposed", device, gen).requires_grad_()
    k = make_operand(1, 2, 7, 24, torch.float64, "contiguous", device, gen).requires_grad_()
    cos, sin = torch.randn(1, 7, 8, generator=gen).to(device), torch.randn(1, 7, 8, generator=gen).to(device)
    yield "apply_rotary", (q, cos, sin, True), {"half_width": True}
    yield "apply_rotary_qk", (q, k, cos, sin), {"half_width": True, "conjugate": True}


def test_opcheck_every_op():
    seen = set()
    for name, args, kwargs in _opcheck_samples():
        torch.library.opcheck(getattr(torch.ops.ropescale, name).default, args, kwargs)
        seen.add(name)
    assert seen == set(ALL_OPS)


def test_torch_compile_fullgraph_matches_eager():
    def attention_inputs(q, k, cos, sin, positions, inv_freq):
        q1, k1 = ops.apply_rotary_qk(q, k, cos, sin)
        q2 = ops.apply_rotary_pos(q, positions, inv_freq, 1.1, True)
        k2 = k.detach().clone()  # in place: on a tensor outside the graph
        ops.apply_rotary_pos_(k2, positions, inv_freq, 1.1, True)
        return (q1 * q2).sum() + (k1 * k2).sum()

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 11, 4, 32, generator=gen).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 11, 2, 32, generator=gen).transpose(1, 2).requires_grad_()
    cos, sin = torch.randn(1, 11, 32, generator=gen), torch.randn(1, 11, 32, generator=gen)
    positions, inv_freq = torch.arange(11).expand(2, 11), ops.default_inv_freq(32, 10000.0)

    compiled = torch.compile(attention_inputs, fullgraph=True, backend="aot_eager")
    eager = attention_inputs(q, k, cos, sin, positions, inv_freq)
    eager_grads = torch.autograd.grad(eager, (q, k))
    got = compiled(q, k, cos, sin, positions, inv_freq)
    got_grads = torch.autograd.grad(got, (q, k))
    torch.testing.assert_close(got, eager)
    for a, b in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the op and the argument.


def _bad_cases():
    x = torch.randn(2, 3, 5, 8)
    cos = torch.randn(2, 5, 8)
    pos, inv = torch.arange(5), ops.default_inv_freq(8, 1e4)
    R = torch.ops.ropescale
    yield "apply_rotary: x must be 4-D", lambda: R.apply_rotary(x[0], cos, cos)
    yield "cos/sin cover 4 positions but x has seq length 5", lambda: R.apply_rotary(x, cos[:, :4], cos[:, :4])
    yield "sin and cos must have the same shape", lambda: R.apply_rotary(x, cos, cos[:1])
    yield "cos/sin has 3 batch rows, which must be 1 or the batch size of x", lambda: R.apply_rotary(
        x, torch.randn(3, 5, 8), torch.randn(3, 5, 8))
    yield r"rotary_dim \(cos.size\(-1\)\) must be a positive even number, got 5", lambda: R.apply_rotary(
        x, cos[..., :5], cos[..., :5])
    yield r"rotary_dim \(cos.size\(-1\)\) = 10 is larger than head_dim = 8", lambda: R.apply_rotary(
        x, torch.randn(2, 5, 10), torch.randn(2, 5, 10))
    yield r"rotary_dim \(2 \* cos.size\(-1\), half_width=True\) = 16 is larger than head_dim = 8", lambda: R.apply_rotary(
        x, cos, cos, half_width=True)
    yield "apply_rotary: x must have a unit stride along head_dim", lambda: R.apply_rotary(
        torch.randn(2, 3, 5, 16)[..., ::2], cos, cos)
    yield "cos and sin must have a unit stride along their last dimension", lambda: R.apply_rotary(
        x, torch.randn(2, 5, 16)[..., ::2], cos)
    yield "apply_rotary: x must be float32, float16, bfloat16 or float64, got Int", lambda: R.apply_rotary(
        x.int(), cos, cos)
    yield r"cos and sin must both be float32 or both have the dtype of x \(Float\), got Double and Double", lambda: R.apply_rotary(
        x, cos.double(), cos.double())
    yield r"cos and sin must both be float32 or both have the dtype of x \(BFloat16\), got Float and BFloat16", lambda: R.apply_rotary(
        x.bfloat16(), cos, cos.bfloat16())
    yield "apply_rotary_qk: q and k must have the same dtype", lambda: R.apply_rotary_qk(x, x.bfloat16(), cos, cos)
    yield "apply_rotary_qk: q and k must have the same sequence length", lambda: R.apply_rotary_qk(x, x[:, :, :4], cos, cos)
    yield "apply_rotary_qk: q and k must have the same head_dim", lambda: R.apply_rotary_qk(
        x, torch.randn(2, 3, 5, 10), cos, cos)
    yield "cos/sin has 2 batch rows, which must be 1 or the batch size of k", lambda: R.apply_rotary_qk(
        x, x[:1], cos, cos)
    yield "apply_rotary_pos: positions must be int32 or int64, got Float", lambda: R.apply_rotary_pos(x, pos.float(), inv)
    yield "apply_rotary_pos: inv_freq must be float32, got Double", lambda: R.apply_rotary_pos(x, pos, inv.double())
    yield "apply_rotary_pos: positions has 4 entries per row but x has seq length 5", lambda: R.apply_rotary_pos(
        x, pos[:4], inv)
    yield r"apply_rotary_pos: rotary_dim \(2 \* inv_freq.size\(0\)\) = 10 is larger than head_dim = 8", lambda: R.apply_rotary_pos(
        x, pos, ops.default_inv_freq(10, 1e4))
    yield "positions has 3 batch rows, which must be 1 or the batch size of x", lambda: R.apply_rotary_pos(
        x, torch.zeros(3, 5, dtype=torch.long), inv)
    yield "apply_rotary_pos: scale must be finite", lambda: R.apply_rotary_pos(x, pos, inv, float("nan"))
    yield r"apply_rotary: cos must be on the same device as x \(cpu\), got meta", lambda: R.apply_rotary(
        x, cos.to("meta"), cos.to("meta"))
    yield r"apply_rotary_pos_qk: positions must be on the same device as q \(cpu\), got meta", lambda: R.apply_rotary_pos_qk(
        x, x, pos.to("meta"), inv)
    yield "apply_rotary_qk_: q is written in place but shares memory with k", lambda: R.apply_rotary_qk_(x, x, cos, cos)
    yield "apply_rotary_: x is written in place but shares memory with cos", lambda: R.apply_rotary_(
        x, x[0, 0], x[0, 0])
    yield "apply_rotary_: x has elements that share memory", lambda: R.apply_rotary_(
        torch.randn(2, 1, 5, 8).expand(2, 3, 5, 8), cos, cos)
    yield "apply_rotary: no gradient flows to cos: it is treated as a constant", lambda: ops.apply_rotary(
        x.clone().requires_grad_(), cos.clone().requires_grad_(), cos)
    yield "apply_rotary_pos_qk: no gradient flows to inv_freq", lambda: ops.apply_rotary_pos_qk(
        x, x, pos, inv.clone().requires_grad_())
    yield "apply_rotary_: x requires grad, but the in-place rotation is not differentiable", lambda: ops.apply_rotary_(
        torch.randn(2, 3, 5, 8, requires_grad=True) * 1, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    yield "apply_rotary_pos_: inv_freq requires grad", lambda: ops.apply_rotary_pos_(
        torch.randn(2, 3, 5, 8), pos, inv.clone().requires_grad_())


@pytest.mark.parametrize("message, call", list(_bad_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input(message, call):
    with pytest.raises(RuntimeError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# What the build contains.


def _nvcc_findable() -> bool:
    """What CMake's ROPESCALE_CUDA=AUTO looks for: CUDACXX, CUDA_HOME/bin, PATH, /usr/local/cuda/bin."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    return any(c and os.access(c, os.X_OK) for c in candidates)


def test_library_contains_the_cuda_kernels_when_the_build_asked_for_them():
    info = ropescale.build_info()
    requested = info["cuda_requested"]
    if torch.version.cuda is None:
        # A CPU-only torch has nothing to build CUDA kernels against, whatever nvcc is around.
        assert not info["cuda"], "CUDA kernels built against a CPU-only torch"
    elif requested == "ON" or (requested == "AUTO" and _nvcc_findable()):
        assert info["cuda"], f"ROPESCALE_CUDA={requested} but the library was built without its CUDA kernels"
    if requested == "OFF":
        assert not info["cuda"]
    for name in ALL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ropescale::{name}", "CPU")
        # Every build registers the CUDA key: the kernels, or (built without them) an error saying how to
        # rebuild (test_import.py checks it); which one is build_info()["cuda"] and the binary below.
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ropescale::{name}", "CUDA"), name
    if info["cuda"]:
        # The kernels themselves: each instantiation registers its device symbol by name with the
        # CUDA runtime, and the device code sits in the .nv_fatbin section.
        binary = Path(ropescale._C.__file__).read_bytes()
        kernels = set(re.findall(rb"_ZN9ropescale6rotary13rotary_kernelI[0-9A-Za-z_]+", binary))
        element_types = {b"f": "float", b"d": "double", b"6__half": "half", b"13__nv_bfloat16": "bfloat16"}
        for mangled, name in element_types.items():
            assert any(k.startswith(b"_ZN9ropescale6rotary13rotary_kernelI" + mangled) for k in kernels), name
        # and the float32-table kernels of the other element types (rotary_kernel<T, float, ...>)
        for mangled, name in list(element_types.items())[1:]:
            assert any(k.startswith(b"_ZN9ropescale6rotary13rotary_kernelI" + mangled + b"f") for k in kernels), name
        assert b".nv_fatbin" in binary
        assert set(info["cuda_archs"].split(",")) >= {"80", "90"}


# ---------------------------------------------------------------------------------------------
# On a GPU: the CUDA kernels against the same references (skipped cleanly without one).


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_cuda_matches_reference(dtype, interleaved, layout):
    gen = torch.Generator().manual_seed(2)
    for seq, head_dim, rotary_dim in [(1, 128, 128), (17, 64, 32), (257, 128, 128), (3, 40, 40), (33, 80, 64)]:
        q = make_operand(2, 8, seq, head_dim, dtype, layout, "cuda", gen)
        k = make_operand(2, 2, seq, head_dim, dtype, layout, "cuda", gen)
        # tables of the operands' dtype, and float32 ones (autocast's) for the other dtypes
        for half_width, conjugate, table_dtype in itertools.product(
                (True,) if interleaved else (False, True), (False, True), {dtype, torch.float32}):
            width = rotary_dim // 2 if half_width else rotary_dim
            cos = (torch.rand(2, seq, width, generator=gen) * 2 - 1).to("cuda", table_dtype)
            sin = (torch.rand(2, seq, width, generator=gen) * 2 - 1).to("cuda", table_dtype)
            kw = dict(half_width=half_width, conjugate=conjugate)
            got = ops.apply_rotary_qk(q, k, cos, sin, interleaved, **kw)
            for x, y in zip((q, k), got):
                ref = reference_rotary(x.cpu(), cos.cpu(), sin.cpu(), interleaved, **kw)
                plain = (reference_rotary(x.cpu(), cos.cpu(), sin.cpu(), interleaved, **kw, dtype=dtype)
                         if table_dtype == dtype else promoted_rotary(x.cpu(), cos.cpu(), sin.cpu(), interleaved, **kw))
                assert_matches_reference(y.cpu(), ref, plain, dtype, f"seq={seq} {kw} tables {table_dtype}")
                # The CPU kernel computes the same thing.
                cpu = ops.apply_rotary(x.cpu(), cos.cpu(), sin.cpu(), interleaved, **kw)
                assert_matches_reference(y.cpu(), ref, cpu, dtype, "vs CPU kernel")
        positions = torch.randint(0, 2**21, (2, seq), generator=gen).to("cuda")
        inv_freq = ops.default_inv_freq(rotary_dim, 5e5).to("cuda")
        got = ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 1.1, interleaved)
        for x, y in zip((q, k), got):
            ref = reference_rotary_pos(x.cpu(), positions.cpu(), inv_freq.cpu(), 1.1, interleaved)
            cpu = ops.apply_rotary_pos(x.cpu(), positions.cpu(), inv_freq.cpu(), 1.1, interleaved)
            assert_matches_reference(y.cpu(), ref, cpu, dtype, f"positions seq={seq}")
        q2, k2 = q.clone(), k.clone()
        ops.apply_rotary_pos_qk_(q2, k2, positions, inv_freq, 1.1, interleaved)
        torch.testing.assert_close(q2, got[0], rtol=0, atol=0)
        torch.testing.assert_close(k2, got[1], rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_accuracy_gradcheck_stream_and_devices():
    q, k, cos, sin = (t.cuda() if torch.is_tensor(t) else t for t in _grad_inputs(False, False))
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ops.apply_rotary_qk(a, b, cos, sin), (q, k))
    inv = ops.default_inv_freq(6, 1e4).cuda()
    positions = torch.tensor([[5, 70, 900, 123456]], device="cuda")
    assert torch.autograd.gradcheck(lambda a: ops.apply_rotary_pos(a, positions, inv, 1.3, True), (q,))

    # Long positions, fp32, against float64.
    inv_freq = ops.default_inv_freq(128, 5e5)
    positions = torch.randint(2**21 - 4096, 2**21 + 1, (1, 512))
    x = torch.randn(1, 8, 512, 128, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    got = ops.apply_rotary_pos(x.float().cuda(), positions.cuda(), inv_freq.cuda()).cpu()
    assert (got.double() - reference_rotary_pos(x, positions, inv_freq)).abs().max().item() <= 1e-5

    # Launched on the current stream.
    stream = torch.cuda.Stream()
    x = torch.randn(4, 32, 1024, 128, device="cuda")
    table = torch.randn(1, 1024, 128, device="cuda")
    expected = ops.apply_rotary(x, table, table)
    with torch.cuda.stream(stream):
        got = ops.apply_rotary(x, table, table)
    stream.synchronize()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    with pytest.raises(RuntimeError, match=r"apply_rotary: cos must be on the same device as the rotated tensor"):
        ops.apply_rotary(x, table.cpu(), table.cpu())
    with pytest.raises(RuntimeError, match=r"apply_rotary_pos: positions must be on the same device"):
        ops.apply_rotary_pos(x, torch.arange(1024), inv_freq.cuda())
    if torch.cuda.device_count() > 1:  # the device guard: a tensor on the second GPU
        x1, t1 = x[:1].to("cuda:1"), table.to("cuda:1")
        torch.testing.assert_close(ops.apply_rotary(x1, t1, t1).cpu(), expected[:1].cpu(), rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_opcheck_every_op():
    seen = set()
    for name, args, kwargs in _opcheck_samples("cuda"):
        torch.library.opcheck(getattr(torch.ops.ropescale, name).default, args, kwargs)
        seen.add(name)
    assert seen == set(ALL_OPS)


# ---------------------------------------------------------------------------------------------
# torch.func (issue 16.14): grad, vjp and jacrev over the rotations (the autograd registration is
# a C++ autograd Function, which functorch supports), against plain autograd.


def test_torch_func_grad_vjp_jacrev():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, generator=gen)
    cos, sin = torch.randn(3, 8, dtype=torch.float64, generator=gen), torch.randn(3, 8, dtype=torch.float64, generator=gen)
    positions, inv_freq = torch.tensor([3, 70, 9000]), ops.default_inv_freq(8, 1e4)

    def loss(x):
        return (ops.apply_rotary(x, cos, sin) ** 2).sum() + (ops.apply_rotary_pos(x, positions, inv_freq, 1.3) ** 3).sum()

    expected = torch.autograd.grad(loss(x.requires_grad_()), x)[0]
    torch.testing.assert_close(torch.func.grad(loss)(x.detach()), expected)

    def rotate_qk(q, k):
        return ops.apply_rotary_qk(q, k, cos[..., :4], sin[..., :4], True, half_width=True)

    (out_q, out_k), vjp = torch.func.vjp(rotate_qk, x.detach(), k)
    gq, gk = vjp((torch.ones_like(out_q), torch.ones_like(out_k)))
    # the transposed map applied to the cotangent (conjugate=True)
    torch.testing.assert_close(gq, ops.apply_rotary(torch.ones_like(x), cos[..., :4], sin[..., :4], True,
                                                    half_width=True, conjugate=True))
    torch.testing.assert_close(gk, ops.apply_rotary(torch.ones_like(k), cos[..., :4], sin[..., :4], True,
                                                    half_width=True, conjugate=True))

    def rotate_pos(q):
        return ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 0.7)[0]

    jac = torch.func.jacrev(rotate_pos)(x.detach())
    expected_jac = torch.autograd.functional.jacobian(rotate_pos, x.detach())
    torch.testing.assert_close(jac, expected_jac)
    # vmap still works (over a batch of inputs, and of gradients)
    xs = torch.randn(3, *x.shape, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(torch.func.vmap(lambda t: ops.apply_rotary(t, cos, sin))(xs),
                               torch.stack([ops.apply_rotary(t, cos, sin) for t in xs]))
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(loss))(xs),
                               torch.stack([torch.func.grad(loss)(t) for t in xs]))


# ---------------------------------------------------------------------------------------------
# The accurate range of positions (issue 16.8): measured against exact angles, refused beyond.


def _exact_cos_sin(positions, inv_freq):
    import mpmath

    mpmath.mp.prec = 200
    cos = torch.empty(len(positions), len(inv_freq), dtype=torch.float64)
    sin = torch.empty_like(cos)
    for i, p in enumerate(positions):
        for j, f in enumerate(inv_freq.tolist()):
            angle = mpmath.mpf(int(p)) * mpmath.mpf(f)  # f: the float32 value, exactly
            cos[i, j], sin[i, j] = float(mpmath.cos(angle)), float(mpmath.sin(angle))
    return cos, sin


def test_rotation_is_accurate_up_to_the_largest_accepted_position():
    """At |p| up to 2^31 - 1 the rotation stays within 3e-7 of the exact one (measured: 2.1e-7 at
    2^31, 1.2e-7 float32 rounding below 2^29; 1.8e-2 at 2^48, the issue's case, now refused)."""
    largest = 2**31 - 1
    positions = torch.tensor([largest, largest - 1, -largest, 2**30 + 12345, 2**29 + 7])
    inv_freq = ops.default_inv_freq(128, 1e4)
    cos, sin = _exact_cos_sin(positions.tolist(), inv_freq)
    x = torch.zeros(1, 1, len(positions), 128)
    x[..., :64] = 1.0  # (1, 0) in every pair: the result is (cos, sin)
    y = ops.apply_rotary_pos(x, positions, inv_freq).double()[0, 0]
    error = max((y[:, :64] - cos).abs().max().item(), (y[:, 64:] - sin).abs().max().item())
    assert error < 3e-7, error
    with pytest.raises(RuntimeError, match="positions must be within"):
        ops.apply_rotary_pos(x, positions + 1, inv_freq)
