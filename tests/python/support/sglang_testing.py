"""What the SGLang test files share: the leg's import rule, and a run of SGLang's engine on checkpoints (a process of
its own, as a user's script: SGLang spawns its scheduler and signals its parent when a child fails).

``run_engines(jobs)`` runs this file as a script: one process, one ``sglang.Engine`` after another (a start costs
15-30 s on 2 cores; the process's import of SGLang is paid once). Each job: ``{"id", "path", "prompts",
"new_tokens", "seed"}``, optional ``"env"`` (set in this process's environment while that engine starts, so in its
scheduler: e.g. ``{"ROPESCALE_SGLANG": "0"}`` makes that engine stock SGLang) and ``"options"`` (further
``sglang.Engine`` arguments). Each result: ``{"id", "requests": [{"prompt_logprobs", "tokens", "logprobs"}]}``
(sampled at temperature 1 with the engine's seed; prompt log-probs of tokens 1..), or ``{"id", "error"}``: the
engine's refusal at start, its child's last error line."""

import json
import os
import subprocess
import sys
import tempfile


def require_sglang() -> None:
    """Skips the calling test module without SGLang; on the SGLang leg a missing SGLang is a failure."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        if os.environ.get("ROPESCALE_SGLANG_LEG") == "1":
            raise
        import pytest

        pytest.skip("SGLang is not installed: these tests run on the SGLang leg (scripts/test_sglang.sh)",
                    allow_module_level=True)


def run_engines(jobs: list[dict], timeout: float = 900.0) -> tuple[dict, str]:
    """({job id: result}, the process's output): ``jobs`` run by this file in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="sglang-engines-") as folder:
        path = os.path.join(folder, "jobs.json")
        with open(path, "w") as f:
            json.dump(jobs, f)
        done = subprocess.run([sys.executable, __file__, path], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
    log = done.stdout + done.stderr
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            results[result["id"]] = result
    assert done.returncode == 0 and len(results) == len(jobs), log[-6000:]
    return results, log


def _run(job):
    """One engine: start, one batch of the job's prompts (seeded sampling, prompt and sampled log-probs), shut
    down."""
    import torch

    import sglang
    from sglang.srt.utils.common import kill_process_tree

    from ropescale._verify_probe import _EngineStartFailed, _last_error, _start_failed

    options = {} if torch.cuda.is_available() else {
        "device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True, "mem_fraction_static": 0.05,
        "max_total_tokens": 4096}
    options.update(job.get("options", {}))
    saved_env = {key: os.environ.get(key) for key in job.get("env", {})}
    os.environ.update(job.get("env", {}))
    log = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)  # a child's traceback (a model SGLang refuses to build): kept to name the refusal
    try:
        engine = sglang.Engine(model_path=job["path"], skip_tokenizer_init=True, dtype="float32",
                               random_seed=job["seed"], log_level="error", custom_sigquit_handler=_start_failed,
                               **options)
    except _EngineStartFailed:
        kill_process_tree(os.getpid(), include_parent=False)
        log.seek(0)
        return {"error": _last_error(log.read().decode(errors="replace")) or "SGLang's engine failed at start"}
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace"))
        log.close()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        outs = engine.generate(input_ids=job["prompts"], return_logprob=True, logprob_start_len=0, sampling_params={
            "temperature": 1.0, "max_new_tokens": job["new_tokens"], "ignore_eos": True})
    finally:
        engine.shutdown()
    requests = []
    for prompt, out in zip(job["prompts"], outs):
        meta = out["meta_info"]
        rows, sampled = meta["input_token_logprobs"], meta["output_token_logprobs"]  # (log p, token id, text)
        assert len(rows) == len(prompt) and rows[0][0] is None and len(sampled) == job["new_tokens"]
        assert [t for _, t, _ in sampled] == list(out["output_ids"])
        requests.append({"prompt_logprobs": [row[0] for row in rows[1:]], "tokens": list(out["output_ids"]),
                         "logprobs": [lp for lp, _, _ in sampled]})
    return {"requests": requests}


def main(path):
    import torch

    if not torch.cuda.is_available():  # SGLang's CPU engine (../shared/SGLANG.md): torch_native attention, float32
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        print("RESULT " + json.dumps({"id": job["id"], **_run(job)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
