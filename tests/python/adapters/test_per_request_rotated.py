"""Issue 43: a ``per="request"`` method with plain attention is served ROTATED AT WRITE in transformers.

A request keeps one table for its whole life (its planned length's: prompt + the tokens it may generate), so its
keys need no raw form: the patched rotary module returns each row's cos/sin of its own table and attention factor,
the model's own attention (sdpa, eager, flex_attention, ...) rotates q and k with them, and the model's own cache
(DynamicCache, StaticCache, sliding-window layers) keeps the rotated keys. So each row of a batch equals the static
``YaRN(factor=s)`` model of its scale ``s = (P + N) / L`` (a row that fits L: the native model), a compiled decode
step reads only tensors (no graph break), and the families whose layers the raw-key path refused (gpt-oss's sinks,
sliding-window layers) take it. Raw-key methods (per-step dynamic, ReRoPE, Self-Extend, DCA) keep the pre-RoPE path.
Tolerance 1e-5 on float32 logits (the rotation is bit-equal to the static model's; attention over a padded batch
rounds differently from a solo run)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CompileConfig, DynamicCache, StaticCache  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

from ropescale import hf, scaling  # noqa: E402
from ropescale.hf.cache import PreRopeLayer  # noqa: E402
from ropescale.tiny_models import ORIGINAL, build  # noqa: E402
from support.tiny_lm import ids, tiny  # noqa: E402
from support.training import loss_and_grads  # noqa: E402

warnings.filterwarnings("ignore", message=".*rope.*")
warnings.filterwarnings("ignore", message=".*maximum length.*")
pytestmark = pytest.mark.usefixtures("one_thread")

L = 64  # the tiny Llama's trained length
NEW = 24
TOL = dict(rtol=1e-5, atol=1e-5)
PER_REQUEST = scaling.DynamicYaRN(original_max_position=L, per="request")


def static_equivalent(planned: int, original: int = L) -> scaling.RopeScaling | None:
    """The static method of a request planned at ``planned`` tokens (None: the native model)."""
    return None if planned <= original else scaling.YaRN(factor=planned / original, original_max_position=original)


def llama(method=None, layers=2, implementation="sdpa"):
    model = tiny(mpe=L, layers=layers)
    model.set_attn_implementation(implementation)
    model.generation_config.eos_token_id = None
    return hf.patch(model, method) if method is not None else model


def generate(model, x, new=NEW, mask=None, **kwargs):
    """(logits [B, new, V], sequences, cache) of a greedy generate call (no mask: every token is one, including the
    prompt's 0s, which transformers would otherwise take for padding)."""
    mask = torch.ones_like(x) if mask is None else mask
    out = model.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    return torch.stack(out.logits, 1), out.sequences, out.past_key_values


def left_padded(prompts):
    """A left-padded batch of the prompts and its attention mask."""
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, prompt in enumerate(prompts):
        batch[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    return batch, mask


def prompts():
    x = ids(3, 216, seed=5)
    # planned lengths 12 + 24 = 36 (fits L: native), 104 + 24 = 128 (s = 2), 216 + 24 = 240 (s = 3.75)
    return [x[0, :12], x[1, :104], x[2]]


def test_each_batched_row_is_the_static_yarn_of_its_scale_through_the_models_own_cache():
    """(a) A left-padded batch of a short prompt (native) and two long ones: each row's generate logits equal the
    static YaRN(s) model of its scale run alone (the native model for the short one); (b) through the model's own
    DynamicCache (no raw-key layer), and a StaticCache gives the same."""
    model = llama(PER_REQUEST)
    state = model._ropescale_patch
    assert state.rotated_at_write and not state.pre_rope
    batch, mask = left_padded(prompts())
    with torch.no_grad():
        batched, tokens, cache = generate(model, batch, mask=mask)
        assert type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)
        assert not any(isinstance(layer, PreRopeLayer) for layer in cache.layers)
        for row, prompt in enumerate(prompts()):
            reference = llama(static_equivalent(len(prompt) + NEW))
            solo, solo_tokens, _ = generate(reference, prompt[None])
            torch.testing.assert_close(batched[row], solo[0], **TOL, msg=lambda m: f"row {row}: {m}")
            assert torch.equal(tokens[row, batch.shape[1]:], solo_tokens[0, len(prompt):])
        static, static_tokens, static_cache = generate(model, batch, mask=mask, cache_implementation="static")
    assert isinstance(static_cache, StaticCache)
    assert torch.equal(static_tokens, tokens)
    torch.testing.assert_close(static, batched, **TOL)
    # the test can fail: the long rows are not the native model's
    with torch.no_grad():
        native, _, _ = generate(llama(), batch, mask=mask)
    assert (native[1:] - batched[1:]).abs().max() > 1e-3
    torch.testing.assert_close(native[0], batched[0], **TOL)


def test_a_manual_loop_through_a_static_cache_is_the_static_model_and_refuses_a_step_past_its_plan():
    model, reference = llama(PER_REQUEST), llama(static_equivalent(100 + 6))
    x = ids(1, 106, seed=7)
    with torch.no_grad():
        full = reference(x).logits
        cache = StaticCache(config=model.config, max_cache_len=120)
        with hf.request(model, max_new_tokens=6):
            out = model(x[:, :100], past_key_values=cache, use_cache=True)
            torch.testing.assert_close(out.logits, full[:, :100], **TOL)
            for t in range(100, 106):
                step = model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, 0]
                torch.testing.assert_close(step, full[:, t], **TOL)
            with pytest.raises(ValueError, match="row 0 is now at length 107, past its planned 106"):
                model(x[:, :1], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[106]]))


