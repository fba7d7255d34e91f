"""The method registry: how a method declares itself (:func:`register`, :func:`parameter`), the tables it fills
(``METHODS``, ``HF_KEYS``), the naming scheme of rope types (:class:`RopeType`) and the base class every method
derives from (:class:`RopeScaling`). The methods themselves are in a module per family (``scaling_plain``,
``scaling_ntk``, ``scaling_yarn``, ``scaling_llama3_longrope``); :mod:`ropescale.scaling` imports them all (which
registers them, in its order) and is the public path of every name here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from . import attentions, ops
from .scaling_checks import check_bool, is_number

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
    return set(rope_parameters or {}) <= required | optional | COMMON_KEYS


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
            return cls(table, METHODS["default"], True, marker)
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
    def unscaled(self) -> bool:
        """Plain RoPE: the unscaled method's own name, no Resonance, no attention marker (``default``)."""
        return self.plain and self.method.stock == "plain"

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
        check_bool(self, "resonance")

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
    def two_tables(self) -> bool:
        """Whether the table switches once, from a short table to a long one past the original length (LongRoPE with
        distinct factors). An engine that picks one of the two per engine rather than per sequence (llama.cpp by its
        context size, vLLM's own longrope past the original length) serves :meth:`long_table` at every length."""
        return False

    def long_table(self) -> "RopeScaling":
        """This method with the table it takes past its original length at every length (itself when it has one
        table: :attr:`two_tables`)."""
        return self

    @property
    def is_plain(self) -> bool:
        """Plain RoPE: the unscaled table without Resonance (the method stock engines serve as it is, ``stock``
        "plain")."""
        return type(self).stock == "plain" and not self.resonance

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


#: Keys and help texts several families' parameters share.
ORIGINAL_KEY = "original_max_position_embeddings"
FACTOR_HELP = "scale factor s: the table is set for s x L"
ORIGINAL_HELP = "pre-training context L"

#: How long a dynamic method's scale holds: "step" (each forward's length, the paper's rule) or "request" (the
#: request's planned length, prompt + the tokens it may generate, for its whole life: the static model of that
#: scale in every layer and step, and the native model when the request fits the trained length).
PER_CHOICES = ("step", "request")
_PER_HELP = ("how long the scale holds: step (the length at each step, the paper's rule) or request (the request's "
             "prompt + max new tokens, fixed for its whole life: a request that fits L runs the native model)")


def per_parameter():
    return parameter("step", cli="--per", help=_PER_HELP, ropescale_key=True)


#: Keys of a model family's rope LAYOUT, not of its method (partial rotary; Qwen-VL's multimodal sections, plain
#: or interleaved; Ministral 3's position-dependent query temperature): every type may carry them, and a patch
#: keeps them when it writes another method.
LAYOUT_KEYS = frozenset({"partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta"})

# Keys every type may carry that are not scaling parameters: the caller passes base and rotary dim
# to inv_freq(); ``resonance: true`` is the same as the ``resonance_`` prefix.
COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "resonance"}) | LAYOUT_KEYS


def _number(value):
    """A real number as float (an integral one as int); anything else as given, for the method's own check."""
    if is_number(value):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    return value


def _integer(value):
    """An integral number (4096 or 4096.0) as int; anything else as given, for the method's own check."""
    if is_number(value) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return value

