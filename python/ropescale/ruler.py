"""RULER's synthetic long-context tasks (Hsieh et al., 2024; github.com/NVIDIA/RULER), generated offline.

The six fully synthetic tasks run by default (``DEFAULT_TASKS``); the five needle tasks that hide their
needles in essays need a text given as ``haystack`` (RULER uses Paul Graham's essays, which are not shipped):

- ``niah_single_1``: one word key -> 7-digit number, in repeated noise sentences (wonderwords)
- ``niah_multikey_2``: the same among distractor needles (other keys, other numbers) (wonderwords)
- ``niah_multikey_3``: uuid key -> uuid value among uuid needles
- ``vt``: variable tracking, one chain of 4 hops in noise, after a one-shot example
- ``cwe``: the 10 most common words of a numbered list of wonderwords' nouns, adjectives, verbs (wonderwords)
- ``fwe``: the 3 most frequent coded words of a zeta(alpha = 2) distributed text
- with a haystack text: ``niah_single_2`` (word key -> number), ``niah_single_3`` (word key -> uuid),
  ``niah_multikey_1`` (one of 4 keys), ``niah_multivalue`` (the 4 numbers of a key), ``niah_multiquery``
  (the numbers of 4 keys), all in the essay haystack, all with word keys (wonderwords)

(wonderwords): the task draws words from the ``wonderwords`` package's lists, as RULER does (``pip install
wonderwords``); without it ``generate`` raises ``WonderwordsMissing`` for those tasks only, ``run`` refuses a
task list holding one (before any work), and ``ropescale eval ruler`` skips them with a note.

How a sample is made, as RULER's ``scripts/data`` does it (read from RULER's sources; the code is ropescale's):

- The prompt is RULER's task template followed by its answer prefix, in RULER's **base** template (the one it
  uses for non-chat models: no chat markup). The model reads the whole text and continues it.
- The haystack is grown by RULER's search: an estimate of tokens per haystack unit from one probe, then a
  binary search for the largest size whose prompt plus ``tokens_to_generate`` fits ``length``; each sample is
  then drawn at that size, shrunk by RULER's step while a draw does not fit. fwe grows its word count
  linearly as RULER does. Tokens are counted with the model's tokenizer as RULER counts them: the text's
  tokens without special tokens (``Sample.tokens``); the model is fed the prompt with them (a BOS token).
- Randomness follows RULER's order of draws from one ``random.Random(seed)`` and one
  ``numpy.random.RandomState(seed)`` per (task, length) (RULER seeds the global generators of a fresh
  process per task), default seed 42, and RULER's ``random.Random(seed)`` shuffles. With the same tokenizer
  and word lists the prompts are RULER's own, character for character (checked against RULER's scripts at
  NVIDIA/RULER c3f5e3b on character- and word-level tokenizers and SmolLM2's).
- Scoring is RULER's ``string_match_all`` for every task: per sample the fraction of references found in the
  prediction (case-insensitive substring), averaged over samples, x 100, rounded to 2 decimals. The prediction
  is the greedy continuation of ``tokens_to_generate`` tokens (or up to EOS), decoded and cleaned as RULER's
  ``postprocess_pred`` does.

Where this differs from RULER, knowingly:

- vt's variable names: when a draw names a variable twice, RULER appends names until enough are distinct,
  then cuts all of them, the duplicate kept, into chains and fails with an IndexError on the short last one.
  Its sample loops catch that and draw again one step smaller (the one-shot example with 5 noise lines fewer),
  as here (the prompts stay RULER's); where RULER sizes the haystack (its estimate and binary search, outside
  any ``try``) the IndexError crashes its script, which writes nothing: here a ``ValueError`` says so. With
  SmolLM2's tokenizer 4 of seeds 0-399 repeat a name in the one-shot example (sized to 500 tokens whatever the
  length): seed 128 in its sample loop (redrawn, equal to RULER's output), 35, 140 and 396 in its sizing (refused).
- A length too short for a task: RULER loops forever (it retries the smallest size without end); here a
  ``ValueError`` says so after a bounded number of draws.
- cwe past the 8,166 words of wonderwords' lists (past about 180k tokens with SmolLM2's tokenizer; 128k
  fits): RULER samples from its ``english_words.json`` (a Git LFS file, not shipped); here a ``ValueError``
  says so.
- Essay haystacks are split into sentences with nltk's punkt when nltk and its data are installed (as RULER
  does), else with a plain rule (a sentence ends at ``.``, ``!`` or ``?`` before white space), which puts
  needles at slightly different sentence boundaries; the cache keys on the splitter.

The effective length (as RULER's paper defines it) is the longest evaluated length whose average over the tasks
exceeds ``THRESHOLD`` = 85.6 (Llama-2-7B's score at 4k, RULER's bar) with every shorter evaluated length
above it too; None when the shortest fails.

    from ropescale import ruler
    result = ruler.run(model, tokenizer, lengths=[4096, 8192], samples=5, cache_dir="ruler-cache")
    result.averages, result.effective_length, result.to_dict()
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
import string
import uuid
import warnings
import weakref
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from .files import atomic_file, check_writable_directory

__all__ = [
    "THRESHOLD",
    "TASKS",
    "DEFAULT_TASKS",
    "ESSAY_TASKS",
    "Task",
    "Sample",
    "SampleResult",
    "TaskScore",
    "RulerResult",
    "WonderwordsMissing",
    "WONDERWORDS_INSTALL",
    "generate",
    "clear_cache",
    "string_match_all",
    "string_match_part",
    "postprocess",
    "effective_length",
    "run",
]

#: RULER's bar: Llama-2-7B's average at 4k. A length counts as effective when the average exceeds it.
THRESHOLD = 85.6

#: Bumped whenever a generator changes what it writes: cached prompts of another version are not read.
_GENERATOR_VERSION = 2  # 2: vt redraws or refuses where RULER's name draw repeats

WONDERWORDS_INSTALL = "pip install wonderwords==3.0.1"


class WonderwordsMissing(ImportError):
    """A task that draws words from the ``wonderwords`` package's lists, which is not installed."""


