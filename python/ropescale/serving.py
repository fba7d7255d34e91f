"""What every engine adapter needs to serve a pre-RoPE model, engine-neutral (``ropescale.hf`` and
``ropescale.vllm`` both use it; an adapter for another engine starts here).

- :class:`PreRopePlan`: how a model's layers attend (the method's table, ReRoPE's attention side), read from
  a checkpoint's config; :func:`needs_pre_rope` says whether a checkpoint needs raw keys, :func:`rotated_at_write`
  whether it is a ``per="request"`` table whose keys are rotated once, when written (then any attention serves it);
- :class:`RequestRotaryTables`: a step's per-request rotation (each token's request, each request's table and
  attention factor) in buffers at fixed addresses, what an engine's rotary layer reads for ``rotated_at_write``.
- :class:`TableCache`: the tables by length (``inv_freq`` and attention factor at ``seq_len``, largest
  position + 1), on the host and on a device, and each step's tables for a batch of requests
  (:class:`StepTables`), cut where rows of one request need different tables (:func:`cut_segments`).

Rows and tables follow one rule per method, whatever the engine and however it schedules the request:

- ``per="step"`` (the paper's rule, and every length-dependent table but the ``per="request"`` ones): the one a
  transformers forward over the prompt and then one per generated token computes: a row at position ``p`` of a
  request whose prompt has ``P`` tokens takes the table at ``max(P, p + 1)``;
- ``per="request"``: every row of a request whose prompt has ``P`` tokens and which may generate ``N`` takes the
  table at ``P + N`` (:meth:`PreRopePlan.table_length`), in every layer and step: the request runs the static
  model of that scale from its first token to its last.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from typing import Mapping

import torch

from . import attentions, config as config_lib, ops, scaling

__all__ = ["NO_WINDOW", "PreRopePlan", "RequestRotaryTables", "StaticTableRotary", "cos_sin_cache",
           "dual_chunk_temperature", "needs_pre_rope", "written_by_ropescale", "rotated_at_write", "ropescale_rotary",
           "Segments", "StepTables", "cut_segments", "extended_layer_type", "rotate_per_request", "times_rows",
           "TableCache"]

#: A window no position reaches: ReRoPE's rule is then plain RoPE attention (the dynamic methods).
NO_WINDOW = 2**31 - 1


# The plan fields an attention's rule may set (``attentions.Attention.plan``), and those the ops take as keywords.
_RULE_FIELDS = ("leaky_k", "logn_length", "group", "chunk_size", "temperature_length", "temperature", "far_start")
_OP_KEYWORDS = ("group", "chunk_size", "far_start")


@dataclasses.dataclass(frozen=True)
class PreRopePlan:
    """How a pre-RoPE model's layers attend: the method's table and ReRoPE's attention side."""

    method: scaling.RopeScaling
    base: float
    rotary_dim: int
    window: int  # NO_WINDOW for the dynamic methods without ReRoPE; Self-Extend's W; DCA's local size S
    leaky_k: float = 0.0
    logn_length: int = 0
    interleaved: bool = False  # GPT-J pairs (vLLM's is_neox_style=False)
    group: int = 0  # Self-Extend's group size G (0: not Self-Extend)
    chunk_size: int = 0  # Dual Chunk Attention's C (0: not DCA)
    temperature_length: int = 0  # DCA's attention temperature length L0 (0: none)
    temperature: str = "qwen"  # DCA's temperature rule (config.DUAL_CHUNK_TEMPERATURES)
    far_start: int = -1  # STRING's local value W (its shifted offset S is ``window``; -1: not STRING)
    # the raw-key attention whose rule this is (attentions.RAW_KEY): ReRoPE's is also the dynamic methods' plain
    # rotation (a window past every distance)
    attention: str = "rerope"

    @classmethod
    def of(cls, parsed: config_lib.RopeConfig, rotary_dim: int, is_neox_style: bool) -> "PreRopePlan":
        return cls.for_attention(parsed.method, parsed.base, rotary_dim, parsed.attention, parsed.parameters,
                                 interleaved=not is_neox_style)

    @classmethod
    def for_attention(cls, method: scaling.RopeScaling, base: float, rotary_dim: int, attention: str,
                      parameters: Mapping, *, interleaved: bool = False) -> "PreRopePlan":
        """The plan of ``attention`` (``sdpa``: plain rotation, a window past every distance) with its checked
        ``parameters``: the ops' arguments its declaration gives (``attentions.Attention.plan``)."""
        if attention not in attentions.RAW_KEY:
            return cls(method, float(base), int(rotary_dim), NO_WINDOW, interleaved=interleaved)
        fields = attentions.RAW_KEY[attention].plan_fields(parameters)
        return cls(method, float(base), int(rotary_dim), **fields, interleaved=interleaved, attention=attention)

    def __post_init__(self):
        """A plan runs its attention's rule and no other: the fields the rule does not set are at their defaults,
        and its fixed ones at their values (a STRING plan with another slope would serve ReRoPE clipped at W)."""
        declared = attentions.RAW_KEY.get(self.attention)
        if declared is None:
            raise ValueError(f"PreRopePlan: attention must be one of {', '.join(attentions.RAW_KEY)}, got "
                             f"{self.attention!r}")
        for spec in dataclasses.fields(self):
            if spec.name not in _RULE_FIELDS:
                continue
            value, source = getattr(self, spec.name), declared.plan.get(spec.name)
            if source is None and value != spec.default:
                raise ValueError(f"PreRopePlan: {spec.name} {value!r} is not part of {declared.title}'s rule "
                                 f"(it sets {', '.join(declared.plan)})")
            if isinstance(source, attentions.Fixed) and value != source.value:
                raise ValueError(f"PreRopePlan: {declared.title}'s rule has {spec.name} {source.value!r}, got "
                                 f"{value!r}")

    def method_arguments(self) -> dict[str, int]:
        """The attention ops' keyword-only arguments of this plan's rule (those it sets; none for ReRoPE)."""
        return {name: getattr(self, name) for name in _OP_KEYWORDS if name in attentions.RAW_KEY[self.attention].plan}

    @property
    def score_factor(self) -> float:
        """The method's own factor on every score's rotated part, as its declaration gives it (STRING's attention
        factor squared: its code puts ``0.1 ln 2 + 1`` on cos and sin, so on q and k; 1 for the others)."""
        return attentions.RAW_KEY[self.attention].score_factor

    def served_within(self, max_length: int | None) -> "PreRopePlan":
        """This plan for an engine that serves at most ``max_length`` tokens a request (None: unknown): DCA's
        temperature dropped where no length passes L0 (``m(len) = 1`` for every ``len <= L0``), so that nothing
        depends on the prompt's length there."""
        if self.temperature_length and max_length is not None and int(max_length) <= self.temperature_length:
            return dataclasses.replace(self, temperature_length=0)
        return self

    def self_extend_reduces_within(self, max_length: int | None) -> str | None:
        """Why Self-Extend under this plan is another, simpler method at every length up to ``max_length`` (the
        longest a checkpoint may be served to), or None (not Self-Extend, a length it extends, or none known).
        Distances there are ``0 .. max_length - 1``: a window ``W >= max_length`` leaves every pair in the neighbour
        region (plain RoPE attention); a group ``G >= max_length`` puts every position in group 0, so every grouped
        pair sits at ``W`` (ReRoPE with window W); ``G = 1`` is RoPE attention at every length. STRING likewise: a
        shifted offset ``S >= max_length`` shifts no distance there (plain RoPE attention with STRING's factor)."""
        if self.attention == "string" and max_length is not None and self.window >= int(max_length):
            return (f"STRING with shifted_offset {self.window}, served up to {int(max_length)} tokens, is plain RoPE "
                    f"attention (times STRING's attention factor) there: every distance is below the shifted offset "
                    "(its authors take S = 0.33 of the length the model is served to)")
        if not self.group or max_length is None:
            return None
        window, group, length = self.window, self.group, int(max_length)
        head = f"Self-Extend with window {window} and group {group}"
        if group == 1:
            return f"{head} is plain RoPE attention at every length (a group of 1 keeps every position)"
        if window >= length:
            return (f"{head}, served up to {length} tokens, is plain RoPE attention there: every distance is below "
                    f"the window (a window below the trained length makes it extend)")
        if group >= length:
            return (f"{head}, served up to {length} tokens, is ReRoPE with window {window} there: every position is "
                    f"below the group size, so every grouped pair sits at distance {window} (the paper's group sizes "
                    "are small: 2 to 16)")
        return None

    @property
    def prompt_dependent(self) -> bool:
        """Whether a row's result depends on its request's prompt length, not on positions alone: a length-dependent
        table (each prompt row takes the whole prompt's), or DCA's temperature (``m(max(P, p + 1))`` on the query
        and key at position ``p``, ``P`` the prompt length)."""
        return self.length_dependent or self.temperature_length > 0

    def temperature_factors(self, seq_lens: list[int], query_lens: list[int], prompt_lens: list[int]) -> torch.Tensor:
        """DCA's temperature of each query row of a step (requests packed as the paged op takes them: request r's
        ``query_lens[r]`` rows are its last positions, ``seq_lens[r] - query_lens[r] + i``), float32
        ``[sum(query_lens)]``: ``m(max(P, p + 1))`` for the token at position ``p`` of a request whose prompt has
        ``P`` tokens, the factor of its query and of its key (:func:`dual_chunk_temperature`; rounded to float32, as ``hf.patch``
        multiplies them). All ones without a temperature."""
        rows = [max(int(q), 0) for q in query_lens]
        count = sum(rows)
        if not self.temperature_length or count == 0:
            return torch.ones(count, dtype=torch.float32)
        counts = torch.tensor(rows, dtype=torch.int64)
        ends = torch.tensor([int(n) for n in seq_lens], dtype=torch.int64).repeat_interleave(counts)
        starts = torch.cumsum(counts, 0) - counts
        offset = torch.arange(count, dtype=torch.int64) - starts.repeat_interleave(counts)
        positions = ends - counts.repeat_interleave(counts) + offset
        prompts = torch.tensor([int(p) for p in prompt_lens], dtype=torch.int64).repeat_interleave(counts)
        lengths = torch.maximum(prompts, positions + 1)
        return self.temperature_at(lengths).to(torch.float32)

    def temperature_at(self, lengths: torch.Tensor) -> torch.Tensor:
        """DCA's temperature of this plan at integer ``lengths`` (:func:`dual_chunk_temperature` with the plan's L0
        and rule), float64."""
        return dual_chunk_temperature(lengths, self.temperature_length,
                                      config_lib.DUAL_CHUNK_TEMPERATURES[self.temperature])

    @classmethod
    def of_config(cls, config) -> "PreRopePlan | None":
        """The plan of a transformers-style config (``rope_parameters``, ``max_position_embeddings``, the
        ``ropescale`` entry), or None when its method needs neither pre-RoPE attention nor a table per request
        (:attr:`rotated_at_write` tells the two apart)."""
        params = config.rope_parameters
        parsed = config_lib.read(params, getattr(config, "max_position_embeddings", None),
                                 getattr(config, config_lib.CONFIG_KEY, None), None,
                                 getattr(config, config_lib.DUAL_CHUNK_KEY, None))
        if not needs_pre_rope(parsed) and not rotated_at_write(parsed):
            return None
        return cls.of(parsed, config_lib.rotary_dim_of(config, params), True)

    @property
    def rotated_at_write(self) -> bool:
        """A ``per="request"`` table with plain attention (:func:`rotated_at_write`): each request's keys are rotated
        once, with its table, when written; the engine's own cache and attention serve it."""
        return (self.per_request and self.window == NO_WINDOW and not self.group and not self.chunk_size
                and not self.logn_length and not self.temperature_length)

    @property
    def attention_factor_varies(self) -> bool:
        """Whether the method's attention factor can differ from 1 (it has its own ``attention_factor_for``: YaRN,
        Dynamic YaRN, LongRoPE); Dynamic NTK's, linear's and the default table's is 1 at every length."""
        return type(self.method).attention_factor_for is not scaling.RopeScaling.attention_factor_for

    def attention_arguments(self, query: torch.Tensor, head_dim: int, scale: float, factor: float = 1.0,
                            scale_factors: torch.Tensor | None = None,
                            query_start_loc: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, float, torch.Tensor | None]:
        """``(query, scale, scale_factors)`` for a ReRoPE attention op (``rerope_attention``, its training and
        paged forms) that rotates the raw ``query`` under this plan's table, with the attention factor squared
        ``factor`` (a static table's, every row) or ``scale_factors`` ``[S]`` (segment s's, for the rows
        ``query_start_loc[s]:query_start_loc[s+1]`` along query's first dim, as the paged op takes them);
        ``scale`` is the plain softmax scale.

        transformers puts the attention factor ``m`` on cos and sin, that is on the ROTATED dims of q and k:
        ``score = scale * (m^2 q_rot . k_rot + q_pass . k_pass)``, while the ops multiply a row's whole score
        by ``scale * factor`` (and its ``scale_factors`` entry). The two agree when every dim is rotated
        (``rotary_dim >= head_dim``): the arguments are then passed on as they are, ``scale * factor``, the
        query untouched. A partial-rotary head (Phi-3, GLM-4) whose factor can differ from 1 gets a copy of the
        query with the first ``rotary_dim`` dims of each head (the dims both pair layouts rotate) times its
        row's factor, and the plain ``scale`` with no ``scale_factors``: the op's rotation is linear, so this
        is transformers' score exactly (the op's log-n scaling multiplies the whole query, before or after).

        ``query`` is ``[..., H * head_dim]`` or ``[..., head_dim]``; per-segment factors need its rows on dim 0
        (``[T, H, D]`` or ``[T, H * D]``), rows past ``query_start_loc[-1]`` (padding) taking the last
        segment's. Whether to copy depends on the plan, the shapes and a static ``factor``, never on the
        values of ``scale_factors`` (no host sync; a CUDA graph captured on one step's factors replays
        correctly on another's). The product is formed in float32 (float64 for float64) and rounded once to
        the query's dtype; differentiable in ``query``. The method's own :attr:`score_factor` (STRING's) joins
        ``factor``: its code too puts it on cos and sin."""
        factor = factor * self.score_factor
        per_row = scale_factors is not None and self.attention_factor_varies
        if self.rotary_dim >= head_dim or (factor == 1.0 and not per_row):
            return query, scale * factor, scale_factors
        if per_row and query_start_loc is None:
            raise ValueError("attention_arguments: per-segment scale_factors need the query_start_loc of their rows")
        heads = query.unflatten(-1, (-1, head_dim))
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        multiplier: torch.Tensor | float = factor
        if per_row:
            rows = heads.shape[0]
            ends = query_start_loc[1:].contiguous()
            row = torch.arange(rows, dtype=ends.dtype, device=ends.device)
            segment = torch.searchsorted(ends, row, right=True).clamp_(max=max(scale_factors.shape[0] - 1, 0))
            multiplier = scale_factors.to(compute).index_select(0, segment) * factor
            multiplier = multiplier.view(rows, *([1] * (heads.dim() - 1)))
        rotated = (heads[..., : self.rotary_dim].to(compute) * multiplier).to(query.dtype)
        folded = torch.cat((rotated, heads[..., self.rotary_dim:]), dim=-1)
        return folded.reshape(query.shape), scale, None

    @property
    def length_dependent(self) -> bool:
        """Each request needs the table of its own length (``RopeScaling.length_dependent``)."""
        return self.method.length_dependent

    @property
    def per_request(self) -> bool:
        """One table per request, at its planned length (``RopeScaling.per_request``)."""
        return self.length_dependent and self.method.per_request

    def table_length(self, prompt_len: int, max_new_tokens: int) -> int:
        """The length whose table a request's prompt is computed under: ``prompt_len + max_new_tokens`` for a
        per-request method (every row of the request, :func:`cut_segments`), the prompt's own otherwise."""
        prompt_len = max(int(prompt_len), 1)
        return prompt_len + max(int(max_new_tokens), 0) if self.per_request else prompt_len


