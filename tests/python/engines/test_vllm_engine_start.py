"""What a user of vLLM + ropescale sees at engine start and around it (issue 42's serving audit; docs/DESIGN.md,
"Engines"):

1. no engine: the startup line says what the plan does (a per-request checkpoint's rule, a request without max_tokens
   included, never ReRoPE's fields where there is no ReRoPE); a per-request checkpoint without a planning budget is
   warned about (vLLM's chat endpoint plans such a request at max_model_len); a Self-Extend that is plain RoPE or
   ReRoPE at every length served is warned about; a refusal raised in an engine process is written where the front
   end reads it, and ends the front end's error;
2. an engine (slow): a refused checkpoint's reason is the last line of the error vLLM raises at engine start, with
   the engine core and worker in processes of their own (vLLM's default).

(The seeded requests with a chunked prompt that vLLM 0.32's CPU runner dies on without the plugin are served in
test_vllm.py's engine processes.)

Runs on the vLLM leg (scripts/test_torch_compat.sh); skips elsewhere.
"""

import json
import logging
import types
import warnings

import pytest
import torch

from support.vllm_engine import run_engines
from support.vllm_testing import ORIGINAL, plugin_isolated, require_vllm, served_llama

require_vllm()

from ropescale import config as config_lib, hf, scaling  # noqa: E402
from ropescale.vllm import attention, attention_steps, engine  # noqa: E402


@pytest.fixture(autouse=True)
def isolated():
    with plugin_isolated():
        yield
    attention_steps.PROMPT_LENS.update(runner=None, tensor=None)


class Lines(logging.Handler):
    """The plugin's log lines (its logger does not propagate to the root, so caplog misses them)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))

    def text(self, level):
        return "\n".join(message for name, message in self.records if name == level)


def start(config, max_model_len=256, generation=None):
    """The plugin's startup of a pre-RoPE model (get_rope's pass-through), as the worker builds it: its INFO and
    WARNING lines. ``generation``: what vLLM reads of the model's generation config (``get_diff_sampling_param``)."""
    model_config = types.SimpleNamespace(hf_config=config, max_model_len=max_model_len,
                                         get_diff_sampling_param=lambda: dict(generation or {}))
    vllm_config = types.SimpleNamespace(model_config=model_config, parallel_config=types.SimpleNamespace())
    attention.register_backends()
    attention._warned.discard("active")  # once per process: this test's
    lines = Lines()
    attention.logger.addHandler(lines)
    try:
        parsed = config_lib.read_config(config)
        attention.pass_through(16, 16, config.max_position_embeddings, True, parsed, vllm_config)
    finally:
        attention.logger.removeHandler(lines)
    return lines.text("INFO"), lines.text("WARNING")


PER_REQUEST = scaling.DynamicYaRN(original_max_position=ORIGINAL, per="request")


def start_per_request(config, max_model_len=256, generation=None):
    """The plugin's startup of a per-request model (get_rope's rotary, rotated at write): its INFO and WARNING lines."""
    from ropescale.vllm import rotary

    model_config = types.SimpleNamespace(hf_config=config, max_model_len=max_model_len,
                                         get_diff_sampling_param=lambda: dict(generation or {}))
    vllm_config = types.SimpleNamespace(model_config=model_config, parallel_config=types.SimpleNamespace())
    rotary._warned.discard("request")  # once per process: this test's
    lines = Lines()
    attention.logger.addHandler(lines)
    try:
        parsed = config_lib.read_config(config)
        layer = rotary.request_rotary(16, 16, config.max_position_embeddings, True, torch.float32, parsed, False,
                                      vllm_config)
    finally:
        attention.logger.removeHandler(lines)
    assert isinstance(layer, rotary.RequestRotaryEmbedding)
    return lines.text("INFO"), lines.text("WARNING")


def test_a_per_request_checkpoint_says_its_plan_and_the_rule_of_a_request_without_max_tokens():
    config = hf.patch(served_llama(), PER_REQUEST).config
    info, warning = start_per_request(config)
    assert "keys rotated when written, served by vLLM's own attention backend" in info, info
    assert "per='request'" in info and "prompt + max_tokens" in info and f"fits {ORIGINAL}" in info, info
    assert "16 offline (SamplingParams()) and on /v1/completions" in info, info
    assert "leaky_k" not in info and "window" not in info, info  # no ReRoPE here (the audit's startup line)
    assert "a chat request without max_tokens is planned at max_model_len (256 tokens)" in warning, warning
    assert "ropescale extend --max-new-tokens N" in warning
    info, warning = start_per_request(config, generation={"max_tokens": 20})  # generation_config.json max_new_tokens
    assert "the generation config's max_new_tokens, 20 (it stops there: finish_reason 'length')" in info, info
    assert warning == ""


