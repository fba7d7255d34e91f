"""The engine side of ``ropescale verify``: runs ONE engine on a token prompt and prints its prompt log-probabilities.

Run as a script (``python _verify_probe.py JOB.json``), never imported by ropescale: the engine's process then holds
only what a user's would (transformers without ropescale's rope types; vLLM with the plugins vLLM itself loads;
llama.cpp). The job: {"engine", "target" (a checkpoint directory or a GGUF file), "tokens", "length"}. Output: one
line ``PROBE {json}`` with "logprobs" (the log-probability of each prompt token after the first, float64), "version",
"max_length" (the longest prompt the engine serves by its own reading of the target, None: unbounded), "planned"
(the request's planned length as the engine counts it, prompt + the tokens it asks for: a per-request method's table
is the one of that length; every probe plans the probe's own length, and runs no position past it), "prompt" (the
tokens of the engine's one forward, when not all of them: vLLM's, the probe less its last token), "dtype" (what
the engine computes in: ``verify.BOUNDS``), "notes", "config" (what the engine parsed of the target's rope:
:func:`config_view`), or "error" (the engine refused the target or the prompt: its message).
"""

import json
import os
import sys

CHUNK = 1024  # rows of logits turned into log-probabilities at a time (a 49k vocabulary: 200 MB per chunk)


def _log_probs_of(logits_rows, tokens):
    """float64 log-probability of tokens[i + 1] under row i, for rows given in order as (start, array) chunks."""
    import numpy as np

    out = []
    for start, rows in logits_rows:
        rows = np.asarray(rows, dtype=np.float64)
        top = rows.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        picked = rows[np.arange(len(rows)), np.asarray(tokens[start + 1: start + 1 + len(rows)])]
        out.extend((picked - lse).tolist())
    return out


def transformers_logprobs(model, tokens, prompt=None):
    """A transformers causal LM's log-probabilities of ``tokens[1:]`` (the logits a chunk of rows at a time; Gemma's
    final soft cap applied), from one forward of ``tokens[:prompt]`` (default all; at least ``len(tokens) - 1``: a
    length-dependent table is the one of the forward's length, as the engine's prefill had it). ``ropescale.verify``
    scores its reference with this function too."""
    import torch

    prompt = len(tokens) if prompt is None else prompt
    with torch.no_grad():
        decoder = model.get_decoder()
        if decoder is model:  # Llama 4's causal LM names itself its decoder (transformers 5.23): its base model
            decoder = model.model
        hidden = decoder(torch.tensor([tokens[:prompt]])).last_hidden_state[0]
        head, cap = model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)

        def chunks():
            for start in range(0, len(tokens) - 1, CHUNK):
                logits = head(hidden[start: min(start + CHUNK, len(tokens) - 1)])
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                yield start, logits.double().numpy()

        return _log_probs_of(chunks(), tokens)


