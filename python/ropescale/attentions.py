"""The raw-key attentions, each declared once: ReRoPE (and Leaky ReRoPE), Self-Extend, Dual Chunk Attention, STRING.

An :class:`Attention` says what the family's members differ in (docs/DESIGN.md, "One declaration per raw-key
attention"; the kernels' one rule is ``RegionRule``, CONTRIBUTING, "Adding a far-field rule"):

- its name: the ``ropescale`` entry's ``attention``, ``hf.patch``'s ``attention=``, the rope type's marker
  (``scaling.RopeType.MARKERS``) and the command line's ``--attention``;
- its parameters (:class:`Parameter`): the entry's keys and ``hf.patch``'s keywords, with the value each takes (one
  check, one message, for every path: ``config.check_attention``), its default and the flag that gives it;
- the far-field rule that runs it: the ops' arguments (``window``, ``leaky_k``, ``group``, ``chunk_size``,
  ``far_start``, DCA's temperature) as ``serving.PreRopePlan`` fields (:attr:`Attention.plan`), and its own
  factor on the scores (:attr:`Attention.score_factor`).

``config`` (checks, entries, reads), ``scaling.RopeType``, ``serving.PreRopePlan``, ``hf.patch`` and ``checkpoint``,
the command line and the vLLM plugin all find them in :data:`RAW_KEY`: a rule the ops' arguments express is one more
entry there (CONTRIBUTING, "Adding a far-field rule"). Imports nothing of ropescale (``scaling`` imports it).
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Attention", "Fixed", "Parameter", "RAW_KEY", "NAMES", "PLAIN", "STRING_ATTENTION_FACTOR", "STRING_LOCAL_VALUE",
           "STRING_SLOPE", "DUAL_CHUNK_TEMPERATURES", "declare", "flag_owners", "takes"]

#: The attention that rotates keys when written: plain RoPE attention (SDPA or any backend).
PLAIN = "sdpa"
#: STRING's attention factor on cos and sin (its code, ``string_for_llama.py``: ``0.1 ln 2 + 1``, "to recover" the
#: attention map it smooths), so every score is times its square; and its authors' recommended local value.
STRING_ATTENTION_FACTOR = 0.1 * math.log(2) + 1
STRING_LOCAL_VALUE = 128
#: STRING's far side in the ops' terms: Leaky ReRoPE's ``leaky_k`` of slope 1, starting at ``far_start`` (its W).
STRING_SLOPE = 1.0
#: Dual Chunk Attention's attention temperatures by source: the coefficient c of ``m(len) = max(1, c ln(len / L0) + 1)``
#: on query and key. ``qwen``: Qwen's ``dual_chunk_attention_config`` as vLLM's DCA backend computes it (L0: its
#: ``original_max_position_embeddings``); ``chunkllama``: ChunkLlama's Llama patch (``chunkllama_attn_replace.py``,
#: ``get_mscale``, L0: the model's ``max_position_embeddings``). The entry names a temperature other than ``qwen``.
DUAL_CHUNK_TEMPERATURES = {"qwen": 0.1, "chunkllama": 0.05}

_REQUIRED = object()


def _integer(value: Any, least: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= least


def _zero_or_at_least_one(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and (value == 0 or value >= 1))


@dataclass(frozen=True)
class Parameter:
    """One parameter of an attention: ``key`` is the entry's key and ``hf.patch``'s keyword."""

    key: str
    accepts: Callable[[Any, Mapping[str, Any]], bool]  # (value, the values before it) -> whether it is taken
    refusal: str  # the message, formatted with got=repr(value) and the values before it by key
    default: Any = _REQUIRED  # the value when not given (None); a callable (values before it, model's length) -> value
    off: tuple[Any, ...] = ()  # values that mean "not given" (ReRoPE's 0s): another attention may pass them
    flag: str | None = None  # the command line's flag that gives it
    from_args: Callable[[Any], Any] | None = None  # its value from the parsed command line (default: the flag's)
    convert: Callable[[Any], Any] = int  # the checked value as stored (leaky_k a float)
    in_entry: bool = True  # written into the ``ropescale`` entry (DCA's L0 lives in Qwen's own config key)
    unwritten: tuple[Any, ...] = ()  # values the entry leaves out (they are the default)

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def given(self, value: Any) -> bool:
        """Whether a value was given: None never is, nor an ``off`` value (as ``0 == 0.0``, so 0 is off for 0.0)."""
        return value is not None and not any(value == off and not isinstance(value, bool) for off in self.off)

    def value_from(self, args) -> Any:
        """Its value from parsed command-line ``args`` (None where the command line gave none)."""
        if self.from_args is not None:
            return self.from_args(args)
        return getattr(args, self.flag.lstrip("-").replace("-", "_"), None) if self.flag else None


@dataclass(frozen=True)
class Fixed:
    """A plan field an attention's rule sets to one value, whatever its parameters (STRING's slope 1)."""

    value: Any


@dataclass(frozen=True)
class Attention:
    """One raw-key attention: its parameters and the far-field rule (the ops' arguments) that runs it."""

    name: str
    title: str  # as messages name it
    parameters: tuple[Parameter, ...]
    # serving.PreRopePlan's fields its rule sets (the ops' arguments), each from a parameter (by key) or Fixed; every
    # other field stays at its default, so that no plan of one attention runs another's rule
    plan: Mapping[str, str | Fixed]
    describe: Callable[[Any], str]  # a plan -> the vLLM plugin's startup line
    check: Callable[[Mapping[str, Any]], str | None] = lambda values: None  # across parameters: a refusal or None
    score_factor: float = 1.0  # its own factor on every score's rotated part
    summary: str = ""  # what it does, for --attention's help

    @property
    def keys(self) -> tuple[str, ...]:
        """Every parameter's key (``hf.patch``'s keywords)."""
        return tuple(p.key for p in self.parameters)

    def plan_fields(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``serving.PreRopePlan``'s fields from checked values."""
        return {name: source.value if isinstance(source, Fixed) else values[source]
                for name, source in self.plan.items()}

    @property
    def entry_keys(self) -> tuple[str, ...]:
        """The keys its ``ropescale`` entry holds besides ``attention``."""
        return tuple(p.key for p in self.parameters if p.in_entry)

    def checked(self, given: Mapping[str, Any], max_position_embeddings: int | None = None) -> dict[str, Any]:
        """Every parameter's value, defaults filled in order (a default may read the values before it and the
        model's ``max_position_embeddings``; one that needs it is None without it), each checked; raises ValueError
        with the parameter's message."""
        values: dict[str, Any] = {}
        for parameter in self.parameters:
            value = given.get(parameter.key)
            if value is None and not parameter.required:
                default = parameter.default
                value = default(values, max_position_embeddings) if callable(default) else default
                if value is None:  # a default that is the model's length, with no model given (a command line)
                    values[parameter.key] = None
                    continue
            if not parameter.accepts(value, values):
                raise ValueError(parameter.refusal.format(got=repr(value), **values))
            values[parameter.key] = parameter.convert(value)
        refusal = self.check(values)
        if refusal:
            raise ValueError(refusal)
        return values

    def entry(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Its ``ropescale`` entry (without the method) from checked values."""
        return {"attention": self.name, **{p.key: values[p.key] for p in self.parameters
                                           if p.in_entry and values[p.key] not in p.unwritten}}


def _dual_chunk_length(values: Mapping[str, Any], max_position_embeddings: int | None) -> int:
    """DCA's temperature length L0 when not given: its rule's own default. ChunkLlama's is the model's
    ``max_position_embeddings`` (its ``get_mscale`` divides by it); Qwen's is none (0)."""
    if values.get("temperature") == "chunkllama":
        return None if max_position_embeddings is None else int(max_position_embeddings)
    return 0


def _dual_chunk_check(values: Mapping[str, Any]) -> str | None:
    if values["temperature"] != "qwen" and values["original_max_position_embeddings"] == 0:
        return (f"temperature={values['temperature']!r} needs its length L0 (original_max_position_embeddings > 0): "
                "with 0 there is no temperature to apply")
    return None


def _string_local_value(values: Mapping[str, Any], max_position_embeddings: int | None = None) -> int:
    """STRING's local value W when not given: its authors' 128 (S where S is smaller: W <= S, and :func:`_string_check`
    refuses W = S, which moves no distance)."""
    return min(STRING_LOCAL_VALUE, values["shifted_offset"])


def _string_check(values: Mapping[str, Any]) -> str | None:
    """W = S shifts every far distance by ``W - S = 0``: plain RoPE attention with STRING's attention factor, not
    STRING. Its authors never meet it (``S = 0.33 L`` of models trained to 8k-128k, ``W = 128``); a small S with the
    default W does, silently, so it is refused by name."""
    offset, local = values["shifted_offset"], values["local_value"]
    if local is None or local != offset:
        return None
    defaulted = (f" (local_value defaults to min({STRING_LOCAL_VALUE}, shifted_offset), its authors' "
                 f"{STRING_LOCAL_VALUE} with S = 0.33 L > {STRING_LOCAL_VALUE})" if offset <= STRING_LOCAL_VALUE else "")
    return (f"attention='string': local_value ({local}) equals shifted_offset ({offset}), so no distance moves "
            f"(d - S + W = d): that is plain RoPE attention with STRING's attention factor, not STRING{defaulted}. "
            "Give local_value below shifted_offset (--local-value W < S)")


def _describe_rerope(plan) -> str:
    return (("Leaky ReRoPE" if plan.leaky_k else "ReRoPE") + f" window {plan.window}"
            + (f", leaky_k {plan.leaky_k:g}" if plan.leaky_k else "")
            + (f", log-n past {plan.logn_length}" if plan.logn_length else ""))


_WINDOW_FLAG = "--window"

REROPE = Attention(
    "rerope", "ReRoPE attention",
    (Parameter("window", lambda v, _: _integer(v, 1), "attention='rerope' needs window, an integer > 0, got {got}",
               flag=_WINDOW_FLAG),
     Parameter("leaky_k", lambda v, _: _zero_or_at_least_one(v),
               "leaky_k must be 0 (plain ReRoPE) or a finite number >= 1, got {got}", default=0.0, off=(0,),
               flag="--leaky-k", from_args=lambda args: args.leaky_k or 0.0, convert=float),
     Parameter("logn_length", lambda v, _: _integer(v, 0) and v != 1,
               "logn_length must be 0 (no log-n scaling) or an integer >= 2 (the trained length; log-n divides by "
               "its log), got {got}", default=0, off=(0,), flag="--logn",
               from_args=lambda args: args.original_max_position if args.logn else 0)),
    plan={"window": "window", "leaky_k": "leaky_k", "logn_length": "logn_length"},
    describe=_describe_rerope,
    summary="rerope (ReRoPE: distances past a window clipped)")

SELF_EXTEND = Attention(
    "self_extend", "Self-Extend attention",
    (Parameter("window", lambda v, _: _integer(v, 1),
               "attention='self_extend' needs window (the neighbour window W), an integer > 0, got {got}",
               flag=_WINDOW_FLAG),
     Parameter("group", lambda v, _: _integer(v, 1),
               "attention='self_extend' needs group (the group size G), an integer > 0, got {got}", flag="--group")),
    plan={"window": "window", "group": "group"},
    describe=lambda plan: f"Self-Extend window {plan.window}, group {plan.group}",
    summary="self_extend (Self-Extend: distances past a neighbour window grouped)")

DUAL_CHUNK = Attention(
    "dual_chunk", "Dual Chunk Attention",
    (Parameter("chunk_size", lambda v, _: _integer(v, 1),
               "attention='dual_chunk' needs chunk_size, an integer > 0, got {got}", flag="--chunk-size"),
     Parameter("local_size", lambda v, values: _integer(v, 0) and v < values["chunk_size"],
               "attention='dual_chunk' needs local_size, an integer with 0 <= local_size < chunk_size "
               "({chunk_size}), got {got}", flag="--local-size"),
     Parameter("temperature", lambda v, _: isinstance(v, str) and v in DUAL_CHUNK_TEMPERATURES,
               "temperature (Dual Chunk Attention's temperature rule) must be one of "
               + ", ".join(map(repr, DUAL_CHUNK_TEMPERATURES)) + ", got {got}",
               default="qwen", flag="--dca-temperature", convert=str, unwritten=("qwen",)),
     Parameter("original_max_position_embeddings", lambda v, _: _integer(v, 0),
               "original_max_position_embeddings (Dual Chunk Attention's temperature length L0; 0: none) must be "
               "an integer >= 0, got {got}", default=_dual_chunk_length, off=(0,), flag="--temperature-length",
               in_entry=False)),
    plan={"window": "local_size", "chunk_size": "chunk_size", "temperature_length": "original_max_position_embeddings",
          "temperature": "temperature"},
    describe=lambda plan: (f"Dual Chunk Attention chunk_size {plan.chunk_size}, local_size {plan.window}, temperature "
                           + (f"{plan.temperature}'s at length {plan.temperature_length}" if plan.temperature_length
                              else "none")),
    check=_dual_chunk_check,
    summary="dual_chunk (Dual Chunk Attention: positions inside chunks, as Qwen2.5-1M)")

STRING = Attention(
    "string", "STRING attention",
    (Parameter("shifted_offset", lambda v, _: _integer(v, 1),
               "attention='string' needs shifted_offset (S: distances from S on are shifted), an integer > 0, "
               "got {got}", flag="--shifted-offset"),
     Parameter("local_value", lambda v, values: _integer(v, 0) and v <= values["shifted_offset"],
               "attention='string' needs local_value (W: where the shifted distances start), an integer with "
               "0 <= local_value <= shifted_offset ({shifted_offset}), got {got}", default=_string_local_value,
               flag="--local-value")),
    plan={"window": "shifted_offset", "leaky_k": Fixed(STRING_SLOPE), "far_start": "local_value"},
    describe=lambda plan: (f"STRING shifted_offset {plan.window}, local_value {plan.far_start}, attention factor "
                           f"{STRING_ATTENTION_FACTOR:.4f} on q and k"),
    check=_string_check,
    score_factor=STRING_ATTENTION_FACTOR ** 2,
    summary="string (STRING: distances past an offset shifted down onto well-trained ones)")

#: Every raw-key attention by name, in the order messages and --help list them.
RAW_KEY: dict[str, Attention] = {a.name: a for a in (REROPE, SELF_EXTEND, DUAL_CHUNK, STRING)}
#: Every attention a config (and ``hf.patch``) may ask for: plain attention first.
NAMES: tuple[str, ...] = (PLAIN, *RAW_KEY)


def declare(attention: Attention) -> Attention:
    """Adds a raw-key attention (a far-field rule the ops' arguments express) to :data:`RAW_KEY`: every path finds it
    from there. Before ``ropescale.config`` is imported (its tables of names and keys are built at import, as
    ``ropescale.hf`` registers rope types at its own). Returns ``attention``."""
    global NAMES
    if attention.name in NAMES:
        raise ValueError(f"declare: the attention {attention.name!r} is taken")
    unknown = [key for key, source in attention.plan.items() if not isinstance(source, Fixed) and source not in
               attention.keys]
    if unknown:
        raise ValueError(f"declare({attention.name!r}): plan fields {unknown} name no parameter of it")
    if "ropescale.config" in sys.modules or "ropescale.config_entry" in sys.modules:  # config_entry builds them
        raise RuntimeError(f"declare({attention.name!r}): declare attentions before ropescale.config (and ropescale.hf, "
                           "serving, cli, vllm) is imported: their tables are built at import")
    RAW_KEY[attention.name] = attention
    NAMES = (PLAIN, *RAW_KEY)
    return attention


def takes(attention: str) -> tuple[str, ...]:
    """The parameter keys ``attention`` takes (none for plain attention)."""
    return RAW_KEY[attention].keys if attention in RAW_KEY else ()


def flag_owners(flag: str) -> tuple[str, ...]:
    """The attentions with a parameter the command-line ``flag`` gives."""
    return tuple(name for name, attention in RAW_KEY.items() if any(p.flag == flag for p in attention.parameters))
