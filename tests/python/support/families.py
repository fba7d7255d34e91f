"""The tiny model of every family of ``ropescale.hf.architectures`` (no downloads), built from its own config
class: shared by the transformers tests (test_architectures) and the vLLM engine tests (test_vllm)."""

import warnings

import transformers
import torch

VOCAB, ORIGINAL = 101, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2)

# The test config of each family (architecture name: config class, model class, fields beyond COMMON). The two
# layers of a family with layer types are one sliding and one full layer.
TINY = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),  # Mistral 7B v0.2 on
    "Ministral 3": ("Ministral3Config", "Ministral3ForCausalLM", dict(llama_4_scaling_beta=0.1)),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(MOE, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1)),
    "Phi-3 / Phi-4-mini": ("Phi3Config", "Phi3ForCausalLM",  # its original length outside rope_parameters too
                           dict(partial_rotary_factor=0.75, pad_token_id=0, original_max_position_embeddings=ORIGINAL)),
    "GLM-4": ("Glm4Config", "Glm4ForCausalLM", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    "Gemma 3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(MOE, num_local_experts=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MOE, head_dim=8, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                         moe_intermediate_size=32)),
    "Qwen2.5-VL (text)": ("Qwen2_5_VLTextConfig", "Qwen2_5_VLTextModel", dict(mrope_section=[2, 3, 3])),
    "Qwen3-VL (text)": ("Qwen3VLTextConfig", "Qwen3VLTextModel", dict(mrope_section=[2, 3, 3], mrope_interleaved=True)),
}
# Keys of a family's rope layout that its test config puts in rope_parameters.
LAYOUT = ("partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta")


def base_rope(name):
    fields = TINY[name][2]
    base = {"rope_type": "default", "rope_theta": 10000.0, **{k: fields[k] for k in LAYOUT if k in fields}}
    if "llama_4_scaling_beta" in base:  # Ministral 3's query temperature needs an original length
        base.update(rope_type="yarn", factor=1.0, original_max_position_embeddings=ORIGINAL)
    return base


def build(name, rope_parameters=None, seed=0, **overrides):
    """The family's tiny model (eval, sharpened weights) with ``rope_parameters`` (of its full-attention layers
    for a per-layer-type family; its sliding layers keep their own)."""
    config_name, model_name, fields = TINY[name]
    fields = {k: v for k, v in fields.items() if k not in LAYOUT}
    params = base_rope(name)
    if rope_parameters is not None:  # the method's keys, the family's layout keys
        params = {"rope_theta": 10000.0, **{k: params[k] for k in LAYOUT if k in params}, **rope_parameters}
    if name == "Gemma 3":
        params = {"full_attention": params, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_name)(**{**COMMON, **fields, **overrides}, rope_parameters=params)
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for parameter_name, p in model.named_parameters():
            if "proj" in parameter_name:
                p.mul_(4.0)
    return model
