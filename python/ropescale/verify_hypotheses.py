"""The hypotheses ``verify`` tells apart: the declared method and each known way an engine gets it wrong
(:func:`hypotheses`), and the label each is named by in a verdict (:func:`label`). :mod:`ropescale.verify` is the
public path of these names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from . import ops, scaling
from .verify_declared import Declared


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
    if m.two_tables:
        # vLLM's own longrope takes the long factors at every length once max_model_len passes the original length
        out.append(Hypothesis("parameter", "applied with a different formula: the short table ignored (the long "
                                           "factors at every length)",
                              m.long_table(),
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
    if len(out) == 2 and m.is_plain:
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
            same.append(label(h))
        elif twin is not None:  # two wrong formulas, one rotation: the verdict names both
            unique[twin] = dataclasses.replace(unique[twin], alternatives=unique[twin].alternatives + (h,))
        else:
            seen.append(key)
            unique.append(h)
    return unique, same

def label(h: Hypothesis) -> str:
    return {"declared": "declared", "ignored": "plain RoPE", "fixed": "fixed table"}.get(
        h.kind, f"{h.key}={h.engine_value!r}")