@pytest.mark.parametrize("arguments,expected", [
    (dict(scaling=scaling.DynamicYaRN(original_max_position=ORIGINAL)), "per step: each row takes the table of its "
                                                                         "own length"),
    (dict(attention="rerope", window=8), "ReRoPE window 8; table Default"),
    (dict(attention="rerope", window=8, leaky_k=4.0, logn_length=ORIGINAL), "Leaky ReRoPE window 8, leaky_k 4, "
                                                                            f"log-n past {ORIGINAL}"),
    (dict(attention="self_extend", window=16, group=5), "Self-Extend window 16, group 5"),
    (dict(attention="dual_chunk", chunk_size=48, local_size=12, temperature="chunkllama"),
     f"Dual Chunk Attention chunk_size 48, local_size 12, temperature chunkllama's at length {ORIGINAL}"),
])
def test_the_startup_line_says_what_the_plan_is(arguments, expected):
    info, warning = start(hf.patch(served_llama(), **arguments).config)
    assert expected in info and warning == "", (info, warning)


@pytest.mark.parametrize("window,group,expected", [
    (16, 5, None),
    (300, 5, "served up to 256 tokens, is plain RoPE attention there: every distance is below the window"),
    (16, 256, "served up to 256 tokens, is ReRoPE with window 16 there"),
    (16, 1, "is plain RoPE attention at every length"),
])
def test_a_self_extend_that_is_another_method_wherever_it_is_served_is_warned_about(window, group, expected):
    with warnings.catch_warnings():  # hf.patch's own warning (the length it writes) is test_hf_self_extend_dca's
        warnings.simplefilter("ignore")
        config = hf.patch(served_llama(), attention="self_extend", window=window, group=group).config
    _, warning = start(config, max_model_len=256)
    assert (expected in warning) if expected else warning == "", warning


def test_a_refusal_in_an_engine_process_ends_the_front_ends_error(monkeypatch, tmp_path):
    """The mechanism without an engine: the front end names a file (its engine processes inherit the variable), a
    ropescale refusal raised in an engine process is written there (other errors are not), and the front end's
    wait for its engines ends its error with it; a start that does not fail is left alone."""
    from vllm.v1.engine import utils

    monkeypatch.setenv(engine.REASONS_ENV, "")  # none named yet; the one install names is gone after the test

    @engine.reported
    def build(message, kind=NotImplementedError):  # a ropescale layer refusing the model in an engine process
        raise kind(message)

    outcome = {"refusal": None, "fails": True}

    def stock_wait(*args, **kwargs):  # the engine processes run while the front end waits for them
        if outcome["refusal"] is not None:
            try:
                build(*outcome["refusal"])
            except Exception:  # noqa: BLE001 (the engine process dies of it)
                pass
        if outcome["fails"]:
            raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
        return "started"

    monkeypatch.setattr(utils, "wait_for_engine_startup", stock_wait)
    assert engine.install_startup_reasons()
    assert not engine.install_startup_reasons()  # once per process
    outcome["refusal"] = ("ropescale.vllm: the reason",)
    with pytest.raises(RuntimeError) as caught:
        utils.wait_for_engine_startup()
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("Engine core initialization failed")
    assert lines[-1] == "ropescale refused the model: NotImplementedError: ropescale.vllm: the reason"
    # the next engine's start: the file is cleared first (the refusal above was another engine's), and an error
    # that is not ropescale's is not written
    outcome["refusal"] = ("a worker's own error", ValueError)
    with pytest.raises(RuntimeError, match=r"Failed core proc\(s\): \{\}$"):
        utils.wait_for_engine_startup()
    outcome.update(refusal=None, fails=False)
    assert utils.wait_for_engine_startup() == "started"


# ---------------------------------------------------------------------------------------------
# 2. Engines


@pytest.mark.slow
def test_a_refused_checkpoints_reason_is_the_last_line_of_vllms_error(tmp_path):
    """An NTK-aware checkpoint whose rope_parameters were edited by hand (its recorded method no longer matches) is
    refused in the worker as the model is built; with the engine core and worker in processes of their own, the
    error vLLM raises in the front end ends with that reason, not with "See root cause above"."""
    path = tmp_path / "edited"
    hf.patch(served_llama(), scaling.NTK(factor=4.0)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] *= 2
    (path / "config.json").write_text(json.dumps(config))
    engines = [{"id": "edited", "path": str(path), "options": dict(enforce_eager=True, max_model_len=64),
                "batches": []}]
    results, log = run_engines(tmp_path, engines, {"VLLM_CPU_KVCACHE_SPACE": "1",
                                                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, timeout=600)
    error = results[0].get("error", "")
    assert error.startswith("RuntimeError: Engine core initialization failed"), (error, log[-3000:])
    last = error.splitlines()[-1]
    assert last.startswith("ropescale refused the model: ValueError: ropescale.vllm: config.ropescale.method") and \
        "the config was edited by hand" in last, error
