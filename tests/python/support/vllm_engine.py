"""The one vLLM engine runner of the vLLM tests (test_vllm, test_vllm_paged, test_vllm_real): engines served one
after the other in one subprocess, their outputs as JSON."""

import json
import os
import subprocess
import sys
import textwrap


# Every vLLM process start costs tens of seconds here (each process imports vLLM again), so the engines a test
# module needs run one after the other in ONE subprocess; with VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core
# and worker run in that process too (a further LLM() then costs a model build, seconds in eager mode, and the
# script can count vLLM's preemptions).

ENGINE = textwrap.dedent("""
    # Serves checkpoints with vLLM, one engine per entry of the job (one process, engines in turn); each engine
    # runs its batches (one llm.generate call each) and prints one RESULT line.
    import gc, json, os, sys, time
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def count_preemptions():
        # vLLM's scheduler, when the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        from vllm.v1.core.sched.scheduler import Scheduler

        stock, count = Scheduler._preempt_request, [0]

        def preempt(self, *args, **kwargs):
            count[0] += 1
            return stock(self, *args, **kwargs)

        Scheduler._preempt_request = preempt
        return count

    def request(out):
        generated = out.outputs[0]
        return {"tokens": list(generated.token_ids),
                "prompt_logprobs": out.prompt_logprobs and [None if d is None else d[t].logprob
                                                            for d, t in zip(out.prompt_logprobs, out.prompt_token_ids)],
                "logprobs": generated.logprobs and [d[t].logprob for d, t in zip(generated.logprobs,
                                                                                  generated.token_ids)],
                "top": generated.logprobs and [{str(t): lp.logprob for t, lp in d.items()} for d in generated.logprobs],
                "cached": out.num_cached_tokens}

    def main():
        with open(sys.argv[1]) as f:
            job = json.load(f)
        preemptions = count_preemptions()
        for engine in job["engines"]:
            start, preemptions[0], llm = time.perf_counter(), 0, None
            result = {"id": engine["id"]}
            saved = {name: os.environ.get(name) for name in engine.get("env", {})}
            os.environ.update(engine.get("env", {}))
            try:
                llm = LLM(model=engine["path"], skip_tokenizer_init=True, seed=0,
                          **{"dtype": "float32", **engine["options"]})
                started = time.perf_counter()
                if engine.get("bad_entry"):
                    result["error"] = "the engine started"
                else:
                    result["batches"] = []
                    for batch in engine["batches"]:
                        # "params": None is no SamplingParams at all: the model's generation config's defaults
                        params = ([SamplingParams(**each) for each in batch["params_each"]] if "params_each" in batch
                                  else None if batch["params"] is None else SamplingParams(**batch["params"]))
                        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]],
                                            params, use_tqdm=False)
                        result["batches"].append([request(out) for out in outs])
                    result.update(start_seconds=started - start, seconds=time.perf_counter() - start,
                                  preemptions=preemptions[0])
            except Exception as err:  # noqa: BLE001 (the error is the result)
                result["error"] = f"{type(err).__name__}: {err}"
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            llm = None
            gc.collect()
            print("RESULT " + json.dumps(result), flush=True)

    if __name__ == "__main__":
        main()
""")


def run_engines(tmp_path, engines, env, timeout):
    """Serves ``engines`` one after the other in one subprocess (cwd ``tmp_path``, ``env`` over os.environ):
    each {"id", "path", "options": LLM's keyword arguments (dtype float32 unless given), "batches": [{"prompts":
    [[token id, ...], ...], "params": SamplingParams' keyword arguments, or None for vLLM's defaults from the
    model's generation config (or "params_each": one such dict per prompt)}], "env": variables set for this engine
    only, "bad_entry": true where the engine must refuse to start}. Returns (results, the process's output): one
    result per engine that ran, in order, {"id", "error"} or {"id", "batches": per batch, per request {"tokens",
    "prompt_logprobs" (None where not asked or read from vLLM's prefix cache), "logprobs" (the generated tokens'),
    "top" (per generated token {token: logprob} of the logprobs asked for), "cached" (prompt tokens read from the
    prefix cache)}, "seconds", "start_seconds", "preemptions" (counted where the engine core runs in the process)}."""
    script, job = tmp_path / "engine.py", tmp_path / "job.json"
    script.write_text(ENGINE)
    job.write_text(json.dumps({"engines": engines}))
    result = subprocess.run([sys.executable, str(script), str(job)], cwd=tmp_path, env={**os.environ, **env},
                            capture_output=True, text=True, timeout=timeout)
    results = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    for r in results:
        print(f"engine {r['id']}: " + (f"error {r['error'][:200]}" if "error" in r else
                                       f"start {r['start_seconds']:.1f} s, {r['seconds']:.1f} s in all, "
                                       f"{r['preemptions']} preemptions"))
    return results, result.stdout + result.stderr
