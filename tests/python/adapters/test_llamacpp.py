"""ropescale.llamacpp: a GGUF carrying a ropescale table as llama.cpp reads it (issue 45, part 1).

Here: the written file against llama.cpp's own arithmetic (its float32 frequency chain and the division by
rope_freqs, as ``ggml_rope_cache_init`` does it), everything else in the file byte for byte, and the refusals.
llama.cpp itself running the file is the llama-cpp-python leg's (engines/test_llamacpp_engine.py). A transformers
directory goes through llama.cpp's converter (``from_transformers``): here a stand-in converter that writes a known
GGUF, so that the glue (the refusals, the unscaled intermediate, what is left behind) is tested without llama.cpp.
"""

import json
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ropescale import llamacpp, scaling  # noqa: E402
from support import gguf_llama  # noqa: E402

BASE, ROT, CONTEXT = 10000.0, 16, 64


def tiny_gguf(path, arch="llama", *, rope_freqs=False, scaling_type=None, alignment=None):
    """A one-layer model's GGUF: float32 and Q8_0 tensors, the keys llama.cpp reads for a llama."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(ROT)
    writer.add_rope_freq_base(BASE)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    if scaling_type is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling_type))
        writer.add_rope_scaling_factor(4.0)
    if alignment is not None:
        writer.add_uint32("general.alignment", alignment)
        writer.data_alignment = alignment
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((50, 32)).astype(np.float32))
    q = rng.standard_normal((32, 32)).astype(np.float32)
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    if rope_freqs:
        writer.add_tensor(llamacpp.ROPE_FREQS, np.ones(ROT // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


STATIC = gguf_llama.static_methods(CONTEXT)
POSITIONS = (1, 7, 63, 255, 1000, 4095)


def llama_cpp_error(table, rope_freqs):
    """The largest relative difference between llama.cpp's frequencies under ``rope_freqs`` and ``table``, over
    POSITIONS."""
    return max(float(np.max(np.abs(llamacpp.effective_inv_freq(BASE, ROT, rope_freqs, p) - table) / table))
               for p in POSITIONS)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_llama_cpps_frequencies_are_the_table_to_its_own_rounding(tmp_path, name):
    method = STATIC[name]
    src = tiny_gguf(tmp_path / "src.gguf")
    written = llamacpp.extend(src, tmp_path / "dst.gguf", method)
    reader, rope = llamacpp.read_rope(written.path)
    assert (rope.scaling_type, rope.has_rope_freqs, rope.base, rope.rotary_dim) == ("none", True, BASE, ROT)
    assert rope.attn_factor == np.float32(method.attention_factor)
    want_length = round(CONTEXT * getattr(method, "factor", 1.0))
    assert rope.context_length == written.context_length == want_length
    (freqs,) = [t for t in reader.tensors if t.name == llamacpp.ROPE_FREQS]
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32 and list(freqs.shape) == [ROT // 2]
    table = method.inv_freq(ROT, BASE, dtype=torch.float64).numpy()
    # The yardstick: llama.cpp's own error on plain RoPE (no rope_freqs) at the same positions.
    native = llama_cpp_error(scaling.Default().inv_freq(ROT, BASE, dtype=torch.float64).numpy(), None)
    ours = llama_cpp_error(table, np.asarray(freqs.data))
    assert ours <= 2 * native + 2 * 2.0 ** -24, (ours, native)
    # the record reads back as the same method
    record = json.loads(reader.get_field(llamacpp.METHOD_KEY).contents())
    assert record["context_length"] == want_length
    assert scaling.from_hf(record["rope_parameters"], CONTEXT) == method


def test_a_longrope_with_two_tables_is_llama_cpps_own_longrope(tmp_path):
    """``rope.scaling.type = longrope``, both tables as divisors, the length llama.cpp switches at; no rope_freqs
    (llama.cpp would take it over both) and no factor (freq_scale stays 1)."""
    src = tiny_gguf(tmp_path / "src.gguf")
    written = llamacpp.extend(src, tmp_path / "dst.gguf", DYNAMIC_LONGROPE)
    reader, rope = llamacpp.read_rope(written.path)
    assert (rope.scaling_type, rope.scaling_factor, rope.has_rope_freqs) == ("longrope", 0.0, True)
    assert reader.get_field("llama.rope.scaling.original_context_length").contents() == CONTEXT
    assert rope.attn_factor == np.float32(DYNAMIC_LONGROPE.attention_factor)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert llamacpp.ROPE_FREQS not in tensors
    native = llama_cpp_error(scaling.Default().inv_freq(ROT, BASE, dtype=torch.float64).numpy(), None)
    for name, seq_len in ((llamacpp.ROPE_FACTORS_SHORT, CONTEXT), (llamacpp.ROPE_FACTORS_LONG, CONTEXT + 1)):
        table = DYNAMIC_LONGROPE.inv_freq(ROT, BASE, seq_len=seq_len, dtype=torch.float64).numpy()
        assert llama_cpp_error(table, tensors[name]) <= 2 * native + 2 * 2.0 ** -24, name
    assert not np.array_equal(tensors[llamacpp.ROPE_FACTORS_SHORT], tensors[llamacpp.ROPE_FACTORS_LONG])
    # a GGUF carrying LongRoPE's factors is already scaled
    with pytest.raises(ValueError, match="already carries a rope scaling"):
        llamacpp.extend(written.path, tmp_path / "again.gguf", STATIC["yarn"])


@pytest.mark.parametrize("name, keys", [
    ("yarn", {"type": "yarn", "factor": 4.0, "original_context_length": CONTEXT}),
    ("linear", {"type": "linear", "factor": 4.0}),
])
def test_qwen_has_no_rope_freqs_so_its_own_types_are_written(tmp_path, name, keys):
    """llama.cpp's qwen2/qwen3 models read no rope_freqs: a method llama.cpp computes itself is written as its keys."""
    src = tiny_gguf(tmp_path / "src.gguf", "qwen2")
    written = llamacpp.extend(src, tmp_path / "dst.gguf", STATIC[name])
    reader, rope = llamacpp.read_rope(written.path)
    assert not rope.has_rope_freqs and written.tensors == () and written.scaling_type == keys["type"]
    got = {k: reader.get_field(f"qwen2.rope.scaling.{k}").contents() for k in keys}
    assert got == keys and rope.attn_factor == 1.0 and rope.context_length == 4 * CONTEXT
    assert reader.get_field(llamacpp.METHOD_KEY) is not None


