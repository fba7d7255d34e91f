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

By role: the step tables (:class:`TableCache`, :class:`StepTables`, :func:`cut_segments`, :class:`RequestRotaryTables`)
are in :mod:`ropescale.serving_tables` (re-exported here, their documented home); here the plan and which checkpoints
need it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from . import attentions, config as config_lib, scaling
from .serving_tables import (RequestRotaryTables, Segments, StepTables, TableCache, cut_segments,  # noqa: F401
                             native_inv_freq, rotate_per_request, times_rows)

__all__ = ["NO_WINDOW", "PreRopePlan", "RequestRotaryTables", "StaticTableRotary", "cos_sin_cache",
           "dual_chunk_temperature", "needs_pre_rope", "written_by_ropescale", "rotated_at_write", "ropescale_rotary",
           "Segments", "StepTables", "config_written_by_ropescale", "cut_segments", "extended_layer_type", "rotate_per_request", "times_rows",
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


def config_written_by_ropescale(config) -> bool:
    """Whether a transformers-style config is a checkpoint ropescale wrote: :func:`written_by_ropescale` of its rope
    parameters (of any layer type, for a per-layer-type config) with its ``ropescale`` entry."""
    params = getattr(config, "rope_parameters", None) or {}
    entry = getattr(config, config_lib.CONFIG_KEY, None)
    layers = params.values() if config_lib.per_layer_type(config) else [params]
    return any(written_by_ropescale(p, entry) for p in layers if isinstance(p, Mapping))


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