def config_view(config):
    """What an engine's parsed transformers config holds of the rope, for ``verify``'s raw-key scan (issue 60): its
    class, its rope parameters as the model reads them (``rope_parameters``; transformers 4's ``rope_scaling`` with
    ``rope_theta``), the fields its class declares, and the same of each sub-config (a multimodal model's
    ``text_config``), and which of them the model runs (``text``: ``get_text_config()``)."""
    import dataclasses
    import inspect

    from transformers import PretrainedConfig

    def get(cfg, name):
        try:
            return getattr(cfg, name, None)
        except Exception:  # noqa: BLE001 (an attribute the config computes and refuses: Gemma 4's per layer)
            return None

    def view(cfg):
        cls = type(cfg)
        fields = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", None) or {})
        if dataclasses.is_dataclass(cls):
            fields |= {f.name for f in dataclasses.fields(cls)}
        rope, theta = get(cfg, "rope_parameters"), get(cfg, "rope_theta")
        if rope is None and "rope_parameters" not in fields and get(cfg, "rope_scaling") is not None:
            rope = dict(cfg.rope_scaling)  # transformers 4
        if theta is not None and isinstance(rope, dict) and "rope_theta" not in rope \
                and not any(isinstance(v, dict) for v in rope.values()):
            rope = {**rope, "rope_theta": theta}
        elif rope is None and theta is not None:
            rope = {"rope_theta": theta}
        subs = {}
        for name in sorted(set(getattr(cls, "sub_configs", None) or {}) | set(vars(cfg))):
            try:
                sub = vars(cfg)[name] if name in vars(cfg) else getattr(cfg, name, None)
            except Exception:  # noqa: BLE001 (an attribute the config computes and refuses: Gemma 4's per layer)
                continue
            if isinstance(sub, PretrainedConfig) and sub is not cfg:
                subs[name] = view(sub)
        return {"class": cls.__name__, "rope": json.loads(json.dumps(rope, default=str)),
                "fields": sorted(fields - {"self", "kwargs"}), "sub": subs}

    out = view(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out["text"] = next((name for name in out["sub"] if getattr(config, name, None) is text), "")
    return out


def load_lm(folder, **kwargs):
    """The checkpoint's language model in float32, eval: its causal LM, or a vision-language model (Qwen2.5-VL,
    Qwen3-VL: ``AutoModelForImageTextToText``), which a text prompt runs with every rope stream at the text position."""
    import torch
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return model.eval()


def transformers_probe(job):
    from pathlib import Path

    import torch
    import transformers

    target = Path(job["target"])
    kwargs = {"gguf_file": target.name} if target.is_file() else {}
    folder = target.parent if target.is_file() else target
    model = load_lm(folder, **kwargs)
    logprobs = transformers_logprobs(model, job["tokens"])
    config = config_view(model.config)
    if target.is_file():  # the GGUF keys transformers' loader reads (into the config), per architecture
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        config["gguf_read"] = {arch: sorted(keys) for arch, keys in GGUF_CONFIG_MAPPING.items()}
    return {"logprobs": logprobs, "version": f"transformers {transformers.__version__}", "max_length": None,
            "planned": len(job["tokens"]), "dtype": "float32",
            "notes": [f"max_position_embeddings {getattr(model.config, 'max_position_embeddings', None)} "
                      "(transformers serves any length)"], "config": config}


def _is_mla(folder):
    """Whether the checkpoint's attention is DeepSeek's multi-head latent attention (its config has a KV latent)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return bool(config.get("kv_lora_rank") or (config.get("text_config") or {}).get("kv_lora_rank"))


def vllm_probe(job):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: the probe's
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import ModelConfig
    from vllm.inputs import TokensPrompt

    length = job["length"]
    overrides = job.get("hf_overrides") or {}
    model_config = ModelConfig(model=job["target"], skip_tokenizer_init=True, hf_overrides=overrides)
    derived = model_config.max_model_len
    notes = []
    if derived < length:
        # vLLM refuses a max_model_len past the one it derives unless told: the probe still measures the formula
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        notes.append(f"vLLM derives max_model_len {derived}: the probe ran at {length} with "
                     "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    options = {}
    if _is_mla(job["target"]):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM picks its AMX_MLA backend on a CPU with AMX whatever the dtype, and it refuses float32 weights
            # (bfloat16 only): CPU_MLA takes them, on every CPU
            options["attention_backend"] = "CPU_MLA"
            notes.append("MLA on vLLM's CPU backend: attention_backend CPU_MLA (float32)")
    llm = LLM(model=job["target"], skip_tokenizer_init=True, dtype="float32", max_model_len=max(length, derived),
              enforce_eager=True, seed=0, hf_overrides=overrides, **options)
    # vLLM serves a prompt shorter than max_model_len only (prompt + the token it asks for): the prompt is the probe
    # less its last token, which the one generated step scores (its logits are the last prompt row's; the raw
    # log-probability, taken before allowed_token_ids masks the rest). The request's planned length (prompt +
    # max_tokens, a per-request method's table) is then the probe's length, and no position past it runs.
    tokens = job["tokens"]
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens[:-1])],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0,
                                      allowed_token_ids=[tokens[-1]]), use_tqdm=False)[0]
    logprobs = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    step = out.outputs[0]
    if list(step.token_ids) != [tokens[-1]] or tokens[-1] not in step.logprobs[0]:
        raise RuntimeError(f"vLLM generated {list(step.token_ids)}, not the probe's last token {tokens[-1]}")
    logprobs.append(step.logprobs[0][tokens[-1]].logprob)
    plugin = "ropescale.vllm.rotary" in sys.modules  # imported by the plugin only when it is active
    notes.append("ropescale's vLLM plugin loaded" if plugin else "ropescale's vLLM plugin not loaded (stock vLLM)")
    served = getattr(getattr(llm, "llm_engine", None), "model_config", None) or model_config
    return {"logprobs": logprobs, "version": f"vLLM {vllm.__version__}", "max_length": derived, "notes": notes,
            "prompt": len(tokens) - 1, "planned": len(tokens[:-1]) + 1, "dtype": "float32",
            "config": config_view(served.hf_config)}


class _EngineStartFailed(Exception):
    """An SGLang child process failed at engine start (it sends the probe SIGQUIT)."""


def _start_failed(signum, frame):
    """The probe's SIGQUIT handler while SGLang starts (its own kills this process, and the reason with it)."""
    raise _EngineStartFailed()


def _last_error(text):
    """The last ``SomeError: message`` line of a traceback in ``text``, or None."""
    import re

    lines = [line.strip() for line in text.splitlines() if re.match(r"^\s*[A-Za-z_.]*(Error|Exception): ", line)]
    return lines[-1] if lines else None


def sglang_probe(job):
    import signal
    import tempfile

    import torch

    if not torch.cuda.is_available():  # SGLang's CPU engine (../shared/SGLANG.md): torch_native attention
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang
    import transformers
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils.common import kill_process_tree
    from sglang.srt.utils.hf_transformers import common

    load_plugins()  # as the engine does first: the context length below is the one the engine derives

    length, tokens = job["length"], job["tokens"]
    overrides = job.get("hf_overrides") or {}
    config = transformers.AutoConfig.from_pretrained(job["target"], **overrides)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    derived = common.get_context_length(text)
    notes = []
    # SGLang takes a prompt shorter than its context length less 6 (the token asked for, and 5 it keeps)
    served = max(length + 8, derived)
    if derived < served:
        os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
        notes.append(f"SGLang derives context length {derived}: the probe ran with context length {served} "
                     "(SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1)")
    options = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
               "mem_fraction_static": 0.05, "max_total_tokens": max(4096, 2 * served)} \
        if not torch.cuda.is_available() else {}
    if overrides:
        options["json_model_override_args"] = json.dumps(overrides)

    # A child's traceback (a model SGLang refuses to build) goes to the shared stderr: kept to name the refusal
    log = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        engine = sglang.Engine(model_path=job["target"], skip_tokenizer_init=True, dtype="float32",
                               context_length=served, random_seed=0, log_level="error",
                               custom_sigquit_handler=_start_failed, **options)
    except _EngineStartFailed:
        kill_process_tree(os.getpid(), include_parent=False)
        log.seek(0)
        raise _EngineStartFailed(_last_error(log.read().decode(errors="replace"))
                                 or "SGLang's engine failed at start") from None
    finally:
        os.dup2(saved, 2)
        log.seek(0)
        sys.stderr.write(log.read().decode(errors="replace"))
        log.close()
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    try:
        out = engine.generate(input_ids=[list(tokens)], sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0)[0]
    finally:
        engine.shutdown()
    rows = out["meta_info"]["input_token_logprobs"]  # (logprob, token id, text) per prompt token; the first's None
    # (SGLang 0.5 shows the ids from vocab_size - 1 up as 0: image-token padding, its comment says)
    last = int(getattr(text, "vocab_size", 0) or 0) - 1
    if len(rows) != len(tokens) or any(row[1] != t for row, t in zip(rows, tokens) if t < last):
        raise RuntimeError("SGLang's prompt log-probabilities are not of the probe's tokens")
    logprobs = [float(row[0]) for row in rows[1:]]
    plugin = "ropescale.sglang.rotary" in sys.modules  # imported by the plugin only when it is active
    notes.append("ropescale's SGLang plugin loaded" if plugin
                 else "ropescale's SGLang plugin not loaded (stock SGLang)")
    return {"logprobs": logprobs, "version": f"SGLang {sglang.__version__}", "max_length": derived, "notes": notes,
            "planned": len(tokens) + 1, "dtype": "float32", "config": config_view(config)}


