"""A transformers Llama written as the GGUF llama.cpp's converter writes it (``convert_hf_to_gguf.py``, LlamaModel), for
tests that run a model in llama.cpp and in transformers on the same weights.

llama.cpp rotates adjacent pairs (its NORM rope mode) where transformers rotates the two halves of a head; the converter
permutes the rows of q and k so that the two agree (``LlamaModel.permute``), and so does this writer. The tokenizer is
SmolLM2's (its GGUF's ``tokenizer.*`` keys), so the model's vocabulary is SmolLM2's 49,152 tokens: prompts are token
ids, never text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

VOCAB = 49152  # SmolLM2's


def static_methods(original: int) -> dict:
    """Every static method llama.cpp can run from one GGUF, for a model trained to ``original`` tokens with 8 rotary
    pairs (the tiny models' n_rot 16), each at s = 4 but plain Resonance RoPE."""
    from ropescale import scaling

    long_factor = (1.0, 1.5, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0)
    return {
        "linear": scaling.Linear(factor=4.0),
        "ntk": scaling.NTK(factor=4.0),
        "yarn": scaling.YaRN(factor=4.0, original_max_position=original),
        "yarn_untruncated_mscale": scaling.YaRN(factor=4.0, original_max_position=original, truncate=False,
                                                mscale=0.707, mscale_all_dim=1.0),
        "llama3": scaling.Llama3(factor=4.0, original_max_position=original),
        "longrope_long": scaling.LongRoPE(short_factor=long_factor, long_factor=long_factor,
                                          original_max_position=original, factor=4.0),
        "resonance_yarn": scaling.YaRN(factor=4.0, original_max_position=original, resonance=True),
        "resonance": scaling.Default(resonance=True),
    }


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The converter's q/k row permutation: each head's two halves become interleaved pairs."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def tokenizer_fields(gguf_path: Path):
    """SmolLM2's ``tokenizer.*`` fields (name, value, type, sub type) from its GGUF."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    out = []
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            kind = field.types[0]
            out.append((field.name, field.contents(), kind, field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                        else None))
    return out


def write(model, path: Path, tokenizer_gguf: Path, *, quantize: bool = False) -> Path:
    """Writes ``model`` (a transformers LlamaForCausalLM, or a Qwen2ForCausalLM, with SmolLM2's vocabulary size,
    default RoPE) as a llama (qwen2) GGUF; ``quantize``: the 2-D weights as Q8_0 (the embedding and norms stay
    float32). llama.cpp rotates a qwen2's two halves as transformers does (NEOX): its q and k are not permuted, and
    its q/k/v biases are written."""
    import gguf

    config = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}[config.model_type]
    if config.vocab_size != VOCAB:
        raise ValueError(f"the model needs SmolLM2's vocabulary ({VOCAB} tokens), has {config.vocab_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32)
    for name, value, kind, sub_type in tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(name, value, kind, sub_type=sub_type)

    def tensor(name: str, value: torch.Tensor, two_d_quantized: bool = True) -> None:
        array = value.detach().to(torch.float32).numpy()
        if quantize and two_d_quantized and array.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))

    state = model.state_dict()
    tensor("token_embd.weight", state["model.embed_tokens.weight"], two_d_quantized=False)
    tensor("output_norm.weight", state["model.norm.weight"])
    if not config.tie_word_embeddings:
        tensor("output.weight", state["lm_head.weight"])
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        tensor(f"blk.{i}.attn_norm.weight", state[prefix + "input_layernorm.weight"])
        q, k = state[prefix + "self_attn.q_proj.weight"], state[prefix + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = torch.from_numpy(permute(q.numpy(), heads)), torch.from_numpy(permute(k.numpy(), kv_heads))
        else:
            for name in ("q", "k", "v"):
                tensor(f"blk.{i}.attn_{name}.bias", state[prefix + f"self_attn.{name}_proj.bias"])
        tensor(f"blk.{i}.attn_q.weight", q)
        tensor(f"blk.{i}.attn_k.weight", k)
        tensor(f"blk.{i}.attn_v.weight", state[prefix + "self_attn.v_proj.weight"])
        tensor(f"blk.{i}.attn_output.weight", state[prefix + "self_attn.o_proj.weight"])
        tensor(f"blk.{i}.ffn_norm.weight", state[prefix + "post_attention_layernorm.weight"])
        tensor(f"blk.{i}.ffn_gate.weight", state[prefix + "mlp.gate_proj.weight"])
        tensor(f"blk.{i}.ffn_up.weight", state[prefix + "mlp.up_proj.weight"])
        tensor(f"blk.{i}.ffn_down.weight", state[prefix + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_like(model, path: Path):
    """``model`` with the weights a (quantised) GGUF written by :func:`write` holds: what llama.cpp computes with."""
    import gguf

    reader = gguf.GGUFReader(path)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    weights = {}
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.asarray(array, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
    unpermute = {"attn_q": heads, "attn_k": kv_heads}
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {"model.embed_tokens.weight": weights["token_embd.weight"], "model.norm.weight": weights["output_norm.weight"]}
    if "output.weight" in weights:
        state["lm_head.weight"] = weights["output.weight"]
    for i in range(config.num_hidden_layers):
        for short, long in names.items():
            value = weights[f"blk.{i}.{short}.weight"]
            if short in unpermute:  # the inverse of permute: interleaved pairs back to halves
                n = unpermute[short]
                value = value.reshape(n, value.shape[0] // n // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)
            state[f"model.layers.{i}.{long}.weight"] = value
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}, strict=False)
    return model
