"""``extend``: a copy of a local model directory with a scaling method, an attention (ReRoPE, Self-Extend, Dual Chunk
Attention) or both written into its config (ropescale.hf.checkpoint).

``extend`` never rewrites what it was not asked to (issue 42): where the method written is of the family of SRC's own
(the same class, or one a subclass of the other: YaRN and Dynamic YaRN), every field the command line did not give
is SRC's (DeepSeek's ``mscale``/``mscale_all_dim``, gpt-oss's ``truncate: false``, Llama 3's frequency bounds, a
dynamic method's ``per``, ...), and the output says which; a kept value that would be wrong at the new table is
refused, naming its key and the flags that settle it (``_inherit``). Without --method, the attention goes over SRC's
own table."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

from .. import config as config_lib, files, scaling
from . import methods
from .common import UsageError, positive_int, subcommand

_SAME_METHOD = "SRC's own when it has the same method, else "
_METHOD_OPTIONS = methods.MethodOptions(
    flags=("--method", "--factor", "--alpha", "--floor", "--original-max-position", "--per", "--beta-fast", "--beta-slow",
           "--extrapolation-factor", "--truncate", "--mscale", "--mscale-all-dim", "--attention-factor", "--resonance",
           "--longrope-factors",
           "--attention", "--window", "--leaky-k", "--logn", "--group", "--chunk-size", "--local-size",
           "--temperature-length", "--dca-temperature", "--shifted-offset", "--local-value"),
    # Not given, a variant flag is SRC's (None tells it from its default; _inherit fills it).
    defaults={"--method": "none: with --attention, the attention over SRC's own table",
              "--original-max-position": "SRC's original_max_position_embeddings, else its max_position_embeddings",
              "--per": _SAME_METHOD + "step", "--beta-fast": _SAME_METHOD + "32",
              "--beta-slow": _SAME_METHOD + "1", "--extrapolation-factor": _SAME_METHOD + "1",
              "--truncate": _SAME_METHOD + "--truncate",
              "--mscale": _SAME_METHOD + "none", "--mscale-all-dim": _SAME_METHOD + "none",
              "--attention-factor": _SAME_METHOD + "auto"},
    notes={"--floor": ". Not the way to serve longer: that is --max-length. Not given: SRC's own floor when SRC is a "
                      "dynamic_yarn",
           "--attention-factor": " (a fixed factor SRC has is refused at another scale: give one, or auto)",
           "--window": "; Self-Extend (--attention self_extend): the neighbour window W, distances below it exact"},
    own_table="SRC's own table", serve_longer="give --max-length N (the floor stays 1)", refuse_unread=True,
    attention_title="attention (over --method's table; without --method, or with --method rerope: SRC's own)")

# Files a model directory keeps its weights in: hard-linked into DST (copied where a link cannot be made).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

_DESCRIPTION = (
    "Write DST: a copy of the transformers model directory SRC (weights hard-linked, or copied where "
    "a link cannot be made; tokenizer and other files copied) whose config.json carries the method "
    "as rope_parameters, with max_position_embeddings set as transformers and vLLM expect: ready "
    "for fine-tuning (ropescale.hf.patch(model) re-applies it) or for an engine that reads "
    "rope_parameters. Types transformers lacks (dynamic_ntk, dynamic_yarn, resonance_*, rerope*, "
    "self_extend*, dual_chunk*, string*) load after `import ropescale.hf`.",
    "Only what is asked for changes. Where --method is of SRC's own method (yarn over a YaRN, "
    "dynamic_yarn over a YaRN or the reverse, llama3 over a Llama 3, ...), every setting no flag gives "
    "is SRC's: DeepSeek's mscale and mscale_all_dim, gpt-oss's truncate false, Llama 3's frequency "
    "bounds, YaRN's betas, a dynamic method's --per; the output lists what was kept, and a flag "
    "overrides each. A fixed attention_factor SRC has is refused at another scale (it is SRC's "
    "temperature for SRC's factor): give --attention-factor A, or auto for the method's own rule. "
    "Another method keeps nothing of SRC's.",
    "Attention: --attention rerope (ReRoPE, --window W), self_extend (Self-Extend, --window W "
    "--group G), dual_chunk (Dual Chunk Attention, --chunk-size C --local-size S, with Qwen's "
    "temperature --temperature-length L0) or string (STRING, --shifted-offset S --local-value W) runs over --method's table, or over SRC's own without "
    "--method (DCA only over an unscaled one). Each reloads as hf.patch(model, attention=...) on the "
    "same weights.",
    "Two lengths, not to be confused. A static table (linear, ntk, yarn, llama3, longrope) is set for "
    "one length, s x L: --factor s sets it, and vLLM serves the checkpoint up to it (max_model_len). "
    "A pre-RoPE checkpoint (dynamic_yarn, dynamic_ntk, or an --attention) has no such length: a "
    "dynamic table follows each request's own length (native up to L), the attentions bound the "
    "distances they show. --max-length N is then the length it may be served to (written as "
    "model_max_length: vLLM's max_model_len, no VLLM_ALLOW_LONG_MAX_MODEL_LEN); without it, vLLM "
    "serves it up to the length it records: L, or s x L where the table has a factor s. "
    "dynamic_yarn takes no --factor: its --floor F applies at EVERY length.",
)


def add_parser(sub) -> None:
    """Adds ``extend`` to the ``ropescale`` command's subparsers."""
    ex = subcommand(sub, "extend", "copy a local model directory with a scaling method written into its config",
                    "\n\n".join(textwrap.fill(p, 108) for p in _DESCRIPTION),
                    ["ropescale extend ./llama ./llama-yarn --method yarn --factor 4",
                     "ropescale extend ./llama ./llama-ryarn --method yarn --factor 4 --resonance "
                     "--original-max-position 8192",
                     "ropescale extend ./llama ./llama-dyarn --method dynamic_yarn --max-length 32768"
                     "   # native up to L",
                     "ropescale extend ./deepseek-v3 ./dsv3-x80 --method yarn --factor 80"
                     "   # keeps its mscale, mscale_all_dim, betas",
                     "ropescale extend ./gpt-oss ./gpt-oss-x64 --method yarn --factor 64"
                     "   # keeps truncate false (--truncate to change it)",
                     "ropescale extend ./llama ./llama-rerope --method rerope --window 1024 --max-length 32768",
                     "ropescale extend ./llama ./llama-leaky --method rerope --window 1024 --leaky-k 16 --logn "
                     "--max-length 32768",
                     "ropescale extend ./llama ./llama-se --attention self_extend --window 1024 --group 8 "
                     "--max-length 32768",
                     "ropescale extend ./llama ./llama-se-yarn --method yarn --factor 2 --attention self_extend "
                     "--window 1024 --group 4",
                     "ropescale extend ./qwen ./qwen-dca --attention dual_chunk --chunk-size 32768 --local-size 4096 "
                     "--temperature-length 32768 --max-length 131072",
                     "ropescale extend ./llama ./llama-string --attention string --shifted-offset 2730 "
                     "--max-length 32768   # S = L/3 of an 8k model, W = 128",
                     "ropescale extend ./phi ./phi-lr --method longrope --longrope-factors factors.json --factor 32",
                     "ropescale extend ./llama ./llama-yarn --method yarn --factor 4 --dry-run   # print the config",
                     "ropescale extend model.gguf model-yarn4.gguf --method yarn --factor 4"
                     "   # for llama.cpp: llama-server -m model-yarn4.gguf -c 32768"])
    ex.add_argument("src", metavar="SRC", help="a local transformers model directory (with config.json), or a GGUF "
                                               "file (then DST is the GGUF llama.cpp serves: static methods only)")
    ex.add_argument("dst", metavar="DST", help="the new directory (must not exist, nor be inside SRC), or file.gguf")
    group = methods.add_options(ex, _METHOD_OPTIONS)
    group.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                       help="per='request' checkpoints: the tokens a request that does not say how many it may "
                            "generate is planned for (and stops at: finish_reason 'length'), written as "
                            "generation_config.json's max_new_tokens, the default of vLLM's chat endpoint and of "
                            "transformers' generate (default: SRC's own, else a quarter of the original length L, so "
                            "a prompt up to 3L/4 runs the native model)")
    group.add_argument("--max-length", type=positive_int, default=None, metavar="N",
                       help="pre-RoPE checkpoints (dynamic_yarn, dynamic_ntk, an --attention): the length it may be "
                            "served to, vLLM's max_model_len (default: the length it records, L or s x L). The table "
                            "keeps L")
    ex.add_argument("--target", choices=("any", *config_lib.STOCK_TARGETS), default="any",
                    help="vllm, sglang: write the table as a longrope (short == long factors) that stock vLLM and "
                         "stock SGLang (and transformers) serve exactly with no plugin (static methods only)")
    ex.add_argument("--converter", metavar="PATH", default=None,
                    help="SRC a directory, DST *.gguf: llama.cpp's convert_hf_to_gguf.py, which writes the unscaled "
                         "model (default: $LLAMA_CPP_CONVERTER, else on the PATH)")
    ex.add_argument("--outtype", default="f16", choices=("f32", "f16", "bf16", "q8_0"),
                    help="SRC a directory, DST *.gguf: the converter's weight type (default f16)")
    ex.add_argument("--dry-run", action="store_true", help="print the new config.json and write nothing")
    ex.set_defaults(func=_cmd_extend)


