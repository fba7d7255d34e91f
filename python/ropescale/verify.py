"""``ropescale verify``: does an engine apply the rope scaling a checkpoint or GGUF declares? (issue 45, part 3)

What the target declares is read as ropescale reads it (:func:`declared`): the method, its table and attention factor
at the probe's length, the length the target is served to. The engine then runs a synthetic prompt past the original
length (a random block and its repeat, so that the second half's log-probabilities depend on attending back across
the whole distance) in its own process (``_verify_probe.py``: the engine's process holds only what a user's would).
Its prompt log-probabilities are compared with ropescale's forward of the same weights (transformers + ``hf.patch``,
float32) under the declared method and under each way an engine is known to get it wrong (:func:`hypotheses`): the
scaling ignored, one parameter at the value an engine takes when it does not read the key, the attention factor 1
(mscale lost), Resonance's rounding dropped, a dynamic scale fixed at the served length, a raw-key attention ignored.

The verdict has an absolute bound (:data:`BOUNDS`, :func:`bound_for`: the engine's own float32 noise): ``exact``
only when the engine's distance to the declared method (mean |delta log p| over the prompt) is within it; else the
wrong formula within the bound of the engine: ``different`` (the parameter, the engine's and the declared value, the
size of the difference) or ``ignored``; else ``unexplained``, with the size. Also ``short`` (not served past length
N), ``refused`` (the engine said so: not silent) or ``inconclusive`` (no answer, nothing to tell apart). Each check
carries its distance and bound. A rope-like key of the target (or of the overrides passed to the engine) that the
engine did not take is a ``rope keys`` check, ``ignored``, naming it (``_verify_keys``). Exit code 0 when every check
is exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import _verify_keys
from . import config as config_lib
from . import ops, scaling

__all__ = ["ENGINES", "Check", "Declared", "Hypothesis", "Report", "declared", "hypotheses", "verify"]


@dataclass(frozen=True)
class Engine:
    """An engine ``verify`` probes: its name (``--engine``), the module it needs, what it runs."""

    name: str
    module: str  # imported only when this engine is asked for
    install: str
    targets: tuple[str, ...]  # "dir" (a transformers checkpoint directory), "gguf"
    refusal: str = ""  # why it does not run the other kind of target, and what to do instead


#: Every engine ``verify`` knows (``_verify_probe.PROBES`` runs each, by name).
ENGINES = {e.name: e for e in (
    Engine("transformers", "transformers", "pip install transformers (and gguf, accelerate for a GGUF)",
           ("dir", "gguf")),
    Engine("vllm", "vllm", "pip install vllm (ropescale's plugin loads with it)", ("dir",),
           "vLLM serves the transformers directory: verify the directory the GGUF was made from"),
    Engine("sglang", "sglang", "pip install sglang (ropescale's plugin loads with it; CPU: scripts/setup_sglang.sh)",
           ("dir",), "SGLang serves the transformers directory: verify the directory the GGUF was made from"),
    Engine("llama.cpp", "llama_cpp", "pip install llama-cpp-python (README, llama.cpp)", ("gguf",),
           "llama.cpp runs GGUF files: convert the directory with llama.cpp's convert_hf_to_gguf.py, write the "
           "method into it with `ropescale extend SRC.gguf DST.gguf --method ...`, and verify DST.gguf"),
)}

VERDICTS = ("exact", "different", "ignored", "unexplained", "short", "refused", "inconclusive")
SAME = 1e-6  # hypotheses whose log-probabilities differ by less (mean nats) cannot be told apart: merged
#: The absolute bound (mean |delta log p|, nats) of an engine's own numerical noise, per engine and the dtype it
#: computes in (the probe's answer "dtype"): "exact" only within it. Measured (docs/DESIGN.md, "Verifying an engine"):
#: float32 engines are 0.5e-6 to 1.4e-6 nats from ropescale's float64 forward of the same formula on the tiny models
#: of the tests; the bound leaves a margin of about 8. A probe's bound is also at least NOISE_MARGIN times its own
#: float32 reference's distance to the float64 one (a deeper model, a longer probe: more float32 noise).
BOUNDS = {("transformers", "float32"): 1e-5, ("vllm", "float32"): 1e-5, ("sglang", "float32"): 1e-5,
          ("llama.cpp", "float32"): 1e-5}
NOISE_MARGIN = 4.0
_ROPE_DICTS = ("rope_parameters", "rope_scaling")  # config keys whose value is a plain dict in every engine


@dataclass(frozen=True)
class Declared:
    """What a target declares: its method as ropescale reads it, the attention, and the lengths."""

    method: scaling.RopeScaling
    base: float
    rotary_dim: int
    original: int  # the length the model was trained to
    served: int  # the length the target is served to
    source: str  # where the declaration was read
    attention: str = "sdpa"
    parameters: dict = field(default_factory=dict)
    vocab_size: int = 0
    config_length: int = 0  # max_position_embeddings (or the GGUF's context_length): a key's fallback
    # the model derives more than the rope from rope_parameters when it is built (DeepSeek's MLA: its softmax scale
    # from mscale_all_dim): two formulas that rotate alike may still differ there
    built_from_config: bool = False
    # the config's partial_rotary_factor (a layout key of the model, not of the method: the rotary dim); 1.0 when it
    # has none, or when the method's own table spans the head (proportional: its own parameter)
    partial_rotary_factor: float = 1.0

    def describe(self) -> str:
        parts = [type(self.method).__name__ + (" with Resonance" if self.method.resonance else "")]
        scale = self.method.scale_at(None)
        if scale is not None:
            parts.append(f"s = {scale:g}")
        parts.append(f"attention factor {self.method.attention_factor:.6g}")
        if self.attention != "sdpa":
            parts.append(f"attention {self.attention}")
        return f"{', '.join(parts)}; trained to {self.original}, served to {self.served} (from {self.source})"


def _target_kind(target: Path) -> str:
    if target.is_dir():
        if not (target / "config.json").is_file():
            raise ValueError(f"{target}: a checkpoint directory needs a config.json")
        return "dir"
    if target.is_file():
        with open(target, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ValueError(f"{target}: not a GGUF file (no GGUF magic) nor a checkpoint directory")
    raise ValueError(f"{target}: neither a checkpoint directory nor a GGUF file")


def _local(path: str | Path, what: str = "") -> Path:
    """``path`` made absolute, and required to exist: every path ``verify`` reads goes through here. The engine's
    process runs in a folder of its own, where a relative path would name nothing (transformers then reads it as a
    hub repository id, and with network access would probe a hub model of that name instead of the user's)."""
    local = Path(os.path.abspath(os.path.expanduser(str(path))))  # not resolve(): a symlinked GGUF keeps its name
    if not local.exists():
        raise ValueError(f"{what}{path}: no such file or directory: verify reads a local checkpoint directory or GGUF "
                         "file, never a hub repository id (download it first, e.g. `hf download ID --local-dir DIR`)")
    return local


def declared(target: str | Path) -> Declared:
    """What ``target`` (a local transformers checkpoint directory or GGUF file) declares."""
    target = _local(target)
    return (_declared_dir if _target_kind(target) == "dir" else _declared_gguf)(target)


def _declared_dir(target: Path) -> Declared:
    from transformers import AutoConfig

    from . import hf  # noqa: F401  (ropescale's rope types, so that the config reads)
    from .hf import architectures

    try:
        cfg = AutoConfig.from_pretrained(target)
    except (OSError, KeyError) as err:  # no model type transformers knows, an unreadable file
        raise ValueError(f"{target}: transformers cannot read this config: {err}") from None
    layer_type = _extended_layer_type(cfg)
    read = config_lib.read_config(cfg, layer_type)
    method = read.method
    mpe = int(cfg.max_position_embeddings)
    original = int(getattr(method, "original_max_position", None) or mpe)
    rotary_dim = config_lib.rotary_dim_of(cfg, config_lib.layer_type_parameters(cfg, layer_type), layer_type)
    return Declared(method, read.base, rotary_dim, original, config_lib.max_model_len_of(cfg, layer_type),
                    f"{target.name}/config.json" + (" (ropescale's entry)" if read.recorded else ""),
                    read.attention, dict(read.parameters), int(cfg.vocab_size), mpe,
                    bool(getattr(architectures.find(cfg), "fixed_method", None)), _layout_partial(cfg, method))


def _extended_layer_type(cfg) -> str | None:
    """For a per-layer-type config (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``), the layer
    type whose rope the probe checks: the first that is not sliding, the one ``hf.patch`` extends by default (the
    references patch it); None for a config with one rope."""
    if not config_lib.per_layer_type(cfg):
        return None
    return next(t for t in cfg.rope_parameters if t != "sliding_attention")


def _layout_partial(cfg, method: scaling.RopeScaling) -> float:
    """The config's ``partial_rotary_factor`` where it narrows the method's table (1.0 otherwise: none, a
    per-layer-type config, or a method whose table spans the head, whose own parameter it is)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    value = params.get("partial_rotary_factor") if not config_lib.per_layer_type(cfg) else None
    if value is None or type(method).head_dim_table:
        return 1.0
    return float(value)


def _declared_gguf(target: Path) -> Declared:
    """A GGUF's declaration: ropescale's record (``llamacpp.METHOD_KEY``) where ``extend`` wrote one, else the GGUF
    rope keys as the GGUF format defines them (type linear/yarn/none, factor, original context, YaRN's betas and
    log multiplier, attn_factor on top of YaRN's own)."""
    from . import llamacpp

    reader, rope = llamacpp.read_rope(target)
    arch = rope.architecture
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(llamacpp._field(reader, f"{arch}.vocab_size", 0) or 0)
    record = llamacpp._field(reader, llamacpp.METHOD_KEY)
    if record is not None:
        try:
            entry = json.loads(record)
            method = scaling.from_hf(entry["rope_parameters"], rope.context_length)
            served, source = int(entry["context_length"]), f"{target.name}: {llamacpp.METHOD_KEY}"
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{target}: ropescale's record ({llamacpp.METHOD_KEY}) does not read: {err}") from None
    else:
        factor = rope.scaling_factor
        original = int(llamacpp._field(reader, f"{arch}.rope.scaling.original_context_length", rope.context_length))
        if rope.has_rope_freqs:
            raise ValueError(f"{target}: {llamacpp.ROPE_FREQS} without ropescale's record ({llamacpp.METHOD_KEY}): "
                             "no declaration to check the engine against")
        if rope.scaling_type == "yarn" and factor > 1:
            log_mul = float(llamacpp._field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
            yarn = scaling.YaRN(
                factor=factor, original_max_position=original,
                beta_fast=float(llamacpp._field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(llamacpp._field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                mscale=1.0 if log_mul else None, mscale_all_dim=log_mul or None)
            method = dataclasses.replace(yarn, attention_factor_override=yarn.attention_factor * rope.attn_factor) \
                if rope.attn_factor != 1.0 else yarn
        elif rope.scaling_type == "linear" and factor > 1:
            method = scaling.Linear(factor=factor)
        elif factor in (0.0, 1.0) and rope.scaling_type in ("linear", "none", "yarn") and rope.attn_factor == 1.0:
            method = scaling.Default()
        else:
            raise ValueError(f"{target}: rope.scaling.type {rope.scaling_type!r} with factor {factor} and attn_factor "
                             f"{rope.attn_factor}: ropescale reads no such declaration")
        served, source = rope.context_length, f"{target.name}: {arch}.rope.* keys"
    original = int(getattr(method, "original_max_position", None) or rope.context_length)
    if record is None and isinstance(method, scaling.Linear):
        original = max(1, int(rope.context_length / method.factor))
    return Declared(method, rope.base, rope.rotary_dim, original, served, source, vocab_size=vocab,
                    config_length=rope.context_length)


@dataclass(frozen=True)
class Hypothesis:
    """One way an engine may run the target: as declared, or one known way of getting it wrong."""

    kind: str  # "declared", "ignored", "parameter", "attention_factor", "fixed", "attention"
    says: str  # the verdict's words when the engine is nearest this one
    method: scaling.RopeScaling
    attention: str = "sdpa"
    parameters: dict = field(default_factory=dict)
    key: str | None = None  # the parameter that differs
    declared_value: Any = None
    engine_value: Any = None
    alternatives: tuple["Hypothesis", ...] = ()  # other wrong formulas that rotate the same at the probe's length
    # rope_parameters edits of the model's own layout (partial_rotary_factor): the reference is the model built from
    # a config that holds them (:func:`_built_with`), on the same weights
    layout: tuple[tuple[str, Any], ...] = ()

    def names(self) -> str:
        """``key engine_value in the engine, declared_value declared`` (and its alternatives')."""
        return "; or, the same rotation at this length, ".join(h._names() for h in (self,) + self.alternatives)

    def _names(self) -> str:
        if self.engine_value is None:  # an optional key the engine does not read: the method's own rule instead
            return (f"{self.key} not read by the engine (its own rule: attention factor "
                    f"{self.method.attention_factor:.6g}), {self.declared_value!r} declared")
        return f"{self.key} {self.engine_value!r} in the engine, {self.declared_value!r} declared"


def _fixed_table(table: torch.Tensor, factor: float, rotary_dim: int, base: float, original: int) -> scaling.LongRoPE:
    """A method whose one table is ``table`` with attention factor ``factor`` (LongRoPE's per-pair factors carry
    any table exactly: ``theta_i / (theta_i / t_i)``)."""
    plain = ops.default_inv_freq(rotary_dim, base, dtype=torch.float64)
    factors = tuple((plain / table.to(torch.float64)).tolist())
    return scaling.LongRoPE(short_factor=factors, long_factor=factors, original_max_position=max(2, original),
                            factor=1.0, attention_factor_override=float(factor))


def hypotheses(d: Declared, length: int) -> tuple[list[Hypothesis], list[str]]:
    """The declared method and every known way of getting it wrong that differs from it at ``length``; and the
    labels of those that rotate as the declared one does there (the probe cannot tell them apart)."""
    m = d.method
    out = [Hypothesis("declared", "applied exactly", m, d.attention, d.parameters),
           Hypothesis("ignored", "silently ignored: the engine runs plain RoPE", scaling.Default())]
    if d.attention != "sdpa":
        out.append(Hypothesis("attention", f"applied with a different formula: the table, without the "
                                           f"{d.attention} attention", m, key="attention",
                              declared_value=d.attention, engine_value="sdpa"))
    for p in type(m).parameters():
        # every key the config carries, a required one too (Llama 3's low/high_freq_factor at Meta's values); a
        # factor ignored is the "ignored" hypothesis, and a key without a default an engine could take is skipped
        # (the replace below refuses it)
        if p.hf_key is None or p.name == "factor" and p.required:
            continue
        value = getattr(m, p.name)
        unread = d.config_length if p.fallback == scaling.FROM_CONFIG_LENGTH else p.default
        if value == unread:
            continue
        try:
            variant = dataclasses.replace(m, **{p.name: unread})
        except (TypeError, ValueError):
            continue  # the default is not valid beside the other values: no engine takes it
        out.append(Hypothesis("parameter", "applied with a different formula", variant, d.attention, d.parameters,
                              p.hf_key, value, unread))
    if m.attention_factor != 1.0 and "attention_factor_override" in {f.name for f in dataclasses.fields(m)}:
        out.append(Hypothesis("attention_factor", "applied with a different formula: the attention factor (mscale) "
                                                  "lost", dataclasses.replace(m, attention_factor_override=1.0),
                              d.attention, d.parameters, "attention factor", m.attention_factor, 1.0))
    if isinstance(m, scaling.LongRoPE) and m.short_factor != m.long_factor:
        # vLLM's own longrope takes the long factors at every length once max_model_len passes the original length
        out.append(Hypothesis("parameter", "applied with a different formula: the short table ignored (the long "
                                           "factors at every length)",
                              dataclasses.replace(m, short_factor=m.long_factor),
                              d.attention, d.parameters, "short_factor", "declared", "long_factor"))
    if m.resonance:
        out.append(Hypothesis("parameter", "applied with a different formula: Resonance's rounding lost",
                              dataclasses.replace(m, resonance=False), d.attention, d.parameters, "resonance", True,
                              False))
    if d.partial_rotary_factor != 1.0:
        # the config's partial_rotary_factor not read: the method's table over the whole head dim
        out.append(Hypothesis("parameter", "applied with a different formula: the rotary over the whole head dim",
                              m, d.attention, d.parameters, "partial_rotary_factor", d.partial_rotary_factor, 1.0,
                              layout=(("partial_rotary_factor", 1.0),)))
    if m.dynamic and d.served != length:
        fixed = _fixed_table(m.inv_freq(d.rotary_dim, d.base, seq_len=d.served, dtype=torch.float64),
                             m.attention_factor_for(d.served), d.rotary_dim, d.base, d.original)
        out.append(Hypothesis("fixed", f"applied with a different formula: one table, the one at the served length "
                                       f"{d.served}, for every length", fixed, d.attention, d.parameters,
                              "scale", f"of the length ({length})", f"of {d.served}"))
    if len(out) == 2 and isinstance(m, scaling.Default) and not m.resonance:
        # plain RoPE declared: "ignored" is the declaration itself; a scaled table gives the verdict its yardstick
        out.append(Hypothesis("parameter", "applied with a different formula: a scaled table", scaling.Linear(
            factor=2.0), d.attention, d.parameters, "table", "default", "linear x2"))
    unique, seen, same = [], [], []
    for h in out:  # hypotheses that are the same rotation at this length are one (the same method, where the model
        # is built from it: Declared.built_from_config)
        key = (h.method.inv_freq(d.rotary_dim, d.base, seq_len=length, dtype=torch.float64),
               h.method.attention_factor_for(length), h.attention, h.method if d.built_from_config else None,
               h.layout)
        twin = next((i for i, k in enumerate(seen)
                     if torch.equal(key[0], k[0]) and key[1:] == k[1:]), None)
        if twin == 0:
            same.append(_label(h))
        elif twin is not None:  # two wrong formulas, one rotation: the verdict names both
            unique[twin] = dataclasses.replace(unique[twin], alternatives=unique[twin].alternatives + (h,))
        else:
            seen.append(key)
            unique.append(h)
    return unique, same


def probe_tokens(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    """A random block and its repeat (``length`` tokens), ids from the upper three quarters of the vocabulary (the
    lowest ids are the special tokens of most tokenizers)."""
    if vocab_size < 8:
        raise ValueError(f"a vocabulary of {vocab_size} tokens is too small to probe")
    block = torch.randint(vocab_size // 4, vocab_size, ((length + 1) // 2,),
                          generator=torch.Generator().manual_seed(seed)).tolist()
    return (block * 2)[:length]


def _reference_model(target: Path):
    from . import hf  # noqa: F401  (ropescale's rope types)

    if target.is_file():
        from . import realmodel

        return realmodel._load_gguf(target, torch.float32, False, with_tokenizer=False)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


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
            model = _built_with(model, h)
            hf.patch(model, attention=h.attention, **h.parameters)
        return score(model)
    # the attention always named: None would keep the checkpoint's own (a ReRoPE checkpoint's "plain" hypothesis)
    hf.patch(model, h.method, attention=h.attention, **h.parameters)
    try:
        return score(model)
    finally:
        hf.unpatch(model)


def _float64_reference(model, h: Hypothesis, tokens: list[int], planned: int | None = None,
                       prompt: int | None = None) -> torch.Tensor:
    """:func:`reference_logprobs` with ``model`` in float64 (converted in place and back: float32 -> float64 ->
    float32 is exact), which measures the float32 reference's own noise."""
    torch.nn.Module.double(model)  # nn.Module's: transformers refuses .float() of a model a GGUF was dequantised to
    try:
        return reference_logprobs(model, h, tokens, planned, prompt)
    finally:
        torch.nn.Module.float(model)


def _built_with(model, h: Hypothesis):
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


@dataclass(frozen=True)
class Check:
    name: str  # "served length", "scaling"
    verdict: str  # one of VERDICTS
    detail: str
    distance: float | None = None  # the engine's from the declared (scaling: mean |delta log p| nats; length: tokens)
    bound: float | None = None  # "exact" only when distance <= bound
    formula: str | None = None  # what explains a wrong verdict: the formula's label (``key=engine value``), the keys

    def measured(self) -> str:
        if self.distance is None:
            return ""
        bound = "none stated" if self.bound is None else f"{self.bound:.3g}"
        return f" [distance {self.distance:.3g}, bound {bound}]"

    @property
    def ok(self) -> bool:
        return self.verdict == "exact"


@dataclass
class Report:
    target: str
    engine: str
    version: str
    declared: str
    length: int
    checks: list[Check]
    distances: dict[str, float]
    notes: list[str]

    @property
    def exit_code(self) -> int:
        return 0 if all(c.ok for c in self.checks) else 1

    def text(self) -> str:
        lines = [f"ropescale verify {self.target} on {self.version}",
                 f"  declared: {self.declared}",
                 f"  probe: {self.length} tokens, the engine's prompt log-probabilities against ropescale's forward "
                 "of the same weights"]
        lines += [f"  note: {n}" for n in self.notes]
        width = max(len(c.name) for c in self.checks)
        lines += [f"  {c.name:<{width}}  {c.verdict.upper() if not c.ok else 'exact'}: {c.detail}{c.measured()}"
                  for c in self.checks]
        failed = sum(not c.ok for c in self.checks)
        lines.append(f"{'every check passed' if not failed else f'{failed} of {len(self.checks)} checks failed'} "
                     f"(exit {self.exit_code})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"target": self.target, "engine": self.engine, "version": self.version, "declared": self.declared,
                "length": self.length, "checks": [dataclasses.asdict(c) for c in self.checks],
                "distances": self.distances, "notes": self.notes, "exit_code": self.exit_code}


def _run_probe(engine: str, target: Path, tokens: list[int], length: int, timeout: float,
               hf_overrides: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ropescale-verify-") as folder:
        # a copy outside the package: run from its own folder, the script's sys.path[0] would make ropescale's
        # subpackages (ropescale/vllm) shadow the engines
        script, job = Path(folder) / "probe.py", Path(folder) / "job.json"
        script.write_text(Path(__file__).with_name("_verify_probe.py").read_text())
        job.write_text(json.dumps({"engine": engine, "target": str(target), "tokens": tokens, "length": length,
                                   **({"hf_overrides": hf_overrides} if hf_overrides else {})}))
        try:
            run = subprocess.run([sys.executable, str(script), str(job)], capture_output=True, text=True,
                                 timeout=timeout, cwd=folder)
        except subprocess.TimeoutExpired:
            return {"error": f"the engine gave no answer in {timeout:g} s (--timeout)", "crashed": True}
    lines = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
    if not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return {"error": f"the engine's process ended (exit {run.returncode}) with no answer: " + " | ".join(tail),
                "crashed": True}
    return json.loads(lines[-1][len("PROBE "):])


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().mean().item()


def _served_check(d: Declared, engine: str, max_length: int | None) -> Check:
    if max_length is None:
        return Check("served length", "exact", f"{engine} bounds no length; the target is served to {d.served}")
    gap = dict(distance=float(abs(max_length - d.served)), bound=0.0)
    if max_length < d.served:
        return Check("served length", "short", f"not served past length {max_length}: the engine reads "
                                                f"{max_length}, the target declares {d.served}", **gap)
    if max_length > d.served:
        return Check("served length", "different", f"the engine serves {max_length} tokens, the target declares "
                                                    f"{d.served}: past {d.served} the table is not the one declared",
                     **gap)
    return Check("served length", "exact", f"{max_length} tokens, as declared", **gap)


def bound_for(engine: str, dtype: str, noise: float) -> float | None:
    """The absolute bound of an ``exact`` verdict (:data:`BOUNDS`): the stated one of ``engine`` computing in
    ``dtype``, at least :data:`NOISE_MARGIN` x ``noise`` (the float32 reference's distance to the float64 one on
    this probe); None where no bound is stated (no verdict is then ``exact``)."""
    stated = BOUNDS.get((engine, dtype))
    return None if stated is None else max(stated, NOISE_MARGIN * noise)


def _scaling_check(hs: list[Hypothesis], logprobs: dict[int, torch.Tensor], engine: torch.Tensor,
                   distances: dict[str, float], bound: float | None, dtype: str = "float32") -> Check:
    """The verdict (module docstring): ``exact`` when the engine is within ``bound`` of the declared method; else the
    wrong formula within ``bound`` of the engine (``different`` naming the key, ``ignored``); else ``unexplained``,
    with the size and the nearest formulas."""
    d_declared = _distance(engine, logprobs[0])
    size = (f"mean |delta log p| {d_declared:.3g} nats against the declared "
            f"(max {(engine - logprobs[0]).abs().max():.3g})")
    if len(hs) == 1:  # nothing to tell the declared method from: no verdict
        return Check("scaling", "inconclusive", "at this length every checked formula gives the declared "
                                                "log-probabilities: probe past the original length (--length)",
                     d_declared, bound)
    if bound is None:
        return Check("scaling", "inconclusive", f"no bound is stated for this engine computing in {dtype} "
                                                f"(verify.BOUNDS): {size}", d_declared, bound)
    near = sorted(range(len(hs)), key=lambda i: _distance(engine, logprobs[i]))
    if d_declared <= bound:
        neighbour = min(range(1, len(hs)), key=lambda i: _distance(logprobs[0], logprobs[i]))
        return Check("scaling", "exact", f"mean |delta log p| {d_declared:.3g} nats (the nearest other formula, "
                                         f"{_label(hs[neighbour])}, is "
                                         f"{_distance(logprobs[0], logprobs[neighbour]):.3g} away)", d_declared, bound)
    within = [i for i in near if i != 0 and _distance(engine, logprobs[i]) <= bound]
    if not within:
        nearest = ", ".join(f"{_label(hs[i])} {distances[_label(hs[i])]:.3g}" for i in near[:3])
        return Check("scaling", "unexplained", f"no checked formula explains the engine within the bound "
                                               f"{bound:.3g}: mean |delta log p| to {nearest} nats; {size}",
                     d_declared, bound)
    h = hs[within[0]]
    also = "".join(f"; as near (within the bound), {_label(hs[i])}" for i in within[1:])
    at = f" (the engine is {_distance(engine, logprobs[within[0]]):.3g} from it)"
    if h.kind == "ignored":
        return Check("scaling", "ignored", f"{h.says}{at}{also}; {size}", d_declared, bound, _label(h))
    return Check("scaling", "different", f"{h.says}: {h.names()}{at}{also}; {size}", d_declared, bound, _label(h))


def _planned(answer: dict, d: Declared, length: int, notes: list[str]) -> int:
    """The request's planned length as the engine counted it (prompt + the tokens it asked for), which the reference
    of a per-request method plans too: the probe's own length when the engine does not say."""
    planned = int(answer.get("planned") or length)
    if planned < length:
        raise RuntimeError(f"the engine planned {planned} tokens for a probe of {length}: a probe bug, please report")
    if planned != length and d.method.per_request:
        notes.append(f"the engine planned the request at {planned} tokens (prompt + the tokens it asked for): the "
                     f"reference's per-request table is that length's")
    return planned


def _label(h: Hypothesis) -> str:
    return {"declared": "declared", "ignored": "plain RoPE", "fixed": "fixed table"}.get(
        h.kind, f"{h.key}={h.engine_value!r}")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (an engine's package), without importing it."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def verify(target: str | Path, engine: str, *, length: int | None = None, timeout: float = 1800.0,
           declared_by: str | Path | None = None, progress: Callable[[str], None] | None = None,
           hf_overrides: dict | None = None) -> Report:
    """Probes ``engine`` on ``target`` (module docstring). ``length``: the probe's prompt length (default: twice the
    original length, at most the served length). ``declared_by``: the checkpoint whose declaration and weights the
    engine is held to, when ``target`` was made from it by another tool (a GGUF that llama.cpp's
    convert_hf_to_gguf.py wrote from a directory ropescale extended: the converter writes only the rope keys it
    knows). ``hf_overrides``: vLLM's, passed to the engine and written into the declaration (a key the engine does
    not take is named: ``_verify_keys``)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; verify knows {', '.join(ENGINES)}")
    spec = ENGINES[engine]
    shown = str(target)
    target = _local(target)  # every path absolute, here, before any engine or reference reads one
    source = _local(declared_by, "declared_by (--declared-by) ") if declared_by is not None else target
    kind = _target_kind(target)
    if kind not in spec.targets:
        raise ValueError(f"{engine} does not run a {'GGUF file' if kind == 'gguf' else 'checkpoint directory'}: "
                         f"{spec.refusal}")
    if hf_overrides and engine not in ("vllm", "sglang"):
        raise ValueError(f"hf_overrides (--hf-overrides) are vLLM's and SGLang's (--json-model-override-args): "
                         f"{engine} takes none")
    nested = sorted(k for k, v in (hf_overrides or {}).items() if isinstance(v, dict) and k not in _ROPE_DICTS)
    if engine == "sglang" and nested:
        raise ValueError(f"hf_overrides {', '.join(nested)}: SGLang sets a config key to the value given (a sub-config "
                         "becomes a plain dict), where vLLM merges it: override the sub-config's own keys in its "
                         "config.json instead")
    if not installed(spec.module):
        raise ValueError(f"--engine {engine} needs the {spec.module} package: {spec.install}")
    say = progress or (lambda message: None)
    d = declared(source) if not hf_overrides else _verify_keys.declared_with(source, hf_overrides)
    if length is None:
        length = min(d.served, 2 * d.original) if d.served > d.original else d.served
    if length < 2:
        raise ValueError(f"the probe needs at least 2 tokens, got {length}")
    if length > d.served:
        raise ValueError(f"--length {length}: the probe runs {length} tokens through the model in one forward (in the "
                         f"engine, and in ropescale's float32 reference once per formula it checks), and "
                         f"{source.name} is served to {d.served} tokens ({d.source}): past that it declares nothing "
                         f"to check, so the probe takes at most {d.served} tokens")
    notes = [] if length > d.original else [f"the probe ({length} tokens) does not pass the original length "
                                            f"{d.original}: what happens past it is not seen"]
    tokens = probe_tokens(d.vocab_size, length)
    hs, same = hypotheses(d, length)
    if same:
        notes.append(f"at {length} tokens these rotate as the declared method does (not checked): {', '.join(same)}")
    say(f"{engine}: {length} tokens")
    answer = _run_probe(engine, target, tokens, length, timeout, **({"hf_overrides": hf_overrides} if hf_overrides
                                                                      else {}))
    if "error" in answer:
        hint = ""
        named = [t for t in scaling.ropescale_rope_types() if f"'{t}'" in answer["error"]]
        if engine == "transformers" and named:
            hint = (f" (plain transformers has no rope type {named[0]!r}, one of ropescale's: `import ropescale.hf` "
                    "registers them, then `ropescale.hf.patch(model)` serves it)")
        check = (Check("scaling", "inconclusive", answer["error"]) if answer.get("crashed") else
                 Check("scaling", "refused", f"the engine refused the target: {answer['error']}{hint}"))
        keys = _verify_keys.check(target, engine, answer, hf_overrides)
        return Report(shown, engine, engine, d.describe(), length, [check] + ([keys] if keys else []), {}, notes)
    engine_logprobs = torch.tensor([math.nan if v is None else v for v in answer["logprobs"]], dtype=torch.float64)
    if engine_logprobs.shape != (length - 1,):
        raise RuntimeError(f"{engine} answered {len(engine_logprobs)} log-probabilities for {length - 1} prompt tokens")
    served = _served_check(d, engine, answer.get("max_length"))
    bad = (~torch.isfinite(engine_logprobs)).nonzero()
    usable = length - 1 if len(bad) == 0 else int(bad[0])  # output rows 0..usable-1 are finite
    if usable < length - 1:
        served = Check("served length", "short", f"not served past length {usable}: the engine's log-probabilities "
                                                  f"are not finite from position {usable} on ({len(bad)} of "
                                                  f"{length - 1}); it reads {answer.get('max_length')}")
        if usable == 0:
            return Report(shown, engine, answer.get("version", engine), d.describe(), length,
                          [served, Check("scaling", "inconclusive", "no finite log-probability to compare")], {},
                          notes + list(answer.get("notes", [])))
        notes.append(f"the scaling is judged on the first {usable} positions (the finite ones)")
    engine_logprobs = engine_logprobs[:usable]
    planned, prompt = _planned(answer, d, length, notes), int(answer.get("prompt") or length)
    model = _reference_model(source)
    logprobs, unrunnable = {}, []
    for i, h in enumerate(hs):
        say(f"ropescale: {_label(h)} ({i + 1} of {len(hs)})")
        try:
            logprobs[i] = reference_logprobs(model, h, tokens, planned, prompt)[:usable]
        except (RuntimeError, ValueError) as err:  # ValueError: hf.patch refused the formula on this model
            if i == 0:  # the declared method itself
                raise
            # a wrong formula this model cannot run (a table narrower than the head its attention rotates, say:
            # plain RoPE under a proportional config's partial_rotary_factor) is no engine's reading of it either
            unrunnable.append(f"{_label(h)} ({str(err).strip().splitlines()[0][:100]})")
            continue
        if not torch.isfinite(logprobs[i]).all():
            raise RuntimeError(f"ropescale's forward under {_label(h)} is not finite: a ropescale bug, please report")
    if unrunnable:
        notes.append(f"not checked, this model cannot run them: {'; '.join(unrunnable)}")
        hs, logprobs = [hs[i] for i in logprobs], {j: logprobs[i] for j, i in enumerate(logprobs)}
    say("ropescale: the declared method in float64 (the float32 reference's own noise)")
    try:
        noise = _distance(logprobs[0], _float64_reference(model, hs[0], tokens, planned, prompt)[:usable])
        measured = f"ropescale's float32 reference is {noise:.3g} from its float64 one"
    except (RuntimeError, TypeError, NotImplementedError) as err:  # a kernel without float64 (grouped_mm's MoE)
        noise, measured = 0.0, f"the float64 reference did not run ({str(err).splitlines()[0][:80]}): the stated bound"
    dtype = str(answer.get("dtype", "float32"))
    bound = bound_for(engine, dtype, noise)
    apart = max(SAME, 2 * bound) if bound is not None else SAME  # nearer: the probe cannot tell them apart
    keep = [i for i in range(len(hs)) if i == 0 or _distance(logprobs[i], logprobs[0]) > apart]
    merged = [_label(hs[i]) for i in range(len(hs)) if i not in keep]
    if merged:
        notes.append(f"at {length} tokens these give the declared log-probabilities within {apart:.3g} nats (not "
                     f"checked: the probe cannot tell them apart): {', '.join(merged)}")
    notes.append(f"bound of an exact verdict {'none stated' if bound is None else f'{bound:.3g}'} nats ({engine} in "
                 f"{dtype}; {measured})")
    hs, logprobs = [hs[i] for i in keep], {j: logprobs[i] for j, i in enumerate(keep)}
    distances = {_label(h): _distance(engine_logprobs, logprobs[i]) for i, h in enumerate(hs)}
    checks = [served, _scaling_check(hs, logprobs, engine_logprobs, distances, bound, dtype)]
    checks += filter(None, [_verify_keys.check(target, engine, answer, hf_overrides)])
    return Report(shown, engine, answer.get("version", engine), d.describe(), length, checks, distances,
                  notes + list(answer.get("notes", [])))
