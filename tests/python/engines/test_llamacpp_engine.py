"""llama.cpp itself runs what ``ropescale extend SRC.gguf DST.gguf`` writes (issue 45, part 2): its logits, past the
original length, against transformers + ropescale on the same weights.

The leg is opt-in: ROPESCALE_LLAMACPP=1 with llama-cpp-python installed. llama-cpp-python has no wheel for this
machine on PyPI and its source build (llama.cpp, CPU) takes minutes on 2 cores (docs/engines/llamacpp.md), past what the
test command can add. Tiny llama GGUFs are made here from a transformers Llama with SmolLM2's vocabulary
(``support.gguf_llama``), float32 and Q8_0.
"""

import os

import numpy as np
import pytest
import torch

if os.environ.get("ROPESCALE_LLAMACPP") != "1":
    pytest.skip("opt-in (builds llama.cpp): ROPESCALE_LLAMACPP=1 with llama-cpp-python installed (docs, llama.cpp)",
                allow_module_level=True)
llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")

from ropescale import hf, llamacpp, realmodel, scaling  # noqa: E402
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


# ``ropescale verify --engine llama.cpp`` (issue 45, part 3): the GGUFs extend writes pass, and so does llama.cpp's own
# YaRN from the GGUF keys; a key llama.cpp does not read for llama (yarn_beta_slow) and an attn_factor another tool
# rewrote are named. Heads of 64 features (32 pairs): the tiny model's 8 pairs rotate YaRN's betas alike.

def wide_model(family: str):
    """A tiny ``family`` ("Llama", "Qwen2") causal LM with heads of 64 features, SmolLM2's vocabulary, seed 0."""
    config = getattr(transformers, f"{family}Config")(
        vocab_size=gguf_llama.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


@pytest.fixture(scope="module")
def wide_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llamacpp-verify")
    model = wide_model("Llama")
    return gguf_llama.write(model, folder / "wide.gguf", realmodel.smollm2_gguf()), folder, model


def _yarn_keys(**extra):
    import gguf

    kinds = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.UINT32}
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": ORIGINAL,
            "context_length": LENGTH, **extra}
    return {f"llama.{k}": (v, kinds[type(v)]) for k, v in keys.items()}


@pytest.mark.parametrize("case", ["extended", "native_yarn", "beta_slow_unread", "attn_factor_rewritten"])
def test_verify_passes_what_llama_cpp_applies_and_names_what_it_does_not(wide_source, case):
    from ropescale import verify

    src, folder, _ = wide_source
    path = folder / f"{case}.gguf"
    reader, _ = llamacpp.read_rope(src)
    if case == "extended":
        llamacpp.extend(src, path, METHODS["yarn"])
    elif case == "native_yarn":
        llamacpp.rewrite(reader, path, _yarn_keys())
    elif case == "beta_slow_unread":
        llamacpp.rewrite(reader, path, _yarn_keys(**{"rope.scaling.yarn_beta_slow": 2.0}))
    else:  # ropescale's record says YaRN's 1.139; the key llama.cpp reads now says 1
        extended = llamacpp.extend(src, folder / "to-rewrite.gguf", METHODS["yarn"]).path
        attn_factor = {k: v for k, v in _yarn_keys(**{"rope.scaling.attn_factor": 1.0}).items()
                       if k.endswith("attn_factor")}
        llamacpp.rewrite(llamacpp.read_rope(extended)[0], path, attn_factor)
    report = verify.verify(path, "llama.cpp")
    print(report.text())
    served, scaled = report.checks
    assert served.verdict == "exact", report.text()
    if case in ("extended", "native_yarn"):
        assert scaled.verdict == "exact" and report.exit_code == 0, report.text()
    else:
        assert scaled.verdict == "different" and report.exit_code == 1, report.text()
        named = {"beta_slow_unread": "beta_slow 1.0 in the engine, 2.0 declared",
                 "attn_factor_rewritten": "attention factor 1.0 in the engine"}[case]
        assert named in scaled.detail and "; or," not in scaled.detail, scaled.detail


