"""The scaling methods, and the registry every other module asks about them.

One small frozen dataclass per method turns ``(dim, base)`` into an ``inv_freq`` table through
ropescale's C++ ops and knows its attention factor (the number transformers multiplies cos and sin
by). ``resonance=True`` rounds every wavelength of the method's table to an integer AFTER the method
(Resonance RoPE, Algorithm 1; Resonance-YaRN rounds the YaRN table), and leaves the attention factor
unchanged.

Each method declares everything about itself in one place, its class, and is registered with
:func:`register` (``METHODS`` maps rope types to classes):

- its rope type, the other names it is read under, the name it is written under;
- its parameters (dataclass fields made with :func:`parameter`: the transformers key, whether a config
  must carry it, where it comes from when absent, its ``ropescale`` command-line flag);
- whether its table depends on the length (``dynamic``: the scale follows each sequence;
  ``length_dependent``: the table differs at some length, which LongRoPE's also does);
- what stock engines do with it (``stock``), which length they derive from its config
  (``stock_length_is_scaled``), whether transformers has it natively, and vLLM's rotary class for it;
- the rotary dim its table is made for (``head_dim_table``: the whole head whatever ``partial_rotary_factor``
  says, transformers' ``proportional``; else ``head_dim * partial_rotary_factor``): ``rotary_dim_for``.

:class:`RopeType` owns the naming scheme of rope types: ``resonance`` / ``resonance_<type>`` for
Resonance on a method, ``rerope`` / ``rerope_<table type>`` for ReRoPE attention over a table (``self_extend``,
``dual_chunk`` likewise for Self-Extend and Dual Chunk Attention), and each
method's aliases. ``from_hf`` reads transformers 5.x ``rope_parameters`` (and the legacy ``rope_scaling``
dict) through the registry; ``to_hf`` writes one back. Resonance on LongRoPE is written as a plain
``longrope`` whose per-pair factors hold the rounded table exactly.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from . import attentions, ops

__all__ = [
    "RopeScaling",
    "Default",
    "Linear",
    "Proportional",
    "NTK",
    "NTKAlpha",
    "DynamicNTK",
    "YaRN",
    "DynamicYaRN",
    "Llama3",
    "LongRoPE",
    "RopeType",
    "from_hf",
    "register",
    "parameter",
    "METHODS",
    "HF_KEYS",
]


# Every method checks its fields when it is built (``__post_init__``), with the bounds the C++ table
# ops enforce (csrc/frequencies.cpp), so ``hf.patch``, ``ropescale extend``, the CLI and ``from_hf``
# refuse a bad setting before anything is patched or written, never at the first forward.


def _fail(obj, name: str, expected: str) -> None:
    raise ValueError(f"{type(obj).__name__}: {name} must be {expected}, got {getattr(obj, name)!r}")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_float(obj, name: str, *, minimum: float | None = None, above: float | None = None,
                 optional: bool = False) -> None:
    """``obj.name`` is a finite real number, ``>= minimum`` / ``> above`` where given (None allowed when
    ``optional``)."""
    value = getattr(obj, name)
    if value is None and optional:
        return
    bounds = [f">= {minimum:g}"] if minimum is not None else []
    bounds += [f"> {above:g}"] if above is not None else []
    expected = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if not _is_number(value) or not math.isfinite(value):
        _fail(obj, name, expected)
    if (minimum is not None and value < minimum) or (above is not None and value <= above):
        _fail(obj, name, expected)


def _check_greater(obj, name: str, other: str, why: str) -> None:
    """``obj.name`` (a finite number) is greater than ``obj.other`` (checked before): the message names the relation
    and both values, not a bound the user never typed."""
    _check_float(obj, name)
    value, bound = getattr(obj, name), getattr(obj, other)
    if value <= bound:
        raise ValueError(f"{type(obj).__name__}: {name} ({value:g}) must be greater than {other} ({bound:g}) ({why})")


def _check_int(obj, name: str, minimum: int, why: str = "") -> None:
    value = getattr(obj, name)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        _fail(obj, name, f"an integer >= {minimum}{why}")


def _check_bool(obj, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        _fail(obj, name, "True or False")


def _check_choice(obj, name: str, choices: tuple[str, ...]) -> None:
    if getattr(obj, name) not in choices:
        _fail(obj, name, " or ".join(repr(c) for c in choices))



#: The keys ``from_hf`` reads for each rope type (besides ``rope_type``/``type``): (required, optional),
#: filled by :func:`register` from the methods' parameters.
HF_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

# ---------------------------------------------------------------------------------------------
# Parameters and the registry

#: Where a parameter comes from when a config does not carry it: the config's ``max_position_embeddings``.
FROM_CONFIG_LENGTH = "max_position_embeddings"


def parameter(default: Any = dataclasses.MISSING, *, hf: str | None = "", required: bool = False,
              fallback: str | None = None, cli: str | None = None, help: str = "", factory=None,
              ropescale_key: bool = False):
    """A method's field, with what the registry needs to know about it:

    - ``hf``: its key in transformers' ``rope_parameters`` ("" = the field's own name; None: not a rope
      parameter, e.g. Dynamic NTK's original length, which transformers reads from the config);
    - ``required``: a config must carry it (``from_hf`` refuses one without it);
    - ``fallback``: where its value comes from when the rope parameters omit it (:data:`FROM_CONFIG_LENGTH`);
    - ``cli`` and ``help``: its flag in the ``ropescale`` command (None: no flag) and what it means;
    - ``ropescale_key``: a key ropescale adds to a rope type transformers has (its validator is told to ignore
      it; the value still reaches ropescale's check)."""
    metadata = {"hf": hf, "required": required, "fallback": fallback, "cli": cli, "help": help,
                "ropescale_key": ropescale_key}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Parameter:
    """A registered method's parameter as the other modules see it (see :func:`parameter`)."""

    name: str  # the dataclass field
    hf_key: str | None
    required: bool
    fallback: str | None
    cli: str | None
    help: str
    default: Any
    kind: type  # int, float, bool, str or tuple: how a config value is read
    ropescale_key: bool = False  # a key transformers' own type does not have


METHODS: dict[str, type["RopeScaling"]] = {}
# Every name a method is read under (its rope type and its aliases) -> the method.
_BY_NAME: dict[str, type["RopeScaling"]] = {}
# (rope type, key) -> the method a config of that type carrying that key is (HunYuan's "dynamic" + "alpha").
_CLAIMS: dict[tuple[str, str], type["RopeScaling"]] = {}


@dataclass(frozen=True)
class Declaration:
    """What a method declares about itself, beside its fields (``register``'s arguments; see ``RopeScaling``'s
    class attributes for each). The defaults are those of a new ropescale type: dynamic methods and tables
    stock engines do not know."""

    rope_type: str
    aliases: tuple[str, ...] = ()
    written_type: str | None = None
    dynamic: bool = False
    stock: str = "refused"
    stock_length_is_scaled: bool = False
    transformers_native: bool = False
    resonance_type: bool = True
    vllm_rotary_class: str | None = None
    vllm_owns_name: bool = False
    vllm_stock_wrong: str = ""
    cli_names: tuple[str, ...] | None = None  # None: the rope type alone
    head_dim_table: bool = False
    claims: tuple[tuple[str, str], ...] = ()  # (rope type, key): a config of that type WITH that key is this method
    unread_keys: tuple[str, ...] = ()  # keys its source checkpoints carry that no table reads: accepted, ignored
    transformers_model_type: bool = False  # transformers names the type in its model files only (see RopeScaling)

    def __post_init__(self):
        if self.stock not in ("plain", "same", "refused"):
            raise TypeError(f"register: stock must be 'plain', 'same' or 'refused', got {self.stock!r}")


def register(rope_type: str, **declared):
    """Class decorator: adds a method to the registry (``METHODS``, every name it is read under) with what it
    declares (:class:`Declaration`). Every declaration is set on the class itself, so a subclass never answers
    with its parent's."""
    declaration = Declaration(rope_type, **declared)

    def decorate(cls: type["RopeScaling"]) -> type["RopeScaling"]:
        for name in (declaration.rope_type, *declaration.aliases):
            if name in _BY_NAME or name.startswith((RopeType.RESONANCE_PREFIX, *RopeType.MARKERS)) \
                    or name == RopeType.RESONANCE:
                raise TypeError(f"register: {cls.__name__}'s name {name!r} is taken or uses a reserved prefix")
        for f in dataclasses.fields(declaration):
            setattr(cls, f.name, getattr(declaration, f.name))
        if declaration.cli_names is None:
            cls.cli_names = (declaration.rope_type,)
        for name in (cls.rope_type, *cls.aliases):
            _BY_NAME[name] = cls
        METHODS[cls.rope_type] = cls
        cls._parameters = tuple(_parameter(cls, f) for f in dataclasses.fields(cls) if f.name != "resonance")
        HF_KEYS[cls.rope_type] = (frozenset(p.hf_key for p in cls._parameters if p.hf_key and p.required),
                                  frozenset(p.hf_key for p in cls._parameters if p.hf_key and not p.required)
                                  | frozenset(declaration.unread_keys))
        for claimed in declaration.claims:
            if claimed in _CLAIMS:
                raise TypeError(f"register: {cls.__name__} claims {claimed}, which {_CLAIMS[claimed].__name__} has")
            _CLAIMS[claimed] = cls
        return cls

    return decorate


def reads_every_key(rope_parameters: Mapping[str, Any]) -> bool:
    """Whether ``from_hf`` reads every key of these rope parameters (their type's, and the common ones)."""
    parsed = RopeType.of(rope_parameters)
    if parsed.method is None:
        return False
    required, optional = HF_KEYS[parsed.method.rope_type]
    return set(rope_parameters or {}) <= required | optional | _COMMON_KEYS


def _parameter(cls, f: dataclasses.Field) -> Parameter:
    meta = f.metadata
    hf = meta.get("hf", "")
    kind = {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type).split(" ")[0], tuple)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return Parameter(f.name, f.name if hf == "" else hf, bool(meta.get("required")), meta.get("fallback"),
                     meta.get("cli"), meta.get("help", ""), default, kind, bool(meta.get("ropescale_key")))


