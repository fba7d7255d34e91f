"""RULER's tasks, declared once (:mod:`ropescale.ruler`): each task's family, template, answer prefix and
arguments, and a generated sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


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


def find_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; the tasks are: {', '.join(TASKS)}")
    return TASKS[name]


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