# original 256: llama.cpp rounds its context size up to a multiple of 256, so a shorter original has no short side
SWITCH = 256
TWO_TABLES = scaling.LongRoPE(short_factor=(1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.0, 2.0),
                              long_factor=(1.0, 1.5, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0), original_max_position=SWITCH,
                              factor=4.0)


def test_a_longrope_with_two_tables_runs_as_transformers_on_either_side_of_the_original_length(source):
    """``rope.scaling.type = longrope``: llama.cpp picks the table by its context size (rounded up to a multiple of
    256). With a context past the original length and a prompt past it (long table), and with a context of the
    original length (short table), its logits are transformers + ropescale's. KNOWN DIFFERENCE, pinned: a short prompt in a long context gets the long
    table in llama.cpp, the short one in transformers."""
    model, src, folder = source
    dst = llamacpp.extend(src, folder / "longrope-two.gguf", TWO_TABLES).path
    patched = hf.patch(tiny_llama(), TWO_TABLES)
    gen = torch.Generator().manual_seed(4)
    for length in (4 * SWITCH, SWITCH):
        tokens = torch.randint(3, gguf_llama.VOCAB, (length,), generator=gen).tolist()
        with torch.no_grad():
            want = patched(torch.tensor([tokens])).logits[0]
        error = ((llama_cpp_logits(dst, tokens) - want).abs().max() / want.abs().max()).item()
        print(f"two-table LongRoPE, {length} tokens: {error:.2e}")
        assert error <= 1e-4, (length, error)
    short = tokens[: SWITCH // 2]
    llm = llama_cpp.Llama(model_path=str(dst), n_ctx=4 * SWITCH, n_batch=SWITCH, logits_all=True, verbose=False,
                          flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(short)
    got = torch.from_numpy(np.array(llm.scores[: len(short)], dtype=np.float32))
    with torch.no_grad():
        want = patched(torch.tensor([short])).logits[0]
    hf.unpatch(patched)
    assert ((got - want).abs().max() / want.abs().max()).item() > 1e-3  # the long table, not transformers' short


def _shifted_error(path, tokens, delta=10):
    """llama.cpp's context shift (``llama_memory_seq_add``: the cached keys re-rotated by ``delta`` positions) and
    one more token, against a fresh run of the same tokens: relative positions are unchanged, so an exact shift
    gives the same logits."""
    def llm():
        return llama_cpp.Llama(model_path=str(path), n_ctx=len(tokens) + delta + 1, n_batch=len(tokens) + 1,
                               logits_all=True, verbose=False, flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32,
                               type_v=llama_cpp.GGML_TYPE_F32)
    fresh = llm()
    fresh.eval(tokens)
    want = torch.tensor(fresh.scores[len(tokens) - 1], dtype=torch.float64)
    shifted = llm()
    shifted.eval(tokens[:-1])
    llama_cpp.llama_memory_seq_add(llama_cpp.llama_get_memory(shifted.ctx), 0, 0, -1, delta)
    shifted.n_tokens = len(tokens) - 1 + delta
    shifted.eval(tokens[-1:])
    got = torch.tensor(shifted.scores[len(tokens) - 1 + delta], dtype=torch.float64)
    return ((got - want).abs().max() / want.abs().max()).item()


def test_llama_cpps_context_shift_applies_the_attention_factor_again(source):
    """KNOWN, pinned (docs, llama.cpp): llama.cpp's context shift re-rotates the cached keys with the attention factor on cos
    and sin (``llama_kv_cache::build_rope_shift`` passes ``yarn_attn_factor``), so every shift multiplies them by it
    once more. A method with factor 1 (linear) shifts exactly; YaRN does not, in ropescale's GGUF and in llama.cpp's
    own ``rope.scaling.type = yarn`` alike."""
    import gguf

    model, src, folder = source
    tokens = torch.randint(3, gguf_llama.VOCAB, (2 * ORIGINAL,), generator=torch.Generator().manual_seed(5)).tolist()
    linear = llamacpp.extend(src, folder / "shift-linear.gguf", METHODS["linear"]).path
    yarn = llamacpp.extend(src, folder / "shift-yarn.gguf", METHODS["yarn"]).path
    native_yarn = llamacpp.rewrite(llamacpp.read_rope(src)[0], folder / "shift-native-yarn.gguf", {
        "llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32),
        "llama.rope.scaling.original_context_length": (ORIGINAL, gguf.GGUFValueType.UINT32)})
    errors = {name: _shifted_error(path, tokens) for name, path in
              (("plain", src), ("linear", linear), ("yarn", yarn), ("native_yarn", native_yarn))}
    print("context shift of 10 positions, relative logit error:", errors)
    assert errors["plain"] < 1e-5 and errors["linear"] < 1e-5, errors
    assert errors["yarn"] > 1e-2 and errors["native_yarn"] > 1e-2, errors
    assert abs(errors["yarn"] - errors["native_yarn"]) < 0.1 * errors["yarn"], errors  # llama.cpp's, not the file's


@pytest.mark.parametrize("case", ["yarn_beta_slow", "resonance_yarn"])
def test_verify_holds_a_converted_gguf_to_the_directory_it_was_made_from(wide_source, case):
    """A GGUF another tool made from a directory ropescale extended (llama.cpp's convert_hf_to_gguf.py writes the
    rope keys it knows: a YaRN's type, factor, original length and betas, nothing of Resonance): ``--declared-by``
    holds llama.cpp to the directory's declaration, and names what the conversion lost."""
    from ropescale import verify

    src, folder, model = wide_source
    method = {"yarn_beta_slow": scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, beta_slow=2.0),
              "resonance_yarn": scaling.YaRN(factor=4.0, original_max_position=ORIGINAL, resonance=True)}[case]
    directory = folder / f"dir-{case}"
    hf.patch(model, method)
    model.save_pretrained(directory)
    hf.unpatch(model)
    keys = _yarn_keys(**({"rope.scaling.yarn_beta_slow": 2.0} if case == "yarn_beta_slow" else {}))
    converted = llamacpp.rewrite(llamacpp.read_rope(src)[0], folder / f"converted-{case}.gguf", keys)
    report = verify.verify(converted, "llama.cpp", declared_by=directory)
    print(report.text())
    served, scaled = report.checks
    assert served.verdict == "exact" and scaled.verdict == "different", report.text()
    named = {"yarn_beta_slow": "beta_slow 1.0 in the engine, 2.0 declared",
             "resonance_yarn": "Resonance's rounding lost"}[case]
    assert named in scaled.detail, scaled.detail
    assert directory.name in report.declared


def test_a_transformers_directory_through_llama_cpps_converter_runs_as_transformers(wide_source, tmp_path):
    """``ropescale extend DIR DST.gguf``: llama.cpp's own converter writes the unscaled model (weights and tokenizer),
    then the method goes in; llama.cpp's logits at 4x equal transformers + ropescale on the directory."""
    try:
        llamacpp.find_converter()
    except ValueError as err:
        pytest.skip(str(err))  # scripts/test_llamacpp.sh provides it (the llama-cpp-python sdist's copy)
    _, _, model = wide_source
    directory = tmp_path / "llama"
    model.save_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(realmodel.smollm2_gguf().parent,
                                                           gguf_file=realmodel.smollm2_gguf().name)
    tokenizer.save_pretrained(directory)
    method = METHODS["yarn"]
    dst = llamacpp.from_transformers(directory, tmp_path / "llama-yarn.gguf", method, outtype="f32").path
    tokens = torch.randint(3, gguf_llama.VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(6)).tolist()
    patched = hf.patch(transformers.AutoModelForCausalLM.from_pretrained(directory).eval(), method)
    with torch.no_grad():
        want = patched(torch.tensor([tokens])).logits[0]
    error = ((llama_cpp_logits(dst, tokens) - want).abs().max() / want.abs().max()).item()
    print(f"converted directory, YaRN at {LENGTH}: {error:.2e}")
    assert error <= 1e-4, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "llama-yarn.gguf"]