class _Markers:
    """``RopeType.MARKERS``: the declared raw-key attentions' names."""

    def __get__(self, instance, owner) -> tuple[str, ...]:
        return tuple(attentions.RAW_KEY)


@dataclass(frozen=True)
class RopeType:
    """A rope type name, parsed: the one place that knows the naming scheme.

    An attention marker says that the checkpoint attends over raw keys with an attention stock engines lack:
    ``rerope`` (ReRoPE), ``self_extend`` (Self-Extend), ``dual_chunk`` (Dual Chunk Attention), alone over plain
    RoPE, else ``<marker>_<table>``; the table is a method's name or alias, ``resonance_<rope type>`` for
    Resonance on it (``resonance`` alone on plain RoPE). ``method`` is None for a name no registered method has.
    The marker exists so that stock transformers and engines refuse the type rather than serve plain RoPE."""

    table: str  # the name without the attention marker, as written
    method: type["RopeScaling"] | None
    resonance: bool = False
    marker: str | None = None  # the attention marker: one of MARKERS, or None

    RESONANCE: ClassVar[str] = "resonance"
    RESONANCE_PREFIX: ClassVar[str] = "resonance_"
    REROPE_MARKER: ClassVar[str] = "rerope"
    REROPE_PREFIX: ClassVar[str] = "rerope_"
    #: The attention markers, each the raw-key ``attention`` it marks (``attentions.RAW_KEY``, read at each use: an
    #: attention declared after this module's import is one).
    MARKERS: ClassVar[tuple[str, ...]] = _Markers()

    @classmethod
    def parse(cls, name: Any) -> "RopeType":
        """Never raises: an unknown name has ``method`` None (the caller says what it expected)."""
        marker, table = None, name
        for candidate in sorted(cls.MARKERS, key=len, reverse=True):  # the longest first: one may start another
            if name == candidate:
                marker, table = candidate, "default"
            elif isinstance(name, str) and name.startswith(candidate + "_"):
                marker, table = candidate, name[len(candidate) + 1:]
            else:
                continue
            break
        if table == cls.RESONANCE:
            return cls(table, Default, True, marker)
        if isinstance(table, str) and table.startswith(cls.RESONANCE_PREFIX) \
                and table[len(cls.RESONANCE_PREFIX):] in METHODS:
            return cls(table, METHODS[table[len(cls.RESONANCE_PREFIX):]], True, marker)
        return cls(table, _BY_NAME.get(table) if isinstance(table, str) else None, False, marker)

    @classmethod
    def of(cls, rope_parameters: Mapping[str, Any] | None) -> "RopeType":
        """The type of a config's rope parameters: :meth:`parse` of its ``rope_type`` (or legacy ``type``), and the
        method that claims that type when the parameters carry its key (``register(claims=...)``: HunYuan's
        ``dynamic`` with ``alpha`` is NTK-alpha, not Dynamic NTK), Resonance and attention marker kept."""
        params = rope_parameters or {}
        parsed = cls.parse(params.get("rope_type") or params.get("type") or "default")
        bare = parsed.table[len(cls.RESONANCE_PREFIX):] if parsed.resonance and parsed.table != cls.RESONANCE \
            else parsed.table
        for key in params:
            claimant = _CLAIMS.get((bare, key)) if isinstance(bare, str) else None
            if claimant is not None:
                return cls(parsed.table, claimant, parsed.resonance, parsed.marker)
        return parsed

    @classmethod
    def table_name(cls, method: type["RopeScaling"], resonance: bool = False) -> str:
        """The name of ``method``'s table (with Resonance on it) as transformers' ``rope_type``."""
        if not resonance:
            return method.rope_type
        return cls.RESONANCE if method.rope_type == "default" else cls.RESONANCE_PREFIX + method.rope_type

    @classmethod
    def join(cls, table: str, marker: "str | bool | None") -> str:
        """``table`` with the attention marker (the inverse of :meth:`parse`'s split). ``marker``: one of
        :attr:`MARKERS`, None (no marker), or a bool (True: ReRoPE's, the older form)."""
        if marker is True:
            marker = cls.REROPE_MARKER
        if not marker:
            return table
        if marker not in cls.MARKERS:
            raise ValueError(f"RopeType.join: unknown attention marker {marker!r}; the markers are {cls.MARKERS}")
        return marker if table == "default" else f"{marker}_{table}"

    @property
    def rerope(self) -> bool:
        """Whether the type carries ReRoPE's marker (see :attr:`marker` for every attention marker)."""
        return self.marker == self.REROPE_MARKER

    @property
    def name(self) -> str:
        return self.join(self.table, self.marker)

    @property
    def plain(self) -> bool:
        """The method's own rope type, with no prefix and no alias."""
        return (self.method is not None and not self.resonance and self.marker is None
                and self.table == self.method.rope_type)

    @property
    def is_stock(self) -> bool:
        """A type stock transformers and vLLM serve by their own code: a method's own name, no prefix."""
        return self.plain and self.method.stock != "refused"


