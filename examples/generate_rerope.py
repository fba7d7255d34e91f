"""Long-context generation with ReRoPE and the pre-RoPE KV cache.

    python examples/generate_rerope.py                      # a tiny Llama built locally
    python examples/generate_rerope.py --model /path/to/llama --window 512 --leaky-k 16 --logn-length 4096

The model's keys are cached BEFORE rotation (ropescale.hf.PreRopeCache); every decoding step rotates
only what ReRoPE needs, so no relative position ever exceeds the window (Leaky ReRoPE: grows by
1/k past it). The script checks that incremental decoding agrees with a full forward at the last step.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ropescale import hf


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local transformers checkpoint (default: a tiny random Llama)")
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=128, help="ReRoPE window w")
    parser.add_argument("--leaky-k", type=float, default=0.0, help="Leaky ReRoPE slope 1/k past the window (0: ReRoPE)")
    parser.add_argument("--logn-length", type=int, default=0, help="training length for log-n query scaling (0: off)")
    args = parser.parse_args(argv)

    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256))
    model.eval()
    hf.patch(model, attention="rerope", window=args.window, leaky_k=args.leaky_k, logn_length=args.logn_length)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_length), generator=torch.Generator().manual_seed(0))

    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                         past_key_values=hf.PreRopeCache(), pad_token_id=0)
    elapsed = time.perf_counter() - start
    print(f"generated {args.new_tokens} tokens after a {args.prompt_length}-token prompt in {elapsed:.2f}s")
    print("new tokens:", out[0, args.prompt_length:].tolist())
    with torch.no_grad():
        last = model(out[:, :-1], use_cache=False).logits[0, -1].argmax().item()
    print(f"full forward agrees with the cached decode at the last step: {last == out[0, -1].item()}")


if __name__ == "__main__":
    main()