def _dequantise_hint(gguf: Path, dst: Path) -> str:
    out = dst.with_name(dst.name + "-src")
    return (f"{gguf} is a GGUF file (quantised weights, no config.json): extend copies a transformers model "
            f"directory. Dequantise it into one first (needs the gguf package): python -c \"from ropescale import "
            f"realmodel; realmodel.save_dequantised('{gguf}', '{out}')\", then ropescale extend {out} {dst} ...; "
            f"or, for llama.cpp, extend the GGUF itself: ropescale extend {gguf} {dst.with_suffix('.gguf')} "
            "--method ...")


def _check_extend_paths(src, dst) -> None:
    """SRC a model directory; DST a new directory that can be made, outside SRC: usage errors before any work."""
    if not (src / "config.json").is_file():
        ggufs = sorted(src.glob("*.gguf")) if src.is_dir() else []
        if ggufs:
            raise UsageError(_dequantise_hint(ggufs[0], dst))
        raise UsageError(f"{src} is not a transformers model directory (no config.json)")
    if dst.exists() or dst.is_symlink():
        raise UsageError(f"{dst} already exists: extend writes a new directory and never overwrites")
    if dst.resolve().is_relative_to(src.resolve()):
        raise UsageError(f"{dst} is inside {src}: extend writes a new directory beside SRC, never in it (a later copy "
                         "of SRC would take DST's weights along)")
    try:  # its folder exists and is writable (a read-only or missing one is said now, not as a traceback later)
        files.check_new_path(dst, "DST")
    except ValueError as err:
        raise UsageError(str(err)) from None


