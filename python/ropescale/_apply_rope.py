"""Stand-in for ``ropescale.hf.patch`` (issue 5) for static methods only: write a scaling method's
table and attention factor into every rotary module of a transformers model. The demo and the
PosGen benchmark use it; it goes away once ``ropescale.hf`` lands."""

from __future__ import annotations

import torch

from .scaling import RopeScaling


def apply_scaling(model: torch.nn.Module, scaling: RopeScaling) -> torch.nn.Module:
    """Set ``inv_freq`` (and ``original_inv_freq``) and ``attention_scaling`` of every rotary
    embedding in ``model`` (transformers 5.x ``*RotaryEmbedding``) from ``scaling``."""
    if scaling.dynamic:
        raise ValueError(f"apply_scaling: {type(scaling).__name__} is dynamic and needs ropescale.hf.patch")
    config = model.config
    base = config.rope_parameters["rope_theta"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    found = 0
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "attention_scaling"):
            table = scaling.inv_freq(rotary_dim, base).to(module.inv_freq.device)
            module.inv_freq.copy_(table)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq.copy_(table)
            module.attention_scaling = scaling.attention_factor
            found += 1
    if not found:
        raise ValueError(f"apply_scaling: {type(model).__name__} has no rotary embedding module")
    return model


def apply_method(model: torch.nn.Module, scaling: RopeScaling) -> torch.nn.Module:
    """``ropescale.hf.patch`` when this build has the rotation ops it runs on, else (static methods
    only) ``apply_scaling``."""
    if hasattr(torch.ops.ropescale, "apply_rotary_qk") and hasattr(torch.ops.ropescale, "apply_rotary_pos"):
        from . import hf

        return hf.patch(model, scaling)
    return apply_scaling(model, scaling)