def written_by_ropescale(rope_parameters, entry) -> bool:
    """Whether a layer's config is one ropescale wrote: its rope type is one of ropescale's (but a name the engine has
    with another formula, vLLM's ``ntk``: ``RopeScaling.vllm_owns_name``), or the ``ropescale`` entry records the
    method (a stock type ropescale wrote: its table is served as ropescale computes it). Every engine adapter serves
    such a layer with ropescale's rotary (or refuses it by name), and leaves every other layer to the engine."""
    rope_type = (rope_parameters or {}).get("rope_type", "default")
    parsed = scaling.RopeType.parse(rope_type)
    ours = rope_type in scaling.ropescale_rope_types() and not (parsed.plain and parsed.method.vllm_owns_name)
    return ours or (isinstance(entry, Mapping) and config_lib.METHOD_KEY in entry)


def ropescale_rotary(rope_parameters, entry) -> bool:
    """Whether the vLLM adapter gives a layer of this config ropescale's rotary (or its pre-RoPE pass-through)
    rather than vLLM's own: :func:`written_by_ropescale`, or a transformers type vLLM serves wrong
    (``RopeScaling.vllm_stock_wrong``: its stock ``dynamic``) with no key ropescale does not read. HunYuan's ``dynamic``
    with ``alpha`` is NTK-alpha (``RopeType.of``), which vLLM's own ``DynamicNTKAlphaRotaryEmbedding`` serves right."""
    parsed = scaling.RopeType.of(rope_parameters)
    wrong_in_vllm = (parsed.method is not None and parsed.plain and bool(parsed.method.vllm_stock_wrong)
                     and scaling.reads_every_key(rope_parameters))
    return written_by_ropescale(rope_parameters, entry) or wrong_in_vllm