def _source_method(config, layer_type: str | None = None) -> scaling.RopeScaling | None:
    """SRC's own method, as every engine adapter reads it (None where ropescale cannot read SRC's config: then nothing
    is kept from it)."""
    from .. import config as config_lib

    try:
        return config_lib.read_config(config, layer_type).method
    except ValueError:
        return None


# Fields never taken from SRC: Resonance is part of --method's name, and the original length has its own default
# (SRC's original_max_position_embeddings, else its max_position_embeddings).
_NEVER_KEPT = ("resonance", "original_max_position")


def _same_family(method: scaling.RopeScaling, source: scaling.RopeScaling) -> bool:
    return isinstance(method, type(source)) or isinstance(source, type(method))


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _listed(values: dict) -> str:
    return ", ".join(f"{key}={_shown(value)}" for key, value in values.items())


def _inherit(method: scaling.RopeScaling, source: scaling.RopeScaling | None,
             given: frozenset[str]) -> tuple[scaling.RopeScaling, dict[str, object]]:
    """``method`` with every field the command line did not give (``given``) taken from SRC's ``source`` where SRC's
    value is not the method's default, when the two are of one family; and what was kept, by config key.

    A field is kept only where it means the same in both methods (the same flag: YaRN's ``factor`` is its scale,
    Dynamic YaRN's the floor of its scale, so neither is ever the other's). Right to keep at any factor, being the
    model's own choices that every factor's formula takes: YaRN's betas, ``truncate``, ``mscale`` and
    ``mscale_all_dim`` (DeepSeek's MLA softmax scale reads ``mscale_all_dim`` and the factor), Llama 3's frequency
    bounds, Proportional's ``partial_rotary_factor`` (the model's rotated pairs), a dynamic method's ``per`` and
    Dynamic YaRN's floor. Wrong, and refused: a fixed ``attention_factor`` (YaRN, LongRoPE) at another scale, or
    from a static table to a dynamic one; it is a temperature chosen for SRC's scale, which the method's own rule
    would change with the scale."""
    if source is None or not _same_family(method, source):
        return method, {}
    own = {p.name: p for p in type(method).parameters()}
    theirs = {p.name: p for p in type(source).parameters()}
    kept: dict[str, object] = {}
    for name, parameter in own.items():
        if name in _NEVER_KEPT or name in given or name not in theirs or theirs[name].cli != parameter.cli:
            continue
        value = getattr(source, name)
        if value != parameter.default:
            kept[name] = value
    if not kept:
        return method, {}
    by_key = {(own[name].hf_key or name): value for name, value in kept.items()}
    try:
        inherited = dataclasses.replace(method, **kept)
    except ValueError as err:
        raise UsageError(f"{err}, with SRC's {_listed(by_key)} kept: give the flag of each value you mean") from None
    if "attention_factor_override" in kept:
        _check_kept_attention_factor(inherited, source)
    return inherited, by_key