@pytest.mark.parametrize("implementation", ("sdpa", "eager", "flex_attention"))
def test_every_attention_implementation_serves_the_rotated_keys(implementation):
    """(c) The model's own attention implementation, unchanged: a left-padded prompt forward of a request (each row
    at its planned length) equals the static YaRN(s) model of each row's scale; a generate call too (eager, sdpa:
    torch's CPU inductor cannot compile flex_attention's decode kernel, the unpatched model fails there too)."""
    model = llama(PER_REQUEST, implementation=implementation)
    short, long_ = ids(2, 100, seed=3)
    batch, mask = left_padded([short[:60], long_])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), hf.request(model, max_new_tokens=20):
        got = model(batch, attention_mask=mask, position_ids=positions).logits
    for row, planned in ((0, 60 + 20), (1, 100 + 20)):
        reference = llama(static_equivalent(planned), implementation=implementation)
        with torch.no_grad():
            want = reference(batch, attention_mask=mask, position_ids=positions).logits
        tokens = slice(batch.shape[1] - (planned - 20), None)  # the row's own (not padding)
        torch.testing.assert_close(got[row, tokens], want[row, tokens], **TOL)
    if implementation == "flex_attention":
        return
    with torch.no_grad():
        batched, _, _ = generate(model, batch, 8, mask)
        for row, prompt in enumerate((short[:60], long_)):
            solo, _, _ = generate(llama(static_equivalent(len(prompt) + 8), implementation=implementation),
                                  prompt[None], 8)
            torch.testing.assert_close(batched[row], solo[0], **TOL)


def test_a_compiled_static_cache_generate_equals_eager():
    """(d) generate with a StaticCache, its decode steps compiled by torch.compile as transformers compiles them
    (CompileConfig: inductor, mode reduce-overhead; fullgraph=True, so a graph break in a decode step fails): the
    tokens and logits of eager. Then the whole forward compiled by the user (its prompt forward breaks the graph
    where the request's tables are fixed): equal too."""
    torch._dynamo.reset()
    model = llama(PER_REQUEST, layers=1)
    batch, mask = left_padded([ids(1, 40, seed=2)[0], ids(1, 90, seed=3)[0]])
    try:
        with torch.no_grad():
            want, tokens, _ = generate(model, batch, 8, mask, cache_implementation="static")
            config = CompileConfig(fullgraph=True)
            config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
            got, compiled_tokens, _ = generate(model, batch, 8, mask, cache_implementation="static",
                                               compile_config=config)
            assert torch.equal(compiled_tokens, tokens)
            torch.testing.assert_close(got, want, **TOL)
            model.forward = torch.compile(model.forward, backend="eager")
            got, compiled_tokens, _ = generate(model, batch, 8, mask, cache_implementation="static")
            assert torch.equal(compiled_tokens, tokens)
            torch.testing.assert_close(got, want, **TOL)
    finally:
        torch._dynamo.reset()


