"""Context parallelism (issue 46, part 3): a patched model trained with PyTorch's ``context_parallel`` on 2 gloo
ranks on CPU gives the unsplit run's loss and gradients, for every scaling method that can run so; the rest is
refused by name (``ropescale.hf.hooks``'s ``_check_context_parallel``; docs/DESIGN.md, "Context parallelism").

PyTorch's ring attention dispatches the CUDA SDPA kernels only; ``support.cpu_ring_attention`` gives CPU SDPA's
kernel the same handler, so PyTorch's own ring loop (key rotation, head-tail load balancing, log-sum-exp merge)
runs here with the CPU kernel at each step. The batch is split as users split it: ``context_parallel(mesh,
buffers=[input_ids, position_ids, shifted labels], buffer_seq_dims=[1, 1, 1])``, the loss summed over each rank's
tokens and all-reduced, the gradients all-reduced (what a data-parallel step does on top of the CP mesh).

One pair of spawned ranks runs every check (``support.two_ranks``); each test reads its check's outcome. With
``ROPESCALE_CP_DEVICE=cuda`` (scripts/gpu_check.sh) the ranks run on CUDA with NCCL and PyTorch's own CUDA ring
attention, one GPU each: it needs 2 GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("this torch is built without torch.distributed", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ropescale import hf, scaling, sharding  # noqa: E402
from support import methods, two_ranks  # noqa: E402
from support.tiny_lm import ids, tiny  # noqa: E402

WORLD, BATCH, LENGTH, ORIGINAL = two_ranks.WORLD, 2, 48, 16  # LENGTH: a multiple of 2 x WORLD (head-tail load balancing)
DEVICE = os.environ.get("ROPESCALE_CP_DEVICE", "cpu")
if DEVICE == "cuda" and torch.cuda.device_count() < WORLD:
    pytest.skip(f"context parallelism on CUDA needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}",
                allow_module_level=True)
if DEVICE == "cpu":
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules  # noqa: E402

    if not hasattr(_sharding_rules, "_single_dim_strategy_context"):  # CI's torch (2.14) has it
        pytest.skip(f"support/cpu_ring_attention.py is written against torch 2.14's context-parallel internals; "
                    f"torch {torch.__version__} has others", allow_module_level=True)
# float32 rounding: the ring merges per-rank partials by their log-sum-exp (another summation order)
LOSS_TOLERANCE = dict(rtol=2e-6, atol=0)
TOKEN_TOLERANCE = 1e-5  # nats, each token's loss
GRAD_TOLERANCE = 1e-5  # relative to each parameter's largest gradient
ERROR_FACTOR = 2.0  # the project's factor on PyTorch's own low-precision error


# ---------------------------------------------------------------------------------------------
# One training step, unsplit or context-parallel (run on each rank)


def _batch():
    input_ids = ids(BATCH, LENGTH).to(DEVICE)
    position_ids = torch.arange(LENGTH, device=DEVICE).expand(BATCH, -1).clone()
    # labels shifted over the WHOLE sequence before the split (a slice's last token predicts the next slice's first)
    labels = torch.cat([input_ids[:, 1:], torch.full((BATCH, 1), -100, device=DEVICE)], dim=1)
    return input_ids, position_ids, labels


def _step(model, input_ids, position_ids, labels, tokens, autocast=None, use_cache=None):
    """Summed token loss / ``tokens`` (the whole batch's count), backward; (loss, per-token losses, {name: grad})."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=autocast, enabled=autocast is not None):
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache).logits
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="none")
    loss = per_token.sum() / tokens
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return loss.detach(), per_token.detach().view(labels.shape), grads


def unsplit_step(model, autocast=None, position_ids=True, use_cache=None):
    """(loss, per-token losses [B, L], grads) of the whole batch."""
    input_ids, positions, labels = _batch()
    return _step(model, input_ids, positions if position_ids else None, labels, int((labels != -100).sum()), autocast,
                 use_cache)