def extended_layer_type(params, hf_config, entry, max_position: int, engine: str) -> bool:
    """For a config with rope parameters per layer type (Gemma 3), whether this layer's are the ones ropescale
    extended: ``hf.patch`` writes its method into some layer types only (``checkpoint.record(layer_types=)``)
    beside the model's one ``ropescale`` entry, so a layer is ropescale's when its parameters read with that
    entry, and the engine's own (a sliding layer's table) when they do not. Pre-RoPE methods are refused: ropescale's
    attention backend serves one plan for every layer of a model."""
    def reads(layer_type, layer_params) -> bool:  # at that type's own rotary dim (Gemma 4's differ by type)
        try:
            config_lib.read(layer_params, max_position, entry,
                            config_lib.rotary_dim_of(hf_config, layer_params, layer_type))
        except ValueError:
            return False
        return True

    extended = [dict(p) for t, p in hf_config.rope_parameters.items() if reads(t, p)]
    if not extended:
        raise ValueError(f"ropescale.{engine.lower()}: no layer type's rope_parameters match the config's ropescale "
                         "entry (the config was edited by hand?): rewrite it with hf.patch + save_pretrained")
    if dict(params) not in extended:
        return False
    if needs_pre_rope(config_lib.read(params, max_position, entry)):
        raise NotImplementedError(
            f"ropescale.{engine.lower()}: a pre-RoPE method (dynamic, ReRoPE) on some layer types of a per-layer-type "
            f"config (Gemma 3, Gemma 4) is not served by {engine}: ropescale's attention backend serves one plan for "
            "every layer, and the other types' layers are rotated at the model. Serve a static table (YaRN, linear, "
            "Llama 3), or use transformers + ropescale.hf")
    return True