@pytest.fixture(scope="module")
def qwen_source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llamacpp-qwen")
    model = wide_model("Qwen2")
    with torch.no_grad():  # Qwen2's biases start at zero: made to count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.1)
    return model, gguf_llama.write(model, folder / "qwen2.gguf", realmodel.smollm2_gguf()), folder


@pytest.mark.parametrize("name", ["yarn", "linear"])
def test_qwen_runs_llama_cpps_own_types_as_transformers_and_ropescale_do(qwen_source, name):
    """llama.cpp's qwen2 has no rope_freqs: extend writes its own type, and llama.cpp's logits at 4x are
    transformers + ropescale's; `verify` passes it."""
    from ropescale import verify

    model, src, folder = qwen_source
    method = METHODS[name]
    dst = llamacpp.extend(src, folder / f"qwen2-{name}.gguf", method).path
    tokens = torch.randint(3, gguf_llama.VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(7)).tolist()
    hf.patch(model, method)
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    hf.unpatch(model)
    error = ((llama_cpp_logits(dst, tokens) - want).abs().max() / want.abs().max()).item()
    unscaled = ((llama_cpp_logits(src, tokens) - want).abs().max() / want.abs().max()).item()
    print(f"qwen2 {name}: llama.cpp vs transformers + ropescale {error:.2e}, the unscaled GGUF {unscaled:.2e}")
    assert error <= 1e-4 and unscaled > 100 * max(error, 1e-6), (error, unscaled)
    report = verify.verify(dst, "llama.cpp")
    assert [c.verdict for c in report.checks] == ["exact", "exact"], report.text()


