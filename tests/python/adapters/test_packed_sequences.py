"""Position ids that jump (issue 46, part 1), in a training forward (no attention mask, no cache): transformers
reads every place where consecutive positions differ by other than 1 as the start of another packed sequence
(``masking_utils.find_packed_sequence_indices``). ``ropescale.hf.hooks``'s ``_check_position_jumps``:

- packed rows (each sequence from 0): every static method gives each sequence what it gives alone, forward and
  backward, in float32 and under autocast; raw-key attentions and length-following tables are refused by name;
- sampled rows (PoSE/CREAM skips: positions that jump forward): one sequence, as the samplers mean, where stock
  transformers cuts the row at the skip (shown here: the second chunk then sees nothing of the first), with and
  without gradient checkpointing (which turns the cache off, so transformers' packing applies);
- rows that do both: refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from ropescale import hf, scaling  # noqa: E402
from support import methods  # noqa: E402
from support.tiny_lm import ids, tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ORIGINAL = 16
LENGTHS = (21, 13, 17)  # packed into one row; two pass the original length, one does not
ERROR_FACTOR = 2.0  # the project's factor on PyTorch's own low-precision error


def _method(cls, **fields):
    return methods.instance(cls, pairs=8, original=ORIGINAL, factor=4.0, **fields)


def _static_methods():
    cases = []
    for name, cls in methods.registered().items():
        for resonance in (False, True):
            method = _method(cls, resonance=resonance)
            if not (method.length_dependent or method.per_request):
                cases.append(pytest.param(method, id=f"{'resonance_' if resonance else ''}{name}"))
    return cases


def _packed():
    tokens = ids(1, sum(LENGTHS))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return tokens, positions


def _separately(model, tokens, autocast=None):
    """Each packed sequence run alone: logits [1, sum(LENGTHS), V]."""
    outs, start = [], 0
    for n in LENGTHS:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            outs.append(model(input_ids=tokens[:, start:start + n], use_cache=False).logits.float())
        start += n
    return torch.cat(outs, dim=1)


def _packed_logits(model, autocast=None):
    tokens, positions = _packed()
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        return model(input_ids=tokens, position_ids=positions, use_cache=False).logits.float()


@pytest.mark.parametrize("method", _static_methods())
def test_packed_rows_give_each_sequence_what_it_gives_alone(method):
    model = hf.patch(tiny(mpe=ORIGINAL).train(), method)
    tokens, _ = _packed()
    with torch.no_grad():
        torch.testing.assert_close(_packed_logits(model), _separately(model, tokens), rtol=0, atol=2e-5)


def _segment_loss(logits, tokens):
    """Next-token loss within each packed sequence (no prediction across a boundary)."""
    losses, start = [], 0
    for n in LENGTHS:
        seq = slice(start, start + n)
        losses.append(F.cross_entropy(logits[0, seq][:-1], tokens[0, seq][1:], reduction="sum"))
        start += n
    return sum(losses)


def test_packed_rows_gradients_equal_separate_sequences():
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.YaRN, resonance=True))
    tokens, _ = _packed()
    grads = []
    for packed in (True, False):
        model.zero_grad(set_to_none=True)
        logits = _packed_logits(model) if packed else _separately(model, tokens)
        _segment_loss(logits, tokens).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_rows_under_autocast_as_close_as_transformers_own(dtype):
    """Packed under autocast against the float32 sequences run alone: within twice what transformers' own YaRN
    model (the same weights) makes so."""
    yarn = _method(scaling.YaRN)
    tokens, _ = _packed()
    errors = []
    for model in (hf.patch(tiny(mpe=ORIGINAL).train(), yarn), tiny(mpe=ORIGINAL, rope_parameters=yarn.to_hf()).train()):
        with torch.no_grad():
            errors.append(float((_packed_logits(model, dtype) - _separately(model, tokens)).abs().max()))
    assert errors[0] <= ERROR_FACTOR * errors[1], errors


@pytest.mark.parametrize("patch", [
    dict(attention="rerope", window=4), dict(attention="rerope", window=4, leaky_k=2.0),
    dict(attention="self_extend", window=4, group=2)], ids=["rerope", "leaky_rerope", "self_extend"])
def test_packed_rows_refused_for_raw_key_attentions(patch):
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.YaRN), **patch)
    with pytest.raises(NotImplementedError, match="packed sequences.*reads padding from the attention mask"):
        _packed_logits(model)
    tokens, _ = _packed()
    _separately(model, tokens)  # a row each: fine


def test_packed_rows_refused_for_tables_that_follow_the_length():
    cases = [_method(cls) for cls in methods.registered(dynamic=True).values()]
    cases += [_method(cls, per="request") for cls in methods.registered().values()
              if any(p.name == "per" for p in cls.parameters())]
    longrope = methods.registered().get("longrope")
    if longrope is not None:
        cases.append(_method(longrope))  # two tables: length-dependent
    assert len(cases) >= 3
    for method in cases:
        assert method.length_dependent or method.per_request
        model = hf.patch(tiny(mpe=ORIGINAL).train(), method)
        with pytest.raises(NotImplementedError, match=f"{type(method).__name__} on packed sequences"):
            _packed_logits(model)


# ---------------------------------------------------------------------------------------------
# Sampled positions (PoSE: two chunks, one skip)

SAMPLED = torch.cat([torch.arange(10), torch.arange(40, 54)])[None]  # 24 tokens, positions to 53


def _sampled_logits(model, mask):
    tokens = ids(1, SAMPLED.shape[1])
    kwargs = dict(attention_mask=torch.ones_like(tokens)) if mask else {}
    return model(input_ids=tokens, position_ids=SAMPLED, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
@pytest.mark.parametrize("patch", [dict(), dict(attention="rerope", window=8)], ids=["yarn", "yarn_rerope"])
def test_sampled_positions_are_one_sequence(patch, checkpointing):
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.YaRN), **patch)
    if checkpointing:
        model.gradient_checkpointing_enable()
    ours, with_mask = _sampled_logits(model, mask=False), _sampled_logits(model, mask=True)
    torch.testing.assert_close(ours, with_mask, rtol=0, atol=0)
    ours.float().sum().backward()  # trains


def test_stock_transformers_cuts_sampled_positions_at_the_skip():
    """Why: transformers' own YaRN model, the same forward, gives the second chunk what it gives alone (the first
    chunk unseen), far from the one sequence the sampler meant."""
    yarn = _method(scaling.YaRN)
    stock = tiny(mpe=ORIGINAL, rope_parameters=yarn.to_hf()).train()
    with torch.no_grad():
        cut, whole = _sampled_logits(stock, mask=False), _sampled_logits(stock, mask=True)
        tokens = ids(1, SAMPLED.shape[1])
        second = stock(input_ids=tokens[:, 10:], position_ids=SAMPLED[:, 10:], use_cache=False).logits
        ours = _sampled_logits(hf.patch(tiny(mpe=ORIGINAL).train(), yarn), mask=False)
    torch.testing.assert_close(cut[:, 10:], second, rtol=0, atol=1e-5)
    assert float((cut - whole).abs().max()) > 0.1
    torch.testing.assert_close(ours, whole, rtol=0, atol=1e-5)


def test_rows_that_jump_and_restart_are_refused():
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.YaRN))
    positions = torch.cat([torch.arange(5), torch.arange(20, 25), torch.arange(6)])[None]
    with pytest.raises(ValueError, match="both jump forward.*and restart"):
        model(input_ids=ids(1, 16), position_ids=positions, use_cache=False)


def test_with_a_mask_or_a_cache_nothing_is_read():
    """transformers packs only without both; ropescale then leaves the forward alone (no refusal)."""
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.DynamicNTK))
    tokens, positions = _packed()
    model(input_ids=tokens, position_ids=positions, attention_mask=torch.ones_like(tokens), use_cache=False)
    model(input_ids=tokens, position_ids=positions, use_cache=True)


def test_sampled_positions_with_inputs_embeds_are_one_sequence():
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.YaRN))
    embeds = model.get_input_embeddings()(ids(1, SAMPLED.shape[1]))
    with torch.no_grad():
        ours = model(inputs_embeds=embeds, position_ids=SAMPLED, use_cache=False).logits
        masked = model(inputs_embeds=embeds, position_ids=SAMPLED, use_cache=False,
                       attention_mask=torch.ones(SAMPLED.shape, dtype=torch.long)).logits
    torch.testing.assert_close(ours, masked, rtol=0, atol=0)


def test_sampled_positions_reach_sdpa_without_a_mask(monkeypatch):
    """What a fused CUDA kernel takes: the all-ones mask ropescale passes is dropped by transformers, SDPA runs
    ``is_causal`` without an L x L mask (a packed row's mask, the alternative, is dense)."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((attn_mask is None, is_causal, q.shape[-1] % 8 == 0))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = hf.patch(tiny(mpe=ORIGINAL).train(), _method(scaling.YaRN))
    _sampled_logits(model, mask=False)
    assert seen and all(s == (True, True, True) for s in seen), seen