def dual_chunk_temperature(lengths: torch.Tensor, temperature_length: int, coefficient: float = 0.1) -> torch.Tensor:
    """Dual Chunk Attention's attention temperature ``m(len) = max(1, c ln(len / L0) + 1)`` at integer ``lengths``,
    float64, ``c = coefficient`` (Qwen's 0.1, ChunkLlama's 0.05: ``config.DUAL_CHUNK_TEMPERATURES``); 1 where
    ``L0 = temperature_length`` is 0. ``hf.patch`` and the vLLM backend both take it from here, so both round the
    same float32 factors."""
    lengths = lengths.clamp_min(1).to(torch.float64)
    if not temperature_length:
        return torch.ones_like(lengths)
    return (coefficient * torch.log(lengths / float(temperature_length)) + 1.0).clamp_min(1.0)


def native_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """The default table as engines compute it for a native model (vLLM's ``RotaryEmbedding``, transformers'
    default rope): ``1 / base ** (2i / d)`` in float32 arithmetic, which differs from ropescale's correctly rounded
    ``default_inv_freq`` in the last bit of about a third of the entries."""
    return 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim))


def cos_sin_cache(method, rotary_dim: int, base: float, rows: int) -> torch.Tensor:
    """An engine's ``cos_sin_cache`` ``[rows, rotary_dim]`` (``[cos | sin]``, half-width per pair: vLLM's and SGLang's
    layout) of a static method: ropescale's float32 inv_freq, angles in double, the attention factor on cos and sin
    (what ``hf.patch`` feeds transformers)."""
    inv_freq = method.inv_freq(rotary_dim, base).to(torch.float64)
    factor = method.attention_factor
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat(((angles.cos() * factor).float(), (angles.sin() * factor).float()), dim=-1)