# ---------------------------------------------------------------------------------------------
# The tasks, declared once


@dataclass(frozen=True)
class Task:
    """One RULER task: its family's template, answer prefix and ``tokens_to_generate`` (RULER's
    ``scripts/data/synthetic/constants.py``) and its arguments (``scripts/synthetic.yaml``)."""

    name: str
    family: str  #: RULER's generator: niah, variable_tracking, common_words_extraction, freq_words_extraction
    args: Mapping[str, Any]
    summary: str

    @property
    def tokens_to_generate(self) -> int:
        return _FAMILIES[self.family]["tokens_to_generate"]

    @property
    def template(self) -> str:
        return _FAMILIES[self.family]["template"]

    @property
    def answer_prefix(self) -> str:
        return _FAMILIES[self.family]["answer_prefix"]

    @property
    def needs_haystack(self) -> bool:
        return self.args.get("type_haystack") == "essay"

    @property
    def needs_wonderwords(self) -> bool:
        return self.family == "common_words_extraction" or (
            self.family == "niah" and "words" in (self.args["type_needle_k"], self.args["type_needle_v"]))


_FAMILIES: dict[str, dict[str, Any]] = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assigned the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. "
                    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                    "words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
}


def _niah_args(haystack, key, value, k=1, v=1, q=1):
    return {"type_haystack": haystack, "type_needle_k": key, "type_needle_v": value, "num_needle_k": k,
            "num_needle_v": v, "num_needle_q": q}


_DECLARED = [
    Task("niah_single_1", "niah", _niah_args("noise", "words", "numbers"),
         "one word key -> 7-digit number, in repeated noise sentences"),
    Task("niah_multikey_2", "niah", _niah_args("needle", "words", "numbers"),
         "word key -> number among distractor needles"),
    Task("niah_multikey_3", "niah", _niah_args("needle", "uuids", "uuids"),
         "uuid key -> uuid among uuid needles"),
    Task("vt", "variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4},
         "variable tracking: a chain of 4 hops in noise, one-shot"),
    Task("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
         "the 10 most common words of a numbered list"),
    Task("fwe", "freq_words_extraction", {"alpha": 2.0},
         "the 3 most frequent coded words (zeta-distributed)"),
    Task("niah_single_2", "niah", _niah_args("essay", "words", "numbers"),
         "word key -> number in the essay haystack"),
    Task("niah_single_3", "niah", _niah_args("essay", "words", "uuids"),
         "word key -> uuid in the essay haystack"),
    Task("niah_multikey_1", "niah", _niah_args("essay", "words", "numbers", k=4),
         "one of 4 keys in the essay haystack"),
    Task("niah_multivalue", "niah", _niah_args("essay", "words", "numbers", v=4),
         "the 4 numbers of one key in the essay haystack"),
    Task("niah_multiquery", "niah", _niah_args("essay", "words", "numbers", q=4),
         "the numbers of 4 keys in the essay haystack"),
]
#: Every task, by name.
TASKS: dict[str, Task] = {t.name: t for t in _DECLARED}
#: The six fully synthetic tasks (no haystack text needed): what ``run`` evaluates by default.
DEFAULT_TASKS: tuple[str, ...] = tuple(t.name for t in _DECLARED if not t.needs_haystack)
#: The needle tasks that need a ``haystack`` text (RULER's essays).
ESSAY_TASKS: tuple[str, ...] = tuple(t.name for t in _DECLARED if t.needs_haystack)


def _task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; the tasks are: {', '.join(TASKS)}")
    return TASKS[name]


# ---------------------------------------------------------------------------------------------
# Samples


@dataclass(frozen=True)
class Sample:
    """One prompt. The model reads ``prompt`` (``input`` then ``answer_prefix``) and continues it."""

    task: str
    length: int  #: the context length asked for (prompt plus the answer)
    index: int
    input: str  #: the prompt without the answer prefix (RULER's ``input``)
    answer_prefix: str
    references: tuple[str, ...]  #: what the answer must contain (RULER's ``outputs``)
    tokens: int  #: tokens of ``prompt`` as RULER counts them (no special tokens); <= length - tokens_to_generate

    @property
    def prompt(self) -> str:
        return self.input + self.answer_prefix