def _transformers_has(name: str) -> bool:
    parsed = RopeType.parse(name)
    return parsed.plain and parsed.method.transformers_native


def _transformers_model_type(name: str) -> bool:
    parsed = RopeType.parse(name)
    return parsed.plain and parsed.method.transformers_model_type


def ropescale_rope_types() -> tuple[str, ...]:
    """The rope types ropescale adds to transformers' (``import ropescale.hf`` registers them): every table
    name transformers lacks, and each attention marker (ReRoPE, Self-Extend, Dual Chunk Attention) over every table."""
    tables = table_type_names()
    return (*(n for n in tables if not _transformers_has(n) and not _transformers_model_type(n)),
            *(RopeType.join(n, marker) for marker in RopeType.MARKERS for n in tables))


def table_type_names() -> tuple[str, ...]:
    """Every table name ropescale reads: each method's rope type and aliases, and Resonance on each method
    written as a ``resonance`` type."""
    names = []
    for cls in METHODS.values():
        names += [cls.rope_type, *cls.aliases]
        if cls.resonance_type:
            names.append(RopeType.table_name(cls, resonance=True))
    return tuple(names)


@dataclass(frozen=True)
class RopeScaling:
    """Base class: the unscaled table. Subclasses override ``_table`` and ``attention_factor_for``; ``register``
    sets the class attributes below on each (its arguments, or :class:`Declaration`'s defaults)."""

    resonance: bool = False

    #: transformers' name for the table (``rope_parameters["rope_type"]``).
    rope_type: ClassVar[str] = "default"
    #: Other names a config may use for it.
    aliases: ClassVar[tuple[str, ...]] = ()
    #: The name ropescale writes it under, where that differs from ``rope_type``.
    written_type: ClassVar[str | None] = None
    #: True when the scale follows the current length (every engine needs a pre-RoPE cache).
    dynamic: ClassVar[bool] = False
    #: What stock transformers and vLLM do with the type it is written under: "plain" (plain RoPE: nothing
    #: to say), "same" (they serve the same table with their own code; ropescale records the method so that
    #: its plugin serves ropescale's), "refused" (a ropescale type: they refuse it by name).
    stock: ClassVar[str] = "plain"
    #: Stock engines take ``max_position_embeddings`` of this type as the scaled length (vLLM multiplies
    #: every other type's by ``factor``).
    stock_length_is_scaled: ClassVar[bool] = False
    #: transformers has this rope type (ropescale registers the others).
    transformers_native: ClassVar[bool] = True
    #: Resonance on it is written as the type ``resonance_<type>``.
    resonance_type: ClassVar[bool] = True
    #: vLLM's rotary class for this table (the opt-in switch rotates it with ropescale's kernel).
    vllm_rotary_class: ClassVar[str | None] = "RotaryEmbedding"
    #: vLLM has a type of this name with another formula: vLLM keeps it.
    vllm_owns_name: ClassVar[bool] = False
    #: What vLLM's own code gets wrong for this transformers type (a config ropescale did not write): the plugin
    #: then serves it as transformers does. Empty: vLLM's own is right, and a model ropescale did not write is vLLM's.
    vllm_stock_wrong: ClassVar[str] = ""
    #: The names the command line's ``--method`` offers for it.
    cli_names: ClassVar[tuple[str, ...]] = ("default", "resonance")
    #: Its table covers the whole head (``head_dim / 2`` pairs) whatever the config's ``partial_rotary_factor``:
    #: the method reads that factor itself and gives the pairs past it frequency 0 (transformers' ``proportional``).
    #: Otherwise its table is for the first ``head_dim * partial_rotary_factor`` features. See ``rotary_dim_for``.
    head_dim_table: ClassVar[bool] = False
    #: (rope type, key) pairs: a config of that type carrying that key is this method (see ``RopeType.of``).
    claims: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: Keys its source checkpoints carry that no engine's table reads: ``from_hf`` accepts them and reads nothing.
    unread_keys: ClassVar[tuple[str, ...]] = ()
    #: transformers knows the rope type by this name in its model files, not in ``ROPE_INIT_FUNCTIONS`` (HunYuan's
    #: ``ntk_alpha``: its rotary and ``PreTrainedModel._init_weights`` compute it, and ``_init_weights`` prefers a
    #: ``ROPE_INIT_FUNCTIONS`` entry of that name): ropescale leaves the name to transformers (an entry of its own would
    #: replace HunYuan's table at load, by float32 rounding) and registers Resonance on it only.
    transformers_model_type: ClassVar[bool] = False

    _parameters: ClassVar[tuple[Parameter, ...]] = ()

    def __post_init__(self):
        _check_bool(self, "resonance")

    @classmethod
    def parameters(cls) -> tuple[Parameter, ...]:
        """The method's parameters, in field order (``resonance`` aside: it is in the rope type)."""
        return cls._parameters

    @property
    def length_dependent(self) -> bool:
        """Whether the table differs between lengths: a dynamic method's, or LongRoPE's with distinct
        short and long factors. Every engine then gives each sequence its own length's table."""
        return self.dynamic

    @property
    def per_request(self) -> bool:
        """Whether one request keeps ONE table for its whole life, the one at its planned length (prompt + the
        tokens it may generate: ``per="request"`` of the dynamic methods), instead of the table of each step's
        length (``per="step"``, the paper's rule)."""
        return getattr(self, "per", "step") == "request"

    @classmethod
    def rotary_dim_for(cls, head_dim: int, partial_rotary_factor: float = 1.0) -> int:
        """The rotary dim (``inv_freq``'s ``dim``) of this method's table on heads of ``head_dim`` features under a
        config's ``partial_rotary_factor``: ``head_dim * partial_rotary_factor`` (transformers' rule), or
        ``head_dim`` itself for a method whose table covers the whole head (``head_dim_table``). The one place
        that decides it: ``config.rotary_dim`` asks here for every adapter."""
        if cls.head_dim_table:
            return int(head_dim)
        return int(head_dim * partial_rotary_factor)

    def check_rotary_dim(self, dim: int) -> None:
        """Raise ValueError when the method cannot make a table for rotary dim ``dim`` (before a model is touched)."""

    def scale_at(self, seq_len: int | None) -> float | None:
        """The scale factor in effect at ``seq_len`` (None: the method has no single one), for display."""
        return None

    def inv_freq(
        self, dim: int, base: float, seq_len: int | None = None, *, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The ``dim // 2`` inverse frequencies for rotary dim ``dim`` and base ``base``. ``seq_len``
        (largest position + 1) matters only for dynamic methods and LongRoPE."""
        table = self._table(dim, base, seq_len, torch.float64)
        if self.resonance:
            table = ops.resonance_inv_freq(table)
        return table.to(dtype or torch.float32)

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin at the method's own scale (1 for most methods)."""
        return self.attention_factor_for(None)

    def attention_factor_for(self, seq_len: int | None) -> float:
        return 1.0

    def to_hf(self, base: float | None = None) -> dict[str, Any]:
        """A transformers ``rope_parameters`` dict for this method (``rope_theta`` when ``base`` is given)."""
        params: dict[str, Any] = {"rope_type": RopeType.table_name(type(self), self.resonance)}
        for p in self.parameters():
            value = getattr(self, p.name)
            if p.ropescale_key and value == p.default:
                continue  # a key of ropescale's at its default is not written: the config stays what it was
            if value is not None and p.hf_key:
                params[p.hf_key] = list(value) if isinstance(value, tuple) else value
        if base is not None:
            params["rope_theta"] = float(base)
        return params

    def stock_parameters(self, base: float, rotary_dim: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(rope_parameters for stock engines, the method for ropescale's entry)``: the entry holds it where
        a stock engine serves the written type with its own code (``stock == "same"``), else None."""
        params = self.to_hf(base=base)
        if params["rope_type"] == self.rope_type and self.written_type:
            params["rope_type"] = self.written_type
        written = RopeType.parse(params["rope_type"])
        return params, (dict(params) if written.is_stock and written.method.stock == "same" else None)

    @classmethod
    def read_hf(cls, params: Mapping[str, Any], max_position_embeddings: int | None) -> dict[str, Any]:
        """The fields' values from a config's rope parameters (keys checked by ``from_hf``); an absent one
        takes its fallback, else the field's default."""
        values = {}
        for p in cls.parameters():
            value = params.get(p.hf_key) if p.hf_key else None
            if value is None and p.kind in (bool, str) and p.hf_key in params:
                values[p.name] = value  # a switch or a choice set to null is refused, not read as its default
                continue
            if value is None and p.fallback == FROM_CONFIG_LENGTH:
                value = max_position_embeddings
                if value is None:
                    needs = f"{p.hf_key} (or the config's max_position_embeddings)" if p.hf_key else \
                        "the config's max_position_embeddings"
                    raise ValueError(f"from_hf: rope_type {cls.rope_type!r} needs {needs}")
            if value is None:
                continue
            values[p.name] = _integer(value) if p.kind is int else _number(value) if p.kind is float else value
        return values

    def _table(self, dim: int, base: float, seq_len: int | None, dtype: torch.dtype) -> torch.Tensor:
        return ops.default_inv_freq(dim, base, dtype=dtype)


_ORIGINAL = "original_max_position_embeddings"
_FACTOR_HELP = "scale factor s: the table is set for s x L"
_ORIGINAL_HELP = "pre-training context L"


@register("default", stock="plain", transformers_native=True, vllm_rotary_class="RotaryEmbedding",
          cli_names=("default", "resonance"))
@dataclass(frozen=True)
class Default(RopeScaling):
    """Plain RoPE (or Resonance RoPE with ``resonance=True``)."""


@register("linear", stock="same", transformers_native=True, vllm_rotary_class="LinearScalingRotaryEmbedding")
@dataclass(frozen=True)
class Linear(RopeScaling):
    """Position interpolation (Chen et al.): ``theta / factor``."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=_FACTOR_HELP)

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)

    def _table(self, dim, base, seq_len, dtype):
        return ops.linear_inv_freq(dim, base, self.factor, dtype=dtype)


# transformers' ``proportional`` (Gemma 4's full-attention layers): its table spans the whole head (head_dim_table),
# the pairs past partial_rotary_factor at frequency 0 (identity). Resonance on it is well defined: the op leaves a zero
# frequency (infinite wavelength) alone and rounds the rotated pairs' wavelengths, so resonance_proportional is kept.
@register("proportional", stock="same", transformers_native=True, head_dim_table=True)
@dataclass(frozen=True)
class Proportional(RopeScaling):
    """transformers' ``proportional`` (Gemma 4): on heads of ``d`` features, ``b^(-2i/d) / factor`` (the exponent over
    the FULL head dim) for the first ``floor(partial_rotary_factor * d / 2)`` pairs and 0 (not rotated) for the
    rest; ``d / 2`` entries whatever ``partial_rotary_factor`` is, so ``inv_freq`` takes the head dim as ``dim``
    (``rotary_dim_for``). ``partial_rotary_factor`` is a parameter of the method here, not the caller's rotary dim.
    Attention factor 1; ``partial_rotary_factor=1`` is ``linear``."""

    # transformers' init function reads ``factor`` but its validator does not list it (5.23 warns "Unrecognized keys"
    # and still uses it): a ropescale key, so the validators of ropescale's types (resonance_/rerope_proportional)
    # ignore it and ``to_hf`` writes it only when it scales (a Gemma 4 config, factor 1, is written as it was).
    factor: float = parameter(1.0, cli="--factor", help=_FACTOR_HELP, ropescale_key=True)
    partial_rotary_factor: float = parameter(1.0)

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        value = self.partial_rotary_factor
        if not _is_number(value) or not math.isfinite(value) or not 0.0 < value <= 1.0:
            _fail(self, "partial_rotary_factor", "a finite number > 0 and <= 1")

    def _table(self, dim, base, seq_len, dtype):
        return ops.proportional_inv_freq(dim, base, self.factor, self.partial_rotary_factor, dtype=dtype)


class _NTKAware:
    """NTK-aware scaling's table, shared by :class:`NTK` (its ``factor``) and :class:`NTKAlpha` (HunYuan's
    ``alpha``): the default table at base ``b * s^(d/(d-2))`` (``ops.ntk_inv_freq``), written for stock engines as
    ``default`` with that base (the same table in every engine) and the method recorded in the entry."""

    _stretch: ClassVar[str]  # the field that is s

    def scaled_base(self, base: float, dim: int) -> float:
        """The base ``ops.ntk_inv_freq`` raises to (csrc/frequencies.cpp): ``b * s^(d/(d-2))``."""
        return float(base) * float(getattr(self, self._stretch)) ** (dim / (dim - 2))

    def stock_parameters(self, base, rotary_dim):
        if self.resonance:
            return super().stock_parameters(base, rotary_dim)
        return {"rope_type": "default", "rope_theta": self.scaled_base(base, rotary_dim)}, self.to_hf(base=base)

    def _table(self, dim, base, seq_len, dtype):
        return ops.ntk_inv_freq(dim, base, getattr(self, self._stretch), dtype=dtype)


# Stock engines serve it as ``default`` with the scaled base; vLLM's own ``ntk`` is another formula (base b*s,
# frequencies divided by s^(2/d)), which vLLM keeps.
@register("ntk", stock="same", vllm_owns_name=True)
@dataclass(frozen=True)
class NTK(_NTKAware, RopeScaling):
    """NTK-aware scaling (bloc97): the base raised to ``base * factor ** (dim / (dim - 2))``.
    transformers has no static NTK type: ropescale writes it as ``default`` with that base (the same
    table in every engine) and records the method; it reads its former ``ntk`` type too."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=_FACTOR_HELP)
    _stretch: ClassVar[str] = "factor"

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)