class StaticTableRotary:
    """Mixin of an engine's rotary layer class (vLLM's and SGLang's ``RotaryEmbedding``: ``(head_size, rotary_dim,
    max_position_embeddings, base, is_neox_style, dtype)``, a ``cos_sin_cache`` its ``_compute_cos_sin_cache``
    fills): the layer's table is a ropescale method's (:func:`cos_sin_cache`), ``rows`` positions long."""

    def __init__(self, head_size: int, rotary_dim: int, rows: int, base: float, is_neox_style: bool,
                 dtype: torch.dtype, method) -> None:
        self.method = method
        super().__init__(head_size, rotary_dim, rows, base, is_neox_style, dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return cos_sin_cache(self.method, self.rotary_dim, self.base, self.max_position_embeddings)


def rotated_at_write(parsed: config_lib.RopeConfig) -> bool:
    """Whether a checkpoint's method is a table per request (``per="request"``: one table for a request's whole life,
    at its planned length) with plain attention: its keys need no raw form, they are rotated once, with the
    request's table, when written, and the engine's own cache and attention serve them (vLLM's backend on every
    platform, transformers' cache and attention implementation)."""
    return parsed.per_length and parsed.method.per_request and not parsed.raw_keys


def needs_pre_rope(parsed: config_lib.RopeConfig) -> bool:
    """Whether a checkpoint's method rotates raw keys at attention time (ReRoPE, Self-Extend, Dual Chunk Attention,
    or a table that changes with each step's length: the per-step dynamic methods and a LongRoPE ropescale wrote
    with distinct factors). A ``per="request"`` table does not: :func:`rotated_at_write`."""
    return parsed.raw_keys or (parsed.per_length and not rotated_at_write(parsed))


@dataclasses.dataclass(frozen=True)
class Segments:
    """A step's requests cut where their rows need different tables (see :func:`cut_segments`), as the op takes
    them: segment i is rows ``query_start_loc[i]:query_start_loc[i+1]``, the last rows of a sequence of
    ``seq_lens[i]`` keys, over the pages of request ``request[i]`` (an index into vLLM's block table)."""

    request: torch.Tensor  # int64 [S]
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]


