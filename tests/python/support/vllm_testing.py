"""What the vLLM test files share: the leg's import rule, the tiny Llama they serve, and the comparison of an
engine's outputs with transformers + ropescale's."""

import os

import pytest
import torch

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


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=HEAD, max_position_embeddings=ORIGINAL, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


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