# HunYuan's NTK-alpha: its checkpoints label it ``dynamic`` with an ``alpha`` key, a fixed table (claims). Sources:
# transformers 5.23 models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py (``compute_ntk_alpha_rope_parameters``), vLLM
# 0.32 model_executor/layers/rotary_embedding/dynamic_ntk_alpha_rope.py (picked by get_rope for "dynamic" + "alpha").
# HunYuan's checkpoints carry YaRN's keys and factor 1.0 beside alpha, which neither reads (unread_keys).
@register("ntk_alpha", stock="same", claims=(("dynamic", "alpha"),), transformers_model_type=True,
          unread_keys=("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"))
@dataclass(frozen=True)
class NTKAlpha(_NTKAware, RopeScaling):
    """HunYuan's NTK-alpha: NTK-aware scaling with ``alpha`` for the factor, base ``b * alpha^(d/(d-2))``, attention
    factor 1, one table at every length. A config ``{"rope_type": "dynamic", "alpha": A}`` (HunYuan's checkpoints) reads
    as this method, not as Dynamic NTK (``claims``; transformers' HunYuan and vLLM read it so too). Written, like
    :class:`NTK`, as ``default`` with the scaled base (every engine's table, in every family; transformers reads
    ``dynamic`` + ``alpha`` in HunYuan's model only). ``alpha`` sets no length: the config's ``max_position_embeddings``
    is kept. HunYuan's ``factor`` (1.0 in its checkpoints) must be 1: no table reads it, but vLLM multiplies
    ``max_position_embeddings`` by it for a ``dynamic`` type (its table would end before the length vLLM allows)."""

    alpha: float = parameter(1.0, required=True, cli="--alpha",
                             help="HunYuan's NTK alpha: the base b x alpha^(d/(d-2)), at every length")
    _stretch: ClassVar[str] = "alpha"

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "alpha", minimum=1.0)

    @classmethod
    def read_hf(cls, params, max_position_embeddings):
        factor = params.get("factor")
        if factor is not None and (not _is_number(factor) or factor != 1):
            raise ValueError(f"NTKAlpha: factor beside alpha must be 1 (no table reads it, and vLLM would derive a "
                             f"max_model_len of factor x max_position_embeddings, past its table), got {factor!r}")
        return super().read_hf(params, max_position_embeddings)


