"""What the vLLM test files share: the leg's import rule, the tiny Llama they serve, and the comparison of an
engine's outputs with transformers + ropescale's (the engine runner: support/vllm_engine.py)."""

import contextlib
import os

import pytest
import torch

from support import tiny_lm

HEAD = 64  # vLLM's CPU attention takes head sizes 32, 64, 80, ...
ORIGINAL = 64  # the tiny models' "pre-training" length


def require_vllm() -> None:
    """Skips the calling test module without vLLM; on the vLLM leg of CI a missing vLLM is a failure."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true" and os.environ.get("ROPESCALE_VLLM_LEG") == "1":
            raise
        pytest.skip("vLLM is not installed: these tests run on the vLLM leg (scripts/test_torch_compat.sh)",
                    allow_module_level=True)


def served_llama(seed=0):
    """The tiny Llama the vLLM tests serve: head dim HEAD, 2 layers, 2 query heads on 1 KV head, trained length
    ORIGINAL, large enough initial weights that positions matter (transformers' default attention)."""
    return tiny_lm.tiny_llama(256, max_position=ORIGINAL, seed=seed, layers=2, hidden_size=128,
                              intermediate_size=256, num_key_value_heads=1, head_dim=HEAD, initializer_range=0.1,
                              tie_word_embeddings=False, attn_implementation=None)


def saved_llama(folder, method=None, *, max_position_embeddings=ORIGINAL, **rope):
    """:func:`served_llama` saved to ``folder``: with ``method`` written by ``hf.patch`` (a checkpoint ropescale
    wrote), or a plain config with the rope parameters ``rope`` (a model ropescale did not write)."""
    from ropescale import hf

    model = served_llama()
    if method is not None:
        hf.patch(model, method)
    else:
        model.config.rope_parameters = {"rope_theta": 10000.0, **rope}
        model.config.max_position_embeddings = max_position_embeddings
    model.save_pretrained(folder)
    return folder


def assert_same(served, expected, what, atol=1e-5):
    """Per request: the same greedy tokens, and prompt logprobs within ``atol`` (float32 logits: 1e-5, plus
    float32's relative rounding on large logprobs); the generated tokens' logprobs too where both sides have them
    (``logprobs``). A served request without prompt logprobs (one that read vLLM's prefix cache, which vLLM skips
    for requests asking for them) is held to its tokens and generated logprobs."""
    assert len(served) == len(expected), what
    for i, (got, want) in enumerate(zip(served, expected)):
        assert got["tokens"] == want["tokens"], f"{what}, request {i}"
        pairs = []
        if got["prompt_logprobs"] is not None:
            assert got["prompt_logprobs"][0] is None
            pairs.append(("prompt", got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]))
        else:
            assert "logprobs" in got and "logprobs" in want, f"{what}, request {i}: no logprobs to compare"
        if "logprobs" in got and "logprobs" in want:
            pairs.append(("generated", got["logprobs"], want["logprobs"]))
        for name, got_lp, want_lp in pairs:
            got_lp = torch.tensor(got_lp, dtype=torch.float64)
            want_lp = torch.tensor(want_lp, dtype=torch.float64)
            torch.testing.assert_close(got_lp, want_lp, atol=atol, rtol=1e-6, msg=(
                f"{what}, request {i}, {name} logprobs: max |diff| {(got_lp - want_lp).abs().max():.2e}"))


def transformers_request(model, prompt: list[int], new_tokens: int) -> dict:
    """One request as vLLM's engine runner reports it (support/vllm_engine.py), computed by transformers alone: the
    greedy tokens, the prompt logprobs (one forward over the prompt) and the generated tokens' logprobs."""
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: exactly new_tokens tokens
    x = torch.tensor([prompt])
    with torch.no_grad():
        logprobs = model(x).logits[0].double().log_softmax(-1)
        generated = model.generate(x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
                                   return_dict_in_generate=True)
    tokens = generated.sequences[0, len(prompt):]
    return {"tokens": tokens.tolist(),
            "prompt_logprobs": [None] + logprobs[:-1].gather(-1, x[0, 1:, None])[:, 0].tolist(),
            "logprobs": [step[0].double().log_softmax(-1)[t].item() for step, t in zip(generated.logits, tokens)]}


def tiny_qwen2(seed=0, **config_fields):
    """A tiny Qwen2 shaped as :func:`served_llama` (head dim HEAD), its q/k/v biases drawn (Qwen2's start at zero:
    made to count), with ``config_fields`` added to its config (e.g. Qwen's dual_chunk_attention_config)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=ORIGINAL, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False, **config_fields)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    return model


@contextlib.contextmanager
def plugin_isolated():
    """A default engine config for the no-engine tests; vLLM's backend overrides and the plugin's recorded plan
    restored after."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    from ropescale.vllm import attention_plan

    saved = dict(_ATTN_OVERRIDES)
    attention_plan.RECORDED_PLAN.clear()
    try:
        with set_current_vllm_config(VllmConfig()):
            yield
    finally:
        _ATTN_OVERRIDES.clear()
        _ATTN_OVERRIDES.update(saved)
        attention_plan.RECORDED_PLAN.clear()


def request_block_hasher(monkeypatch):
    """vLLM's block hasher of 16-token blocks with the plugin's hash key installed (twice: idempotent), the engine
    state it reads cleared for the test."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from ropescale.vllm import attention, attention_prefix_cache

    assert attention.install_block_hash_key() and attention.install_block_hash_key()
    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    monkeypatch.setattr(attention_prefix_cache, "ENGINE", {})
    return kv_cache_utils.get_request_block_hasher(16, hash_fn)