def test_everything_but_the_rope_is_copied_byte_for_byte(tmp_path):
    src = tiny_gguf(tmp_path / "src.gguf", alignment=64)
    dst = llamacpp.extend(src, tmp_path / "dst.gguf", STATIC["yarn"]).path
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    rope_keys = {"llama.rope.scaling.type", "llama.rope.scaling.attn_factor", "llama.context_length",
                 llamacpp.METHOD_KEY}
    old = {f.name: f.contents() for f in before.fields.values() if not f.name.startswith("GGUF.")}
    new = {f.name: f.contents() for f in after.fields.values() if not f.name.startswith("GGUF.")}
    assert {k: v for k, v in new.items() if k not in rope_keys} == {k: v for k, v in old.items() if k not in rope_keys}
    assert set(new) - set(old) == rope_keys - {"llama.context_length"}
    old_tensors = {t.name: (t.tensor_type, list(t.shape), bytes(t.data)) for t in before.tensors}
    new_tensors = {t.name: (t.tensor_type, list(t.shape), bytes(t.data)) for t in after.tensors}
    assert set(new_tensors) - set(old_tensors) == {llamacpp.ROPE_FREQS}
    assert all(new_tensors[name] == value for name, value in old_tensors.items())
    assert old_tensors["blk.0.attn_q.weight"][0] == gguf.GGMLQuantizationType.Q8_0  # quantised, never dequantised


def truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def not_gguf(path):
    path.write_text("not a model\n")
    return path


DYNAMIC_LONGROPE = scaling.LongRoPE(short_factor=(1.0,) * 8, long_factor=(4.0,) * 8, original_max_position=CONTEXT,
                                    factor=4.0)