def _check_kept_attention_factor(method: scaling.RopeScaling, source: scaling.RopeScaling) -> None:
    """SRC's fixed attention factor is its temperature at SRC's scale: kept only where the new table has that scale
    (the same static factor, or both dynamic: SRC's factor then already held at every length)."""
    factor, source_factor = method.factor or 1.0, source.factor or 1.0  # LongRoPE's None: 1
    if method.dynamic == source.dynamic and (method.dynamic or factor == source_factor):
        return
    value = source.attention_factor_override
    own_rule = dataclasses.replace(method, attention_factor_override=None)
    name = type(method).rope_type
    if method.dynamic:
        rule = f"{name}'s own rule follows each length's scale"
        settle = f"--attention-factor {methods.AUTO} for that rule, or --attention-factor A to fix A at every length"
    else:
        rule = f"{name}'s own rule gives {own_rule.attention_factor:g} at factor {factor:g}"
        settle = (f"--attention-factor {methods.AUTO} for that rule, or --attention-factor A to fix one (e.g. "
                  f"{own_rule.attention_factor:g})")
    written_for = "its dynamic scale" if source.dynamic else f"its factor {source_factor:g}"
    raise UsageError(f"attention_factor: SRC's {type(source).rope_type} fixes it at {value:g}, set for {written_for}; "
                     f"{rule}. Keeping {value:g} would keep SRC's temperature on the new table: give {settle}")


