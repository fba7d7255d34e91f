"""The pre-RoPE plan a vLLM process serves: the one ``get_rope`` recorded at model build (:func:`current_plan`), the
one a config gives (:func:`served_plan`, with the checks that the plugin's code reaches the layers that rotate), the
engine settings it is checked against, and the line that describes it at engine start (:func:`describe_plan`).
:mod:`ropescale.vllm.attention` is the public path of these names."""

from __future__ import annotations

from .. import attentions, config as config_lib, serving
from ..serving import NO_WINDOW, PreRopePlan


# The plan of the pre-RoPE model this process serves, recorded by get_rope at model build (vLLM builds one
# model per worker process) with the id of the engine config it was built under, read by the attention
# layers and the metadata builder.
RECORDED_PLAN: dict[str, object] = {}


def current_plan() -> PreRopePlan | None:
    return RECORDED_PLAN.get("plan")  # type: ignore[return-value]


def record_plan(plan: PreRopePlan, vllm_config) -> None:
    if RECORDED_PLAN.get("config") == id(vllm_config) and RECORDED_PLAN.get("plan") != plan:
        raise NotImplementedError(f"ropescale.vllm: the layers of one model ask for two pre-RoPE plans, "
                                  f"{RECORDED_PLAN['plan']} and {plan}; ropescale serves one per model")
    RECORDED_PLAN.update(config=id(vllm_config), plan=plan)


def max_model_len(vllm_config) -> int | None:
    value = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_temperature(plan: PreRopePlan, vllm_config) -> None:
    """Refuse the configurations where DCA's temperature cannot be served exactly: it needs each row's position,
    read from vLLM's host lengths, which under asynchronous speculative decoding are an upper bound (the length if
    every draft is accepted), so a rejected draft would shift the next rows' factors."""
    if not plan.temperature_length:
        return
    speculative = getattr(vllm_config, "speculative_config", None)
    asynchronous = bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))
    if speculative is not None and asynchronous:
        raise NotImplementedError(
            f"ropescale.vllm: Dual Chunk Attention's temperature (original_max_position_embeddings = "
            f"{plan.temperature_length}, served up to {max_model_len(vllm_config)} tokens) takes each row's position "
            "from vLLM's host lengths, which asynchronous scheduling with speculative decoding only bounds: serve it "
            "without speculative decoding, with --no-async-scheduling, or with max_model_len <= "
            f"{plan.temperature_length} (no temperature there)")



def unset_max_tokens_default(vllm_config) -> int | None:
    """What vLLM's chat endpoint gives a request that sets neither max_tokens nor max_completion_tokens: the
    model's generation config ``max_new_tokens`` (with ``--override-generation-config`` applied; none under
    ``--generation-config vllm``), or None: then ``max_model_len`` less the prompt."""
    model_config = getattr(vllm_config, "model_config", None)
    try:
        value = model_config.get_diff_sampling_param().get("max_tokens")
    except Exception:  # noqa: BLE001 (an unreadable generation config reads as none, as vLLM's own falls back)
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def describe_plan(plan: PreRopePlan, unset_max_tokens: int | None = None) -> str:
    """What the engine does with each request under ``plan``, for the startup line: the attention's settings,
    and for a length-dependent table which length each row's table is for (under ``per="request"``: the rule a
    request without max_tokens is planned by, ``unset_max_tokens`` the chat default :func:`unset_max_tokens_default`
    read)."""
    method = type(plan.method).__name__ + (" with Resonance" if plan.method.resonance else "")
    original = getattr(plan.method, "original_max_position", None)
    parts = [attentions.RAW_KEY[plan.attention].describe(plan)] if plan.window != NO_WINDOW else []
    if plan.per_request:
        parts.append(
            f"{method} per='request': each request runs, for its whole life, the static table of its planned length "
            f"prompt + max_tokens (the native model when that fits {original or 'the original length'}); a request "
            "without max_tokens gets vLLM's default: 16 offline (SamplingParams()) and on /v1/completions, on "
            "/v1/chat/completions " + (f"the generation config's max_new_tokens, {unset_max_tokens} (it stops there: "
                                       "finish_reason 'length')" if unset_max_tokens is not None
                                       else "max_model_len less the prompt (planned at max_model_len)"))
    elif plan.length_dependent:
        parts.append(f"{method} per step: each row takes the table of its own length (the whole prompt's for a "
                     f"prompt row, its position + 1 after it; native up to {original or 'the original length'})")
    else:
        parts.append(f"table {method}")
    return "; ".join(parts)