#: How long a dynamic method's scale holds: "step" (each forward's length, the paper's rule) or "request" (the
#: request's planned length, prompt + the tokens it may generate, for its whole life: the static model of that
#: scale in every layer and step, and the native model when the request fits the trained length).
PER_CHOICES = ("step", "request")
_PER_HELP = ("how long the scale holds: step (the length at each step, the paper's rule) or request (the request's "
             "prompt + max new tokens, fixed for its whole life: a request that fits L runs the native model)")


def _per_parameter():
    return parameter("step", cli="--per", help=_PER_HELP, ropescale_key=True)


@register("dynamic", aliases=("dynamic_ntk",), written_type="dynamic_ntk", dynamic=True, transformers_native=True,
          cli_names=("dynamic", "dynamic_ntk"),
          vllm_stock_wrong="vLLM 0.32's DynamicNTKScalingRotaryEmbedding takes max_position_embeddings as both the "
                           "trained and the served length: plain RoPE up to it and a table that ends there (NaN past "
                           "it), while vLLM derives max_model_len = factor x max_position_embeddings")
@dataclass(frozen=True)
class DynamicNTK(RopeScaling):
    """Dynamic NTK (emozilla): NTK whose factor grows with the length past
    ``original_max_position`` (transformers uses ``max_position_embeddings`` there). Written as
    ``dynamic_ntk``: stock vLLM serves transformers' ``dynamic`` as plain RoPE with a table shorter than
    the length it allows (NaN logprobs past it, no error)."""

    factor: float = parameter(1.0, required=True, cli="--factor",
                              help="scale factor s in the base b*((s*len/L) - (s-1))^(d/(d-2)) past L, native up to L")
    # transformers' dynamic rule reads the config's max_position_embeddings, not a rope parameter.
    original_max_position: int = parameter(2048, hf=None, fallback=FROM_CONFIG_LENGTH, cli="--original-max-position",
                                           help=_ORIGINAL_HELP)
    per: str = _per_parameter()

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        _check_int(self, "original_max_position", 1)
        _check_choice(self, "per", PER_CHOICES)

    def _table(self, dim, base, seq_len, dtype):
        return ops.dynamic_ntk_inv_freq(
            dim, base, self.factor, self.original_max_position, seq_len or 0, dtype=dtype
        )


