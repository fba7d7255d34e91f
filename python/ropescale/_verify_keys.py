"""``verify``'s raw-key scan (issue 60): every rope-like key a target holds that the engine did not take.

``verify`` reads what a target declares through the same config class the engine reads, so a scaling written where
no engine looks (a misspelled ``rope_scalings``, a ``rope_scaling`` beside ``rope_parameters``, one inside the
``text_config`` of a model that has none, a top-level ``rope_theta`` transformers 5 drops beside ``rope_parameters``,
an ``hf_overrides`` key vLLM stores but never reads) is invisible to both sides and would pass as exact. Here the raw
keys (``config.json`` as JSON, the overrides passed to the engine, a GGUF's key-value pairs) are held against what the
engine parsed, as its probe reports it (``_verify_probe.config_view``):

- a rope-like key (its name holds ``rope`` or ``rotary``) is taken when the engine holds its value: each entry of a
  rope dict equal to the engine's rope parameters (those of one layer type, where the engine keeps one per type), a
  scalar equal to the engine's entry of that name, or a field of the engine's config class (the model reads it).
  Where the engine has no config at that place (a ``text_config`` on a Llama), or a multimodal model's outer config
  (whose rope the language model does not run: Gemma 3's class keeps a top-level ``rope_scaling`` there, its text
  config runs without it), the key is held against the rope parameters the engine's text model runs. A key whose value the engine holds anyway changes nothing: not reported.
- a GGUF key is taken when the engine's loader reads it: for transformers, the keys its GGUF loader maps
  (``GGUF_CONFIG_MAPPING``, from the probe), for llama.cpp the rope keys of its ``LLM_KV`` table
  (:data:`LLAMA_CPP_KEYS`, under the file's ``general.architecture``: llama.cpp exposes no parsed config). A key the
  engine does not read is reported unless its value is llama.cpp's own default for it (:data:`GGUF_NEUTRAL`).

``ropescale``'s own record (``config.json``'s ``ropescale``, a GGUF's ``ropescale.method``) is the declaration verify
reads; the probe checks it (method, attention): it is not scanned here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

ROPE_LIKE = re.compile(r"rope|rotary", re.IGNORECASE)

#: Where each engine reads the rope of a transformers checkpoint (the names a report suggests beside an unread key).
PLACES = {
    "rope_parameters": "transformers 5 and vLLM: the rope dict of the model's (text) config",
    "rope_scaling": "transformers 4 (with a top-level rope_theta); transformers 5 converts it into rope_parameters, "
                    "and lets it win over a rope_parameters beside it",
    "rope_theta": "inside rope_parameters since transformers 5 (a top-level one beside rope_parameters is dropped)",
    "text_config": "a multimodal model's language model: its rope keys go there",
}

#: The rope keys llama.cpp reads from a GGUF (its ``LLM_KV`` names, under ``{general.architecture}.``).
LLAMA_CPP_KEYS = frozenset({
    "rope.dimension_count", "rope.dimension_sections", "rope.freq_base", "rope.freq_base_swa", "rope.scale_linear",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.attn_factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned", "rope.scaling.yarn_log_multiplier", "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"})

#: GGUF values that scale nothing: an unread key holding one changes nothing (llama.cpp's defaults).
GGUF_NEUTRAL = {"rope.scaling.type": ("none", "linear"), "rope.scaling.factor": (0.0, 1.0),
                "rope.scale_linear": (0.0, 1.0), "rope.scaling.attn_factor": (1.0,),
                "rope.scaling.finetuned": (False,)}

ALIASES = frozenset({"rope_scaling", "rope_parameters"})  # one place in transformers 5: an override of one replaces both
RECORD_KEYS = ("ropescale", "ropescale.method")  # ropescale's record: the declaration, checked by the probe


@dataclass(frozen=True)
class Unread:
    key: str  # the key's path ("text_config.rope_scaling", "llama.rope.scaling.factors")
    where: str  # "config.json", "hf_overrides", the GGUF's name
    why: str

    def text(self) -> str:
        return f"{self.key} ({self.where}): {self.why}"


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


# The names an engine's model gives a rope type it runs, written into its own parsed config: vLLM's DeepSeek-V2/V3
# (models/deepseek_v2.py) renames yarn to its YaRN rotary's, deepseek_llama_scaling where attention_factor is 1.0.
ENGINE_TYPES = {"yarn": ("deepseek_yarn", "deepseek_llama_scaling")}


def _layered(rope) -> bool:
    return isinstance(rope, dict) and bool(rope) and all(isinstance(v, dict) for v in rope.values())


def _flat(rope) -> list[dict]:
    """The engine's rope dicts: one, or one per layer type."""
    if not isinstance(rope, dict):
        return []
    return list(rope.values()) if _layered(rope) else [rope]