def llama_cpp_probe(job):
    import llama_cpp
    import numpy as np

    tokens, length = job["tokens"], job["length"]
    llm = llama_cpp.Llama(model_path=job["target"], n_ctx=length, n_batch=min(length, 2048),
                          n_ubatch=min(length, 512), logits_all=True, verbose=False, flash_attn=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          n_threads=os.cpu_count() or 1)
    llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens) - 1])
    logprobs = _log_probs_of(((start, scores[start: start + CHUNK]) for start in range(0, len(scores), CHUNK)),
                             tokens)
    return {"logprobs": logprobs, "version": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
            "max_length": int(llm._model.n_ctx_train()), "notes": ["K and V cache in float32"],
            "planned": len(tokens), "dtype": _gguf_dtype(llm)}


def _gguf_dtype(llm):
    """"float32" for a GGUF of float32 weights (general.file_type 0, ALL_F32), else its file type: llama.cpp computes
    a quantised or float16 weight's products from activations rounded to that type."""
    file_type = str((getattr(llm, "metadata", None) or {}).get("general.file_type", ""))
    return "float32" if file_type == "0" else f"GGUF file type {file_type or 'unknown'}"


PROBES = {"transformers": transformers_probe, "vllm": vllm_probe, "sglang": sglang_probe,
          "llama.cpp": llama_cpp_probe}


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    try:
        result = PROBES[job["engine"]](job)
    except _EngineStartFailed as err:  # the error line of the engine's child process
        result = {"error": str(err)}
    except Exception as err:  # noqa: BLE001 (the engine's refusal is the result)
        result = {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
    print("PROBE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