_YARN_FACTOR_HELP = "scale factor s: the table is set for s x L"



@register("yarn", stock="same", stock_length_is_scaled=True, transformers_native=True,
          vllm_rotary_class="YaRNScalingRotaryEmbedding", cli_names=("yarn", "resonance_yarn"))
@dataclass(frozen=True)
class YaRN(RopeScaling):
    """YaRN (Peng et al.): NTK-by-parts table and attention temperature ``0.1 ln(s) + 1``."""

    factor: float = parameter(1.0, required=True, cli="--factor", help=_YARN_FACTOR_HELP)
    original_max_position: int = parameter(4096, hf=_ORIGINAL, fallback=FROM_CONFIG_LENGTH,
                                           cli="--original-max-position", help=_ORIGINAL_HELP)
    beta_fast: float = parameter(32.0, cli="--beta-fast", help="YaRN beta_fast")
    beta_slow: float = parameter(1.0, cli="--beta-slow", help="YaRN beta_slow")
    truncate: bool = parameter(True, cli="--truncate",
                               help="YaRN truncate: round the ramp's bounds to whole pairs (--no-truncate: keep them "
                                    "fractional, as gpt-oss does)")
    mscale: float | None = parameter(None, cli="--mscale",
                                     help="YaRN mscale m (DeepSeek): the attention factor is (0.1 m ln s + 1) / "
                                          "(0.1 m' ln s + 1), m' = --mscale-all-dim, when both are set (else 0.1 ln s "
                                          "+ 1)")
    mscale_all_dim: float | None = parameter(None, cli="--mscale-all-dim",
                                             help="YaRN mscale_all_dim m' (DeepSeek): the divisor of the attention "
                                                  "factor; DeepSeek's MLA also multiplies its softmax scale by "
                                                  "(0.1 m' ln s + 1)^2")
    attention_factor_override: float | None = parameter(
        None, hf="attention_factor", cli="--attention-factor",
        help="the attention factor on cos and sin, fixed, in place of YaRN's own rule of s (config key "
             "attention_factor)")

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        _check_int(self, "original_max_position", 1)
        _check_float(self, "beta_slow", above=0.0)
        _check_greater(self, "beta_fast", "beta_slow", "the ramp runs from pairs turning beta_slow times over the "
                       "original length, interpolated, to those turning beta_fast times, kept")
        _check_bool(self, "truncate")
        _check_float(self, "mscale", optional=True)
        _check_float(self, "mscale_all_dim", optional=True)
        _check_float(self, "attention_factor_override", above=0.0, optional=True)

    @property
    def unread_mscale(self) -> str | None:
        """Why this method's ``mscale`` changes nothing, or None (not set, or it counts): transformers' YaRN
        (``_compute_yarn_parameters``) reads ``mscale`` only beside a non-zero ``mscale_all_dim``, taking
        ``0.1 ln s + 1`` whatever ``mscale`` alone is, and so does ropescale (``attention_factor_for``) and vLLM's YaRN
        rotary. The command line refuses it (a flag that does nothing); ``from_hf`` reads a config that carries it as
        transformers does, with a warning (checkpoints do)."""
        if not self.mscale or self.mscale_all_dim:
            return None
        return (f"mscale {self.mscale:g} without mscale_all_dim changes nothing: transformers' YaRN reads mscale only "
                "beside mscale_all_dim (the attention factor is then (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s "
                "+ 1)), else 0.1 ln s + 1 whatever mscale is, as vLLM's YaRN does (only vLLM's DeepSeek model reads "
                "mscale alone)")

    def _scale(self, seq_len: int | None) -> float:
        return self.factor

    def scale_at(self, seq_len):
        return self._scale(seq_len)

    def _table(self, dim, base, seq_len, dtype):
        return ops.yarn_inv_freq(
            dim, base, self._scale(seq_len), self.original_max_position,
            self.beta_fast, self.beta_slow, self.truncate, dtype=dtype,
        )

    def attention_factor_for(self, seq_len):
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        # The op applies transformers' rule: the mscale ratio only when both are non-zero.
        return ops.yarn_attention_factor(
            self._scale(seq_len), float(self.mscale or 0.0), float(self.mscale_all_dim or 0.0)
        )