REFUSALS = {
    "dynamic": (lambda p: tiny_gguf(p), scaling.DynamicYaRN(original_max_position=CONTEXT),
                "follows each sequence's length"),
    "per_request": (lambda p: tiny_gguf(p), scaling.DynamicYaRN(original_max_position=CONTEXT, per="request"),
                    "follows each sequence's length"),
    "architecture": (lambda p: tiny_gguf(p, "phi2"), STATIC["yarn"], "architecture 'phi2'"),
    "qwen2_ntk": (lambda p: tiny_gguf(p, "qwen2"), STATIC["ntk"], "only its own rope types run exactly"),
    "qwen2_resonance_yarn": (lambda p: tiny_gguf(p, "qwen2"), STATIC["resonance_yarn"], "YaRN with Resonance"),
    "qwen2_yarn_mscale": (lambda p: tiny_gguf(p, "qwen2"), STATIC["yarn_untruncated_mscale"], "'truncate': False"),
    "already_scaled_freqs": (lambda p: tiny_gguf(p, rope_freqs=True), STATIC["yarn"], "already carries a rope scaling"),
    "already_scaled_yarn": (lambda p: tiny_gguf(p, scaling_type="yarn"), STATIC["yarn"], "rope.scaling.type 'yarn'"),
    "truncated": (lambda p: truncated(tiny_gguf(p)), STATIC["yarn"], "is not a GGUF file the gguf package can read"),
    "not_gguf": (not_gguf, STATIC["yarn"], "is not a GGUF file the gguf package can read"),
    "rotary_dim": (lambda p: tiny_gguf(p), scaling.LongRoPE(short_factor=(1.0,) * 4, long_factor=(1.0,) * 4,
                                                             original_max_position=CONTEXT, factor=1.0), "4"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_input_is_refused_before_anything_is_written(tmp_path, case):
    make, method, message = REFUSALS[case]
    src = make(tmp_path / "src.gguf")
    with pytest.raises(ValueError, match=message):
        llamacpp.extend(src, tmp_path / "dst.gguf", method)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_an_existing_destination_is_never_overwritten(tmp_path):
    src = tiny_gguf(tmp_path / "src.gguf")
    (tmp_path / "dst.gguf").write_text("keep me")
    with pytest.raises(FileExistsError, match="never overwrites"):
        llamacpp.extend(src, tmp_path / "dst.gguf", STATIC["yarn"])
    assert (tmp_path / "dst.gguf").read_text() == "keep me"


def test_ctrl_c_while_writing_leaves_no_file(tmp_path, monkeypatch):
    src = tiny_gguf(tmp_path / "src.gguf")
    calls = []

    def interrupted(self, tensor, tensor_endianess=None):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llamacpp.extend(src, tmp_path / "dst.gguf", STATIC["yarn"])
    assert calls and sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


def test_a_table_with_an_unrotated_pair_has_no_factor():
    table = scaling.Default().inv_freq(ROT, BASE, dtype=torch.float64)
    table[-1] = 0.0
    with pytest.raises(ValueError, match="a pair left unrotated"):
        llamacpp.rope_freqs_for(table, BASE, ROT)


def test_the_chain_is_llama_cpps_float32_product():
    # ts = powf(base, -2/n) and a float32 running product, not base ** (-2i/n) in double
    values = llamacpp.chain(BASE, ROT)
    ts = np.float32(BASE) ** np.float32(-2.0 / ROT)
    assert values.dtype == np.float32 and values[0] == 1.0 and values[1] == ts
    assert values[5] == np.float32(np.float32(np.float32(np.float32(ts * ts) * ts) * ts) * ts)
    exact = BASE ** (-2.0 * np.arange(ROT // 2) / ROT)
    assert 0 < np.max(np.abs(values - exact) / exact) < 1e-6 and not math.isclose(values[7], np.float32(exact[7]),
                                                                                  rel_tol=0)


@pytest.mark.parametrize("rot,base", [(64, 10000.0), (64, 100000.0), (128, 500000.0)])
def test_at_real_head_dims_the_factors_cancel_the_chains_drift(rot, base):
    """Against llama.cpp's float32 chain (not base^(-2i/n) in double), the factors also cancel the chain's drift
    (powf's rounded ts, raised to the i-th power): llama.cpp then turns YaRN's table more exactly than its own plain
    RoPE (measured: 3.5e-7 against 2.4e-6 at n_rot 64, positions to 32k)."""
    positions = (1, 7, 100, 1000, 4095, 16383, 32767)
    method = scaling.YaRN(factor=4.0, original_max_position=8192)
    table = method.inv_freq(rot, base, dtype=torch.float64).numpy()
    plain = scaling.Default().inv_freq(rot, base, dtype=torch.float64).numpy()

    def error(want, factors):
        return max(float(np.max(np.abs(llamacpp.effective_inv_freq(base, rot, factors, p) - want) / want))
                   for p in positions)

    ours = error(table, llamacpp.rope_freqs_for(torch.from_numpy(table), base, rot))
    against_double = error(table, (base ** (-2.0 * np.arange(rot // 2) / rot) / table).astype(np.float32))
    assert ours < error(plain, None) / 2 and ours < against_double / 2, (ours, error(plain, None), against_double)


# ---- the command line: ropescale extend SRC.gguf DST.gguf --method ...

def extend_cli(capsys, *argv):
    from ropescale import cli

    code = None
    try:
        code = cli.main(["extend", *map(str, argv)])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_extend_cli_writes_the_gguf_and_says_how_to_serve_it(tmp_path, capsys):
    src = tiny_gguf(tmp_path / "src.gguf")
    code, out, _ = extend_cli(capsys, src, tmp_path / "dst.gguf", "--method", "yarn", "--factor", 4)
    assert code == 0 and f"llama-server -m {tmp_path / 'dst.gguf'} -c 256" in out
    _, rope = llamacpp.read_rope(tmp_path / "dst.gguf")
    # --original-max-position defaults to the GGUF's context length: YaRN s = 4 over 64 tokens
    assert rope.context_length == 256
    assert rope.attn_factor == np.float32(STATIC["yarn"].attention_factor)
    code, out, _ = extend_cli(capsys, src, tmp_path / "dry.gguf", "--method", "ntk", "--factor", 2, "--dry-run")
    assert code == 0 and "would write" in out and not (tmp_path / "dry.gguf").exists()


CLI_REFUSALS = {
    "attention": (["--attention", "string", "--shifted-offset", 8], "llama.cpp has no STRING attention"),
    "rerope": (["--method", "rerope", "--window", 8], "llama.cpp has no ReRoPE attention"),
    "no_method": ([], "a GGUF DST takes --method M"),
    "dynamic": (["--method", "dynamic_yarn"], "follows each sequence's length"),
    "target": (["--method", "yarn", "--factor", 4, "--target", "vllm"], "--target is for a transformers directory"),
    "max_length": (["--method", "yarn", "--factor", 4, "--max-length", 512], "--max-length is for a transformers"),
}


@pytest.mark.parametrize("case", sorted(CLI_REFUSALS))
def test_extend_cli_refuses_what_llama_cpp_cannot_run_by_name(tmp_path, capsys, case):
    options, message = CLI_REFUSALS[case]
    src = tiny_gguf(tmp_path / "src.gguf")
    code, _, err = extend_cli(capsys, src, tmp_path / "dst.gguf", *options)
    assert code == 2 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.gguf"]


FAKE_CONVERTER = """
import shutil, sys
args = sys.argv[1:]
if "fail" in args[0]:
    print("Traceback: the model type is not supported", file=sys.stderr)
    sys.exit(1)
shutil.copyfile({source!r}, args[args.index("--outfile") + 1])
"""


def llama_directory(path, **config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "max_position_embeddings": CONTEXT, **config}))
    return path


def fake_converter(tmp_path):
    source = tiny_gguf(tmp_path / "converted.gguf")
    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text(FAKE_CONVERTER.format(source=str(source)))
    return script


def test_a_transformers_directory_is_converted_unscaled_then_extended(tmp_path, capsys):
    converter = fake_converter(tmp_path)
    src = llama_directory(tmp_path / "llama")
    code, out, err = extend_cli(capsys, src, tmp_path / "llama-yarn.gguf", "--method", "yarn", "--factor", 4,
                                "--converter", converter)
    assert code == 0, err
    assert "llama-server -m" in out and "-c 256" in out
    reader, rope = llamacpp.read_rope(tmp_path / "llama-yarn.gguf")
    assert (rope.scaling_type, rope.context_length) == ("none", 4 * CONTEXT)
    assert scaling.from_hf(json.loads(reader.get_field(llamacpp.METHOD_KEY).contents())["rope_parameters"],
                           CONTEXT) == STATIC["yarn"]
    # nothing but DST is left: the unscaled intermediate is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convert_hf_to_gguf.py", "converted.gguf", "llama",
                                                          "llama-yarn.gguf"]


@pytest.mark.parametrize("case", ["scaled", "entry", "architecture", "no_converter", "converter_fails", "no_config"])
def test_a_directory_the_converter_would_get_wrong_is_refused_before_it_runs(tmp_path, capsys, monkeypatch, case):
    converter = fake_converter(tmp_path)
    name, config, message = {
        "scaled": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "already carries a rope scaling"),
        "entry": ("llama", {"ropescale": {"attention": "rerope"}}, "already carries a rope scaling"),
        "architecture": ("qwen", {"architectures": ["Qwen2ForCausalLM"]}, "architecture ['Qwen2ForCausalLM']"),
        "no_converter": ("llama", {}, "convert_hf_to_gguf.py was not found"),
        "converter_fails": ("fail", {}, "llama.cpp's converter failed on"),
        "no_config": ("empty", None, "not a transformers model directory"),
    }[case]
    src = llama_directory(tmp_path / name, **config) if config is not None else tmp_path / name
    if config is None:
        src.mkdir()
    monkeypatch.delenv(llamacpp.CONVERTER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    options = [] if case == "no_converter" else ["--converter", converter]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = extend_cli(capsys, src, tmp_path / "dst.gguf", "--method", "yarn", "--factor", 4, *options)
    assert code == 2 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no DST, no intermediate