class _Draws:
    """RULER's random sources for one (task, length): Python's ``random`` and numpy's legacy generator,
    both seeded with ``seed`` (RULER seeds the global ones in a fresh process per task)."""

    def __init__(self, seed: int):
        import numpy as np

        self.seed = seed
        self.py = random.Random(seed)
        self.np = np.random.RandomState(seed)

    def shuffled(self, items: list) -> list:
        """RULER's ``random.Random(seed).shuffle(items)``: a fresh generator, the same order every time."""
        random.Random(self.seed).shuffle(items)
        return items


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Tokens of a text as RULER counts them (``tokenizer.tokenize``: no special tokens), or a callable's."""
    if callable(getattr(tokenizer, "tokenize", None)):
        return lambda text: len(tokenizer.tokenize(text))
    if callable(tokenizer):
        return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
    raise TypeError(f"a tokenizer with .tokenize(text) is needed, got {type(tokenizer).__name__}")


def _search(fits: Callable[[int], bool], lower: int, upper: int) -> int | None:
    """RULER's binary search: the largest size in [lower, upper] that ``fits`` (one new draw per probe)."""
    best = None
    while lower <= upper:
        mid = (lower + upper) // 2
        if fits(mid):
            best, lower = mid, mid + 1
        else:
            upper = mid - 1
    return best


# A draw at the smallest size that does not fit is retried (RULER retries it forever).
_RETRIES_AT_FLOOR = 50


class _RulerIndexError(Exception):
    """Where RULER's own generator raises (vt: a variable name drawn twice makes its chain loop read past a short
    slice of names). Its sample loops catch every exception and redraw with one step less; anywhere else RULER's
    script crashes."""


def _draw_fitting(draw: Callable[[int], Any], fits: Callable[[Any], bool], size: int, step: int, what: str,
                  too_short: str = "the length is too short for even the smallest prompt"):
    """RULER's sample loop: draw at ``size``; while the draw does not fit, or RULER's generator raises in it
    (``_RulerIndexError``: RULER's bare ``except``), shrink by ``step`` (never below ``step``) and draw again."""
    floor_tries = 0
    while True:
        try:
            out = draw(size)
        except _RulerIndexError:
            out = None
        if out is not None and fits(out):
            return out
        if size > step:
            size -= step
        else:
            floor_tries += 1
            if floor_tries >= _RETRIES_AT_FLOOR:
                raise ValueError(f"{what}: {too_short}")


def _fitted_samples(task: Task, make: Callable[[int], tuple[str, list[str]]], count: Callable[[str], int],
                    length: int, samples: int, step: int, upper: int) -> list[Sample]:
    """RULER's loop for the tasks whose prompt grows with one size: the largest size in ``[step, upper]`` whose
    prompt plus ``tokens_to_generate`` fits ``length`` (``make(size)``: (prompt, answers), a new draw each call),
    then ``samples`` draws at it (smaller where a draw does not fit)."""
    def fits(text: str) -> bool:
        return count(text) + task.tokens_to_generate <= length

    size = _search(lambda n: fits(make(n)[0]), step, upper) or step
    out = []
    for index in range(samples):
        text, answers = _draw_fitting(make, lambda made: fits(made[0]), size, step, task.name)
        body, prefix = _split_prefix(text, task.answer_prefix)
        out.append(Sample(task.name, length, index, body, prefix, tuple(answers), count(text)))
    return out


def _split_prefix(text: str, raw_prefix: str) -> tuple[str, str]:
    """RULER's split of a prompt into ``input`` and ``answer_prefix``: at the last occurrence of the answer
    prefix's first 10 characters (of the template's, before formatting)."""
    at = text.rfind(raw_prefix[:10])
    return text[:at], text[at:]


# ---------------------------------------------------------------------------------------------
# Word lists


def _wonderwords(name: str) -> list[str]:
    """One of wonderwords' lists, read as RULER reads it (``_get_words_from_text_file``)."""
    try:
        from wonderwords import random_word
    except ImportError:
        raise WonderwordsMissing(
            f"this RULER task draws words from the wonderwords package's lists: {WONDERWORDS_INSTALL}") from None
    reader = getattr(random_word, "_get_words_from_text_file", None)
    if reader is not None:
        return reader(name)
    from importlib.resources import files

    with files("wonderwords.assets").joinpath(name).open("r", encoding="utf-8") as f:
        return [line.rstrip() for line in f.readlines()]