@dataclasses.dataclass(frozen=True)
class StepTables:
    """What ``rerope_attention_paged`` takes for one step's requests: ``inv_freq`` ``[P]`` (a static table)
    or ``[S, P]`` (segment s's table), ``scale_factors`` ``[S]`` (segment s's attention factor squared; None
    for a static table) and ``scale_factor``, a static table's attention factor squared (1 when per segment).
    ``segments`` is None when every request is one segment (vLLM's own lengths and block table then serve).
    ``temperature``: DCA's temperature of the step's query rows, float32, row t's at ``temperature[t]`` (the factor
    of that token's query and of the key it writes, :meth:`PreRopePlan.temperature_factors`; the buffer may be
    longer than the step), None without one."""

    inv_freq: torch.Tensor
    scale_factors: torch.Tensor | None
    scale_factor: float
    segments: Segments | None = None
    temperature: torch.Tensor | None = None


def cut_segments(seq_lens: list[int], query_lens: list[int] | None = None, prompt_lens: list[int] | None = None,
                 request_lens: list[int] | None = None) -> list[tuple[int, int, int, int]]:
    """``(request, rows, seq_len, table_len)`` per segment: the length whose table each query row takes, as
    one transformers forward over the prompt and then one per generated token compute it (``hf.patch``), however
    vLLM chunks, batches or recomputes the request. A row at position ``p`` of a request whose prompt has ``P``
    tokens takes the table at ``max(P, p + 1)``: every prompt row the whole prompt's (a chunk of a long prompt
    scheduled beside other requests is not computed under a smaller scale), every later row its own length's
    (a decode step; several such rows in one step, after a preemption's recompute or as speculative tokens, are
    one segment each). Without prompt lengths (``prompt_lens`` None) each request takes its current length's.

    ``request_lens`` (a per-request method: each request's planned length, prompt + max new tokens) replaces that
    rule: every row of request i takes the table at ``request_lens[i]``, one segment per request."""
    out = []
    for request, seq_len in enumerate(seq_lens):
        rows = query_lens[request] if query_lens is not None else 1
        if request_lens is not None:
            out.append((request, max(rows, 0), seq_len, max(int(request_lens[request]), 1)))
            continue
        prompt = prompt_lens[request] if prompt_lens is not None else None
        if rows <= 0 or prompt is None:
            out.append((request, max(rows, 0), seq_len, max(seq_len, 1)))
            continue
        first = seq_len - rows
        prompt_end = min(seq_len, prompt)
        if first < prompt_end:
            out.append((request, prompt_end - first, prompt_end, prompt))
        out.extend((request, 1, position + 1, position + 1) for position in range(max(first, prompt), seq_len))
    return out


