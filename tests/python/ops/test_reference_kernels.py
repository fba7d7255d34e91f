"""ROPESCALE_KERNELS=reference: every kernel op routed to its plain-PyTorch implementation
(ropescale/reference.py), visible in build_info(), with the native ops' results and errors; an
unknown value refused at import. (The core suite also runs whole under the switch in CI.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ropescale
from ropescale import ops
from ropescale.reference import ROUTED_OPS

PACKAGE_PARENT = str(Path(ropescale.__file__).parents[1])
RUNNING_REFERENCE = ropescale.build_info()["kernels"] == "reference"


def python(code: str, *args: str, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env, "PYTHONPATH": PACKAGE_PARENT}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=environment, timeout=300)


def test_build_info_names_the_kernels_in_use():
    assert ropescale.build_info()["kernels"] == ("reference" if RUNNING_REFERENCE else "native")
    for name in ROUTED_OPS:
        dump = torch._C._dispatch_dump(f"ropescale::{name}")
        cpu = next(line for line in dump.splitlines() if line.startswith("CPU:"))
        assert ("reference.py" in cpu) == RUNNING_REFERENCE, cpu


def test_an_unknown_value_is_refused_at_import():
    value = "fast"
    result = python("import ropescale", ROPESCALE_KERNELS=value)
    assert result.returncode != 0
    assert (f"ImportError: ROPESCALE_KERNELS='{value}' is not a kernel choice: use ROPESCALE_KERNELS=native "
            "(the default, the compiled kernels) or ROPESCALE_KERNELS=reference") in result.stderr


def _cases():
    """(name, call) pairs over every routed op: fp32/fp16/bf16, GQA, partial rotary, interleaved
    pairs, conjugate, strided operands, ReRoPE prefill with padding and decode."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = torch.randn(2, 13, 4, 40, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(2, 2, 13, 40, generator=gen).to(dtype)
        cos, sin = ((torch.rand(2, 13, 32, generator=gen) * 2 - 1).to(dtype) for _ in range(2))
        half_cos, half_sin = cos[:1, :, :16].contiguous(), sin[:1, :, :16].contiguous()
        positions = torch.randint(0, 1 << 20, (2, 13), generator=gen)
        inv_freq = ops.default_inv_freq(32, 1e4)

        def in_place(fn, *tensors):
            copies = [t.clone() for t in tensors]
            fn(*copies)
            return copies

        yield f"apply_rotary {dtype}", lambda: [ops.apply_rotary(q, cos, sin)]
        yield f"apply_rotary_ {dtype}", lambda: in_place(
            lambda x: ops.apply_rotary_(x, half_cos, half_sin, True, half_width=True, conjugate=True), q)
        yield f"apply_rotary_qk {dtype}", lambda: list(ops.apply_rotary_qk(q, k, cos, sin, conjugate=True))
        yield f"apply_rotary_qk_ {dtype}", lambda: in_place(
            lambda a, b: ops.apply_rotary_qk_(a, b, half_cos, half_sin, half_width=True), q, k)
        yield f"apply_rotary_pos {dtype}", lambda: [ops.apply_rotary_pos(q, positions, inv_freq, 1.2, True)]
        yield f"apply_rotary_pos_ {dtype}", lambda: in_place(
            lambda x: ops.apply_rotary_pos_(x, positions[0].int(), inv_freq, conjugate=True), q)
        yield f"apply_rotary_pos_qk {dtype}", lambda: list(ops.apply_rotary_pos_qk(q, k, positions, inv_freq, 0.8))
        # an engine's packed tokens [T, H, D], a table and factor per request
        packed_q, packed_k = q[0].transpose(0, 1), k[1].transpose(0, 1)
        request_index = torch.tensor([0] * 5 + [2] * 6 + [1] * 2, dtype=torch.int32)
        tables = torch.stack([inv_freq, inv_freq / 2.5, inv_freq / 7.0])
        factors = torch.tensor([1.0, 1.09, 1.19])
        yield f"apply_rotary_per_request {dtype}", lambda: list(ops.apply_rotary_per_request(
            packed_q, packed_k, positions[0], request_index, tables, factors, True))
        yield f"apply_rotary_per_request_ {dtype}", lambda: in_place(
            lambda a, b: ops.apply_rotary_per_request_(a, b, positions[1], request_index.long(), tables, factors),
            packed_q, packed_k)
        yield f"apply_rotary_pos_qk_ {dtype}", lambda: in_place(
            lambda a, b: ops.apply_rotary_pos_qk_(a, b, positions, inv_freq, 1.0, True), q, k)

        # q and k as disjoint slices of one buffer (a fused qkv projection): rotated in place.
        qkv = torch.randn(1, 6, 13, 40, generator=gen).to(dtype)

        def fused_qkv_in_place():
            buffer = qkv.clone()
            ops.apply_rotary_pos_qk_(buffer[:, :4], buffer[:, 4:], positions[:1], inv_freq, 1.0)
            return [buffer]

        yield f"apply_rotary_pos_qk_ on one qkv buffer {dtype}", fused_qkv_in_place

        qa = torch.randn(2, 4, 50, 32, generator=gen).to(dtype)
        ka, va = (torch.randn(2, 2, 50, 32, generator=gen).to(dtype) for _ in range(2))
        kp = torch.arange(50).repeat(2, 1)
        kp[1, :7] = -1
        yield f"rerope_attention prefill {dtype}", lambda: list(
            ops.rerope_attention(qa, ka, va, kp, kp, inv_freq[:12], 9, logn_length=20))
        yield f"rerope_attention decode {dtype}", lambda: list(
            ops.rerope_attention(qa[:, :, -1:], ka, va, kp[:, -1:], kp, inv_freq, 16, 8.0, interleaved=True))

        if dtype != torch.float32:  # float32 tables with half operands (autocast's), full and half width
            cos32, sin32 = (torch.rand(2, 13, 32, generator=gen) * 2 - 1 for _ in range(2))
            half32 = (cos32[:1, :, :16].contiguous(), sin32[:1, :, :16].contiguous())
            yield f"apply_rotary_qk float32 tables {dtype}", lambda: list(ops.apply_rotary_qk(q, k, cos32, sin32))
            yield f"apply_rotary_ float32 tables {dtype}", lambda: in_place(
                lambda x: ops.apply_rotary_(x, *half32, True, half_width=True, conjugate=True), q)


