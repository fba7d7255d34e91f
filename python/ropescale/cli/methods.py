"""The scaling-method options of ``table``, ``decay``, ``gap``, ``eval`` and ``extend``, declared once.

``NAMES``: what --method takes, each name the ``scaling.METHODS`` entry it builds (each method's ``cli_names``).
``OPTIONS``: one entry per option (flag, type, default, help); the methods that read it and the field it fills
come from the registry (each method's parameters declare their flag: ``scaling.parameter(cli=...)``). A
command names the subset it takes in a ``MethodOptions`` and ``add_options`` adds them; ``build`` turns the
parsed options into a ``scaling.RopeScaling`` and ``given_fields`` says which of its fields the command line
gave (``extend`` takes the others from SRC). The attention options' texts are here too; which attention each
belongs to, which are needed and what values they take come from ``ropescale.attentions`` (each parameter's flag):
``check_attention_options`` says which go together and ``attention_arguments`` turns them into ``hf.patch``'s
arguments.

The method's dataclass checks the values it is given (``__post_init__``): its ValueError is the usage error
the user sees (``main``). Checked here: which option goes with which method, and the values whose argparse
check says more than the dataclass would: --factor and --floor >= 1 (both fill ``factor``; s < 1 would
shrink the context), --original-max-position and --window > 0 (within int64, and found while parsing,
before a model is loaded), --leaky-k > 1 (``config.check_attention`` takes 1: plain RoPE past the window),
--mscale and --mscale-all-dim > 0 (the dataclass takes any finite number, and transformers reads 0 as unset),
--attention-factor > 0 or ``auto``, and the attentions' sizes (``config.check_attention`` checks them again).
``check_built`` refuses a method a given flag does nothing in (--mscale without mscale_all_dim), after ``extend``
took SRC's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .. import attentions, config as config_lib, scaling
from .common import UsageError, non_negative_int, number, positive_float, positive_int


def scale_factor(text: str) -> float:
    value = positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"the scale factor s must be >= 1 (s < 1 would shrink the context), got {text}")
    return value


def leaky_k(text: str) -> float:
    value = positive_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"must be > 1 (K = 1 is plain RoPE past the window), got {text}")
    return value


def per_choice(text: str) -> str:
    if text not in scaling.PER_CHOICES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(scaling.PER_CHOICES)}, got {text!r}")
    return text


def mscale_value(text: str) -> float:
    value = number(text)
    if not (math.isfinite(value) and value > 0):
        hint = " (transformers reads 0 as not set: leave the flag out)" if value == 0 else ""
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}{hint}")
    return value


#: What --attention-factor takes besides a number: no fixed factor, the method's own rule.
AUTO = "auto"


def attention_factor(text: str) -> float | str:
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, or {AUTO} (the method's own rule), "
                                         f"got {text!r}")
    return value


#: The attentions --attention takes: the raw-key ones (``scaling.RopeType.MARKERS``).
ATTENTIONS = scaling.RopeType.MARKERS


def attention_choice(text: str) -> str:
    if text not in ATTENTIONS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(ATTENTIONS)}, got {text!r}")
    return text


# Dual Chunk Attention's temperature rules by source (config.DUAL_CHUNK_TEMPERATURES).
DUAL_CHUNK_TEMPERATURES = tuple(config_lib.DUAL_CHUNK_TEMPERATURES)


def dca_temperature_choice(text: str) -> str:
    if text not in DUAL_CHUNK_TEMPERATURES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DUAL_CHUNK_TEMPERATURES)}, got {text!r}")
    return text


@dataclass(frozen=True)
class MethodName:
    """A name --method takes."""

    rope_type: str | None  # the scaling.METHODS entry it builds; None: no table (the model's own)
    resonance: bool = False  # Resonance RoPE on top (wavelengths rounded to integers)
    needs: tuple[str, ...] = ()  # the options a command must take to offer the name


def _needs(method: type[scaling.RopeScaling]) -> tuple[str, ...]:
    """The flags of the parameters the method requires: a command offers it only if it takes them all (LongRoPE's
    per-pair factors come from a search: only a command that reads them from a file offers it)."""
    return tuple(dict.fromkeys(p.cli for p in method.parameters() if p.required and p.cli))


# Each method's names (``cli_names``: its rope type, aliases, Resonance on it) from the registry.
NAMES: dict[str, MethodName] = {
    **{name: MethodName(method.rope_type, scaling.RopeType.parse(name).resonance, _needs(method))
       for method in scaling.METHODS.values() for name in method.cli_names},
    # The model's own table, with ReRoPE attention (--window with another name puts ReRoPE on top of that one).
    "rerope": MethodName(None, needs=("--window",)),
}


def _read_by(flag: str) -> frozenset[str]:
    """The rope types with a parameter the option ``flag`` fills (``scaling.parameter(cli=...)``)."""
    return frozenset(t for t, method in scaling.METHODS.items() if any(p.cli == flag for p in method.parameters()))


def _field(flag: str) -> str:
    """The one field ``flag`` fills in every method that reads it."""
    (name,) = {p.name for m in scaling.METHODS.values() for p in m.parameters() if p.cli == flag}
    return name


def _help(flag: str) -> str:
    """The one help text the parameters ``flag`` fills declare (``scaling.parameter(help=...)``)."""
    (text,) = {p.help for m in scaling.METHODS.values() for p in m.parameters() if p.cli == flag}
    return text


@dataclass(frozen=True)
class Option:
    """One method option."""

    flag: str
    help: str
    read_by: frozenset[str] = frozenset()  # the rope types (scaling.METHODS keys) it is for
    field: str | None = None  # the dataclass field it fills; None: build or the command reads it
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    switch: bool = False  # store_true
    negatable: bool = False  # --X / --no-X (argparse.BooleanOptionalAction); None when neither is given
    # the attentions whose option it is (listed in the attention group): the parameters' flags declare it
    attention: tuple[str, ...] = ()
    # --method name -> a sentence of help, shown where the command offers that name
    method_notes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.attention:
            object.__setattr__(self, "attention", attentions.flag_owners(self.flag))

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


_DYNAMIC = frozenset(t for t, method in scaling.METHODS.items() if method.dynamic)

OPTIONS: dict[str, Option] = {o.flag: o for o in (
    Option("--method", "scaling method"),
    # A static table's s and Dynamic NTK's s; never dynamic_yarn's floor (issue 27: --factor 8 read as "serve
    # 8x longer" made every length run at s >= 8), which is --floor.
    Option("--factor", "scale factor s: the table of linear/ntk/yarn/llama3/yarn_log/theta_scale is set for s x L; "
           "dynamic (dynamic_ntk) uses s in its base b*((s*len/L) - (s-1))^(d/(d-2)) past L, native up to L; not for "
           "dynamic_yarn (see --floor)", read_by=_read_by("--factor"), field=_field("--factor"), type=scale_factor,
           method_notes={"longrope": "; longrope: the s its long factors were searched for (attention factor, "
                                     "served to s x L)"}),
    Option("--alpha", "ntk_alpha (HunYuan's NTK-alpha): the base b x A^(d/(d-2)) at every length",
           read_by=_read_by("--alpha"), field=_field("--alpha"), type=scale_factor, metavar="A"),
    Option("--floor", "dynamic_yarn only: the floor F of its scale s = max(F, len/L), applied at EVERY length "
           "(requests shorter than F x L are then no longer native); default 1",
           read_by=_read_by("--floor"), field=_field("--floor"), type=scale_factor, metavar="F"),
    Option("--original-max-position", "pre-training context L", read_by=_read_by("--original-max-position"),
           field=_field("--original-max-position"), type=positive_int, default=4096),
    Option("--beta-fast", "YaRN beta_fast", read_by=_read_by("--beta-fast"), field=_field("--beta-fast"), type=number,
           default=32.0),
    Option("--beta-slow", "YaRN beta_slow", read_by=_read_by("--beta-slow"), field=_field("--beta-slow"), type=number,
           default=1.0),
    Option("--truncate", _help("--truncate"), read_by=_read_by("--truncate"), field=_field("--truncate"),
           negatable=True),
    Option("--extrapolation-factor", _help("--extrapolation-factor"), read_by=_read_by("--extrapolation-factor"),
           field=_field("--extrapolation-factor"), type=number, metavar="E"),
    Option("--mscale", _help("--mscale"), read_by=_read_by("--mscale"), field=_field("--mscale"), type=mscale_value,
           metavar="M"),
    Option("--mscale-all-dim", _help("--mscale-all-dim"), read_by=_read_by("--mscale-all-dim"),
           field=_field("--mscale-all-dim"), type=mscale_value, metavar="M'"),
    Option("--attention-factor", "yarn, dynamic_yarn, longrope: the attention factor A on cos and sin, fixed (config "
           f"key attention_factor), in place of the method's own rule of its scale; {AUTO}: the method's own rule",
           read_by=_read_by("--attention-factor"), field=_field("--attention-factor"), type=attention_factor,
           metavar="{A," + AUTO + "}"),
    Option("--per", "dynamic methods: how long the scale holds: step (each step's length, the paper's rule) or "
           "request (prompt + the tokens a request may generate, fixed for its whole life: a request that fits L is "
           "the native model, a longer one the static model of its scale)", read_by=_read_by("--per"),
           field=_field("--per"), type=per_choice, metavar="{" + ",".join(scaling.PER_CHOICES) + "}", default="step"),
    # The table commands pass it to inv_freq.
    Option("--seq-len", "current length (largest position + 1) for the dynamic methods "
           f"({', '.join(sorted(_DYNAMIC))})", read_by=_DYNAMIC, type=positive_int),
    Option("--resonance", "round wavelengths to integers (Resonance RoPE)", read_by=frozenset(scaling.METHODS),
           field="resonance", switch=True),
    Option("--longrope-factors", "longrope: a JSON object with short_factor and long_factor (one per rotary pair), "
           "at its top or under rope_parameters / rope_scaling (a LongRoPE model's config.json), optionally factor",
           read_by=_read_by("--longrope-factors"), metavar="FILE.json"),
    Option("--attention", "the attention over the table, on raw keys: "
           + ", ".join(a.summary for a in attentions.RAW_KEY.values()) + "; default: rerope when --window is given",
           type=attention_choice, metavar="{" + ",".join(ATTENTIONS) + "}", attention=ATTENTIONS),
    Option("--window", "ReRoPE: relative distances >= W count as W", type=positive_int, metavar="W"),
    Option("--leaky-k", "Leaky ReRoPE: distances >= W count as W + (d - W)/K (K > 1)", type=leaky_k, metavar="K"),
    Option("--logn", "ReRoPE log-n scaling: queries past L times log(n)/log(L)", switch=True),
    Option("--group", "Self-Extend: the group size G: past the neighbour window W, a query at i and a key at j count "
           "as floor(i/G) - floor(j/G) + W - floor(W/G) apart, so a model trained to L reaches about (L - W) x G + W",
           type=positive_int, metavar="G"),
    Option("--chunk-size", "Dual Chunk Attention: the chunk size C (Qwen's chunk_size), the largest relative position "
           "it shows the model (Qwen's checkpoints: C = the trained length L)", type=positive_int, metavar="C"),
    Option("--local-size", "Dual Chunk Attention: the local size S < C (Qwen's local_size): chunks are C - S "
           "positions long, and a key in the previous chunk keeps its true distance while the query is within S "
           "positions of its own chunk's start", type=non_negative_int, metavar="S"),
    Option("--temperature-length", "Dual Chunk Attention: the length L0 of its attention temperature max(1, c "
           "ln(len/L0) + 1) on queries and keys (Qwen's original_max_position_embeddings; default 0: none, or the "
           "model's max_position_embeddings under --dca-temperature chunkllama)",
           type=non_negative_int, metavar="L0"),
    Option("--dca-temperature", "Dual Chunk Attention: whose temperature rule: qwen (c = 0.1, Qwen's checkpoints as "
           "vLLM serves them) or chunkllama (c = 0.05, ChunkLlama's own Llama patch, L0 by default the model's "
           "max_position_embeddings); default qwen", type=dca_temperature_choice,
           metavar="{" + ",".join(DUAL_CHUNK_TEMPERATURES) + "}"),
    Option("--shifted-offset", "STRING: the shifted offset S: distances d >= S count as d - S + W, so the model "
           "reads the last S positions it was trained on no more (its authors: S = 0.25 to 0.4 of the trained length)",
           type=positive_int, metavar="S"),
    Option("--local-value", f"STRING: the local value W < S, where the shifted distances start (default "
           f"{attentions.STRING_LOCAL_VALUE}, its authors', or S if smaller, which W = S refuses: it moves no "
           "distance; they suggest 128 to 512)", type=non_negative_int, metavar="W"),
)}

# What a table method reads and an attention over the model's own table refuses: every option that fills a field but
# the original length (ReRoPE's --logn reads it too), and LongRoPE's factors.
_TABLE_ONLY = tuple(flag for flag, option in OPTIONS.items()
                    if (option.field or flag == "--longrope-factors") and flag != "--original-max-position")
# The options each attention needs (its required parameters' flags): the others of its own are optional.
_ATTENTION_NEEDS = {name: tuple(p.flag for p in attention.parameters if p.required)
                    for name, attention in attentions.RAW_KEY.items()}


@dataclass(frozen=True)
class MethodOptions:
    """The method options one command takes (``flags``, in OPTIONS' order on --help), and its own defaults."""

    flags: tuple[str, ...]
    method: str | None = None  # --method's default (None: no method unless one is given)
    required: bool = False  # --method must be given
    factor: float | None = None  # the factor of a method that scales when --factor is not given
    defaults: Mapping[str, str] = dataclasses.field(default_factory=dict)  # flag -> the default it works out itself
    notes: Mapping[str, str] = dataclasses.field(default_factory=dict)  # flag -> help text only this command needs
    own_table: str = "the model's own table"  # what --method rerope keeps
    serve_longer: str | None = None  # how this command serves dynamic_yarn longer (its --factor refusal says)
    # Refuse an option --method does not read (off where an option may be meant for another method: table --compare).
    refuse_unread: bool = False
    title: str = "method"
    attention_title: str = "ReRoPE attention"


def names(taken: MethodOptions) -> list[str]:
    """The --method names a command offers: those whose options it takes."""
    return sorted(name for name, entry in NAMES.items() if set(entry.needs) <= set(taken.flags))


def reads(name: str, flag: str) -> bool:
    """Whether --method ``name`` reads option ``flag``."""
    return NAMES[name].rope_type in OPTIONS[flag].read_by


def add_options(parser: argparse.ArgumentParser, taken: MethodOptions) -> argparse._ArgumentGroup:
    """Adds the options ``taken`` names to ``parser``; returns their group (for a command's own option there)."""
    unknown = set(taken.flags) - set(OPTIONS)
    if unknown:
        raise ValueError(f"add_options: no method option {sorted(unknown)}")
    group = parser.add_argument_group(taken.title)
    attention = None
    offered = names(taken)
    for option in OPTIONS.values():
        if option.flag not in taken.flags:
            continue
        help = option.help + "".join(note for name, note in option.method_notes.items() if name in offered)
        help += taken.notes.get(option.flag, "")
        kwargs: dict[str, Any] = {}
        if option.flag == "--method":
            kwargs.update(choices=offered, default=taken.method, required=taken.required)
            if "rerope" in offered:
                help += f", or rerope ({taken.own_table} with ReRoPE attention: needs --window)"
        elif option.switch:
            kwargs.update(action="store_true")
        elif option.negatable:
            kwargs.update(action=argparse.BooleanOptionalAction, default=None)
        else:
            kwargs.update(type=option.type, metavar=option.metavar,
                          default=None if option.flag in taken.defaults else option.default)
        default = _default_help(option, taken)
        if default:
            help += f" ({default})"
        if option.attention and attention is None:
            attention = parser.add_argument_group(taken.attention_title)
        (attention if option.attention else group).add_argument(option.flag, help=help, **kwargs)
    parser.set_defaults(method_options=taken)
    return group


def _default_help(option: Option, taken: MethodOptions) -> str | None:
    if option.flag in taken.defaults:
        return "default: " + taken.defaults[option.flag]
    if option.flag == "--method":
        return f"default {taken.method}" if taken.method else None
    if option.flag == "--factor":
        return f"default {taken.factor:g}" if taken.factor else "needed by the methods that scale"
    if option.default is None:
        return None
    return f"default {option.default:g}" if isinstance(option.default, (int, float)) else f"default {option.default}"


def _not_given(option: Option, taken: MethodOptions) -> Any:
    """An option's value when the command line does not give it: None where the command tells the two apart
    (``MethodOptions.defaults``, a negatable switch), False for a switch, else its default."""
    if option.flag in taken.defaults or option.negatable:
        return None
    return False if option.switch else option.default


def _given(args, flag: str) -> bool:
    """Whether the command line gave ``flag`` (one whose default is a value, as table's --beta-fast 32, reads as given
    only where it differs from it)."""
    taken: MethodOptions = args.method_options
    if flag not in taken.flags:
        return False
    value = getattr(args, OPTIONS[flag].dest)
    return value is not None and value != _not_given(OPTIONS[flag], taken)


def given_fields(args, rope_type: str) -> frozenset[str]:
    """The fields of the ``rope_type`` method that ``build`` took from the command line (``resonance`` aside: it is in
    --method's name): those of the options given, and LongRoPE's factors (--longrope-factors, --factor or the file's,
    which it always takes). Exact for a command whose options default to None (``extend``: ``MethodOptions.defaults``),
    which takes every other field from SRC's method."""
    taken: MethodOptions = args.method_options
    fields = {option.field for option in OPTIONS.values()
              if option.field and option.field != "resonance" and rope_type in option.read_by
              and _given(args, option.flag)}
    if rope_type in OPTIONS["--longrope-factors"].read_by and "--longrope-factors" in taken.flags:
        fields |= {p.name for p in scaling.METHODS[rope_type].parameters()
                   if p.cli in ("--longrope-factors", "--factor")}
    return frozenset(fields)


def _refuse_table_options(args, keeps: str, instead: str) -> None:
    given = [flag for flag in _TABLE_ONLY if _given(args, flag)]
    if given:
        raise UsageError(f"{keeps}: {', '.join(given)} belong to a table method ({instead})")


def check_rerope(args) -> None:
    """ReRoPE's options against --method: usage errors found before a model is loaded."""
    taken: MethodOptions = args.method_options
    if args.method == "rerope":
        if args.window is None:
            raise UsageError("--method rerope needs --window W: relative distances below W stay exact, longer ones "
                             "count as W (a quarter of the trained length is a good start)")
        _refuse_table_options(args, f"--method rerope keeps {taken.own_table}",
                              "ReRoPE over one: --method M --window W")
    if args.window is None and (args.leaky_k or args.logn):
        raise UsageError("--leaky-k and --logn belong to ReRoPE: add --window W (e.g. --method rerope --window W)")


def attention_of(args) -> str | None:
    """The attention the command line asks for: --attention's, else ReRoPE where --window or --method rerope says
    so; None for plain attention."""
    chosen = getattr(args, "attention", None)
    if chosen is not None:
        return chosen
    return "rerope" if args.window is not None or args.method == "rerope" else None


def _usage(attention: str) -> str:
    """An attention's options as the command line takes them: ``--window W --group G``, optional ones bracketed."""
    words = []
    for option in OPTIONS.values():
        if attention in option.attention and option.flag != "--attention":
            word = option.flag if option.switch else f"{option.flag} {option.metavar}"
            words.append(word if option.flag in _ATTENTION_NEEDS[attention] else f"[{word}]")
    return " ".join(words)


def check_attention_options(args) -> None:
    """The attention options against each other and --method (``extend``, which takes --attention): which go with which
    attention, what each needs. Usage errors found before a model is loaded."""
    taken: MethodOptions = args.method_options
    chosen = getattr(args, "attention", None)
    if args.method == "rerope" and chosen not in (None, "rerope"):
        raise UsageError(f"--method rerope is ReRoPE attention over {taken.own_table}; for "
                         f"{config_lib.ATTENTION_NAMES[chosen]} over it leave --method out: --attention {chosen} "
                         f"{_usage(chosen)}")
    attention = attention_of(args)
    if attention in (None, "rerope"):
        check_rerope(args)
    for option in OPTIONS.values():
        if not option.attention or option.flag == "--attention" or not _given(args, option.flag) \
                or attention in option.attention:
            continue
        owners = " or ".join(f"{config_lib.ATTENTION_NAMES[a]} (--attention {a} {_usage(a)})" for a in option.attention)
        if attention is None:
            raise UsageError(f"{option.flag} belongs to {owners}")
        raise UsageError(f"{option.flag} belongs to {owners}, not to {config_lib.ATTENTION_NAMES[attention]}, which "
                         f"takes {_usage(attention)}")
    if attention is None:
        return
    missing = [flag for flag in _ATTENTION_NEEDS[attention] if not _given(args, flag)]
    if missing:
        raise UsageError(f"--attention {attention} needs {', '.join(missing)}: {_usage(attention)}")
    attention_arguments(args)  # the values together (a default that is the model's length: checked with it)
    if args.method is None:
        _refuse_table_options(args, f"--attention {attention} without --method keeps {taken.own_table}",
                              f"{config_lib.ATTENTION_NAMES[attention]} over one: --method M --attention {attention}")


def attention_arguments(args, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """``hf.patch``'s attention arguments from the command line (none for plain attention): each parameter's value from
    its flag (``attentions.Parameter.flag``; ReRoPE's --logn gives ``logn_length``, --original-max-position), checked
    (``config.check_attention``) with the defaults filled (those that are the model's ``max_position_embeddings`` only
    when it is given). A value the attention refuses is a usage error."""
    attention = attention_of(args)
    if attention is None:
        return {}
    given = {p.key: p.value_from(args) for p in attentions.RAW_KEY[attention].parameters}
    try:
        values = config_lib.check_attention(attention, given, max_position_embeddings=max_position_embeddings)
    except ValueError as err:
        raise UsageError(f"--attention {attention}: {err}") from None
    return {"attention": attention, **values}


def build(args, name: str | None = None, *, factor: float | None = None,
          inherit: bool = False) -> scaling.RopeScaling | None:
    """The scaling method the options describe: --method's, or ``name``'s (``table --compare``: the options are
    the main method's, so only it is refused those it does not read). ``factor``: the one a method that scales
    gets without --factor (default: the command's). None for --method rerope (the model's own table).
    ``inherit``: the command fills the fields no flag gave from elsewhere (``extend``: SRC's) and calls
    :func:`check_built` on the method it ends with; otherwise ``build`` does."""
    taken: MethodOptions = args.method_options
    main = name is None or name == args.method
    name = name or args.method
    rope_type, resonance = NAMES[name].rope_type, NAMES[name].resonance
    if rope_type is None:
        check_rerope(args)
        return None
    if main:
        _refuse_unread(args, rope_type)
    kwargs: dict[str, Any] = {}
    for option in OPTIONS.values():
        if option.field and rope_type in option.read_by and option.flag in taken.flags:
            value = getattr(args, option.dest)
            if value is not None:  # --attention-factor auto: the field's default, the method's own rule
                kwargs[option.field] = None if value == AUTO else value
    kwargs["resonance"] = kwargs.get("resonance", False) or resonance
    scales = rope_type in OPTIONS["--factor"].read_by
    if scales and "factor" not in kwargs:
        default = factor if factor is not None else taken.factor
        if default is not None:
            kwargs["factor"] = default
    if rope_type in OPTIONS["--longrope-factors"].read_by:
        factors = longrope_factors(args.longrope_factors)
        kwargs.update(short_factor=factors["short_factor"], long_factor=factors["long_factor"])
        if kwargs.get("factor") is None:
            kwargs["factor"] = factors.get("factor")
        if kwargs["factor"] is None:
            raise UsageError("--method longrope needs --factor s, the length scale its long factors were searched for "
                             "(it sets the attention factor, and the length s x L it is served to)")
    elif scales and "factor" not in kwargs:
        # The dataclasses default to s = 1 (the table unchanged): on the command line that is never meant.
        raise UsageError(f"--method {name} needs --factor")
    if rope_type in OPTIONS["--alpha"].read_by and "alpha" not in kwargs:
        raise UsageError(f"--method {name} needs --alpha")
    # The dataclass checks every value; its ValueError is the usage error.
    method = scaling.METHODS[rope_type](**kwargs)
    if main and not inherit:
        check_built(args, method)
    return method


def check_built(args, method: scaling.RopeScaling | None) -> None:
    """What the final method of the command line must not be, beyond the dataclass's checks: a flag given that the
    method never reads (--mscale without mscale_all_dim: ``YaRN.unread_mscale``). A value a command takes from
    elsewhere (``extend``: SRC's) is that source's, and not refused here."""
    unread = getattr(method, "unread_mscale", None)
    if unread and _given(args, "--mscale"):
        raise UsageError(f"--mscale: {unread}. Give --mscale-all-dim M' with it (DeepSeek's checkpoints carry both), "
                         "or leave it out (--attention-factor A fixes the factor on cos and sin)")


def _refuse_unread(args, rope_type: str) -> None:
    taken: MethodOptions = args.method_options
    if _given(args, "--floor") and rope_type not in OPTIONS["--floor"].read_by:
        raise UsageError(f"--floor is dynamic_yarn's (the floor of its scale s = max(F, length / L)); --method "
                         f"{args.method} has none")
    if _given(args, "--factor") and rope_type in OPTIONS["--floor"].read_by:
        # issue 27: `--factor 8` read as "serve 8x longer" made every length run at s >= 8.
        raise UsageError(
            f"--method dynamic_yarn takes no --factor: its scale is s = max(F, length / L), so a factor would be "
            f"the FLOOR F at every length (requests shorter than {args.factor:g} x L would no longer be native). "
            + (f"To serve it longer {taken.serve_longer}; for a floor, " if taken.serve_longer else "For a floor, ")
            + f"--floor {args.factor:g}")
    if _given(args, "--per") and args.per != "step" and rope_type not in OPTIONS["--per"].read_by:
        raise UsageError(f"--per {args.per} belongs to the dynamic methods ({', '.join(sorted(_DYNAMIC))}): the table "
                         f"of --method {args.method} is the same at every length")
    if _given(args, "--longrope-factors") and rope_type not in OPTIONS["--longrope-factors"].read_by:
        raise UsageError("--longrope-factors belongs to --method longrope")
    if not taken.refuse_unread:
        return
    for option in OPTIONS.values():
        # --per's step is every static table's rule; --original-max-position the command fills from the model.
        if option.field and option.flag not in ("--per", "--original-max-position") and _given(args, option.flag) \
                and rope_type not in option.read_by:
            raise UsageError(f"{option.flag} belongs to --method {', '.join(sorted(option.read_by))}: --method "
                             f"{args.method} has none")


def longrope_factors(path: str | None) -> dict:
    """The ``short_factor``/``long_factor`` (and ``factor``, when there) of ``--longrope-factors FILE``."""
    if path is None:
        raise UsageError("--method longrope needs --longrope-factors FILE.json: its per-pair short and long factors "
                         "(they come from LongRoPE's search)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise UsageError(f"--longrope-factors: cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise UsageError(f"--longrope-factors: {path} is not JSON: {err}") from None
    holders = [data] + [data.get(k) for k in ("rope_parameters", "rope_scaling")] if isinstance(data, dict) else []
    for holder in holders:
        if isinstance(holder, dict) and "short_factor" in holder and "long_factor" in holder:
            return holder
    raise UsageError(f"--longrope-factors: {path} has no short_factor and long_factor (at its top, or under "
                     "rope_parameters or rope_scaling)")


def check_seq_len(args, *methods: scaling.RopeScaling) -> None:
    """--seq-len is the length a dynamic table is built for; refused when no method in ``methods`` is dynamic."""
    if args.seq_len is not None and not any(m.dynamic for m in methods):
        raise UsageError(f"--seq-len applies to the dynamic methods ({', '.join(sorted(_DYNAMIC))}) only: the table "
                         f"of --method {args.method} does not depend on the length")


def label(args, name: str | None = None) -> str:
    """--method's name (or ``name``), with `` + resonance`` where --resonance adds it."""
    name = name or args.method
    return name + (" + resonance" if args.resonance and not NAMES[name].resonance else "")


def without_resonance(name: str) -> str:
    """The name of the method a Resonance name rounds (``resonance_yarn`` -> ``yarn``; others as they are)."""
    return NAMES[name].rope_type if NAMES[name].resonance else name