def _dict_differences(raw: dict, rope) -> list[str]:
    """What of the raw rope dict ``raw`` the engine's rope parameters ``rope`` do not hold (empty: all taken)."""
    if not isinstance(rope, dict) or not rope:
        return ["the engine has no rope parameters"]
    if _layered(raw) and _layered(rope):
        return [f"{kind}: {d}" for kind, sub in raw.items() for d in _dict_differences(sub, rope.get(kind, {}))]
    best = None
    for candidate in _flat(rope):
        diffs = []
        for k, v in raw.items():
            name = "rope_type" if k == "type" and "type" not in candidate else k
            if name not in candidate:
                diffs.append(f"{k} {v!r} (the engine's rope parameters have no {name})")
            elif not _same(v, candidate[name]) and not (
                    name == "rope_type" and candidate[name] in ENGINE_TYPES.get(v, ())):
                diffs.append(f"{k} {v!r} (the engine: {candidate[name]!r})")
        if best is None or len(diffs) < len(best):
            best = diffs
    return best


def _rope_dim_taken(raw: dict, value, rope_dicts) -> bool:
    """A ``qk_rope_head_dim`` where the config class takes it as a legacy alias only (DeepSeek-V4's, which derives its
    ``partial_rotary_factor`` from it and writes it back): taken when it is the rope dim the engine runs, ``head_dim``
    times a rope dict's ``partial_rotary_factor``."""
    head_dim = raw.get("head_dim")
    return isinstance(head_dim, int) and any(
        isinstance(d.get("partial_rotary_factor"), (int, float)) and _same(value, int(head_dim * d["partial_rotary_factor"]))
        for d in rope_dicts)


def _scalar_taken(key: str, value, view: dict | None, text_rope, raw: dict | None = None) -> str | None:
    """None when the engine holds ``value`` for ``key``; else why not."""
    rope_dicts = _flat(view["rope"] if view is not None and view.get("rope") else text_rope)
    if key == "qk_rope_head_dim" and _rope_dim_taken(raw or {}, value, rope_dicts):
        return None
    named = [d[key] for d in rope_dicts if key in d]
    if named:
        return None if any(_same(value, v) for v in named) else \
            f"{value!r} here, the engine runs {named[0]!r}"
    if view is not None and key in view["fields"]:
        return None  # a field of the engine's config class: the model reads it
    if any(_same(value, v) for d in rope_dicts for v in d.values()):
        return None  # held under another name (vLLM's rotary_emb_base as rope_theta)
    return f"{value!r}: no key the engine reads" + (f" ({view['class']} has no field {key})" if view else "")


def _scan(raw: dict, view: dict | None, text_rope, path: str, where: str, out: list[Unread]) -> None:
    for key, value in raw.items():
        here = f"{path}.{key}" if path else key
        if key in RECORD_KEYS and isinstance(value, dict):  # ropescale's record, top level or a sub-config's (text)
            continue
        if ROPE_LIKE.search(key):
            if isinstance(value, dict):
                diffs = _dict_differences(value, view["rope"] if view is not None and view.get("rope") else text_rope)
                if diffs:
                    place = "" if view is not None else " (the engine has no config here: held against the rope " \
                                                       "parameters its model runs)"
                    siblings = [k for k in raw if k != key and ROPE_LIKE.search(k) and isinstance(raw[k], dict)]
                    beside = f"; beside {', '.join(siblings)}" if siblings else ""
                    out.append(Unread(here, where, f"not taken{place}: {'; '.join(diffs)}{beside}" +
                                      _hint(key, view)))
            else:
                why = _scalar_taken(key, value, view, text_rope, raw)
                if why is not None:
                    out.append(Unread(here, where, f"not taken: {why}" + _hint(key, view)))
        elif isinstance(value, dict):
            sub = view["sub"].get(key) if view is not None else None
            _scan(value, sub, text_rope, here, where, out)


def _hint(key: str, view: dict | None) -> str:
    import difflib

    names = set(PLACES) | (set(view["fields"]) if view else set())
    near = [n for n in difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.8) if n != key]
    return f" (did you mean {near[0]}?)" if near else ""


def unread_config(raw: dict, view: dict, where: str = "config.json") -> list[Unread]:
    """The rope-like keys of ``raw`` (a config.json's dict, or the overrides passed to the engine) that the engine,
    whose parsed config is ``view`` (``_verify_probe.config_view``), did not take."""
    text = view["sub"][view["text"]] if view.get("text") else view
    if text is not view:  # a multimodal model's outer config: its language model runs the text config's rope, not
        view = {**view, "rope": text.get("rope")}  # whatever rope_parameters the outer class keeps (Gemma 3's alias)
    out: list[Unread] = []
    _scan(raw, view, text.get("rope"), "", where, out)
    return out