def cp_step(model, mesh, autocast=None, position_ids=True, load_balance=True, reference=None, use_cache=None):
    """The same step under ``context_parallel``: each rank's slice, loss and gradients all-reduced; (loss, the
    largest per-token loss difference to ``reference`` (per-token losses of the whole batch, split with it), grads)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    input_ids, positions, labels = _batch()
    tokens = int((labels != -100).sum())
    reference = torch.zeros(labels.shape, device=DEVICE) if reference is None else reference.clone()
    buffers = [input_ids, positions, labels, reference]
    saved, _cp_options.enable_load_balance = _cp_options.enable_load_balance, load_balance
    try:
        with _ring(), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
            assert input_ids.shape[1] == LENGTH // WORLD
            loss, per_token, grads = _step(model, input_ids, positions if position_ids else None, labels, tokens,
                                           autocast, use_cache)
            token_error = (per_token - reference).abs().max()
    finally:
        _cp_options.enable_load_balance = saved
    dist.all_reduce(loss)
    dist.all_reduce(token_error, op=dist.ReduceOp.MAX)
    for grad in grads.values():
        dist.all_reduce(grad)
    return loss, float(token_error), grads


def _ring():
    """CPU: PyTorch's ring loop with the CPU kernel (support.cpu_ring_attention); CUDA: PyTorch's own."""
    import contextlib

    if DEVICE != "cpu":
        return contextlib.nullcontext()
    from support.cpu_ring_attention import cpu_ring_attention
    return cpu_ring_attention()


def model_for(method=None, **patch):
    model = tiny(mpe=ORIGINAL).to(DEVICE).train()
    return model if method is None and not patch else hf.patch(model, method, **patch)


def grad_error(grads, reference) -> float:
    return max(float((g - reference[n]).abs().max() / reference[n].abs().max().clamp_min(1e-30))
               for n, g in grads.items())


def assert_cp_equals_unsplit(mesh, model, **options):
    """The CP step equals the unsplit one; (per-token losses, (largest token error, largest gradient error))."""
    loss, per_token, grads = unsplit_step(model, use_cache=options.get("use_cache"))
    cp_loss, token_error, cp_grads = cp_step(model, mesh, reference=per_token, **options)
    torch.testing.assert_close(cp_loss, loss, **LOSS_TOLERANCE)
    assert token_error < TOKEN_TOLERANCE, token_error
    assert grad_error(cp_grads, grads) < GRAD_TOLERANCE, grad_error(cp_grads, grads)
    return per_token, (token_error, grad_error(cp_grads, grads))


def _method(cls, **fields):
    return methods.instance(cls, pairs=8, original=ORIGINAL, factor=4.0, **fields)


def _cp_refuses(mesh, model, error, *names, **options):
    try:
        cp_step(model, mesh, **options)
    except error as refused:
        missing = [name for name in names if name not in str(refused)]
        assert not missing, f"the refusal does not name {missing}: {refused}"
        return
    raise AssertionError(f"not refused under context parallelism (expected {error.__name__} naming {names})")


# ---------------------------------------------------------------------------------------------
# The checks


def check_every_method(mesh, rank):
    """Every registered method, plain and with Resonance: CP equals unsplit, or (a table that follows the length)
    it is refused by name. The patched loss differs from plain RoPE's (the scaling is in play at 3x the original
    length), so equality is not vacuous."""
    plain = unsplit_step(model_for())[1]
    ran = refused = 0
    worst = [0.0, 0.0, 0.0]  # token error, gradient error (CP vs unsplit); smallest change from plain RoPE
    worst[2] = float("inf")
    for name, cls in methods.registered().items():
        for resonance in (False, True):
            method = _method(cls, resonance=resonance)
            model = model_for(method)
            if method.length_dependent or method.per_request:
                _cp_refuses(mesh, model, NotImplementedError, cls.__name__, "context parallelism")
                refused += 1
                continue
            try:
                per_token, errors = assert_cp_equals_unsplit(mesh, model)
                worst[:2] = [max(a, b) for a, b in zip(worst, errors)]
            except AssertionError as error:
                raise AssertionError(f"{name} (resonance={resonance}): {error}") from error
            if cls is not scaling.Default:
                change = float((per_token - plain).abs().max())
                assert change > 1e-2, f"{name}: the method changes no token's loss by 1e-2 ({change})"
                worst[2] = min(worst[2], change)
            ran += 1
    assert ran >= 8 and refused >= 2, (ran, refused)
    return dict(ran=ran, refused=refused, token_error=worst[0], grad_error=worst[1], smallest_change=worst[2])


def check_per_request_refused(mesh, rank):
    for name, cls in methods.registered().items():
        if any(p.name == "per" for p in cls.parameters()):
            _cp_refuses(mesh, model_for(_method(cls, per="request")), NotImplementedError, cls.__name__, "per request")


def check_without_load_balancing(mesh, rank):
    """Contiguous slices (rank 0 the first half) instead of head-tail pairs."""
    for method in (_method(scaling.YaRN), _method(scaling.YaRN, resonance=True), _method(scaling.Llama3)):
        assert_cp_equals_unsplit(mesh, model_for(method), load_balance=False)


def check_without_cache(mesh, rank):
    """``use_cache=False`` (gradient checkpointing sets it): transformers then reads a rank's head-tail slice, whose
    positions jump (rank 0: the first and the last quarter), as two packed sequences; ropescale keeps it one."""
    for method in (_method(scaling.YaRN), _method(scaling.Llama3)):
        model = model_for(method)
        assert_cp_equals_unsplit(mesh, model, use_cache=False)
        model.gradient_checkpointing_enable()
        assert_cp_equals_unsplit(mesh, model)


def check_autocast(mesh, rank):
    """bf16 / fp16 autocast (as Trainer's bf16=True): the CP step's distance to its float32 unsplit step, loss and
    gradients, is within twice what transformers' own model (its own rope type, the same weights) makes under the
    same CP autocast step (the project's precision rule: the ring's per-step outputs are rounded to the low
    precision before their merge, which the unsplit step does not do, so that is the error to compare with)."""
    cases = [(_method(scaling.YaRN), _method(scaling.YaRN)), (_method(scaling.YaRN, resonance=True),
             _method(scaling.YaRN)), (_method(scaling.Llama3), _method(scaling.Llama3))]
    figures = []
    for method, native in cases:
        ours, own = model_for(method), tiny(mpe=ORIGINAL, rope_parameters=native.to_hf()).to(DEVICE).train()
        references = [unsplit_step(model) for model in (ours, own)]
        for dtype in (torch.bfloat16, torch.float16):
            # (largest per-token loss error, largest relative gradient error) against the model's float32 step
            (ours_token, ours_grad), (own_token, own_grad) = [
                (token_error, grad_error(grads, reference[2]))
                for (_, token_error, grads), reference in (
                    (cp_step(model, mesh, autocast=dtype, reference=reference[1]), reference)
                    for model, reference in zip((ours, own), references))]
            what = (type(method).__name__, method.resonance, dtype, (ours_token, ours_grad), (own_token, own_grad))
            assert ours_token <= ERROR_FACTOR * own_token, what
            assert ours_grad <= ERROR_FACTOR * own_grad, what
            figures.append(f"{type(method).__name__}{'+res' if method.resonance else ''} {dtype}: token "
                           f"{ours_token:.2e}/{own_token:.2e} grad {ours_grad:.2e}/{own_grad:.2e}")
    return figures


def check_refusals(mesh, rank):
    """What a slice would compute wrong, refused by name; outside the context nothing is refused."""
    yarn = _method(scaling.YaRN)
    _cp_refuses(mesh, model_for(yarn), ValueError, "position_ids", "context_parallel(", position_ids=False)
    _cp_refuses(mesh, model_for(yarn, attention="rerope", window=8), NotImplementedError, "ReRoPE",
                "context parallelism")
    _cp_refuses(mesh, model_for(yarn, attention="rerope", window=8, leaky_k=4.0), NotImplementedError, "ReRoPE")
    eager = model_for(yarn)
    eager.set_attn_implementation("eager")
    _cp_refuses(mesh, eager, NotImplementedError, "eager", "attn_implementation='sdpa'")
    assert not sharding.context_parallel_active()
    unsplit_step(model_for(yarn), position_ids=False)  # no context: transformers' own positions are right


def check_ring_ran(mesh, rank):
    """The CP step ran PyTorch's ring loop forward and backward (not each rank on its own keys), and the control:
    a slice attending to its own keys only is far off."""
    if DEVICE != "cpu":
        return
    from support import cpu_ring_attention as ring

    before = dict(ring.calls)
    model = model_for(_method(scaling.YaRN))
    assert_cp_equals_unsplit(mesh, model)
    layers = model.config.num_hidden_layers
    assert ring.calls[ring.FORWARD] - before[ring.FORWARD] == layers, ring.calls
    assert ring.calls[ring.BACKWARD] - before[ring.BACKWARD] == layers, ring.calls


def check_stock_hazard(mesh, rank):
    """Why the refusals: transformers' own YaRN under context parallelism WITHOUT position ids (each slice counted
    from 0) trains on a different loss, silently; given the position ids it is right, as ropescale's is. Its own
    dynamic type is wrong even with them."""
    model = tiny(mpe=ORIGINAL, rope_parameters=_method(scaling.YaRN).to_hf()).to(DEVICE).train()
    _, per_token, _ = unsplit_step(model)
    _, no_positions, _ = cp_step(model, mesh, position_ids=False, reference=per_token)
    assert no_positions > 0.1, no_positions
    assert_cp_equals_unsplit(mesh, model)
    # transformers' own dynamic type, given the position ids: each rank's slice takes the table of its own largest
    # position (head-tail: rank 0 holds the last quarter, rank 1 stops at 3/4 of the length), silently. (Its table
    # only grows: a model that ran the whole length first keeps that length's table, so each model is fresh.)
    dynamic = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    _, per_token, _ = unsplit_step(tiny(mpe=ORIGINAL, rope_parameters=dynamic).to(DEVICE).train())
    model = tiny(mpe=ORIGINAL, rope_parameters=dynamic).to(DEVICE).train()
    _, token_error, _ = cp_step(model, mesh, reference=per_token)
    assert token_error > 0.01, token_error
    return dict(yarn_without_position_ids=no_positions, dynamic_with_position_ids=token_error)


CHECKS = {f.__name__: f for f in (
    check_every_method, check_per_request_refused, check_without_load_balancing, check_without_cache, check_autocast,
    check_refusals,
    check_ring_ran, check_stock_hazard,
)}



@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return two_ranks.run(tmp_path_factory.mktemp("cp_ranks"), __name__, CHECKS, device=DEVICE, timeout=400)


@pytest.mark.parametrize("name", list(CHECKS))
def test_on_two_ranks(ranks, name):
    figures = two_ranks.assert_passed(ranks, name)
    if figures:
        print(name, figures)  # shown with pytest -s


def test_not_active_outside_context_parallel():
    """No context, no refusal: the check costs a dict lookup (torch.distributed.tensor imported or not)."""
    assert not sharding.context_parallel_active()
    model = model_for(_method(scaling.YaRN))
    input_ids, _, _ = _batch()
    model(input_ids=input_ids)