class _AdjectiveNounKeys(Sequence):
    """RULER's needle keys ``sorted(set(f"{adj}-{noun}" ...))`` over wonderwords' adjectives and nouns,
    indexed without being built (6.2 M strings: 8 s and 800 MB in full).

    The list splits into blocks, one per "family" of adjectives, in the order of ``root + "-"``: a family is
    an adjective ``root`` and the adjectives that start with ``root + "-"`` (``high``, ``high-pitched``);
    the strings of two families never interleave (``root1 + "-"`` and ``root2 + "-"`` differ before either
    ends), those of one family may, and are sorted together (a few times the nouns). A lone adjective's block
    is its prefix over the sorted nouns."""

    def __init__(self, adjectives: Iterable[str], nouns: Iterable[str]):
        adjectives, self._nouns = sorted(set(adjectives)), sorted(set(nouns))
        known = set(adjectives)
        families: dict[str, list[str]] = {}
        for adj in adjectives:
            # the shortest adjective that `adj` starts with, followed by "-", is its family's root
            roots = [adj[:i] for i, c in enumerate(adj) if c == "-" and adj[:i] in known]
            families.setdefault(roots[0] if roots else adj, []).append(adj)
        self._blocks: list[str | list[str]] = []  # a root (lone adjective) or a family's sorted strings
        self._starts = [0]
        for root in sorted(families, key=lambda r: r + "-"):
            members = families[root]
            if len(members) == 1:
                self._blocks.append(root)
                size = len(self._nouns)
            else:
                block = sorted({f"{m}-{n}" for m in members for n in self._nouns})
                self._blocks.append(block)
                size = len(block)
            self._starts.append(self._starts[-1] + size)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> str:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        b = bisect_right(self._starts, i) - 1
        block, offset = self._blocks[b], i - self._starts[b]
        return block[offset] if isinstance(block, list) else f"{block}-{self._nouns[offset]}"


_WORD_CACHE: dict[str, Any] = {}


def _needle_words() -> _AdjectiveNounKeys:
    if "keys" not in _WORD_CACHE:
        _WORD_CACHE["keys"] = _AdjectiveNounKeys(_wonderwords("adjectivelist.txt"), _wonderwords("nounlist.txt"))
    return _WORD_CACHE["keys"]


def _common_words() -> list[str]:
    """cwe's words: wonderwords' nouns, adjectives and verbs, sorted without duplicates (RULER then shuffles
    them with ``random.Random(seed)``)."""
    if "cwe" not in _WORD_CACHE:
        _WORD_CACHE["cwe"] = sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                                        + _wonderwords("verblist.txt")))
    return list(_WORD_CACHE["cwe"])


# ---------------------------------------------------------------------------------------------
# Needle in a haystack (RULER's niah.py)

_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."