# The conformance matrix's llama.cpp columns (issue 57): llama.cpp's converter on the publisher's checkpoint, and
# `ropescale extend DIR DST.gguf`, each a verify run against real llama.cpp.

def test_the_matrixs_llama_cpp_columns_find_what_llama_cpp_drops_and_ropescales_gguf_is_exact(tmp_path):
    from ropescale import matrix

    if not all(matrix.installed(c) for c in matrix.COLUMNS if c.gguf):
        pytest.skip("llama.cpp's converter is not found: LLAMA_CPP_CONVERTER (scripts/test_llamacpp.sh sets it)")
    rows = [r for r in matrix.ROWS if r.key in ("factor", "attention_factor", "partial_rotary_factor",
                                                "short_factor, long_factor")]
    columns = [c for c in matrix.COLUMNS if c.gguf]
    matrix.run(tmp_path / "results.jsonl", tmp_path / "work", rows, columns)
    cells = matrix.load(tmp_path / "results.jsonl")
    said = {(row.key, column.name): matrix.judged(cells, row, column) for row in rows for column in columns}
    assert said[("factor", "llama.cpp")] == said[("factor", "llama.cpp + ropescale")] == ("exact", False)
    # llama.cpp's converter writes yarn_attn_factor, which llama.cpp never reads: YaRN's own 0.1 ln s + 1, silently
    text, silent = said[("attention_factor", "llama.cpp")]
    assert silent and text.startswith("different: attention_factor=None"), text
    assert said[("attention_factor", "llama.cpp + ropescale")] == ("exact", False)
    # GLM-4's llama.cpp model has no rope_freqs: llama.cpp's own yarn, from its converter or from ropescale alike
    assert said[("partial_rotary_factor", "llama.cpp")] == said[("partial_rotary_factor", "llama.cpp + ropescale")] \
        == ("exact", False)
    text, silent = said[("short_factor, long_factor", "llama.cpp + ropescale")]  # Phi-3: no GGUF ropescale writes
    assert not silent and text.startswith("refused by ropescale: architecture ['Phi3ForCausalLM']"), text