def served_plan(vllm_config) -> PreRopePlan | None:
    """The plan of the model ``vllm_config`` serves (its config, read as get_rope reads it): a pre-RoPE one, or a
    per-request table rotated at write (``plan.rotated_at_write``); None for any other model."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        return None
    entry = getattr(hf_config, config_lib.CONFIG_KEY, None)
    layer_params = params.values() if config_lib.per_layer_type(hf_config) else (params,)
    if getattr(hf_config, config_lib.DUAL_CHUNK_KEY, None) is None and \
            not any(serving.ropescale_rotary(p, entry) for p in layer_params):
        # get_rope's rule: a model ropescale did not write (a stock `dynamic` config, say) is vLLM's alone, its
        # rotary and its attention
        return None
    try:
        plan = PreRopePlan.of_config(hf_config)
    except (ValueError, TypeError, AttributeError):
        return None  # not ropescale's to judge: get_rope reports it
    if plan is None:
        return None
    _check_layers_reached(plan, vllm_config, hf_config)
    return plan.served_within(max_model_len(vllm_config))


def _check_layers_reached(plan: PreRopePlan, vllm_config, hf_config) -> None:
    """A per-request or pre-RoPE plan works through ropescale's get_rope (and, pre-RoPE, its backend, which serves
    every attention layer of the model): refused by name where those do not reach exactly the layers that rotate,
    which would serve the model silently wrong. vLLM's Transformers modeling backend (SmolLM3 in vLLM 0.32) runs
    the model's own transformers rotary, never get_rope: a per-request SmolLM3 was served 0.14 nats off. A model
    with NoPE layers (``no_rope_layers``: 0) would have them rotated by the pre-RoPE backend."""
    model_config = getattr(vllm_config, "model_config", None)
    what = (f"{type(plan.method).__name__}" + (" per request" if plan.rotated_at_write else " (pre-RoPE: raw keys "
                                                                                          "rotated at attention time)"))
    try:
        transformers_backend = bool(model_config.using_transformers_backend())
    except (AttributeError, TypeError):
        transformers_backend = False
    if transformers_backend:
        raise NotImplementedError(
            f"ropescale.vllm: {what} is not served by vLLM's Transformers modeling backend, which vLLM uses for this "
            f"model ({model_config.architecture}): its rope is the model's own transformers code, which ropescale's "
            "get_rope never reaches, so each request would get another table without a word. Serve a static table "
            "(YaRN), or use transformers + ropescale.hf")
    if not plan.rotated_at_write and 0 in (getattr(hf_config, "no_rope_layers", None) or ()):
        raise NotImplementedError(
            f"ropescale.vllm: {what} on a model with NoPE layers (no_rope_layers) is not served by vLLM: ropescale's "
            "pre-RoPE backend serves every attention layer of the model and would rotate the NoPE layers' keys. "
            "Serve a static or per-request table, or use transformers + ropescale.hf")


def serving_pre_rope() -> bool:
    """Whether the model this process builds is a pre-RoPE one (raw keys; a per-request table rotated at write is
    served by vLLM's own attention)."""
    from vllm.config import get_current_vllm_config_or_none

    plan = served_plan(get_current_vllm_config_or_none())
    return plan is not None and not plan.rotated_at_write
