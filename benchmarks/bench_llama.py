"""Tokens/s of a small Llama patched by ropescale against the same model run natively by transformers.

    python benchmarks/bench_llama.py            # 512, 2k and 8k tokens (CPU: a few minutes)
    python benchmarks/bench_llama.py --quick    # 512 and 2k

Model: 4 layers, d_model 512, 8 heads of 64, GQA 8/4, fp32. Methods: YaRN x4 (a static method: the
patch's rotary module gives ropescale's table, angles in double, and the model's own apply_rotary_pos_emb
rotates) and Dynamic NTK (pre-RoPE: the identity rotation at the model, q and the raw cached keys rotated
by ropescale's kernel in the wrapped attention implementation; transformers' own dynamic path on the native
side). Prefill: one forward over
the prompt. Decode: 16 greedy steps after the prompt, per token (the prefilled cache copied before each run). Ratios > 1 mean ropescale is faster.

Then Dynamic-YaRN per request (issue 43: rotated at write, the model's own cache and attention) against the native
model (plain RoPE, never patched): one ``generate`` of the prompt and 16 greedy tokens, timed whole. A request that
fits the trained length (2048 here) runs the model's own rotary; a longer one each row's table of s = (P + 16) / L.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import device_name, median_time  # noqa: E402

from ropescale import hf, scaling  # noqa: E402

warnings.filterwarnings("ignore")

METHODS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


def model_for(rope_parameters, device):
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         rope_parameters={**rope_parameters, "rope_theta": 10000.0}, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval()


def prefill(model, x):
    with torch.no_grad():
        model(x, use_cache=False)


def prefilled(model, prompt):
    """A cache holding the prompt, and the first generated token."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)  # a patched pre-RoPE model converts its layers
        token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
    return cache, token


def decode(model, cache, token, steps):
    cache = copy.deepcopy(cache)
    with torch.no_grad():
        for _ in range(steps):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="512 and 2k tokens only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    lengths = (512, 2048) if args.quick else (512, 2048, 8192)
    steps = 16
    print(f"device: {device_name(args.device)}; torch {torch.__version__}")
    print(f"{'method':8} {'tokens':>6} {'prefill tok/s native':>21} {'patched':>9} {'ratio':>6} "
          f"{'decode tok/s native':>20} {'patched':>9} {'ratio':>6}")
    for name, params in METHODS.items():
        native = model_for(params, args.device)
        patched = hf.patch(model_for({"rope_type": "default"}, args.device), params)
        for n in lengths:
            x = torch.randint(0, 1000, (1, n), device=args.device)
            t_native = median_time(lambda: prefill(native, x), args.repeats, device=args.device)
            t_patched = median_time(lambda: prefill(patched, x), args.repeats, device=args.device)
            state_native, state_patched = prefilled(native, x), prefilled(patched, x)
            per_native = median_time(lambda: decode(native, *state_native, steps), args.repeats,
                                     device=args.device) / steps
            per_patched = median_time(lambda: decode(patched, *state_patched, steps), args.repeats,
                                      device=args.device) / steps
            print(f"{name:8} {n:>6} {n / t_native:>21.0f} {n / t_patched:>9.0f} {t_native / t_patched:>6.2f} "
                  f"{1 / per_native:>20.1f} {1 / per_patched:>9.1f} {per_native / per_patched:>6.2f}")

    print(f"\n{'per request':12} {'tokens':>6} {'generate s native':>18} {'per request':>12} {'ratio':>6}")
    native = model_for({"rope_type": "default"}, args.device)
    per_request = hf.patch(model_for({"rope_type": "default"}, args.device),
                           scaling.DynamicYaRN(original_max_position=2048, per="request"))
    for n in lengths:
        x = torch.randint(0, 1000, (1, n), device=args.device)
        times = [median_time(lambda: generate(model, x, steps), args.repeats, device=args.device)
                 for model in (native, per_request)]
        print(f"{'dynamic_yarn':12} {n:>6} {times[0]:>18.3f} {times[1]:>12.3f} {times[0] / times[1]:>6.2f}")


def generate(model, x, steps):
    with torch.no_grad():
        model.generate(x, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)


if __name__ == "__main__":
    main()
