"""What the plugin changes in vLLM's engine beyond ropescale's own layers (docs/DESIGN.md, "Engines"):

- ropescale's reason for refusing a model at engine start is the last thing a user sees. vLLM builds the model in a
  worker process; when that fails, the front end raises only "Engine core initialization failed. See root cause
  above." at the end of three tracebacks (``vllm/v1/engine/utils.py``, ``wait_for_engine_startup``), and no
  process passes the cause on. So the first process the plugin runs in (the front end) names a file in the
  environment the engine processes it starts inherit; a refusal raised by ropescale's layers there is written to it
  (:func:`reported`), and ``wait_for_engine_startup`` (wrapped in every process: only a front end calls it) adds
  it to its own error;
- a seeded request whose prompt is chunked no longer kills vLLM's CPU engine (vLLM 0.32:
  ``GPUModelRunner._bookkeeping_sync`` rewinds the seeded generator of every row whose sampled token it discards,
  a partial prefill's, with ``gen.set_offset(gen.get_offset() - 4)``: CUDA's Philox offset, which a CPU
  ``torch.Generator`` refuses: "CPU Generator does not use offset"). On the CPU platform the seeded generators of
  those rows sit out ``sample_tokens``: the token vLLM throws away is drawn from the global generator, so the
  request's own stream is not advanced (what the CUDA rewind restores) and the rewind finds nothing to rewind. A
  chunked seeded request then samples what the same request unchunked samples (tested);
- a Llama 4 checkpoint ropescale wrote gets its NoPE layers' attention temperature as its config says
  (``attn_temperature_tuning``, what transformers runs): vLLM 0.32's ``Llama4ForCausalLM`` reads it from the generation
  config only, whose loader drops the key, and otherwise turns it on only past a ``max_model_len`` of 32768, so such a
  checkpoint was served without it, silently (0.027 nats at the conformance matrix's tiny Llama 4).
"""

from __future__ import annotations

import atexit
import functools
import os
import tempfile

#: The environment variable naming the file engine processes write ropescale's refusals to (set by the front end).
REASONS_ENV = "ROPESCALE_VLLM_REASONS"


def reported(function):
    """``function`` (a ropescale layer's constructor or ``get_rope``), its ropescale refusals also written where the
    front end reads them (:func:`install_startup_reasons`)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 (re-raised as it is)
            if str(err).startswith("ropescale"):
                record_reason(err)
            raise

    return wrapper


def record_reason(err: BaseException) -> None:
    """Append ``err`` (one line) to the front end's reasons file, where there is one."""
    path = os.environ.get(REASONS_ENV)
    if not path:
        return
    line = f"{type(err).__name__}: {err}".replace("\n", " ")
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:  # the front end's file is gone: its error message is then vLLM's alone
        pass


def _reasons(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError:
        return []


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _reasons_file() -> str:
    """The reasons file this process and the engine processes it starts share: the one named in the environment (by
    the front end that started this process), else a new one, named there for the processes this one starts."""
    path = os.environ.get(REASONS_ENV)
    if path and os.path.exists(path):
        return path
    handle, path = tempfile.mkstemp(prefix="ropescale-vllm-reasons-", suffix=".txt")
    os.close(handle)
    os.environ[REASONS_ENV] = path
    atexit.register(_remove, path)
    return path


def install_startup_reasons() -> bool:
    """Name the reasons file (:func:`_reasons_file`) and wrap vLLM's ``wait_for_engine_startup`` (what a front end
    calls while its engine processes start) so that its failure ends with the reasons they wrote. Idempotent;
    returns whether it wrapped now."""
    try:  # vLLM: imported only once the plugin runs inside it (vllm/__init__.py)
        from vllm.v1.engine import utils
    except ImportError:  # a vLLM without V1's engine utilities: its own message stays
        return False
    stock = getattr(utils, "wait_for_engine_startup", None)
    if stock is None or getattr(stock, "_ropescale", False):
        return False
    path = _reasons_file()

    @functools.wraps(stock)
    def wait_for_engine_startup(*args, **kwargs):
        open(path, "w").close()  # this engine's reasons only (a process may start several engines)
        try:
            return stock(*args, **kwargs)
        except RuntimeError as err:
            reasons = _reasons(path)
            if not reasons:
                raise
            raise RuntimeError(f"{err}\nropescale refused the model: " + "\n".join(dict.fromkeys(reasons))) from None

    wait_for_engine_startup._ropescale = True  # type: ignore[attr-defined]
    utils.wait_for_engine_startup = wait_for_engine_startup
    return True


def install_seeded_sampling_fix() -> bool:
    """On vLLM's CPU platform: a chunked prompt's discarded sample no longer touches its request's seeded generator
    (see the module docstring). Idempotent; returns whether the runner was patched."""
    from vllm.platforms import current_platform  # vLLM: as above

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    return _wrap_once(GPUModelRunner, "sample_tokens", _held_seeded_generators)


def _held_seeded_generators(stock):
    def sample_tokens(self, *args, **kwargs):
        generators = getattr(getattr(self, "input_batch", None), "generators", None)
        mask = getattr(self, "discard_request_mask", None)
        held = {}
        if generators and mask is not None and getattr(self, "execute_model_state", None) is not None:
            for row in mask.np[: self.input_batch.num_reqs].nonzero()[0].tolist():
                generator = generators.get(row)
                if generator is not None and generator.device.type == "cpu":
                    held[row] = generators.pop(row)
        try:
            return stock(self, *args, **kwargs)
        finally:
            if held:
                generators.update(held)

    return sample_tokens


def _wrap_once(owner, name: str, wrapper) -> bool:
    """``owner.name`` replaced by ``wrapper(stock)`` (marked, so a second install leaves it); True."""
    stock = getattr(owner, name)
    if not getattr(stock, "_ropescale", False):
        wrapped = functools.wraps(stock)(wrapper(stock))
        wrapped._ropescale = True
        setattr(owner, name, wrapped)
    return True


#: The Llama 4 config key of its NoPE layers' attention temperature, which vLLM reads from the generation config only.
NOPE_TEMPERATURE_KEY = "attn_temperature_tuning"


def install_nope_temperature() -> bool:
    """vLLM's generation config of a checkpoint ropescale wrote carries the config's ``attn_temperature_tuning`` (see
    the module docstring) unless the generation config (or ``--override-generation-config``) says it; any other
    model's is vLLM's own. Idempotent; returns whether ``ModelConfig`` was patched."""
    try:
        from vllm.config.model import ModelConfig  # vLLM: the class whose generation config Llama 4 reads
    except ImportError:
        return False
    return _wrap_once(ModelConfig, "try_get_generation_config", _with_nope_temperature)


def _with_nope_temperature(stock):
    def try_get_generation_config(self):
        from .. import serving

        config = stock(self)
        text = getattr(self, "hf_text_config", None)
        value = getattr(text, NOPE_TEMPERATURE_KEY, None)
        if NOPE_TEMPERATURE_KEY not in config and isinstance(value, bool) \
                and serving.config_written_by_ropescale(text):
            config = {**config, NOPE_TEMPERATURE_KEY: value}
        return config

    return try_get_generation_config