# Families the raw-key path refused per-request, and Gemma 3 (its sliding layers keep their own rope): the family's
# tiny model, with what makes the case (a sliding window on every Mistral layer).
FAMILIES = {"gpt-oss": {}, "Gemma 3": {}, "Mistral": dict(sliding_window=8)}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_families_with_sinks_and_sliding_windows_equal_the_static_yarn_of_each_rows_scale(name):
    """(e) Each row of a left-padded batch (a request that fits the original length, and a long one) equals the
    static YaRN(s) model of its scale (of that family, patched by ropescale; the short row: the native model) on the
    same batch, at every step of generate."""
    def family(method=None):
        model = build(name, **FAMILIES[name])
        model.generation_config.eos_token_id = None
        return hf.patch(model, method) if method is not None else model

    new = 8
    x = ids(2, 36, seed=4)
    batch, mask = left_padded([x[0, :6], x[1]])  # planned 14 (<= 16: native) and 44 (s = 2.75)
    with torch.no_grad():
        got, _, cache = generate(family(scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")),
                                 batch, new, mask)
        assert not any(isinstance(layer, PreRopeLayer) for layer in cache.layers)
        for row, planned in ((0, 6 + new), (1, 36 + new)):
            want, _, _ = generate(family(static_equivalent(planned, ORIGINAL)), batch, new, mask)
            torch.testing.assert_close(got[row], want[row], **TOL, msg=lambda m: f"{name} row {row}: {m}")
        native, _, _ = generate(family(), batch, new, mask)
    assert (native[1] - got[1]).abs().max() > 1e-3  # the test can fail: the long row is scaled


def test_a_family_whose_layers_cannot_take_a_request_scale_is_refused_by_name():
    config_method = scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")
    model = build("DeepSeek-V3", config_method.to_hf())
    with pytest.raises(ValueError, match=r"per-request methods .* cannot patch DeepSeek-V3: .*softmax scale"):
        hf.patch(model)
    assert not hf.is_patched(model)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
def test_training_under_autocast_runs_through_the_models_own_attention(dtype):
    """(f) A training forward (no cache: the sequence is the request) under CPU autocast: finite loss and gradients,
    and the same step as the static YaRN(s) model of its length (s = 100 / 64) under the same autocast."""
    model, reference = llama(PER_REQUEST), llama(static_equivalent(100))
    model.train(), reference.train()
    x = ids(2, 100, seed=6)
    logprobs, grads = loss_and_grads(model, x, dtype)
    want_logprobs, want_grads = loss_and_grads(reference, x, dtype)
    assert torch.isfinite(logprobs).all() and torch.isfinite(grads).all()
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=0)
    torch.testing.assert_close(grads, want_grads, rtol=0, atol=0)


def test_raw_key_methods_keep_the_pre_rope_path():
    """A per-step dynamic method, and a per-request one under ReRoPE, still cache raw keys."""
    for method, kwargs in ((scaling.DynamicYaRN(original_max_position=L), {}),
                           (PER_REQUEST, dict(attention="rerope", window=8))):
        model = hf.patch(llama(), method, **kwargs)
        assert model._ropescale_patch.pre_rope and not model._ropescale_patch.rotated_at_write
        with torch.no_grad():
            _, _, cache = generate(model, ids(1, 20), 2)
        assert any(isinstance(layer, PreRopeLayer) for layer in cache.layers)


