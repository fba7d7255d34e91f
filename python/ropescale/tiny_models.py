"""The tiny model of every family of ``ropescale.hf.architectures`` (no downloads), built from its own config
class with weights large enough that positions matter: the conformance matrix (``ropescale.matrix``) builds its
checkpoints from it, and the tests (transformers, vLLM, SGLang, verify) their models."""

import warnings

import transformers
import torch

VOCAB, ORIGINAL = 101, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2)

# The test config of each family (architecture name: config class, model class, fields beyond COMMON). The
# layers of a family with layer types are sliding and full layers in turn.
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
    # Gemma 4: its full layers' own head dim (32, the sliding layers' 16: per_layer_config), keys as values there
    # (attention_k_eq_v), the last two layers KV-shared (attending the keys of layers 0 and 1), per-layer inputs.
    "Gemma 4": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4,
                     global_head_dim=32, attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                     vocab_size_per_layer_input=VOCAB)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(MOE, num_local_experts=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "DeepSeek-V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(MOE, head_dim=8, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                         moe_intermediate_size=32)),
    # DeepSeek-V4: a sliding layer (rope "main", theta 1e4), a compressed-sparse and a heavily-compressed layer (rope
    # "compress", theta 160000: their compressors and the indexer rotate too), a 16-feature trailing rope slice of
    # 32-feature heads, one KV head (keys are values), sinks, hyper-connections.
    "DeepSeek-V4": ("DeepseekV4Config", "DeepseekV4ForCausalLM",
                    dict(MOE, head_dim=32, partial_rotary_factor=0.5, num_key_value_heads=1, q_lora_rank=32,
                         moe_intermediate_size=32, n_routed_experts=4, num_hidden_layers=3, sliding_window=8,
                         layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                         compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                         o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
                         hc_sinkhorn_iters=3, mlp_layer_types=["moe"] * 3, num_nextn_predict_layers=0)),
    # HunYuan dense: QK-norm after the rotation; its checkpoints' rope is NTK-alpha ("dynamic" with "alpha")
    "HunYuan dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
    # NoPE layers between rope layers (config.no_rope_layers: 1 rotates, 0 NoPE): layers 0 and 2 rotate, 1 and 3 not.
    "SmolLM3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # Llama 4 (iRoPE): its rope layers are chunked local attention (chunks of 8) with QK-norm after the rotation, its
    # NoPE layers global with the attention temperature log1p(floor((pos + 1) / 4)) * 0.5 + 1 on q (from position 3).
    "Llama 4 (text)": ("Llama4TextConfig", "Llama4ForCausalLM",
                       dict(num_hidden_layers=4, no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=4,
                            attn_scale=0.5, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                            interleave_moe_layer_step=2, pad_token_id=0)),
    "Qwen2.5-VL (text)": ("Qwen2_5_VLTextConfig", "Qwen2_5_VLTextModel", dict(mrope_section=[2, 3, 3])),
    "Qwen3-VL (text)": ("Qwen3VLTextConfig", "Qwen3VLTextModel", dict(mrope_section=[2, 3, 3], mrope_interleaved=True)),
}
# The families whose rope_parameters are per layer type: (the extended type, the sliding layers' type, its theta).
# build's rope_parameters are the extended type's; the sliding layers keep the default table.
PER_LAYER_TYPE = {"Gemma 3": ("full_attention", "sliding_attention", 10000.0),
                  "Gemma 4": ("full_attention", "sliding_attention", 10000.0),
                  "DeepSeek-V4": ("compress", "main", 10000.0)}
# A family's base for its extended layers, where its checkpoints' differs from 1e4 (V4's compress_rope_theta).
THETA = {"DeepSeek-V4": 160000.0}
# Keys of a family's rope layout that its test config puts in rope_parameters.
LAYOUT = ("partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta")


def base_rope(name):
    fields = TINY[name][2]
    base = {"rope_type": "default", "rope_theta": THETA.get(name, 10000.0),
            **{k: fields[k] for k in LAYOUT if k in fields}}
    if "llama_4_scaling_beta" in base:  # Ministral 3's query temperature needs an original length
        base.update(rope_type="yarn", factor=1.0, original_max_position_embeddings=ORIGINAL)
    return base


