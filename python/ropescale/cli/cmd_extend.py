"""``extend``: a copy of a local model directory with a scaling method (and ReRoPE attention) written into its
config (ropescale.hf.checkpoint)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

from .. import scaling
from . import methods
from .common import UsageError, positive_int, subcommand

_METHOD_OPTIONS = methods.MethodOptions(
    flags=("--method", "--factor", "--floor", "--original-max-position", "--per", "--beta-fast", "--beta-slow",
           "--resonance", "--longrope-factors", "--window", "--leaky-k", "--logn"),
    required=True,
    defaults={"--original-max-position": "SRC's original_max_position_embeddings, else its max_position_embeddings"},
    notes={"--floor": ". Not the way to serve longer: that is --max-length"},
    own_table="SRC's own table", serve_longer="give --max-length N (the floor stays 1)",
    attention_title="ReRoPE attention (on top of --method's table; --method rerope: SRC's own)")

# Files a model directory keeps its weights in: hard-linked into DST (copied where a link cannot be made).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

_DESCRIPTION = (
    "Write DST: a copy of the transformers model directory SRC (weights hard-linked, or copied where "
    "a link cannot be made; tokenizer and other files copied) whose config.json carries the method "
    "as rope_parameters, with max_position_embeddings set as transformers and vLLM expect: ready "
    "for fine-tuning (ropescale.hf.patch(model) re-applies it) or for an engine that reads "
    "rope_parameters. Types transformers lacks (dynamic_ntk, dynamic_yarn, resonance_*, rerope*) load "
    "after `import ropescale.hf`.",
    "Two lengths, not to be confused. A static table (linear, ntk, yarn, llama3, longrope) is set for "
    "one length, s x L: --factor s sets it, and vLLM serves the checkpoint up to it (max_model_len). "
    "A pre-RoPE checkpoint (dynamic_yarn, dynamic_ntk, or ReRoPE attention with --window) has no such "
    "length: a dynamic table follows each request's own length (native up to L), ReRoPE clips "
    "distances at its window. --max-length N is then the length it may be served to (written as "
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
                     "ropescale extend ./llama ./llama-rerope --method rerope --window 1024 --max-length 32768",
                     "ropescale extend ./llama ./llama-leaky --method rerope --window 1024 --leaky-k 16 --logn "
                     "--max-length 32768",
                     "ropescale extend ./phi ./phi-lr --method longrope --longrope-factors factors.json --factor 32",
                     "ropescale extend ./llama ./llama-yarn --method yarn --factor 4 --dry-run   # print the config"])
    ex.add_argument("src", metavar="SRC", help="a local transformers model directory (with config.json)")
    ex.add_argument("dst", metavar="DST", help="the new directory (must not exist, nor be inside SRC)")
    group = methods.add_options(ex, _METHOD_OPTIONS)
    group.add_argument("--max-length", type=positive_int, default=None, metavar="N",
                       help="pre-RoPE checkpoints (dynamic_yarn, dynamic_ntk, --window): the length it may be served "
                            "to, vLLM's max_model_len (default: the length it records, L or s x L). The table keeps L")
    ex.add_argument("--target", choices=("any", "vllm"), default="any",
                    help="vllm: write the table as a longrope (short == long factors) that stock vLLM serves "
                         "exactly with no plugin (static methods only)")
    ex.add_argument("--dry-run", action="store_true", help="print the new config.json and write nothing")
    ex.set_defaults(func=_cmd_extend)


def _dequantise_hint(gguf: Path, dst: Path) -> str:
    out = dst.with_name(dst.name + "-src")
    return (f"{gguf} is a GGUF file (quantised weights, no config.json): extend copies a transformers model "
            f"directory. Dequantise it into one first (needs the gguf package): python -c \"from ropescale import "
            f"realmodel; realmodel.save_dequantised('{gguf}', '{out}')\", then ropescale extend {out} {dst} ...")


def _check_extend_paths(src, dst) -> None:
    if src.is_file() and src.suffix.lower() == ".gguf":
        raise UsageError(_dequantise_hint(src, dst))
    if not (src / "config.json").is_file():
        ggufs = sorted(src.glob("*.gguf")) if src.is_dir() else []
        if ggufs:
            raise UsageError(_dequantise_hint(ggufs[0], dst))
        raise UsageError(f"{src} is not a transformers model directory (no config.json)")
    if dst.exists():
        raise UsageError(f"{dst} already exists: extend writes a new directory and never overwrites")
    if dst.resolve().is_relative_to(src.resolve()):
        raise UsageError(f"{dst} is inside {src}: extend writes a new directory beside SRC, never in it (a later copy "
                         "of SRC would take DST's weights along)")


def _cmd_extend(args) -> int:
    import shutil

    src, dst = Path(args.src), Path(args.dst)
    _check_extend_paths(src, dst)
    from transformers import AutoConfig

    from .. import config as config_lib
    from ..hf import checkpoint

    try:
        config = AutoConfig.from_pretrained(src)
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise UsageError(f"{src} is not a transformers model directory: {err}") from None
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise UsageError(f"{src}: its config ({config.model_type}) has no RoPE parameters to extend "
                         "(or one set per layer type, which extend does not write)")
    args.original_max_position = (args.original_max_position or params.get("original_max_position_embeddings")
                                  or config.max_position_embeddings)
    methods.check_rerope(args)
    method = methods.build(args)  # None for --method rerope: SRC's own table
    rerope = args.window is not None
    if rerope and args.target == "vllm":
        raise UsageError("--target vllm writes a table stock vLLM serves with no plugin; ReRoPE attention needs "
                         "ropescale's plugin: leave --target out")
    if method is not None:
        try:
            method.check_rotary_dim(config_lib.rotary_dim_of(config))
        except ValueError as err:
            raise UsageError(f"SRC: {err}") from None
    if args.max_length is not None and not rerope and not method.dynamic:
        raise UsageError(f"--max-length is for pre-RoPE checkpoints (dynamic_yarn, dynamic_ntk, --window), whose table "
                         f"follows each request's length; --method {args.method} is a static table, set for s x L: "
                         "--factor s sets the length it is served to")
    replaced = params.get("rope_type", "default")
    try:
        checkpoint.record(config, method, **methods.rerope_attention(args), target=args.target,
                          max_length=args.max_length)
    except ValueError as err:
        raise UsageError(f"--target {args.target}: {err}" if args.target != "any" else str(err)) from None
    try:  # what every engine adapter will read back (hf.patch, the vLLM plugin)
        written = config_lib.read_config(config)
    except ValueError as err:
        raise UsageError(f"--method {args.method}: {err}") from None
    text = config.to_json_string(use_diff=True)
    if args.dry_run:
        print(text, end="")
        return 0

    dst.mkdir(parents=True)
    linked, copied, skipped = [], [], []
    for f in sorted(src.iterdir()):
        if f.name == "config.json":
            continue
        if not f.is_file():
            skipped.append(f.name)
        elif f.name.endswith(_WEIGHT_SUFFIXES):
            try:
                os.link(f.resolve(), dst / f.name)
                linked.append(f.name)
            except OSError:  # another file system, or links not allowed
                shutil.copy2(f, dst / f.name)
                copied.append(f.name)
        else:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    (dst / "config.json").write_text(text)
    new = config.rope_parameters
    served = getattr(config, config_lib.SERVED_LENGTH_KEY, None)
    max_model_len = config_lib.vllm_max_model_len(new, config.max_position_embeddings, served)
    print(f"wrote {dst}: rope_type {new['rope_type']}"
          + (f" (was {replaced})" if replaced not in ("default", new["rope_type"]) else "")
          + f", max_position_embeddings {config.max_position_embeddings}"
          + (f", model_max_length {served}" if served is not None else "")
          + f": vLLM serves it up to {max_model_len} tokens (max_model_len)")
    if written.method.per_request:
        print("  per request: each request runs the static model of the table at its prompt + max new tokens, for its "
              "whole life (the native model when that fits L)")
    if written.length_free and served is None:
        print(f"  pre-RoPE: its table follows each request's length; to serve it past {max_model_len} tokens, write "
              "it with --max-length N")
    print(f"  hard-linked {len(linked)} weight file(s), copied {len(copied)} file(s)"
          + (f", skipped directories: {', '.join(skipped)}" if skipped else ""))
    return 0

