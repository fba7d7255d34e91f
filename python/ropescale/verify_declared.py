"""What a target declares, as ``verify`` reads it (:func:`declared`): the method, its lengths and where they were
read, from a transformers checkpoint directory or a GGUF file. :mod:`ropescale.verify` is the public path of these
names."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import config as config_lib
from . import scaling


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


def target_kind(target: Path) -> str:
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


def local_path(path: str | Path, what: str = "") -> Path:
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
    target = local_path(target)
    return (_declared_dir if target_kind(target) == "dir" else _declared_gguf)(target)


def _declared_dir(target: Path) -> Declared:
    from transformers import AutoConfig, PretrainedConfig

    from . import hf  # noqa: F401  (ropescale's rope types, so that the config reads)
    from .hf import architectures

    try:
        cfg = AutoConfig.from_pretrained(target)
    except (OSError, KeyError) as err:  # no model type transformers knows, an unreadable file
        raise ValueError(f"{target}: transformers cannot read this config: {err}") from None
    text = cfg.get_text_config()  # a vision-language model's rope is its text model's (Qwen2.5-VL: text_config)
    cfg = text if isinstance(text, PretrainedConfig) else cfg  # a stray text_config dict on a Llama: its own config
    layer_type = extended_layer_type(cfg)
    read = config_lib.read_config(cfg, layer_type)
    method = read.method
    mpe = int(cfg.max_position_embeddings)
    original = int(getattr(method, "original_max_position", None) or mpe)
    rotary_dim = config_lib.rotary_dim_of(cfg, config_lib.layer_type_parameters(cfg, layer_type), layer_type)
    return Declared(method, read.base, rotary_dim, original, config_lib.max_model_len_of(cfg, layer_type),
                    f"{target.name}/config.json" + (" (ropescale's entry)" if read.recorded else ""),
                    read.attention, dict(read.parameters), int(cfg.vocab_size), mpe,
                    bool(getattr(architectures.find(cfg), "fixed_method", None)), _layout_partial(cfg, method))


def extended_layer_type(cfg) -> str | None:
    """For a per-layer-type config (Gemma 3: ``{"full_attention": {...}, "sliding_attention": {...}}``; DeepSeek-V4:
    ``main`` and ``compress``), the layer type whose rope the probe checks: the first that ``hf.patch`` extends by
    default (``Architecture.extended_layer_types``: the references patch it); None for a config with one rope."""
    from .hf import architectures

    if not config_lib.per_layer_type(cfg):
        return None
    arch = architectures.find(cfg)
    if arch is None:
        return next(t for t in cfg.rope_parameters if t != "sliding_attention")
    return arch.extended_layer_types(cfg)[0]


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
    vocab = len(tokens.data) if tokens is not None else int(llamacpp.gguf_field(reader, f"{arch}.vocab_size", 0) or 0)
    record = llamacpp.gguf_field(reader, llamacpp.METHOD_KEY)
    linear_original = None  # a linear GGUF's trained length: its context length over the factor
    if record is not None:
        try:
            entry = json.loads(record)
            method = scaling.from_hf(entry["rope_parameters"], rope.context_length)
            served, source = int(entry["context_length"]), f"{target.name}: {llamacpp.METHOD_KEY}"
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{target}: ropescale's record ({llamacpp.METHOD_KEY}) does not read: {err}") from None
    else:
        factor = rope.scaling_factor
        original = int(llamacpp.gguf_field(reader, f"{arch}.rope.scaling.original_context_length", rope.context_length))
        if rope.has_rope_freqs:
            raise ValueError(f"{target}: {llamacpp.ROPE_FREQS} without ropescale's record ({llamacpp.METHOD_KEY}): "
                             "no declaration to check the engine against")
        types = llamacpp.SCALING_TYPES  # llama.cpp's names
        if rope.scaling_type == types["yarn"] and factor > 1:
            log_mul = float(llamacpp.gguf_field(reader, f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
            yarn = scaling.YaRN(
                factor=factor, original_max_position=original,
                beta_fast=float(llamacpp.gguf_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(llamacpp.gguf_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                mscale=1.0 if log_mul else None, mscale_all_dim=log_mul or None)
            method = dataclasses.replace(yarn, attention_factor_override=yarn.attention_factor * rope.attn_factor) \
                if rope.attn_factor != 1.0 else yarn
        elif rope.scaling_type == types["linear"] and factor > 1:
            method = scaling.Linear(factor=factor)
            linear_original = max(1, int(rope.context_length / factor))
        elif factor in (0.0, 1.0) and rope.scaling_type in (types["linear"], types["plain"], types["yarn"]) \
                and rope.attn_factor == 1.0:
            method = scaling.Default()
        else:
            raise ValueError(f"{target}: rope.scaling.type {rope.scaling_type!r} with factor {factor} and attn_factor "
                             f"{rope.attn_factor}: ropescale reads no such declaration")
        served, source = rope.context_length, f"{target.name}: {arch}.rope.* keys"
    original = int(getattr(method, "original_max_position", None) or rope.context_length)
    if linear_original is not None:
        original = linear_original
    return Declared(method, rope.base, rope.rotary_dim, original, served, source, vocab_size=vocab,
                    config_length=rope.context_length)