@register("dynamic_yarn", dynamic=True)
@dataclass(frozen=True)
class DynamicYaRN(YaRN):
    """Dynamic YaRN: YaRN at scale ``s = max(factor, seq_len / original_max_position)``, recomputed as
    the sequence grows (``factor`` defaults to 1: plain RoPE until the original length is passed).
    ``factor`` is a FLOOR applied at every length (above 1, no length runs native), not the length the
    model may be served to: that one is written apart (``ropescale extend --max-length``)."""

    factor: float = parameter(1.0, cli="--floor",
                              help="the floor F of its scale s = max(F, len/L), applied at EVERY length (requests "
                                   "shorter than F x L are then no longer native)")
    per: str = _per_parameter()

    def __post_init__(self):
        super().__post_init__()
        _check_choice(self, "per", PER_CHOICES)

    def _scale(self, seq_len):
        if seq_len is None:
            return self.factor
        return max(self.factor, seq_len / self.original_max_position)


@register("llama3", stock="same", stock_length_is_scaled=True, transformers_native=True,
          vllm_rotary_class="Llama3RotaryEmbedding")
@dataclass(frozen=True)
class Llama3(RopeScaling):
    """Llama 3.1's piecewise wavelength rule."""

    factor: float = parameter(8.0, required=True, cli="--factor", help=_FACTOR_HELP)
    low_freq_factor: float = parameter(1.0, required=True)
    high_freq_factor: float = parameter(4.0, required=True)
    original_max_position: int = parameter(8192, hf=_ORIGINAL, required=True, cli="--original-max-position",
                                           help=_ORIGINAL_HELP)

    def __post_init__(self):
        super().__post_init__()
        _check_float(self, "factor", minimum=1.0)
        _check_float(self, "low_freq_factor", above=0.0)
        _check_greater(self, "high_freq_factor", "low_freq_factor", "the ramp runs from wavelengths L / "
                       "low_freq_factor, divided by factor, to L / high_freq_factor, kept")
        _check_int(self, "original_max_position", 1)

    def _table(self, dim, base, seq_len, dtype):
        return ops.llama3_inv_freq(
            dim, base, self.factor, self.low_freq_factor, self.high_freq_factor,
            self.original_max_position, dtype=dtype,
        )


# Resonance on it is written as a plain longrope whose factors hold the rounded table (resonance_type=False).
@register("longrope", stock="same", stock_length_is_scaled=True, transformers_native=True,
          resonance_type=False)
