"""One fine-tuning step of a patched model under mixed precision (issue 26.1): what HF Trainer's
``bf16=True``/``fp16=True`` and accelerate do, ``torch.autocast`` with float32 weights, so q/k leave
the projections in half precision while the rotary tables (computed from float32 hidden states)
stay float32. For every patch kind (every scaling method ropescale has, with and without Resonance,
static ones on the fused rotation, dynamic ones pre-RoPE; ReRoPE, Leaky ReRoPE and log-n) a tiny
Llama built from its config takes one step (forward + ``loss.backward()``) under autocast bf16 and
fp16: no error, a finite gradient on every parameter, and loss and gradients as close to the same
model's float32 step as an UNPATCHED stock model's autocast step is to its own float32 step (the
project's rule: low precision is judged relative to PyTorch's own error on the same inputs).

The step runs in a MODE (``MODES``): eager, transformers' gradient checkpointing (every kind), and
torch.compile (one kind per attention path: ``_COMPILED_KINDS``); the stock model's deviation is
measured in the same mode."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from ropescale import hf, scaling  # noqa: E402
from support import methods  # noqa: E402
from support.tiny_lm import tiny_llama  # noqa: E402

# Tiny models run several times faster on one intra-op thread (conftest's one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LAYERS, HEAD_DIM, ORIGINAL, BATCH, LENGTH = 97, 2, 16, 16, 2, 48
DTYPES = [torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# The project's factor on PyTorch's own error (tests/python/ops/test_rotary.py judges the kernels so).
ERROR_FACTOR = 2.0


# ---------------------------------------------------------------------------------------------
# The patch kinds: every method of scaling.METHODS (the library's own registry), plain and with
# Resonance; ReRoPE's attention variants on the plain table. A method takes its settings from the
# names of its fields, sized for the tiny model: 8 rotary pairs, an original length of 16 that the
# 48-token sequences pass by more than the factor (so both dynamic tables rescale, to 3x, and
# LongRoPE takes its long factors).

# hf.patch's attention side for ReRoPE (window below the length: near and far keys both occur).
_REROPE_VARIANTS = {
    "rerope": dict(window=8),
    "leaky_rerope": dict(window=8, leaky_k=4.0),
    "rerope_logn": dict(window=8, logn_length=ORIGINAL),
}


@dataclasses.dataclass(frozen=True)
class PatchKind:
    id: str
    method: scaling.RopeScaling
    attention: dict  # hf.patch's keyword arguments

    @property
    def path(self) -> str:
        """Which attention path the patch takes: the fused rotation (static; a per-request method's too: its keys
        are rotated when written, each row with its table), pre-RoPE, or ReRoPE."""
        if self.attention.get("attention") == "rerope":
            return "rerope"
        return "pre_rope" if self.method.dynamic and not self.method.per_request else "static"


def _method(cls: type[scaling.RopeScaling], **fields) -> scaling.RopeScaling:
    return methods.instance(cls, pairs=HEAD_DIM // 2, original=ORIGINAL, factor=2.0, **fields)


def _patch_kinds() -> list[PatchKind]:
    kinds = []
    for name, cls in methods.registered().items():
        for resonance in (False, True):
            kinds.append(PatchKind(f"{'resonance_' if resonance else ''}{name}", _method(cls, resonance=resonance),
                                   {"attention": "sdpa"}))
        if any(p.name == "per" for p in cls.parameters()):  # a dynamic method's scale held per request
            kinds.append(PatchKind(f"{name}_per_request", _method(cls, per="request"), {"attention": "sdpa"}))
    for name, settings in _REROPE_VARIANTS.items():
        kinds.append(PatchKind(name, scaling.Default(), {"attention": "rerope", **settings}))
    return kinds


PATCH_KINDS = _patch_kinds()


def test_the_kinds_cover_every_method_and_path():
    """The list is derived, not written: every registered method is in it, on each path it has."""
    assert {type(k.method) for k in PATCH_KINDS} >= set(scaling.METHODS.values())
    assert {k.path for k in PATCH_KINDS} == {"static", "pre_rope", "rerope"}
    assert any(k.method.resonance and isinstance(k.method, scaling.YaRN) and k.path == "static" for k in PATCH_KINDS)


# ---------------------------------------------------------------------------------------------
# Modes: how the step runs the model. Each takes the model and returns what to call.

def _checkpointed(model: torch.nn.Module) -> Callable:
    # transformers' own switch (what Trainer's gradient_checkpointing=True calls): every decoder layer's
    # forward, the patched attention included, runs again during backward.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _compiled(model: torch.nn.Module) -> Callable:
    # torch.compile as a fine-tuning script calls it (fullgraph=False: a length-dependent table breaks the
    # graph, see hf.patch). aot_eager traces forward and backward through dynamo and AOTAutograd, where
    # custom ops and autograd functions break; inductor's code generation adds nothing ropescale owns and
    # costs ~10x the time on this 2-core CI.
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager")


MODES: dict[str, Callable[[torch.nn.Module], Callable]] = {
    "eager": lambda model: model,
    "checkpointing": _checkpointed,
    "compile": _compiled,
}
# torch.compile per kind and dtype costs seconds; the kinds it runs for: one per attention path (static
# fused rotation, pre-RoPE, ReRoPE), with Resonance on the static one. The kinds share their code path with
# the others of their path: only the table differs.
_COMPILED_KINDS = {"resonance_yarn", "dynamic_yarn", "leaky_rerope"}


# ---------------------------------------------------------------------------------------------
# The step and its comparison.


def _model(device: str, kind: PatchKind | None) -> torch.nn.Module:
    """The tiny Llama (GQA, SDPA attention, float32 weights) in training mode, patched with ``kind``
    (None: stock transformers). Every model has the same weights."""
    model = tiny_llama(VOCAB, max_position=4 * ORIGINAL, layers=LAYERS, hidden_size=64, intermediate_size=96,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       attn_implementation="sdpa")
    with torch.no_grad():  # sharper attention than the default init, so the rotation matters
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    if kind is not None:
        hf.patch(model, kind.method, **kind.attention)
    return model.to(device).train()


@dataclasses.dataclass
class Step:
    losses: torch.Tensor  # per token, float32
    grads: dict[str, torch.Tensor]


def _step(model, mode: str, device: str, dtype: torch.dtype | None) -> Step:
    """One training step: forward and loss under autocast (``dtype`` None: float32), backward."""
    run = MODES[mode](model)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1)).to(device)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = run(ids).logits
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(),
                                                   reduction="none")
    losses.mean().backward()
    return Step(losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None})


@dataclasses.dataclass
class Deviation:
    """How far a mixed-precision step is from the float32 step of the same model."""

    loss: float  # max over tokens of |loss - loss_fp32|
    grads: dict[str, float]  # per parameter, ||g - g_fp32|| / ||g_fp32||


def _deviation(low: Step, full: Step) -> Deviation:
    grads = {n: ((g.double() - full.grads[n].double()).norm() / full.grads[n].double().norm()).item()
             for n, g in low.grads.items()}
    return Deviation((low.losses.double() - full.losses.double()).abs().max().item(), grads)


_STOCK: dict[tuple, Deviation] = {}


def _stock_deviation(mode: str, device: str, dtype: torch.dtype) -> Deviation:
    """PyTorch's own error: the unpatched model's autocast step against its float32 step (once per
    mode, device and dtype)."""
    key = (mode, device, dtype)
    if key not in _STOCK:
        model = _model(device, None)
        _STOCK[key] = _deviation(_step(model, mode, device, dtype), _step(model, mode, device, None))
    return _STOCK[key]


def _kind_modes():
    """(kind, mode, dtype): every kind in eager and checkpointing mode under both dtypes; the compiled kinds
    compiled under bf16 autocast (slow: each compile costs 15-35 s on CI's 2 cores; the fp16 graph is the same
    trace with another dtype)."""
    for kind in PATCH_KINDS:
        for mode in sorted(MODES):
            if mode == "compile" and kind.id not in _COMPILED_KINDS:
                continue
            for dtype in DTYPES:
                if mode == "compile" and dtype != torch.bfloat16:
                    continue
                yield pytest.param(kind, mode, dtype, marks=[pytest.mark.slow] if mode == "compile" else [],
                                   id=f"{kind.id}-{mode}-{str(dtype).split('.')[-1]}")


def test_every_compiled_kind_exists():
    assert _COMPILED_KINDS <= {k.id for k in PATCH_KINDS}
    assert {k.path for k in PATCH_KINDS if k.id in _COMPILED_KINDS} == {"static", "pre_rope", "rerope"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, mode, dtype", _kind_modes())
def test_autocast_training_step(kind, mode, dtype, device):
    model = _model(device, kind)
    mixed = _step(model, mode, device, dtype)  # before the fix: "cos and sin must have the dtype of q"
    full = _step(model, mode, device, None)

    every = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(mixed.grads) == set(full.grads) == every, "a parameter got no gradient"
    for name, g in mixed.grads.items():
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), f"{name}: non-finite gradient"
    assert torch.isfinite(mixed.losses).all()

    ours, stock = _deviation(mixed, full), _stock_deviation(mode, device, dtype)
    report = (f"{kind.id} {dtype} {mode} {device}: loss {ours.loss:.2e} (stock {stock.loss:.2e}); worst grad "
              f"ratio {max(ours.grads[n] / stock.grads[n] for n in ours.grads):.2f}")
    print(report)
    assert ours.loss <= ERROR_FACTOR * stock.loss, report
    for name, error in ours.grads.items():
        assert error <= ERROR_FACTOR * stock.grads[name], (
            f"{report}\n{name}: relative gradient error {error:.2e}, stock model {stock.grads[name]:.2e}")