def _depths() -> list[int]:
    """RULER's 40 needle depths (percent): 0..100 evenly spaced, rounded."""
    import numpy as np

    return [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


def _sentences(text: str) -> tuple[list[str], str]:
    """The text's sentences and the splitter's name: nltk's punkt when installed with its data (RULER's
    ``sent_tokenize``), else a plain rule."""
    try:
        from nltk.tokenize import sent_tokenize

        return sent_tokenize(text), "nltk-punkt"
    except (ImportError, LookupError):
        return [s for s in re.split(r"(?<=[.!?])\s+", text) if s], "regex"


def _splitter_name() -> str:
    return _sentences("A b. C d.")[1]


def _niah(task: Task, count, length: int, samples: int, seed: int, haystack: str | None) -> list[Sample]:
    a = task.args
    kind = a["type_haystack"]
    num_q, num_v = a["num_needle_q"], a["num_needle_v"]
    num_k = max(a["num_needle_k"], num_q)
    rng = _Draws(seed)
    words = _needle_words() if "words" in (a["type_needle_k"], a["type_needle_v"]) else None
    if kind == "essay":
        if haystack is None:
            raise ValueError(f"{task.name} hides its needles in essays: give a haystack text")
        essay_words = re.sub(r"\s+", " ", haystack).split(" ")
        depths = _depths()

    def draw(kind_of: str) -> str:
        if kind_of == "numbers":
            return str(rng.py.randint(10**6, 10**7 - 1))
        if kind_of == "words":
            return rng.py.choice(words)
        return str(uuid.UUID(int=rng.py.getrandbits(128), version=4))

    template = task.template + task.answer_prefix
    type_v = a["type_needle_v"]
    if num_q * num_v == 1:  # RULER's singular wording
        for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(plural, singular)
        type_v = type_v[:-1]

    def make(n: int) -> tuple[str, list[str]]:
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(draw(a["type_needle_k"]))
            values.append([])
            for _ in range(num_v):
                values[-1].append(draw(a["type_needle_v"]))
                needles.append(_NEEDLE.format(type_needle_v=a["type_needle_v"], key=keys[-1], value=values[-1][-1]))
        rng.shuffled(needles)
        if kind == "essay":
            if n <= len(essay_words):
                text = " ".join(essay_words[:n])
            else:
                text = " ".join((essay_words * ((n + len(essay_words) - 1) // len(essay_words)))[:n])
            sents = _sentences(text.strip())[0]
            cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in rng.py.sample(depths, len(needles))) + [len(sents)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        else:
            if kind == "noise":
                lines = [_NOISE] * n
            else:  # "needle": distractor needles, each with a fresh key, then a fresh value
                lines = []
                for _ in range(n):
                    key = draw(a["type_needle_k"])
                    lines.append(_NEEDLE.format(type_needle_v=a["type_needle_v"], key=key,
                                                value=draw(a["type_needle_v"])))
            for at, needle in zip(sorted(rng.py.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(at, needle)
            context = "\n".join(lines)
        asked = rng.py.sample(range(num_k), num_q)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return template.format(type_needle_v=type_v, context=context, query=query), answers

    step = 500 if kind == "essay" else (5 if length < 4096 else 25)
    per_unit = count(make(step)[0]) / step
    return _fitted_samples(task, make, count, length, samples, step, max(int((length / per_unit) * 3), step * 2))


# ---------------------------------------------------------------------------------------------
# Variable tracking (RULER's variable_tracking.py)


def _vt(task: Task, count, length: int, samples: int, seed: int, haystack: str | None) -> list[Sample]:
    chains_n, hops = task.args["num_chains"], task.args["num_hops"]
    ttg = task.tokens_to_generate
    template = task.template + task.answer_prefix
    rng = _Draws(seed)

    def chains(example: bool) -> tuple[list[list[str]], list[list[str]]]:
        letters = 3 if example else 5
        n_hops = min(10, hops) if example else hops
        need = (n_hops + 1) * chains_n

        def name() -> str:
            return "".join(rng.py.choices(string.ascii_uppercase, k=letters)).upper()

        names = [name() for _ in range(need)]
        while len(set(names)) < need:  # RULER draws more names until enough are distinct...
            names.append(name())
        names_out, chains_out = [], []
        for c in range(0, len(names), n_hops + 1):  # ...then cuts all of them, duplicates kept, into chains
            these = names[c:c + n_hops + 1]
            value = "12345" if example else str(rng.np.randint(10000, 99999))
            if len(these) < n_hops + 1:  # RULER's IndexError, after the value's draw
                raise _RulerIndexError(f"{task.name}: a variable name was drawn twice (seed {seed})")
            chain = [f"VAR {these[0]} = {value}"] + [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(n_hops)]
            names_out.append(these)
            chains_out.append(chain)
        return names_out, chains_out

    def make(noises: int, example: bool) -> tuple[str, list[str]]:
        names, all_chains = chains(example)
        value = all_chains[0][0].split("=")[-1].strip()
        lines = [_NOISE] * noises
        for chain in all_chains:
            at = sorted(rng.py.sample(range(len(lines)), len(chain)))
            for j, (pos, line) in enumerate(zip(at, chain)):
                lines.insert(pos + j, line)
        context = "\n".join(lines).replace(". \n", ".\n")
        return template.format(context=context, query=value, num_v=hops + 1), names[0]

    def randomized(example: str) -> str:
        """RULER's ``randomize_icl``: the example's answer names and its value replaced by fresh ones."""
        for old in example.strip().split()[-hops - 1:]:
            example = example.replace(old, "".join(rng.py.choices(string.ascii_uppercase, k=len(old))).upper())
        return example.replace("12345", str(rng.np.randint(10000, 99999)))

    def crashes(where: str):
        return ValueError(
            f"{task.name}: with seed {seed} RULER's script draws a variable name twice while it sizes {where} "
            "(an IndexError in its generate_chains, outside the sample loop that would catch it): RULER crashes "
            "there and writes no prompts, so none are made here; pick another seed")

    # The one-shot example: the same task with 3-letter names and value 12345, fitted to 500 tokens.
    ex_step, ex_len = 5, 500
    try:
        per_unit = count(make(ex_step, True)[0]) / ex_step
        upper = max(int((ex_len / per_unit) * 3), ex_step * 2)
        ex_size = _search(lambda n: count(make(n, True)[0]) <= ex_len, ex_step, upper) or ex_step
    except _RulerIndexError:
        raise crashes("the one-shot example") from None
    ex_text, ex_names = _draw_fitting(lambda n: make(n, True), lambda made: count(made[0]) <= ex_len, ex_size,
                                      ex_step, task.name, f"RULER's one-shot example does not fit its {ex_len} "
                                      "tokens with this tokenizer (a character-level one, say)")
    example = ex_text + " " + " ".join(ex_names) + "\n"
    example_tokens = count(example)

    step = 5 if length < 4096 else 10
    try:
        per_unit = count(make(step, False)[0]) / step
        upper = max(int((length / per_unit) * 3), step * 2)
        size = _search(lambda n: count(make(n, False)[0]) + example_tokens + ttg <= length, step, upper) or step
    except _RulerIndexError:
        raise crashes(f"the haystack at {length} tokens") from None
    cut_at = task.template[:20]

    def draw(n: int) -> tuple[str, list[str]]:
        text, names = make(n, False)
        cut = text.index(cut_at)
        return text[:cut] + randomized(example) + "\n" + text[cut:], names

    out = []
    for index in range(samples):
        text, names = _draw_fitting(draw, lambda made: count(made[0]) + ttg <= length, size, step, task.name)
        body, prefix = _split_prefix(text, task.answer_prefix)
        out.append(Sample(task.name, length, index, body, prefix, tuple(names), count(text)))
    return out


# ---------------------------------------------------------------------------------------------
# Common words extraction (RULER's common_words_extraction.py)


def _cwe(task: Task, count, length: int, samples: int, seed: int, haystack: str | None) -> list[Sample]:
    a = task.args
    num_cw = a["num_cw"]
    template = task.template + task.answer_prefix
    rng = _Draws(seed)
    words = rng.shuffled(_common_words())

    def example(n_words: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        if n_words > len(words):
            raise ValueError(
                f"{task.name} at {length} tokens needs more than the {len(words)} words of wonderwords' lists "
                "(RULER then draws from its english_words.json, which ropescale does not ship)")
        chosen = rng.py.sample(words, n_words)
        common, uncommon = chosen[:num_cw], chosen[num_cw:]
        listed = rng.shuffled(common * common_repeats + uncommon * uncommon_repeats)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common

    def make(n_words: int) -> tuple[str, list[str]]:
        if length < 4096:  # RULER's short-context setting: a 20-word example, the common words 6 times
            shot = example(20, 3, 1)
            context, answer = example(n_words, 6, 1)
        else:
            shot = example(40, 10, 3)
            context, answer = example(n_words, a["freq_cw"], a["freq_ucw"])
        shot_text = (template.format(num_cw=num_cw, context=shot[0], query="") + " "
                     + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot[1])))
        return shot_text + "\n" + template.format(num_cw=num_cw, context=context, query=""), answer

    step = 10
    per_word = count(make(4096)[0]) / 4096
    return _fitted_samples(task, make, count, length, samples, step, max(int(length // per_word) * 2, step * 2))


# ---------------------------------------------------------------------------------------------
# Frequent words extraction (RULER's freq_words_extraction.py)


def _zeta(s: float) -> float:
    """Riemann zeta(s), s > 1 (RULER: scipy.special.zeta): pi^2/6 exactly at 2, else Euler-Maclaurin
    (relative error below 1e-15)."""
    if s == 2.0:
        return math.pi ** 2 / 6
    if not s > 1:
        raise ValueError(f"fwe: alpha must be > 1, got {s}")
    n = 20
    total = math.fsum(k ** -s for k in range(1, n))
    # tail from n: integral + half term + Bernoulli corrections
    tail = n ** (1 - s) / (s - 1) + 0.5 * n ** -s
    bernoulli = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730)
    rising, factorial = s, 2.0
    for j, b in enumerate(bernoulli):
        tail += b / factorial * rising * n ** (-s - 2 * j - 1)
        rising *= (s + 2 * j + 1) * (s + 2 * j + 2)
        factorial *= (2 * j + 3) * (2 * j + 4)
    return total + tail


def _fwe(task: Task, count, length: int, samples: int, seed: int, haystack: str | None) -> list[Sample]:
    import numpy as np

    alpha, word_len = float(task.args["alpha"]), 6
    ttg = task.tokens_to_generate
    template = task.template + task.answer_prefix
    budget = length - ttg
    vocab_size = budget // 50
    if vocab_size < 4:
        raise ValueError(f"{task.name}: the length is too short (RULER's vocabulary is (length - {ttg}) // 50 "
                         "words, and 3 of them are the answer)")
    rng = _Draws(seed)
    step = budget // 32
    z = _zeta(alpha)

    def make(n_words: int, vocab: list[str]) -> tuple[str, list[str]]:
        ranks = np.arange(1, len(vocab) + 1)
        counts = (n_words * (ranks ** -alpha) / z).astype(int)
        text = [w for word, c in zip(vocab, counts) for w in [word] * c]
        rng.shuffled(text)
        return template.format(context=" ".join(text), query=""), vocab[1:4]

    def generated(n_words: int) -> tuple[str, list[str], int]:
        vocab = ["".join(rng.py.choices(string.ascii_lowercase, k=word_len)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.py.choices(string.ascii_lowercase, k=word_len)))
        vocab = rng.shuffled(sorted(set(vocab)))
        vocab[0] = "..."  # the most frequent word is noise
        if n_words > 0:  # shrink until it fits
            text, _ = make(n_words, vocab)
            while count(text) > budget:
                if n_words <= 0:  # (RULER would shrink forever)
                    raise ValueError(f"{task.name}: the length is too short for even the smallest prompt")
                n_words -= step
                text, _ = make(n_words, vocab)
        else:  # grow past the budget, then one step back
            n_words = budget // word_len
            text, _ = make(n_words, vocab)
            while count(text) < budget:
                n_words += step
                text, _ = make(n_words, vocab)
            n_words -= step
        text, answer = make(n_words, vocab)
        return text, answer, n_words

    n_words = generated(-1)[2]
    out = []
    for index in range(samples):
        text, answer, _ = generated(n_words)
        body, prefix = _split_prefix(text, task.answer_prefix)
        out.append(Sample(task.name, length, index, body, prefix, tuple(answer), count(text)))
    return out


_GENERATORS = {"niah": _niah, "variable_tracking": _vt, "common_words_extraction": _cwe,
               "freq_words_extraction": _fwe}


# ---------------------------------------------------------------------------------------------
# Generation with caches


_MEMORY: dict[str, list[Sample]] = {}
_IDENTITIES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def clear_cache() -> None:
    """Forget the prompts generated in this process (the files of a ``cache_dir`` stay)."""
    _MEMORY.clear()


def _tokenizer_identity(tokenizer: Any) -> str:
    """A digest of what decides token counts: the fast tokenizer's whole definition, else the vocabulary."""
    try:
        return _IDENTITIES[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        payload = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    else:
        payload = repr(tokenizer)
    digest = hashlib.sha256(f"{type(tokenizer).__name__}\n{payload}".encode()).hexdigest()
    try:
        _IDENTITIES[tokenizer] = digest
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return digest


def _cache_key(task: Task, tokenizer: Any, length: int, samples: int, seed: int, haystack: str | None) -> str:
    key = {"version": _GENERATOR_VERSION, "task": task.name, "family": task.family, "args": dict(task.args),
           "template": task.template, "answer_prefix": task.answer_prefix, "length": length, "samples": samples,
           "seed": seed, "tokenizer": _tokenizer_identity(tokenizer)}
    if task.needs_haystack:
        key["haystack"] = hashlib.sha256((haystack or "").encode()).hexdigest()
        key["splitter"] = _splitter_name()
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _read_cached(path: Path, key: str) -> list[Sample] | None:
    try:
        with open(path, encoding="utf-8") as f:
            header = json.loads(f.readline())
            if header.get("key") != key:
                return None
            rows = [json.loads(line) for line in f if line.strip()]
        samples = [Sample(**{**row, "references": tuple(row["references"])}) for row in rows]
    except (OSError, ValueError, TypeError, KeyError):  # missing, cut short or foreign: generated again
        return None
    return samples if len(samples) == header.get("samples") else None


def _write_cached(path: Path, key: str, samples: list[Sample]) -> None:
    """The prompts as one JSONL file, whole or not at all (even if interrupted), with the user's umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as part, open(part, "w", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "samples": len(samples)}) + "\n")
        for s in samples:
            f.write(json.dumps(dataclasses.asdict(s), ensure_ascii=False) + "\n")


def _generate_uncached(task: Task, tokenizer: Any, length: int, samples: int, seed: int,
                       haystack: str | None) -> list[Sample]:
    if length <= task.tokens_to_generate:
        raise ValueError(f"{task.name}: the length ({length}) must exceed the {task.tokens_to_generate} tokens "
                         "the answer may take")
    return _GENERATORS[task.family](task, _token_counter(tokenizer), length, samples, seed, haystack)


def generate(task: str, tokenizer: Any, length: int, samples: int = 5, seed: int = 42, *,
             haystack: str | None = None, cache_dir: str | Path | None = None) -> list[Sample]:
    """``samples`` prompts of RULER task ``task`` whose prompt (counted with ``tokenizer`` as RULER does)
    plus the task's ``tokens_to_generate`` fits ``length`` tokens, in RULER's base template (the task
    template then the answer prefix). ``haystack``: the essay text of the essay tasks.

    Generated once per (task, length, samples, seed, tokenizer, haystack) in a process, and, with
    ``cache_dir``, once on disk (one JSONL file per key there, read back by later runs)."""
    spec = _task(task)
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if spec.needs_haystack and haystack is None:
        raise ValueError(f"{task} hides its needles in essays: give a haystack text (RULER uses Paul Graham's)")
    key = _cache_key(spec, tokenizer, length, samples, seed, haystack if spec.needs_haystack else None)
    if key in _MEMORY:
        return list(_MEMORY[key])
    path = Path(cache_dir) / f"{task}-{length}-{key[:16]}.jsonl" if cache_dir is not None else None
    made = _read_cached(path, key) if path is not None else None
    if made is None:
        made = _generate_uncached(spec, tokenizer, length, samples, seed, haystack if spec.needs_haystack else None)
        if path is not None:
            try:
                _write_cached(path, key, made)
            except OSError as err:  # a full disk, say: the prompts are made, the run goes on without keeping them
                warnings.warn(f"RULER prompt cache: cannot write {path}: {err.strerror or err}; the prompts are "
                              "used, not kept", RuntimeWarning, stacklevel=2)
    _MEMORY[key] = made
    return list(made)


# ---------------------------------------------------------------------------------------------
# Scoring (RULER's scripts/eval)


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: stripped, control characters turned into newlines, stripped again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric of the synthetic tasks: per prediction the fraction of its references it contains
    (case-insensitive), averaged, x 100, rounded to 2 decimals."""
    per = [sum(r.lower() in p.lower() for r in refs) / len(refs) for p, refs in zip(predictions, references)]
    return round(sum(per) / len(predictions) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's metric of its QA tasks: per prediction 1 when it contains any of its references."""
    per = [max(float(r.lower() in p.lower()) for r in refs) for p, refs in zip(predictions, references)]
    return round(sum(per) / len(predictions) * 100, 2)


def effective_length(averages: Mapping[int, float], threshold: float = THRESHOLD) -> int | None:
    """The longest length whose average exceeds ``threshold`` with every shorter length's average above it
    too (RULER's effective length); None when the shortest length does not pass."""
    best = None
    for length in sorted(averages):
        if not averages[length] > threshold:  # NaN fails too
            break
        best = length
    return best


# ---------------------------------------------------------------------------------------------
# The runner


@dataclass(frozen=True)
class SampleResult:
    index: int
    prompt_tokens: int  #: tokens fed to the model (with the tokenizer's special tokens)
    references: tuple[str, ...]
    prediction: str  #: the greedy answer, decoded and post-processed as RULER does
    score: float  #: the fraction of references found, x 100


@dataclass(frozen=True)
class TaskScore:
    task: str
    length: int
    score: float  #: string_match_all over the samples (0..100)
    samples: tuple[SampleResult, ...] = ()


@dataclass(frozen=True)
class RulerResult:
    """Scores per task and length, the average per length and the effective length."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    seed: int
    results: tuple[TaskScore, ...] = field(default=())
    threshold: float = THRESHOLD

    def score(self, task: str, length: int) -> float:
        return next(r.score for r in self.results if r.task == task and r.length == length)

    @property
    def scores(self) -> dict[str, dict[int, float]]:
        return {t: {n: self.score(t, n) for n in self.lengths} for t in self.tasks}

    @property
    def averages(self) -> dict[int, float]:
        return {n: sum(self.score(t, n) for t in self.tasks) / len(self.tasks) for n in self.lengths}

    @property
    def effective_length(self) -> int | None:
        return effective_length(self.averages, self.threshold)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: lengths as keys are strings."""
        return {
            "tasks": list(self.tasks), "lengths": list(self.lengths), "samples": self.samples, "seed": self.seed,
            "template": "base", "threshold": self.threshold, "effective_length": self.effective_length,
            "scores": {t: {str(n): s for n, s in by.items()} for t, by in self.scores.items()},
            "average": {str(n): s for n, s in self.averages.items()},
            "results": [{"task": r.task, "length": r.length, "score": r.score,
                         "samples": [{**dataclasses.asdict(s), "references": list(s.references)}
                                     for s in r.samples]} for r in self.results],
        }


def _check_tasks(tasks: Sequence[str], haystack: str | None) -> tuple[str, ...]:
    tasks = tuple(tasks)
    if not tasks:
        raise ValueError("no RULER task given")
    for name in tasks:
        if _task(name).needs_haystack and haystack is None:
            raise ValueError(f"{name} hides its needles in essays: give a haystack text")
    wordy = [name for name in tasks if TASKS[name].needs_wonderwords]
    if wordy:
        try:
            _wonderwords("verblist.txt")
        except WonderwordsMissing:
            raise WonderwordsMissing(f"{', '.join(wordy)} draw words from the wonderwords package's lists: "
                                     f"{WONDERWORDS_INSTALL} (or leave them out of tasks)") from None
    return tuple(dict.fromkeys(tasks))


def run(model: Any, tokenizer: Any, tasks: Sequence[str] = DEFAULT_TASKS, lengths: Sequence[int] = (4096,),
        samples: int = 5, seed: int = 42, *, haystack: str | None = None, cache_dir: str | Path | None = None,
        progress: bool = False) -> RulerResult:
    """RULER on a causal LM: for every length and task, ``samples`` prompts (``generate``, cached), each
    answered greedily with the task's ``tokens_to_generate`` tokens (or up to EOS; the base template: the
    model continues the answer prefix) and scored with ``string_match_all``. ``progress``: a bar over the
    answers with the time left."""
    from .evaluate import _encode, _greedy

    tasks = _check_tasks(tasks, haystack)
    lengths = tuple(dict.fromkeys(int(n) for n in lengths))
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be positive, got {list(lengths)}")
    if cache_dir is not None:  # before any work, not after the first task's prompts
        check_writable_directory(cache_dir, "cache_dir")
    eos = getattr(tokenizer, "eos_token_id", None)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks) * len(lengths) * samples, desc="ruler", unit="answer")
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    results = []
    try:
        for length in lengths:
            for name in tasks:
                if bar is not None:
                    bar.set_description(f"{name}@{length} prompts")
                made = generate(name, tokenizer, length, samples, seed, haystack=haystack, cache_dir=cache_dir)
                if bar is not None:
                    bar.set_description(f"{name}@{length}")
                done = []
                for s in made:
                    ids = _encode(tokenizer, s.prompt)
                    new = _greedy(model, ids, TASKS[name].tokens_to_generate, eos)
                    prediction = postprocess(tokenizer.decode(new, skip_special_tokens=True))
                    done.append(SampleResult(s.index, len(ids), s.references, prediction,
                                             string_match_all([prediction], [s.references])))
                    if bar is not None:
                        bar.update()
                score = string_match_all([d.prediction for d in done], [d.references for d in done])
                results.append(TaskScore(name, length, score, tuple(done)))
    finally:
        if bar is not None:
            bar.close()
        if hasattr(model, "train"):
            model.train(was_training)
    return RulerResult(tasks, lengths, samples, seed, tuple(results))
