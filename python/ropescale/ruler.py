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

By role: the tasks in :mod:`ropescale.ruler_tasks`, the word lists in :mod:`ropescale.ruler_words`, the task
generators in :mod:`ropescale.ruler_generators`, the scoring in :mod:`ropescale.ruler_scoring` (their public names
re-exported here); the prompt cache, the runner and its result tables here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .files import atomic_file, check_writable_directory
from .ruler_generators import GENERATORS, splitter_name, token_counter
from .ruler_scoring import THRESHOLD, effective_length, postprocess, string_match_all, string_match_part
from .ruler_tasks import DEFAULT_TASKS, ESSAY_TASKS, TASKS, Sample, Task, find_task
from .ruler_words import WONDERWORDS_INSTALL, WonderwordsMissing, wonderwords_list

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

#: Bumped whenever a generator changes what it writes: cached prompts of another version are not read.
_GENERATOR_VERSION = 2  # 2: vt redraws or refuses where RULER's name draw repeats

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
        key["splitter"] = splitter_name()
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
    return GENERATORS[task.family](task, token_counter(tokenizer), length, samples, seed, haystack)


def generate(task: str, tokenizer: Any, length: int, samples: int = 5, seed: int = 42, *,
             haystack: str | None = None, cache_dir: str | Path | None = None) -> list[Sample]:
    """``samples`` prompts of RULER task ``task`` whose prompt (counted with ``tokenizer`` as RULER does)
    plus the task's ``tokens_to_generate`` fits ``length`` tokens, in RULER's base template (the task
    template then the answer prefix). ``haystack``: the essay text of the essay tasks.

    Generated once per (task, length, samples, seed, tokenizer, haystack) in a process, and, with
    ``cache_dir``, once on disk (one JSONL file per key there, read back by later runs)."""
    spec = find_task(task)
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
        if find_task(name).needs_haystack and haystack is None:
            raise ValueError(f"{name} hides its needles in essays: give a haystack text")
    wordy = [name for name in tasks if TASKS[name].needs_wonderwords]
    if wordy:
        try:
            wonderwords_list("verblist.txt")
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
    from .evaluate import encode_text, greedy_tokens

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
                    ids = encode_text(tokenizer, s.prompt)
                    new = greedy_tokens(model, ids, TASKS[name].tokens_to_generate, eos)
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