def _planning_budget(args, src: Path, written) -> int | None:
    """The ``max_new_tokens`` a per-request checkpoint's generation config gets (None: not per request, nothing
    written): --max-new-tokens, else SRC's own, else a quarter of the original length. A request that does not say
    how many tokens it may generate is planned with it (vLLM's chat endpoint and transformers' generate take it as
    their default), so a short question runs the native model and stops there rather than running the model scaled
    for max_model_len (vLLM's own fallback)."""
    if not written.method.per_request:
        if args.max_new_tokens is not None:
            raise UsageError("--max-new-tokens is the planning budget of a per='request' checkpoint (--per request): "
                             "other methods do not plan a request's length")
        return None
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    own = _generation_config(src).get("max_new_tokens")
    if isinstance(own, int) and not isinstance(own, bool) and own > 0:
        return own
    return max(1, int(written.method.original_max_position) // 4)


def _generation_config(folder: Path) -> dict:
    import json

    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except ValueError as err:
        raise UsageError(f"{path} is not JSON: {err}") from None
    return value if isinstance(value, dict) else {}


def _write_planning_budget(src: Path, dst: Path, budget: int) -> None:
    """DST's generation_config.json: SRC's (or a new one) with ``max_new_tokens`` set to ``budget``."""
    import json

    generation = _generation_config(src)
    generation["max_new_tokens"] = int(budget)
    (dst / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def _attention_summary(plan) -> str:
    """The attention's line of the report: its settings as the vLLM plugin's startup line gives them."""
    from .. import attentions

    return (f"  {attentions.RAW_KEY[plan.attention].describe(plan)} (import ropescale.hf, then hf.patch(model); vLLM "
            "with ropescale's plugin)")


def _cmd_extend_gguf(args, src: Path, dst: Path, from_directory: bool = False) -> int:
    """SRC a GGUF file, or a transformers directory llama.cpp's converter turns into one: DST the GGUF llama.cpp
    reads the method from (``ropescale.llamacpp``)."""
    from .. import llamacpp

    attention = methods.attention_of(args)
    if attention is not None:
        from .. import attentions

        raise UsageError(f"--attention {attention}: llama.cpp has no {attentions.RAW_KEY[attention].title} (its attention "
                         "rotates keys once, when written): serve it with transformers (ropescale.hf) or vLLM with "
                         "ropescale's plugin, from a transformers directory (extend SRC_DIR DST_DIR --attention ...)")
    if args.method is None:
        raise UsageError("a GGUF DST takes --method M (a static table llama.cpp applies); --attention is not for it")
    for flag, given in (("--target", args.target != "any"), ("--max-length", args.max_length is not None),
                        ("--max-new-tokens", args.max_new_tokens is not None)):
        if given:
            raise UsageError(f"{flag} is for a transformers directory; a GGUF DST is served at its context_length "
                             "(llama-server -c N)")
    if dst.suffix.lower() != ".gguf":
        raise UsageError(f"{dst}: a GGUF SRC writes a GGUF file: name DST *.gguf")
    files.check_new_path(dst, "DST")  # the run's and --dry-run's first check (a ValueError: a usage error)
    if from_directory:
        return _cmd_extend_directory_to_gguf(args, src, dst)
    try:
        _, rope = llamacpp.read_rope(src)
    except (ValueError, ImportError) as err:
        raise UsageError(str(err)) from None
    args.original_max_position = args.original_max_position or rope.context_length
    method = methods.build(args)
    if args.dry_run:  # every check the run makes (llamacpp.plan_extend), nothing written
        plan = _gguf_refusals(args, lambda: llamacpp.plan_extend(src, dst, method)).written
        print(f"would write {dst}: {type(method).__name__} over {rope.architecture} (base {rope.base:g}, n_rot "
              f"{rope.rotary_dim}, context_length {rope.context_length}): rope.scaling.type {plan.scaling_type}, "
              f"attn_factor {plan.attn_factor:.6g}, served with llama-server -m {dst} -c {plan.context_length}")
        return 0
    return _write_gguf(args, dst, method, lambda: llamacpp.extend(src, dst, method, progress=sys.stderr.isatty()))


def _cmd_extend_directory_to_gguf(args, src: Path, dst: Path) -> int:
    from .. import llamacpp

    if not (src / "config.json").is_file():
        raise UsageError(f"{src} is not a transformers model directory (no config.json)")
    config = json.loads((src / "config.json").read_text())
    args.original_max_position = args.original_max_position or config.get("max_position_embeddings")
    method = methods.build(args)
    if args.dry_run:  # the checks made before the converter runs (llamacpp.check_from_transformers)
        _gguf_refusals(args, lambda: llamacpp.check_from_transformers(src, dst, method, converter=args.converter))
        print(f"would convert {src} with llama.cpp's converter ({args.outtype}) and write {dst}: "
              f"{type(method).__name__}")
        return 0
    return _write_gguf(args, dst, method, lambda: llamacpp.from_transformers(
        src, dst, method, converter=args.converter, outtype=args.outtype, progress=sys.stderr.isatty()))


def _gguf_refusals(args, run):
    """``run()``, its refusals (FileExistsError, ValueError) as usage errors: the same for the run and --dry-run."""
    try:
        return run()
    except FileExistsError as err:
        raise UsageError(str(err)) from None
    except ValueError as err:
        raise UsageError(f"--method {args.method}: {err}") from None


def _write_gguf(args, dst: Path, method, write) -> int:
    """Runs ``write`` (``llamacpp.extend`` or ``from_transformers``), its refusals as usage errors, and says what it
    wrote and how to serve it."""
    written = _gguf_refusals(args, write)
    factors = (f"{' and '.join(written.tensors)} ({len(written.rope_freqs)} factors)" if written.tensors else
               "llama.cpp's own keys (no factor tensor)")
    print(f"wrote {dst}: rope.scaling.type {written.scaling_type}, {factors}, attn_factor {written.attn_factor:.6g}, "
          f"context_length {written.context_length}; {written.copied_tensors} tensors copied byte for byte. Serve it: "
          f"llama-server -m {dst} -c {written.context_length}")
    if written.two_tables:
        print(f"note: llama.cpp takes the long table for EVERY prompt when -c exceeds {method.original_max_position} "
              "(transformers: only for a sequence longer than that), the short one otherwise")
    return 0


def _place(source: Path, target: Path) -> bool:
    """One file of SRC into DST: a weights file hard-linked (True) where a link can be made, else copied (False)."""
    if source.name.endswith(_WEIGHT_SUFFIXES):
        try:
            os.link(source.resolve(), target)
            return True
        except OSError:  # another file system, or links not allowed
            pass
    shutil.copy2(source, target)
    return False


def _copy_source(src: Path, dst: Path) -> tuple[list[str], list[str], list[str]]:
    """SRC's files but config.json into the folder ``dst``: (linked, copied, skipped directories)."""
    linked, copied, skipped = [], [], []
    for f in sorted(src.iterdir()):
        if f.name == "config.json":
            continue
        if not f.is_file():
            skipped.append(f.name)
        else:
            (linked if _place(f, dst / f.name) else copied).append(f.name)
    return linked, copied, skipped


def _cmd_extend(args) -> int:
    src, dst = Path(args.src), Path(args.dst)
    if src.is_file() and src.suffix.lower() == ".gguf":
        return _cmd_extend_gguf(args, src, dst)
    if dst.suffix.lower() == ".gguf":
        return _cmd_extend_gguf(args, src, dst, from_directory=True)
    methods.check_attention_options(args)
    attention = methods.attention_of(args)
    if args.method is None and attention is None:
        raise UsageError("give --method M (a scaling method), --attention A (an attention over SRC's own table), or "
                         "both (the attention over M's table)")
    _check_extend_paths(src, dst)
    from transformers import AutoConfig

    from .. import config as config_lib, serving
    from ..hf import architectures, checkpoint

    try:
        config = AutoConfig.from_pretrained(src)
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise UsageError(f"{src} is not a transformers model directory: {err}") from None
    arch = architectures.find(config)
    # a per-layer-type config (Gemma 3, DeepSeek-V4): the layer types hf.patch extends, each keeping its own table
    per_type = config_lib.per_layer_type(config)
    try:
        layer_types = arch.extended_layer_types(config) if arch is not None and per_type else None
    except ValueError as err:
        raise UsageError(f"SRC: {err}") from None
    layer_type = layer_types[0] if layer_types else None
    params = config_lib.layer_type_parameters(config, layer_type) if not per_type or layer_type else None
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise UsageError(f"{src}: its config ({config.model_type}) has no RoPE parameters to extend "
                         "(or one set per layer type of a family ropescale does not know)")
    # SRC's ORIGINAL length, not the one a scaled SRC's max_position_embeddings holds (checkpoint.original_length)
    args.original_max_position = args.original_max_position or checkpoint.original_length(config, layer_type)
    method = methods.build(args, inherit=True) if args.method is not None else None  # None: SRC's own table
    kept: dict[str, object] = {}
    if method is not None:
        method, kept = _inherit(method, _source_method(config, layer_type),
                                methods.given_fields(args, methods.NAMES[args.method].rope_type))
        methods.check_built(args, method)
    if args.target == "vllm" and arch is not None and arch.vllm_yarn_keys:
        raise UsageError(f"--target vllm writes a longrope table for stock vLLM, but stock vLLM's {arch.name} model "
                         "builds YaRN whatever rope_type says: --method yarn (no --target) is what it serves of this "
                         "family exactly")
    if attention is not None and args.target != "any":
        raise UsageError(f"--target {args.target} writes a table its stock engine serves with no plugin; "
                         f"{config_lib.ATTENTION_NAMES[attention]} needs ropescale's plugin: leave --target out")
    if method is not None:
        try:
            method.check_rotary_dim(config_lib.rotary_dim_of(config, params, layer_type))
        except ValueError as err:
            raise UsageError(f"SRC: {err}") from None
    if args.max_length is not None and attention is None and not method.dynamic:
        raise UsageError(f"--max-length is for pre-RoPE checkpoints (dynamic_yarn, dynamic_ntk, an --attention), whose "
                         f"table follows each request's length or whose attention bounds the distances; --method "
                         f"{args.method} is a static table, set for s x L: --factor s sets the length it is served to")
    replaced = params.get("rope_type", "default")
    # the attention's parameters with their defaults (DCA's L0 under chunkllama: the model's length), as hf.patch's
    patch_arguments = methods.attention_arguments(args, config.max_position_embeddings)
    parameters = {key: value for key, value in patch_arguments.items() if key != "attention"}
    try:
        checkpoint.record(config, method, attention or "sdpa", parameters, target=args.target,
                          max_length=args.max_length, layer_types=layer_types)
    except ValueError as err:  # a table DCA does not take, one --target vllm cannot write, ...
        if args.target != "any":
            raise UsageError(f"--target {args.target}: {err}") from None
        raise UsageError(f"--attention {attention}: {err}" if attention not in (None, "rerope") else str(err)) from None
    try:  # what every engine adapter will read back (hf.patch, the vLLM plugin)
        written = config_lib.read_config(config, layer_type)
    except ValueError as err:
        raise UsageError(f"--method {args.method}: {err}" if args.method else f"--attention {attention}: {err}") \
            from None
    if layer_types and (serving.needs_pre_rope(written) or serving.rotated_at_write(written)):
        raise UsageError(f"extend writes a static table into the layer types {', '.join(layer_types)} of a "
                         "per-layer-type config (each other type keeps its own); a pre-RoPE or per-request method "
                         "there: patch the model with ropescale.hf.patch and save_pretrained")
    if arch is not None:  # what hf.patch(model) would refuse on the reload, refused before it is written
        rotated_at_write = serving.rotated_at_write(written)
        refusal = arch.method_refusal(type(written.method).__name__, written.length_free and not rotated_at_write,
                                      rotated_at_write)
        if refusal:
            raise UsageError(f"SRC: {refusal}")
    misread = architectures.stock_vllm_misreads(config)
    if misread is not None:
        print(f"warning: {misread}", file=sys.stderr)
    layers = config.rope_parameters.values() if config_lib.per_layer_type(config) else [config.rope_parameters]
    for misread in dict.fromkeys(config_lib.stock_sglang_misreads(p, config.max_position_embeddings) for p in layers):
        if misread is not None:
            print(f"warning: {misread}", file=sys.stderr)
    text = config.to_json_string(use_diff=True)
    budget = _planning_budget(args, src, written)
    plan = serving.PreRopePlan.of_config(config) if layer_type is None else None
    max_model_len = config_lib.max_model_len_of(config, layer_type)
    reduced = plan.self_extend_reduces_within(max_model_len) if plan is not None else None
    if reduced is not None:
        print(f"warning: {reduced}", file=sys.stderr)
    if kept:  # on stderr beside --dry-run's JSON
        print(f"kept from SRC (a flag overrides each): {_listed(kept)}",
              file=sys.stderr if args.dry_run else sys.stdout)
    if args.dry_run:
        print(text, end="")
        return 0

    try:  # written whole or not at all: a temporary folder beside DST, renamed at the end (Ctrl-C, a full disk)
        with files.atomic_directory(dst) as part:
            linked, copied, skipped = _copy_source(src, part)
            (part / "config.json").write_text(text)
            if budget is not None:
                _write_planning_budget(src, part, budget)
    except FileExistsError as err:
        raise UsageError(str(err)) from None
    except OSError as err:
        print(f"ropescale extend: error: writing {dst} failed, nothing written: {err}", file=sys.stderr)
        return 1
    new = config_lib.layer_type_parameters(config, layer_type)
    served = getattr(config, config_lib.SERVED_LENGTH_KEY, None)
    print(f"wrote {dst}: rope_type {new['rope_type']}"
          + (f" (was {replaced})" if replaced != new["rope_type"] and not scaling.RopeType.parse(replaced).unscaled
             else "")
          + (f" in layer types {', '.join(layer_types)} (the others keep their own)" if layer_types else "")
          + f", max_position_embeddings {config.max_position_embeddings}"
          + (f", model_max_length {served}" if served is not None else "")
          + f": vLLM serves it up to {max_model_len} tokens (max_model_len)")
    if patch_arguments:
        print(_attention_summary(plan))
    if written.method.per_request:
        print("  per request: each request runs the static model of the table at its prompt + max new tokens, for its "
              "whole life (the native model when that fits L); a request that does not set them (a chat request "
              f"without max_tokens) is planned at prompt + {budget} and stops there (finish_reason 'length'): "
              "generation_config.json max_new_tokens, --max-new-tokens N")
    if written.length_free and served is None:
        print(f"  pre-RoPE: its table follows each request's length; to serve it past {max_model_len} tokens, write "
              "it with --max-length N")
    print(f"  hard-linked {len(linked)} weight file(s), copied {len(copied)} file(s)"
          + (f", skipped directories: {', '.join(skipped)}" if skipped else ""))
    return 0