class TableCache:
    """A plan's tables by length (``hf.patch``'s ``state.table(seq_len)``: the method's float32 table and
    its attention factor at ``seq_len`` = largest position + 1), and each step's tables on ``device``.

    Every tensor a step hands the attention op lives at an address that never changes (CUDA graphs replay
    the addresses they captured): a static table is computed once; per-request tables are written into two
    buffers of ``rows`` rows (vLLM's ``max_num_seqs``; grown, outside any graph, if a step has more
    requests), from pinned host memory without waiting for the device. Lengths come from the host
    (:func:`host_seq_lens`): a step never reads the device."""

    def __init__(self, plan: PreRopePlan, device: torch.device | str = "cpu", rows: int = 0,
                 max_lengths: int = 4096) -> None:
        self.plan, self.device, self.max_lengths = plan, torch.device(device), max_lengths
        self._by_length: OrderedDict[int | None, tuple[torch.Tensor, float]] = OrderedDict()
        self._on_device: dict[tuple[int | None, torch.device], tuple[torch.Tensor, float]] = {}
        self._last: tuple[tuple[int, ...] | None, StepTables] | None = None
        self._inv_freq = self._factors = None
        if plan.length_dependent and rows > 0:
            self._allocate(rows)
        self.computed = 0  # tables computed so far (tests count them)

    def _allocate(self, rows: int) -> None:
        self._inv_freq = torch.zeros(rows, self.plan.rotary_dim // 2, dtype=torch.float32, device=self.device)
        self._factors = torch.ones(rows, dtype=torch.float32, device=self.device)

    def table(self, seq_len: int | None, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
        """The float32 table and the attention factor at ``seq_len`` (None, or any length for a table that does
        not depend on it: the static table), on the host or on ``device`` (copies kept: every layer of a forward
        asks for the same one)."""
        if not self.plan.length_dependent:
            seq_len = None
        if device is not None and torch.device(device).type != "cpu":
            key = (seq_len, torch.device(device))
            hit = self._on_device.get(key)
            if hit is None:
                if len(self._on_device) > 8:
                    self._on_device.clear()
                inv_freq, factor = self.table(seq_len)
                hit = self._on_device[key] = (inv_freq.to(device), factor)
            return hit
        hit = self._by_length.get(seq_len)
        if hit is not None:
            self._by_length.move_to_end(seq_len)
            return hit
        plan = self.plan
        inv_freq = plan.method.inv_freq(plan.rotary_dim, plan.base, seq_len=seq_len)
        factor = float(plan.method.attention_factor_for(seq_len))
        self.computed += 1
        self._by_length[seq_len] = (inv_freq, factor)
        if len(self._by_length) > self.max_lengths:
            self._by_length.popitem(last=False)
        return inv_freq, factor

    def prompt_digest(self, prompt_len: int, max_new_tokens: int = 0) -> str:
        """A digest of the table (and attention factor) a prompt of ``prompt_len`` tokens, in a request that may
        generate ``max_new_tokens``, is computed under (the one :func:`cut_segments` gives its rows,
        :meth:`PreRopePlan.table_length`): equal digests, equal results for the prompt's cached pages."""
        inv_freq, factor = self.table(self.plan.table_length(prompt_len, max_new_tokens))
        digest = hashlib.sha256(inv_freq.to(torch.float32).contiguous().numpy().tobytes())
        digest.update(repr(factor).encode())
        return digest.hexdigest()[:32]

    def step(self, seq_lens: list[int], query_lens: list[int] | None = None,
             prompt_lens: list[int] | None = None, request_lens: list[int] | None = None) -> StepTables:
        """The tables for requests of lengths ``seq_lens`` (this step's: computed + scheduled tokens, host
        integers) with ``query_lens`` rows each and prompts of ``prompt_lens`` tokens, and for a per-request method
        planned lengths ``request_lens`` (:func:`cut_segments`; a padded request's 0 rows get any valid table)."""
        if not self.plan.length_dependent:
            if self._last is None:
                inv_freq, factor = self.table(None)
                self._last = (None, StepTables(inv_freq.to(self.device), None, factor * factor))
            return self._last[1]
        if self.plan.per_request and request_lens is None:
            raise RuntimeError(f"ropescale: {type(self.plan.method).__name__}(per='request') needs each request's "
                               "planned length (prompt + max new tokens), and this step has none")
        cut = cut_segments(seq_lens, query_lens, prompt_lens, request_lens if self.plan.per_request else None)
        split = len(cut) != len(seq_lens)
        key = tuple(cut) if split else tuple(seg[3] for seg in cut)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        count = len(cut)
        rows = [self.table(seg[3]) for seg in cut]
        if self._inv_freq is None or self._inv_freq.shape[0] < count:
            self._allocate(max(count, 1))
        inv_freq, factors = self._inv_freq[:count], self._factors[:count]
        if rows:
            host_freq = torch.stack([r[0] for r in rows])
            host_factors = torch.tensor([r[1] * r[1] for r in rows], dtype=torch.float32)
            if self.device.type != "cpu":  # asynchronous copies need page-locked sources
                host_freq, host_factors = host_freq.pin_memory(), host_factors.pin_memory()
            inv_freq.copy_(host_freq, non_blocking=True)
            factors.copy_(host_factors, non_blocking=True)
        pieces = None
        if split:  # fresh tensors: only mixed steps split, and vLLM captures graphs for single-token decode only
            starts = [0]
            for seg in cut:
                starts.append(starts[-1] + seg[1])
            pieces = Segments(
                torch.tensor([seg[0] for seg in cut], dtype=torch.int64).to(self.device, non_blocking=True),
                torch.tensor(starts, dtype=torch.int32).to(self.device, non_blocking=True),
                torch.tensor([seg[2] for seg in cut], dtype=torch.int32).to(self.device, non_blocking=True))
        tables = StepTables(inv_freq, factors, 1.0, pieces)
        self._last = (key, tables)
        return tables


class RequestRotaryTables:
    """A step's per-request rotation for an engine's rotary layer (:func:`rotated_at_write`): ``request_index``
    (int32 ``[max_tokens]``: token t's request), ``inv_freq`` (float32 ``[max_requests, rotary_dim / 2]``: request r's
    table, the plan's at its planned length) and ``attention_factors`` (float32 ``[max_requests]``), what
    ``ops.apply_rotary_per_request`` takes; ``native`` (bool ``[max_requests]``, the op's ``native_angles``):
    request r's table is the model's own (the default table, factor 1: a request that fits the trained length), so
    its row holds the engines' own float32 ``inv_freq`` (:func:`native_inv_freq`) and its angles are formed as their
    native tables form them: such a request is the native model as an engine serves it (engines and transformers
    form the native angles in float32, ropescale's tables in double: 2.4e-4 rad apart at 8k).

    The three tensors are allocated once, at the engine's largest step, and written in place every step (from
    pinned host memory, without waiting for the device): a compiled graph and a CUDA graph read them at the
    addresses they captured, and nothing inside a step reads the host. Tokens past the step (an engine's padding)
    keep request 0, a valid row. Tables come from the plan's :class:`TableCache` (computed once per length)."""

    def __init__(self, plan: PreRopePlan, device: torch.device | str, max_tokens: int, max_requests: int) -> None:
        if not plan.per_request:
            raise ValueError("RequestRotaryTables: the plan's method has no table per request")
        self.plan, self.device = plan, torch.device(device)
        self.max_tokens, self.max_requests = max(int(max_tokens), 1), max(int(max_requests), 1)
        self.tables = TableCache(plan)
        native, factor = self.tables.table(1)  # a valid row for every slot until a step writes it
        self.request_index = torch.zeros(self.max_tokens, dtype=torch.int32, device=self.device)
        self.inv_freq = native.to(self.device).repeat(self.max_requests, 1)
        self.attention_factors = torch.full((self.max_requests,), factor, dtype=torch.float32, device=self.device)
        self.native = torch.zeros(self.max_requests, dtype=torch.bool, device=self.device)
        self._default = torch.ops.ropescale.default_inv_freq(plan.rotary_dim, plan.base)
        self._native_inv_freq = native_inv_freq(plan.rotary_dim, plan.base)
        self._native_lengths: dict[int, bool] = {}
        self._last: tuple | None = None

    def is_native(self, length: int) -> bool:
        """Whether the plan's table at ``length`` is the model's own: the default table, attention factor 1."""
        if length not in self._native_lengths:
            inv_freq, factor = self.tables.table(self.plan.table_length(length, 0))
            self._native_lengths[length] = factor == 1.0 and torch.equal(inv_freq, self._default)
        return self._native_lengths[length]

    def update(self, request_lens: list[int], query_lens: list[int]) -> None:
        """This step's requests, in the order the step packs their tokens: request r has ``query_lens[r]`` tokens
        and the planned length ``request_lens[r]`` (prompt + max new tokens)."""
        count, tokens = len(request_lens), sum(max(int(n), 0) for n in query_lens)
        if count > self.max_requests or tokens > self.max_tokens:
            raise RuntimeError(f"ropescale: a step of {count} requests and {tokens} tokens is larger than the "
                               f"per-request rotation's buffers ({self.max_requests} requests, {self.max_tokens} "
                               "tokens: the engine's max_num_seqs and max_num_batched_tokens)")
        key = (tuple(int(n) for n in request_lens), tuple(int(n) for n in query_lens))
        if key == self._last:
            return
        native = [self.is_native(length) for length in request_lens]
        rows = [(self._native_inv_freq, 1.0) if is_native else self.tables.table(self.plan.table_length(length, 0))
                for length, is_native in zip(request_lens, native)]
        index = torch.repeat_interleave(torch.arange(count, dtype=torch.int32),
                                        torch.tensor([max(int(n), 0) for n in query_lens], dtype=torch.int64))
        host = [index]
        if rows:
            host += [torch.stack([r[0] for r in rows]), torch.tensor([r[1] for r in rows], dtype=torch.float32),
                     torch.tensor(native, dtype=torch.bool)]
        if self.device.type != "cpu":  # asynchronous copies need page-locked sources
            host = [t.pin_memory() for t in host]
        self.request_index[:tokens].copy_(host[0], non_blocking=True)
        if rows:
            self.inv_freq[:count].copy_(host[1], non_blocking=True)
            self.attention_factors[:count].copy_(host[2], non_blocking=True)
            self.native[:count].copy_(host[3], non_blocking=True)
        self._last = key


def rotate_per_request(tables: RequestRotaryTables, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor | None, head_size: int, interleaved: bool, in_place: bool):
    """An engine rotary layer's forward for a ``per="request"`` table (vLLM's and SGLang's contract: ``query``
    ``[T, Hq * head_size]``, ``key`` ``[T, Hkv * head_size]`` or None): every token turned with its request's table
    and attention factor from ``tables`` (``ops.apply_rotary_per_request``), in place or not."""
    positions = positions.flatten()
    tokens = positions.shape[0]
    index = tables.request_index[:tokens]
    q = query.view(tokens, -1, head_size)
    k = key.view(tokens, -1, head_size) if key is not None else None
    arguments = (positions, index, tables.inv_freq, tables.attention_factors, interleaved)
    if in_place:
        ops.apply_rotary_per_request_(q, k, *arguments, native_angles=tables.native)
        return query, key
    q, k = ops.apply_rotary_per_request(q, k, *arguments, native_angles=tables.native)
    return q.reshape(query.shape), (k.reshape(key.shape) if key is not None else None)


def times_rows(x: torch.Tensor, factors: torch.Tensor, n: int) -> torch.Tensor:
    """``x``'s first ``n`` rows (its first dim: tokens) each times its row of ``factors`` (float32, at least ``n``
    rows), formed in float32 (float64 for float64) and rounded once to x's dtype: ``hf.patch``'s DCA temperature on
    q and k, the same float32 product."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = factors[:n].to(device=x.device, dtype=compute).view(n, *([1] * (x.dim() - 1)))
    return (x[:n].to(compute) * rows).to(x.dtype)