@dataclass(frozen=True)
class LongRoPE(RopeScaling):
    """LongRoPE: per-pair short/long factors, long once ``seq_len > original_max_position``.
    ``factor`` (for the attention factor) defaults to ``max_position / original_max_position``."""

    short_factor: tuple[float, ...] = parameter(required=True, factory=tuple, cli="--longrope-factors",
                                                help="per-pair factors up to L")
    long_factor: tuple[float, ...] = parameter(required=True, factory=tuple, cli="--longrope-factors",
                                               help="per-pair factors past L")
    original_max_position: int = parameter(4096, hf=_ORIGINAL, fallback=FROM_CONFIG_LENGTH,
                                           cli="--original-max-position", help=_ORIGINAL_HELP)
    factor: float | None = parameter(None, cli="--factor",
                                     help="the length scale s its long factors were searched for (the attention "
                                          "factor, and the length s x L it is served to)")
    attention_factor_override: float | None = parameter(
        None, hf="attention_factor", cli="--attention-factor",
        help="the attention factor on cos and sin, fixed, in place of LongRoPE's own rule of s and L (config key "
             "attention_factor)")

    def __post_init__(self):
        super().__post_init__()
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            try:
                factors = tuple(value)
            except TypeError:
                factors = None
            if not factors or not all(_is_number(f) and math.isfinite(f) and f > 0 for f in factors):
                _fail(self, name, "a non-empty sequence of finite numbers > 0 (one per rotary pair)")
            object.__setattr__(self, name, tuple(float(f) for f in factors))  # hashable, compares equal
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(f"LongRoPE: short_factor and long_factor must have the same length (one per rotary "
                             f"pair), got {len(self.short_factor)} and {len(self.long_factor)}")
        # The attention factor divides by ln(original_max_position).
        _check_int(self, "original_max_position", 2, " (the attention factor divides by its log)")
        _check_float(self, "factor", above=0.0, optional=True)
        _check_float(self, "attention_factor_override", above=0.0, optional=True)

    @property
    def length_dependent(self) -> bool:
        return self.short_factor != self.long_factor

    def check_rotary_dim(self, dim):
        if len(self.short_factor) != dim // 2:
            raise ValueError(f"LongRoPE: {len(self.short_factor)} factors per list, but rotary dim {dim} has "
                             f"{dim // 2} pairs")

    @classmethod
    def read_hf(cls, params, max_position_embeddings):
        values = super().read_hf(params, max_position_embeddings)
        original = values.get("original_max_position")
        if values.get("factor") is None and max_position_embeddings is not None and _is_number(original) \
                and original > 0:
            values["factor"] = max_position_embeddings / original
        return values

    def _table(self, dim, base, seq_len, dtype):
        return ops.longrope_inv_freq(
            dim, base, self.short_factor, self.long_factor, self.original_max_position, seq_len or 0, dtype=dtype
        )

    def attention_factor_for(self, seq_len):
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        return ops.longrope_attention_factor(self.factor or 1.0, self.original_max_position)

    def to_hf(self, base=None):
        """``factor`` is always written (1.0 when unset, as the attention factor uses it): without it
        transformers would derive one from ``max_position_embeddings``. With ``resonance=True`` the
        rounded short and long tables are written as the factors of a plain ``longrope`` (``theta_i /
        rounded_i``), which transformers and vLLM run natively; that needs ``base``."""
        params = super().to_hf(base)
        params["factor"] = float(self.factor or 1.0)
        if self.resonance:
            if base is None:
                raise ValueError("to_hf: Resonance LongRoPE is written as longrope factors, which needs base")
            dim = 2 * len(self.short_factor)
            plain = ops.default_inv_freq(dim, float(base), dtype=torch.float64)
            for name, seq_len in (("short_factor", None), ("long_factor", self.original_max_position + 1)):
                rounded = self.inv_freq(dim, float(base), seq_len=seq_len, dtype=torch.float64)
                params[name] = (plain / rounded).tolist()
            params["rope_type"] = "longrope"
        return params


#: Keys of a model family's rope LAYOUT, not of its method (partial rotary; Qwen-VL's multimodal sections, plain
#: or interleaved; Ministral 3's position-dependent query temperature): every type may carry them, and a patch
#: keeps them when it writes another method.
LAYOUT_KEYS = frozenset({"partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta"})

# Keys every type may carry that are not scaling parameters: the caller passes base and rotary dim
# to inv_freq(); ``resonance: true`` is the same as the ``resonance_`` prefix.
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "resonance"}) | LAYOUT_KEYS


def _number(value):
    """A real number as float (an integral one as int); anything else as given, for the method's own check."""
    if _is_number(value):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def _integer(value):
    """An integral number (4096 or 4096.0) as int; anything else as given, for the method's own check."""
    if _is_number(value) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return value


def from_hf(
    rope_parameters: Mapping[str, Any] | None,
    max_position_embeddings: int | None = None,
) -> RopeScaling:
    """Build the scaling method from a transformers ``rope_parameters`` (5.x) or legacy
    ``rope_scaling`` dict. ``max_position_embeddings`` is the config's value: transformers' dynamic
    rule uses it as the original length, YaRN and LongRoPE use it when
    ``original_max_position_embeddings`` is absent, and LongRoPE derives a missing ``factor`` from it.

    Strict, unlike transformers (which warns): a key the type does not read is an error naming it
    (and the close match, for a typo), so is a missing required key, and the values are checked by
    the method's dataclass. ``HF_KEYS`` lists the keys of every type."""
    if not rope_parameters:
        return Default()
    params = dict(rope_parameters)
    name = params.get("rope_type") or params.get("type") or "default"
    parsed = RopeType.of(params)
    if parsed.method is None or parsed.marker is not None:
        raise ValueError(f"from_hf: unknown rope_type {name!r}; ropescale knows {sorted(METHODS)}")
    cls = parsed.method
    resonance = parsed.resonance or params.get("resonance", False)
    required, optional = HF_KEYS[cls.rope_type]
    known = required | optional | _COMMON_KEYS
    for key in sorted(set(params) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known - {"type"}), n=1)
        raise ValueError(
            f"from_hf: rope_type {cls.rope_type!r} has no parameter {key!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; it reads {sorted(required | optional) or 'no parameters'}")
    missing = sorted(k for k in required if params.get(k) is None)
    if missing:
        raise ValueError(f"from_hf: rope_type {cls.rope_type!r} needs {', '.join(missing)}")
    if not isinstance(resonance, bool):
        raise ValueError(f"from_hf: resonance must be true or false, got {resonance!r}")
    try:
        method = cls(**cls.read_hf(params, max_position_embeddings), resonance=resonance)
    except ValueError as err:
        message = str(err)
        if message.startswith("from_hf"):
            raise
        raise ValueError(f"from_hf: rope_type {cls.rope_type!r}: {message}") from None
    unread = getattr(method, "unread_mscale", None)
    if unread:  # a checkpoint may carry it: read as transformers reads it (exact), and said once
        warn_once(f"ropescale: rope_type {cls.rope_type!r}: {unread}; read as transformers reads it (attention "
                  f"factor {method.attention_factor:.6g})")
    return method


_warned: set[str] = set()


def warn_once(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message)`` the first time this process sees ``message`` (``stacklevel`` counted from the
    caller, as ``warnings.warn``'s from its own)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)
