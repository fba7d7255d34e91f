"""ropescale's side of ``verify``: the probe's tokens (:func:`probe_tokens`) and ropescale's forward of the same
weights under a hypothesis (:func:`reference_logprobs`, transformers + ``hf.patch``, float32, and its float64 twin
that measures the float32 reference's own noise). :mod:`ropescale.verify` is the public path of these names."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .verify_hypotheses import Hypothesis


def probe_tokens(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A random block and its repeat (``length`` tokens), ids from the upper three quarters of the vocabulary (the
    lowest ids are the special tokens of most tokenizers)."""
    if vocab_size < 8:
        raise ValueError(f"a vocabulary of {vocab_size} tokens is too small to probe")
    block = torch.randint(vocab_size // 4, vocab_size, ((length + 1) // 2,),
                          generator=torch.Generator().manual_seed(seed)).tolist()
    return (block * 2)[:length]


def reference_model(target: Path):
    from . import hf  # noqa: F401  (ropescale's rope types)

    if target.is_file():
        from . import realmodel

        return realmodel.load_gguf_model(target, torch.float32, False, with_tokenizer=False)[0]
    from ._verify_probe import load_lm

    return load_lm(target)


def reference_logprobs(model, h: Hypothesis, tokens: list[int], planned: int | None = None,
                       prompt: int | None = None) -> torch.Tensor:
    """ropescale's forward of ``model`` under hypothesis ``h``: float64 log-probability of each token after the
    first, scored by the same function as the transformers engine's (``_verify_probe.transformers_logprobs``).
    ``planned``: the request's planned length as the engine counted it (prompt + the tokens it asked for; default
    the prompt's): a per-request method's table is that length's (``hf.request``). ``prompt``: the tokens of the
    engine's one forward (default all; vLLM's is the probe less its last token): a per-step table is that length's."""
    from . import hf

    prompt = len(tokens) if prompt is None else int(prompt)
    planned = len(tokens) if planned is None else int(planned)
    if not len(tokens) - 1 <= prompt <= len(tokens) or planned < len(tokens):
        raise ValueError(f"a forward of {prompt} tokens planned at {planned} for a probe of {len(tokens)}")

    def score(patched):
        from . import _verify_probe

        with hf.request(patched, max_new_tokens=planned - prompt):
            return torch.tensor(_verify_probe.transformers_logprobs(patched, tokens, prompt), dtype=torch.float64)

    return _reference_forward(model, h, score)


def _reference_forward(model, h: Hypothesis, score) -> torch.Tensor:
    from . import hf
    from .hf import architectures

    arch = architectures.find(model.config)
    if h.layout or arch is not None and arch.fixed_method:
        # the family derives more than the rope from rope_parameters when it is built (DeepSeek's MLA: its softmax
        # scale from mscale_all_dim and the factor), so patch takes only the config's own method: the model of each
        # formula is built from a config that holds it, on the same weights, and serves it as a reload would
        with warnings.catch_warnings():  # what a wrong formula's config would warn a user of is no news here
            warnings.filterwarnings("ignore", message="ropescale: ", category=UserWarning)
            model = built_with(model, h)
            hf.patch(model, attention=h.attention, **h.parameters)
        return score(model)
    # the attention always named: None would keep the checkpoint's own (a ReRoPE checkpoint's "plain" hypothesis)
    hf.patch(model, h.method, attention=h.attention, **h.parameters)
    try:
        return score(model)
    finally:
        hf.unpatch(model)


def float64_reference(model, h: Hypothesis, tokens: list[int], planned: int | None = None,
                       prompt: int | None = None) -> torch.Tensor:
    """:func:`reference_logprobs` with ``model`` in float64 (converted in place and back: float32 -> float64 ->
    float32 is exact), which measures the float32 reference's own noise."""
    torch.nn.Module.double(model)  # nn.Module's: transformers refuses .float() of a model a GGUF was dequantised to
    try:
        return reference_logprobs(model, h, tokens, planned, prompt)
    finally:
        torch.nn.Module.float(model)


def built_with(model, h: Hypothesis):
    """``model``'s class built from its config with ``h``'s method written in (as ``extend`` writes it), holding
    ``model``'s parameters (the same tensors, not copies: only the new model's own initial ones are allocated, for
    the time the class takes to build)."""
    import copy

    from .hf import checkpoint

    config = copy.deepcopy(model.config)
    if h.layout:
        config.rope_parameters = {**config.rope_parameters, **dict(h.layout)}
    checkpoint.record(config, h.method, h.attention, h.parameters)
    with torch.no_grad():
        built = type(model)(config).eval()
        built.load_state_dict(model.state_dict(), strict=True, assign=True)
    return built
