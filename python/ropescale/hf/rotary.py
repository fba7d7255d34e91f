"""The patched rotary module's forward: the cos/sin that the model's own attention rotates q and k with.

- rotated at write: for a static method, cos/sin of ropescale's table (each row with the table of its own length
  when the table depends on it); for a per-request method (``PatchState.rotated_at_write``), each row's cos/sin of
  its request's table and attention factor (:func:`_request_cos_sin`), from per-row tables computed once per request;
- a raw-key forward (``ropescale.hf.pre_rope``): the identity rotation, so the model's own attention caches raw keys
  (the attention function rotates them, or runs ReRoPE).

Transformers' Llama layout (``cat(angles, angles)``) is computed by ropescale, angles in double precision; a rotary
module of another layout keeps its forward for a static method, on ropescale's table in its buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import scaling
from .pre_rope import start_pre_rope_step
from .requests import DATA_DEPENDENT, batch_positions, length_groups, planned_lengths, token_positions
from .state import PatchState


@torch.no_grad()
def rotary_forward(self, x, position_ids, layer_type=None):
    """cos/sin in transformers' Llama layout: for a static method, of ropescale's table (each row with the table
    of its own length when the table depends on it); for a per-request method, each row's of its request's table
    (:func:`_request_cos_sin`); for a pre-RoPE forward, the identity (the attention function rotates). A layer type
    the patch does not extend gets the model's own."""
    state: PatchState = self._ropescale_patch
    if state.layer_types is not None and layer_type not in state.layer_types:
        return type(self).forward(self, x, position_ids, layer_type)
    if state.step_pre_rope:
        start_pre_rope_step(state, position_ids, x.shape[0])
        ones = torch.ones(*position_ids.shape, state.rotary_dim, dtype=x.dtype, device=x.device)
        return ones, torch.zeros_like(ones)
    if state.rotated_at_write:
        cos, sin = _request_cos_sin(state, x, position_ids)
        if _own_rotary_is_native(self):
            # A request whose table is the model's own (it fits the trained length) takes the model's own cos/sin: it
            # IS the native model, bit for bit (transformers forms the native angles in float32, ropescale in double:
            # 2.4e-4 rad apart at 8k). Always computed, picked per row: no data-dependent branch in a compiled step.
            own_cos, own_sin = type(self).forward(self, x, position_ids, layer_type)
            native = state.request_rows[3][:, None, None]
            cos, sin = torch.where(native, own_cos, cos), torch.where(native, own_sin, sin)
        return cos, sin
    groups = length_groups(state, position_ids)
    if groups[0][0] is not None:  # rows of different lengths: per-row angles and factors
        angles = position_ids.new_empty(*position_ids.shape, state.rotary_dim // 2, dtype=torch.float64)
        factors = angles.new_empty(position_ids.shape[0], 1, 1)
    for rows, seq_len in groups:
        inv_freq, factor = state.table(seq_len, x.device)
        # Angles in double: a float32 product is already ~1e-2 rad off at position 1e6.
        group = (position_ids if rows is None else position_ids[rows]).to(torch.float64)[..., None]
        group_angles = group * inv_freq.to(torch.float64)
        if rows is None:
            angles, factors = group_angles, factor
        else:
            angles[rows], factors[rows] = group_angles, factor
    emb = torch.cat((angles, angles), dim=-1)
    cos = (emb.cos() * factors).to(x.dtype)
    sin = (emb.sin() * factors).to(x.dtype)
    return cos, sin


def own_layout_rotary_forward(self, x, position_ids, *args, **kwargs):
    """A rotary module of another layout that takes pre-RoPE methods (multimodal sections) or a per-request method
    (gpt-oss's half width too): its own forward on ropescale's static table (``set_rotary_buffers``); for a
    per-request method each row's cos/sin in its layout (:func:`_request_cos_sin`); for a pre-RoPE forward the
    identity in its own output layout (the attention function rotates, each pair at its stream's position)."""
    state: PatchState = self._ropescale_patch
    if state.rotated_at_write and not state.step_pre_rope:
        return _request_cos_sin(state, x, position_ids)
    cos, sin = type(self).forward(self, x, position_ids, *args, **kwargs)
    if not state.step_pre_rope:
        return cos, sin
    start_pre_rope_step(state, position_ids, x.shape[0])
    return torch.ones_like(cos), torch.zeros_like(sin)


def set_rotary_buffers(state: PatchState, module: nn.Module) -> None:
    """A rotary module of another layout keeps its forward and runs it on ropescale's (static) table: its
    ``inv_freq`` and ``attention_scaling`` (per extended layer type), its ``rope_type`` made ``default`` so
    that transformers' dynamic update leaves them alone. ``unpatch`` puts all back."""
    inv_freq, factor = state.table(None, torch.device("cpu"))
    prefixes = [f"{t}_" for t in state.layer_types] if state.layer_types else [""]
    for prefix in prefixes:
        for name in (f"{prefix}inv_freq", f"{prefix}original_inv_freq"):
            old = getattr(module, name, None)
            if old is None:
                continue
            if old.shape != inv_freq.shape:
                raise ValueError(f"patch: {state.architecture.name}'s rotary table {name} has {old.shape[-1]} "
                                 f"frequencies, ropescale's method {inv_freq.shape[-1]}")
            state.saved_buffers.append((module, name, old))
            setattr(module, name, inv_freq.to(device=old.device, dtype=old.dtype))
        name = f"{prefix}attention_scaling"
        state.saved_buffers.append((module, name, getattr(module, name)))
        setattr(module, name, factor)
    rope_type = module.rope_type
    state.saved_buffers.append((module, "rope_type", rope_type))
    module.rope_type = ({t: ("default" if t in state.layer_types else v) for t, v in rope_type.items()}
                        if isinstance(rope_type, dict) else "default")


# ---------------------------------------------------------------------------------------------
# Rotated at write: a per-request method with plain attention (``PatchState.rotated_at_write``)


def _request_cos_sin(state: PatchState, x: torch.Tensor, position_ids: torch.Tensor):
    """cos/sin of a per-request method in the rotary module's output layout: each row with its request's table and
    attention factor (the planned length's, :func:`_request_rows`), so the model's own attention rotates q and k
    with them and its own cache keeps the rotated keys. Transformers' Llama layout ``cat(angles, angles)`` (a
    multimodal rope: each pair at its own stream's position), gpt-oss's half width (the angles alone), or Llama 4's
    complex ``freqs_cis`` (``factor * exp(i * angle)``); angles in
    double precision (float32, as the model's own forward computes them, for a family of another layout). Pure tensor
    ops once the request's tables are fixed: a compiled decode step does not break its graph here."""
    if state.pair_streams is not None:  # [streams, B, T] (or [B, T]: every stream at the text position)
        streams = position_ids if position_ids.dim() == 3 else position_ids[None].expand(3, -1, -1)
        position_ids = streams.permute(1, 2, 0)
    positions = batch_positions(position_ids, x.shape[0])
    _, inv_freq, factor, _ = _request_rows(state, positions, x.device)
    if state.pair_streams is None:
        per_pair = positions.to(inv_freq.dtype)[..., None]  # [B, T, 1]
    else:
        per_pair = positions.to(inv_freq.dtype)[..., state.pair_streams]  # [B, T, P]: each pair's stream
    angles = per_pair * inv_freq[:, None, :]
    if state.architecture.complex_rotary:  # Llama 4's freqs_cis: factor * exp(i * angle), one per pair
        return torch.polar(factor[:, None, None].expand_as(angles).contiguous(), angles)
    if not state.architecture.half_width:
        angles = torch.cat((angles, angles), dim=-1)
    factor = factor[:, None, None]
    return (angles.cos() * factor).to(x.dtype), (angles.sin() * factor).to(x.dtype)


def _own_rotary_is_native(module: nn.Module) -> bool:
    """Whether the model's own rotary module computes the default table, attention factor 1 (the table a per-request
    method takes within the trained length); a model whose own rope is scaled (Llama 3.1's llama3) is not."""
    return getattr(module, "rope_type", None) == scaling.Default.rope_type and getattr(module, "attention_scaling", 1.0) == 1.0


def _request_rows(state: PatchState, positions: torch.Tensor, device: torch.device):
    """``(planned [B], inv_freq [B, P], factor [B], native [B])``: each row's planned length, table, attention factor
    and whether that table is the default one with factor 1 (the model's own, within the trained length). A
    ``generate`` call's decode steps read the tables its first forward fixed (transformers stops every row at its
    planned length: nothing to check); other forwards go through :func:`_fix_request_rows`."""
    rows = state.request_rows
    if state.request_bounded and rows is not None and rows[1].shape[0] == positions.shape[0]:
        return rows
    return _fix_request_rows(state, positions, device)


@torch.compiler.disable(reason=DATA_DEPENDENT)
def _fix_request_rows(state: PatchState, positions: torch.Tensor, device: torch.device):
    """This forward's planned lengths (:func:`planned_lengths`: fixed at the request's first forward, a step past
    them refused) and their tables, computed once per planned lengths (kept with them)."""
    planned = planned_lengths(state, token_positions(positions), state.step_cache)
    state.step_planned = planned
    rows = state.request_rows
    if rows is None or rows[0] is not planned or rows[1].device != device:
        rows = state.request_rows = (planned, *_row_tables(state, planned, device))
    return rows


def _row_tables(state: PatchState, planned: torch.Tensor, device: torch.device):
    """``inv_freq [B, P]``, the attention factor ``[B]`` and whether the table is the default one with factor 1
    ``[B]``, of each row's planned length (the serving core's table cache: one table per distinct length), in the
    precision the rotary forward computes angles in."""
    compute = torch.float64 if state.architecture.cat_layout else torch.float32
    lengths = planned.tolist()
    tables = {n: state.table(n, torch.device("cpu")) for n in dict.fromkeys(lengths)}
    default = torch.ops.ropescale.default_inv_freq(state.rotary_dim, state.plan.base)
    native = {n: t[1] == 1.0 and torch.equal(t[0], default) for n, t in tables.items()}
    inv_freq = torch.stack([tables[n][0] for n in lengths]).to(device=device, dtype=compute)
    factor = torch.tensor([tables[n][1] for n in lengths], dtype=compute, device=device)
    return inv_freq, factor, torch.tensor([native[n] for n in lengths], dtype=torch.bool, device=device)
