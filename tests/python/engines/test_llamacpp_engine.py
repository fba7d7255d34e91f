"""llama.cpp itself runs what ``ropescale extend SRC.gguf DST.gguf`` writes (issue 45, part 2): its logits, past the
original length, against transformers + ropescale on the same weights.

The leg is opt-in: ROPESCALE_LLAMACPP=1 with llama-cpp-python installed. llama-cpp-python has no wheel for this
machine on PyPI and its source build (llama.cpp, CPU) takes minutes on 2 cores (README, "llama.cpp"), past what the
test command can add. Tiny llama GGUFs are made here from a transformers Llama with SmolLM2's vocabulary
(``support.gguf_llama``), float32 and Q8_0.
"""

import os

import numpy as np
import pytest
import torch

if os.environ.get("ROPESCALE_LLAMACPP") != "1":
    pytest.skip("opt-in (builds llama.cpp): ROPESCALE_LLAMACPP=1 with llama-cpp-python installed (README, llama.cpp)",
                allow_module_level=True)
llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

from ropescale import hf, llamacpp, realmodel  # noqa: E402
from support import gguf_llama  # noqa: E402

ORIGINAL = 64
LENGTH = 4 * ORIGINAL  # the must-hold's length: 4x the original
# plain Resonance RoPE is left out: at 4x it is too near the unscaled model for the test's control
METHODS = {name: method for name, method in gguf_llama.static_methods(ORIGINAL).items() if name != "resonance"}


def tiny_llama(seed=0):
    config = transformers.LlamaConfig(vocab_size=gguf_llama.VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than the init's, so that the rotation shows in the logits
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    return model


def llama_cpp_logits(path, tokens):
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens), n_batch=len(tokens), n_ubatch=len(tokens),
                          n_threads=2, logits_all=True, verbose=False, flash_attn=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(tokens)
    return torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llamacpp")
    model = tiny_llama()
    return model, gguf_llama.write(model, folder / "tiny-f32.gguf", realmodel.smollm2_gguf()), folder


@pytest.mark.parametrize("name", sorted(METHODS))
def test_llama_cpp_runs_the_written_table_as_transformers_and_ropescale_do(source, name):
    model, src, folder = source
    method = METHODS[name]
    dst = llamacpp.extend(src, folder / f"{name}.gguf", method).path
    tokens = torch.randint(3, gguf_llama.VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()
    got = llama_cpp_logits(dst, tokens)
    patched = hf.patch(tiny_llama(), method)
    with torch.no_grad():
        want = patched(torch.tensor([tokens])).logits[0]
    hf.unpatch(patched)
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error <= 1e-4, f"{name}: llama.cpp's logits are {error:.2e} (relative to the largest) from ropescale's"
    # the test can fail: the source GGUF (plain RoPE) is far from the method at this length
    unscaled = ((llama_cpp_logits(src, tokens) - want).abs().max() / want.abs().max()).item()
    print(f"{name}: llama.cpp vs transformers + ropescale {error:.2e}, the unscaled GGUF {unscaled:.2e}")
    assert unscaled > 100 * max(error, 1e-6), (name, unscaled, error)


@pytest.fixture(scope="module")
def quantized(source):
    model, _, folder = source
    path = gguf_llama.write(model, folder / "tiny-q8_0.gguf", realmodel.smollm2_gguf(), quantize=True)
    return gguf_llama.dequantized_like(tiny_llama(), path), path, folder


@pytest.mark.parametrize("name", ["yarn", "resonance_yarn", "llama3"])
def test_a_q8_0_gguf_is_as_close_as_llama_cpps_own_quantised_model(quantized, name):
    """Q8_0 weights (copied as they are): llama.cpp also quantises the activations of a Q8_0 product, so its logits
    differ from transformers on the dequantised weights by that error. The yardstick is llama.cpp's own: the
    unscaled Q8_0 model against transformers' plain RoPE on the same weights, at the same length."""
    dequantized, src, folder = quantized
    method = METHODS[name]
    dst = llamacpp.extend(src, folder / f"{name}-q8_0.gguf", method).path
    tokens = torch.randint(3, gguf_llama.VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        plain = dequantized(torch.tensor([tokens])).logits[0]
    native = ((llama_cpp_logits(src, tokens) - plain).abs().max() / plain.abs().max()).item()
    patched = hf.patch(dequantized, method)
    with torch.no_grad():
        want = patched(torch.tensor([tokens])).logits[0]
    hf.unpatch(patched)
    error = ((llama_cpp_logits(dst, tokens) - want).abs().max() / want.abs().max()).item()
    print(f"{name} Q8_0: llama.cpp vs transformers + ropescale {error:.2e}, llama.cpp's own Q8_0 error {native:.2e}")
    assert error <= 2 * native, (name, error, native)