def test_a_request_within_the_trained_length_is_the_native_model_bit_for_bit_at_long_positions():
    """A row planned within the trained length takes the model's OWN cos/sin, not ropescale's default table: at
    positions in the thousands transformers' float32 angles are up to 2.4e-4 rad from ropescale's double-precision
    ones (SmolLM2 moved 2.6e-4 nats in vLLM), and the promise is the native model, bit for bit. Long rows of the
    same batch keep ropescale's YaRN(s) table."""
    trained = 8192
    native = tiny(mpe=trained, layers=2).eval()
    patched = hf.patch(tiny(mpe=trained, layers=2).eval(),
                       scaling.DynamicYaRN(original_max_position=trained, per="request"))
    x = ids(2, 12, seed=4)
    positions = torch.stack([torch.arange(6000, 6012), torch.arange(9000, 9012)])
    with torch.no_grad():
        want = native(x[:1], position_ids=positions[:1]).logits
        with hf.request(patched, max_new_tokens=4):  # row 0 planned at 6016 <= 8192: native; row 1 at 9016
            got = patched(x, position_ids=positions).logits
        yarn = hf.patch(tiny(mpe=trained, layers=2).eval(),
                        scaling.YaRN(factor=9016 / trained, original_max_position=trained))
        long_row = yarn(x[1:], position_ids=positions[1:]).logits
    assert torch.equal(got[:1], want)
    torch.testing.assert_close(got[1:], long_row, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Issue 55: a conversation's next turn, a generate call continuing the previous one's cache


def forwarded_tokens(model):
    """The number of tokens each forward of ``model`` embeds (a list that fills as it runs)."""
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    return seen


def two_turns(first, new_prompt):
    """A 1-row conversation: the first turn's prompt (``first`` tokens) and the second turn's new prompt tokens
    (``new_prompt``), which follow the first turn's generated ones."""
    x = ids(1, 300, seed=11)
    return x[:, :first], x[:, 200:200 + new_prompt]


def test_a_turn_continuing_a_cache_of_another_table_is_prefilled_again_under_its_plan():
    """Turn 1 (40 + 8 tokens: within L, the native table) leaves native keys in the cache; turn 2 continues it to
    120 + 8 tokens (s = 2). Its cached keys, and the first turn's values and later layers' keys (computed under the
    native table), are not the request's: generate drops them and prefills the whole conversation under s = 2, so
    the turn equals the same request without a cache and the static YaRN(2) model (issue 55: 0.1-0.25 from both)."""
    model = llama(PER_REQUEST)
    prompt, more = two_turns(40, 72)
    seen = forwarded_tokens(model)
    with torch.no_grad():
        _, first, cache = generate(model, prompt, 8)
        turn = torch.cat([first, more], 1)  # 48 + 72 = 120
        seen.clear()
        got, tokens, continued = generate(model, turn, 8, past_key_values=cache)
        # the first forward (its new tokens) refused before any layer ran, then the whole conversation, in place
        assert seen[:2] == [73, 120] and continued is cache and cache.get_seq_length() == 127
        fresh, fresh_tokens, _ = generate(model, turn, 8)
        static, _, _ = generate(llama(static_equivalent(128)), turn, 8)
    assert torch.equal(tokens, fresh_tokens)
    torch.testing.assert_close(got, fresh, **TOL)
    torch.testing.assert_close(got, static, **TOL)


@pytest.mark.parametrize("method, first, new_prompt", [
    (PER_REQUEST, 12, 20),  # planned 20 then 48: both within L, the native table
    (scaling.DynamicYaRN(factor=2.0, original_max_position=L, per="request"), 40, 72),  # 48 and 128: s = 2 both
], ids=("native", "floor"))
def test_a_turn_whose_table_is_the_caches_continues_it(method, first, new_prompt):
    """Where each row's table is the one its cached keys were written with, the cache is continued as it is (only
    the new tokens are forwarded) and the turn equals the request without a cache."""
    model = llama(method)
    prompt, more = two_turns(first, new_prompt)
    seen = forwarded_tokens(model)
    with torch.no_grad():
        _, tokens, cache = generate(model, prompt, 8)
        turn = torch.cat([tokens, more], 1)
        seen.clear()
        got, _, _ = generate(model, turn, 8, past_key_values=cache)
        assert seen[0] == new_prompt + 1  # not prefilled again: the last generated token and the new ones
        fresh, _, _ = generate(model, turn, 8)
    torch.testing.assert_close(got, fresh, **TOL)


def test_a_continuation_that_cannot_be_prefilled_again_is_refused_by_name():
    """Nothing continues a cache under another table silently: generate given only the new tokens (transformers
    takes them with the whole conversation's mask), a manual forward in hf.request, a cache the patched model did
    not write. Each refusal leaves the cache as it was; generate over the latter prefills again."""
    model = llama(PER_REQUEST)
    prompt, more = two_turns(40, 72)
    with torch.no_grad():
        _, first, cache = generate(model, prompt, 8)
        turn = torch.cat([first, more], 1)
        with pytest.raises(ValueError, match=r"planned at 128 tokens\) continues a cache of 47 tokens written by a "
                                             r"request planned at 48.*hold 73 tokens"):
            model.generate(turn[:, 47:], attention_mask=torch.ones_like(turn), past_key_values=cache,
                           max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert cache.get_seq_length() == 47
        with hf.request(model, max_new_tokens=8), pytest.raises(ValueError, match="Pass the whole conversation"):
            model(turn[:, 47:], past_key_values=cache, position_ids=torch.arange(47, 120)[None])
        assert cache.get_seq_length() == 47
        # outside a request the cache's request goes on, to its plan and no further
        with pytest.raises(ValueError, match="past its planned 48"):
            model(turn[:, 47:49], past_key_values=cache, position_ids=torch.arange(47, 49)[None])
        foreign = DynamicCache(config=model.config)
        llama()(prompt, past_key_values=foreign, use_cache=True)  # the unpatched model's keys
        with pytest.raises(ValueError, match="not written by this patched model's requests"):
            model(turn[:, 40:41], past_key_values=foreign, position_ids=torch.tensor([[40]]))
        got, _, _ = generate(model, turn, 8, past_key_values=foreign)
        fresh, _, _ = generate(model, turn, 8)
    torch.testing.assert_close(got, fresh, **TOL)


def test_a_chunked_prefill_is_refused_by_name():
    """generate's prefill_chunk_size: the request's first forward would see the first chunk only and plan a shorter
    request (0.37 from the whole prefill on this model, silently, before issue 55's fix): refused."""
    model = llama(PER_REQUEST)
    with torch.no_grad(), pytest.raises(ValueError, match="first chunk only.*without prefill_chunk_size"):
        generate(model, ids(1, 100, seed=3), 8, prefill_chunk_size=32)
