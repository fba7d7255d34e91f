"""Serves token prompts with SGLang's engine and prints their prompt log-probabilities, for the SGLang tests.

Run as a script in its own process (SGLang spawns processes and installs signal handlers):
``python sglang_serve.py JOB.json``. The job: {"target", "context_length", "engine" (extra ``sglang.Engine``
arguments), "batches": [[prompt, ...], ...], "starts": [logprob_start_len per batch] (default 0),
"budgets": [[max_new_tokens per prompt] per batch] (default 1)}: each batch is sent as one ``generate`` call
(SGLang schedules its
prompts together), every batch to the same engine, in order (a later batch may read the radix cache of an earlier
one). Output: one line ``SERVED {json}``: per batch, per prompt, the prompt log-probabilities from its batch's start
(the first token's None), the cached-token count SGLang reports, and the greedy tokens it generated with their
log-probabilities. On a machine without a GPU it is SGLang's CPU engine.
"""

import json
import os
import sys


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import torch

    options = dict(job.get("engine") or {})
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        options = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
                   "mem_fraction_static": 0.05, "max_total_tokens": 4096, **options}
    os.environ.setdefault("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
    import sglang

    engine = sglang.Engine(model_path=job["target"], skip_tokenizer_init=True, dtype="float32", random_seed=0,
                           context_length=job["context_length"], log_level="error", **options)
    try:
        batches = []
        starts = job.get("starts") or [0] * len(job["batches"])
        budgets = job.get("budgets") or [[1] * len(prompts) for prompts in job["batches"]]
        for prompts, start, budget in zip(job["batches"], starts, budgets):
            # (SGLang reads a cached prefix only past logprob_start_len: the log-probabilities from there on)
            outs = engine.generate(input_ids=[list(p) for p in prompts],
                                   sampling_params=[{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                                                    for n in budget],
                                   return_logprob=True, logprob_start_len=start)
            batches.append([{"logprobs": [row[0] for row in out["meta_info"]["input_token_logprobs"]],
                             "cached": out["meta_info"].get("cached_tokens", 0), "tokens": list(out["output_ids"]),
                             "token_logprobs": [row[0] for row in out["meta_info"]["output_token_logprobs"]]}
                            for out in outs])
    finally:
        engine.shutdown()
    print("SERVED " + json.dumps(batches), flush=True)


if __name__ == "__main__":
    main()