def build(name, rope_parameters=None, seed=0, **overrides):
    """The family's tiny model (eval, sharpened weights) with ``rope_parameters`` (of its full-attention layers
    for a per-layer-type family; its sliding layers keep their own)."""
    config_name, model_name, fields = TINY[name]
    # a per-layer-type config keeps its partial_rotary_factor at the top level too (DeepSeek-V4's checkpoints: the
    # same as each type's)
    fields = {k: v for k, v in fields.items() if k not in LAYOUT or (name in PER_LAYER_TYPE and k == LAYOUT[0])}
    params = base_rope(name)
    if rope_parameters is not None:  # the method's keys, the family's layout keys
        params = {"rope_theta": THETA.get(name, 10000.0), **{k: params[k] for k in LAYOUT if k in params},
                  **rope_parameters}
    if name in PER_LAYER_TYPE:
        extended, sliding, theta = PER_LAYER_TYPE[name]
        layout = {k: params[k] for k in LAYOUT if k in params}
        params = {extended: params, sliding: {"rope_type": "default", "rope_theta": theta, **layout}}
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


# What a family's model needs beyond TINY to be served by vLLM's CPU backend: head dim 32 (its attention takes no
# less), and for the multimodal families the whole vision-language model (vLLM serves no text-only class of them;
# text prompts take the text positions on all three rope streams).
SERVED = dict(hidden_size=128, head_dim=32)
SERVED_FIELDS = {
    # vLLM's CPU MLA kernel takes V3's latent only (kv_lora_rank 512 + rope head 64); heads and topk_method as V3's
    # config (MLA has as many KV heads as query heads; vLLM then loads the gate's correction bias).
    "DeepSeek-V3": dict(num_key_value_heads=4, head_dim=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                        kv_lora_rank=512, topk_method="noaux_tc"),
    # vLLM's CPU backend takes chunks of a multiple of its 128-token blocks only: past every served length here.
    "Llama 4 (text)": dict(attention_chunk_size=128),
}
VISION = {
    "Qwen2.5-VL (text)": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                          dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=128,
                               fullatt_block_indexes=[0])),
    "Qwen3-VL (text)": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                        dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=128,
                             deepstack_visual_indexes=[0], num_position_embeddings=16)),
}


def build_served(name, rope_parameters=None, seed=0, **overrides):
    """The family's tiny model at vLLM's sizes (SERVED), as the class vLLM serves: its causal LM, or the
    vision-language model around its text model (``overrides``: its text config's other fields)."""
    if name not in VISION:
        model = build(name, rope_parameters, seed, **{**SERVED, **SERVED_FIELDS.get(name, {}), **overrides})
        if getattr(model.config, "attn_temperature_tuning", False):
            # vLLM's Llama 4 reads the NoPE layers' temperature switch from the generation config (else on only past
            # a max_model_len of 32k), transformers from the model's config: the checkpoint says it in both
            model.generation_config.attn_temperature_tuning = True
        return model
    config_name, model_name, vision = VISION[name]
    params = base_rope(name)
    params["mrope_section"] = [4, 6, 6]  # of 16 pairs
    if rope_parameters is not None:
        params = {**{k: params[k] for k in LAYOUT if k in params}, "rope_theta": 10000.0, **rope_parameters}
    text = {**COMMON, **SERVED, **overrides, "rope_parameters": params}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_name)(text_config=text, vision_config=vision, bos_token_id=None,
                                                    eos_token_id=None)
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for parameter_name, p in model.named_parameters():
            if "proj" in parameter_name and "visual" not in parameter_name:
                p.mul_(4.0)
    return model


def stream_positions(length):
    """Position ids ``[3, length]`` of a multimodal rope whose streams differ, as around an image (Qwen-VL's
    get_rope_index): height and width behind time, time the largest."""
    t = torch.arange(length)
    return torch.stack((t, t - t // 4, t // 2))