def unread_gguf(path: str | Path, engine: str, read: dict | None = None) -> list[Unread]:
    """The rope-like keys of the GGUF at ``path`` that ``engine`` does not read (``read``: the keys transformers'
    GGUF loader maps, per architecture, from its probe); a key at its neutral value is not reported."""
    from . import llamacpp

    reader, rope = llamacpp.read_rope(path)
    arch = rope.architecture
    if engine == "llama.cpp":
        known = LLAMA_CPP_KEYS
    else:
        if read is None:  # the probe reported none: transformers' own table, read here
            from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

            read = GGUF_CONFIG_MAPPING
        known = frozenset(read.get(arch, ()))
    name, out = Path(path).name, []
    for key in reader.fields:
        if key in RECORD_KEYS or not ROPE_LIKE.search(key) or key.startswith(("general.", "tokenizer.")):
            continue
        short = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        value = llamacpp.gguf_field(reader, key)
        if short is not None and short in known:
            continue
        if short is not None and any(_same(value, v) for v in GGUF_NEUTRAL.get(short, ())):
            continue
        if short is None:
            why = f"{value!r}: not under this file's architecture {arch!r} ({engine} reads {arch}.rope.*)"
        else:
            why = f"{value!r}: a key {engine} does not read"
            import difflib

            near = difflib.get_close_matches(short, sorted(known), n=1, cutoff=0.8)
            if near:
                why += f" (did you mean {arch}.{near[0]}?)"
        out.append(Unread(key, name, why))
    return out


def unread(target: Path, engine: str, config: dict | None, overrides: dict | None = None) -> list[Unread]:
    """Every rope-like key of ``target`` (and of the ``overrides`` passed to the engine) that ``engine`` did not
    take; ``config``: what its probe reported of its parsed config (None: nothing to hold the keys against)."""
    if target.is_file():
        return unread_gguf(target, engine, (config or {}).get("gguf_read"))
    if config is None:  # the engine reported no parsed config (it refused the target): transformers' reading, here
        from transformers import AutoConfig

        from . import _verify_probe

        try:
            config = _verify_probe.config_view(AutoConfig.from_pretrained(target))
        except Exception as err:  # noqa: BLE001 (the engine's own answer is the verdict; this is a detail of it)
            return [Unread("config.json", target.name, f"not scanned: transformers cannot read it ({err})")]
    with open(target / "config.json") as f:
        raw = json.load(f)
    if overrides:  # a key the overrides replace is not the engine's to take (rope_scaling and rope_parameters: one)
        replaced = set(overrides) | ({"rope_scaling", "rope_parameters"} if ALIASES & set(overrides) else set())
        raw = {k: v for k, v in raw.items() if k not in replaced or (isinstance(v, dict) and "model_type" in v)}
    return unread_config(raw, config) + (unread_config(overrides, config, "hf_overrides") if overrides else [])


def check(target: Path, engine: str, answer: dict, overrides: dict | None = None):
    """A ``rope keys`` check, ``ignored``, naming each rope-like key the engine did not take; None when it took every
    one."""
    from .verify_check import Check

    try:
        keys = unread(target, engine, answer.get("config"), overrides)
    except ValueError:
        if "error" not in answer:
            raise
        return None  # the engine refused a file ropescale cannot read either: the refusal is the verdict
    if not keys:
        return None
    return Check("rope keys", "ignored", f"{len(keys)} rope key{'s' * (len(keys) > 1)} the engine did not take: "
                                         + "; ".join(k.text() for k in keys), formula=", ".join(k.key for k in keys))


def declared_with(source: Path, overrides: dict):
    """``verify.declared`` of checkpoint directory ``source`` with ``overrides`` (vLLM's ``hf_overrides``) written
    into its config.json (a dict for a sub-config merged into it, as vLLM applies them): what the engine is asked to
    serve."""
    import dataclasses
    import tempfile

    from .verify_declared import declared

    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {overrides!r}")
    if not source.is_dir():
        raise ValueError(f"{source}: hf_overrides apply to a checkpoint directory")
    with open(source / "config.json") as f:
        raw = json.load(f)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict) and "model_type" in raw[key]:
            raw[key] = {**raw[key], **value}  # a sub-config: vLLM updates it
        else:
            raw[key] = value
    with tempfile.TemporaryDirectory(prefix="ropescale-verify-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(raw))
        d = declared(folder)
    return dataclasses.replace(d, source=f"{source.name}/config.json with hf_overrides {json.dumps(overrides)}")