_ERRORS = """
x, cos = torch.randn(2, 3, 5, 8), torch.randn(2, 5, 8)
R = torch.ops.ropescale
zeros = torch.zeros(2, 5, dtype=torch.long)
calls = [
    lambda: R.apply_rotary(x[0], cos, cos),
    lambda: R.apply_rotary_pos(x, torch.arange(5).float(), ops.default_inv_freq(8, 1e4)),
    lambda: R.apply_rotary(x, cos.to("meta"), cos.to("meta")),
    lambda: R.apply_rotary_qk_(x, x, cos, cos),
    lambda: R.apply_rotary_(torch.randn(2, 1, 5, 8).expand(2, 3, 5, 8), cos, cos),
    lambda: ops.apply_rotary_(x.clone().requires_grad_(), cos, cos),
    lambda: ops.rerope_attention(x, x[:, :2], x[:, :2], zeros, zeros, ops.default_inv_freq(8, 1e4), 0),
    lambda: ops.rerope_attention(x, x, x, zeros, zeros, ops.default_inv_freq(8, 1e4).to("meta"), 2),
]
errors = []
for call in calls:
    try:
        call()
        errors.append("no error")
    except Exception as error:
        errors.append(type(error).__name__ + ": " + str(error).splitlines()[0])
"""

# Under ROPESCALE_KERNELS=reference, in one process: the results of _cases, the errors of _ERRORS,
# gradcheck through the registered autograd, opcheck.
_REFERENCE_RUN = """
import sys, torch, ropescale
from ropescale import ops
sys.path.insert(0, sys.argv[2])
from test_reference_kernels import _ERRORS, _cases
assert ropescale.build_info()["kernels"] == "reference"
results = {name: call() for name, call in _cases()}
exec(_ERRORS)
q = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
cos, sin = torch.randn(1, 5, 6, dtype=torch.float64), torch.randn(1, 5, 6, dtype=torch.float64)
positions, inv_freq = torch.tensor([[3, 70, 900, 5, 123456]]), ops.default_inv_freq(6, 1e4)
assert torch.autograd.gradcheck(lambda x: ops.apply_rotary(x, cos, sin), (q,))
assert torch.autograd.gradcheck(lambda x: ops.apply_rotary_pos_qk(x, x, positions, inv_freq, 1.3)[1], (q,))
x = torch.randn(2, 3, 5, 8)
for name, args in [("apply_rotary", (x, cos.float(), sin.float())),
                   ("apply_rotary_pos_qk_", (x.clone(), x.clone(), positions, inv_freq)),
                   ("rerope_attention", (x, x[:, :1], x[:, :1], positions.repeat(2, 1), positions.repeat(2, 1),
                                         inv_freq, 4))]:
    torch.library.opcheck(getattr(torch.ops.ropescale, name).default, args)
torch.save({"results": results, "errors": errors}, sys.argv[1])
"""


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run.pt"
    result = python(_REFERENCE_RUN, str(out), os.path.dirname(__file__), ROPESCALE_KERNELS="reference")
    assert result.returncode == 0, result.stderr
    return torch.load(out)


@pytest.mark.skipif(RUNNING_REFERENCE, reason="this process runs the reference kernels too (ROPESCALE_KERNELS="
                                               "reference): no native results to compare with")
def test_reference_kernels_give_the_native_results(reference_run):
    for name, call in _cases():
        for native, routed in zip(call(), reference_run["results"][name]):
            assert routed.dtype == native.dtype and routed.shape == native.shape, name
            assert routed.stride() == native.stride(), name
            finite = torch.isfinite(native)
            assert torch.equal(finite, torch.isfinite(routed)), name
            # The same math, rounded to the dtype at the end: a rounding step or two apart (FMA or not).
            # Attention: the native bf16/fp16 kernels also round the rotated q/k and the probabilities
            # to the dtype (as SDPA), the reference computes in float32: a few roundings of the inputs'
            # dtype apart, in out and lse alike.
            dtype = name.split()[-1]
            eps = torch.finfo(getattr(torch, dtype.removeprefix("torch."))).eps
            tolerance = (2 if name.startswith("apply_rotary") else 8) * eps * max(1.0, native[finite].abs().max().item())
            error = (routed[finite].double() - native[finite].double()).abs().max().item()
            assert error <= tolerance, f"{name}: {error:.3g} > {tolerance:.3g}"


@pytest.mark.skipif(RUNNING_REFERENCE, reason="this process runs the reference kernels too: no native errors to "
                                               "compare with")
def test_bad_input_gives_the_native_errors(reference_run):
    scope = {"torch": torch, "ops": ops}
    exec(_ERRORS, scope)
    assert not any(line == "no error" for line in scope["errors"]), scope["errors"]
    assert reference_run["errors"] == scope["errors"]
