"""RULER's task generators (:mod:`ropescale.ruler`), as RULER's ``scripts/data`` makes its prompts: the random
sources, the haystack search and sample loop, and one generator per task family (niah, vt, cwe, fwe)."""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from typing import Any, Callable

from .ruler_tasks import Sample, Task
from .ruler_words import common_words, needle_words


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


def token_counter(tokenizer: Any) -> Callable[[str], int]:
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


def splitter_name() -> str:
    return _sentences("A b. C d.")[1]


def _niah(task: Task, count, length: int, samples: int, seed: int, haystack: str | None) -> list[Sample]:
    a = task.args
    kind = a["type_haystack"]
    num_q, num_v = a["num_needle_q"], a["num_needle_v"]
    num_k = max(a["num_needle_k"], num_q)
    rng = _Draws(seed)
    words = needle_words() if "words" in (a["type_needle_k"], a["type_needle_v"]) else None
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
    words = rng.shuffled(common_words())

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


def zeta(s: float) -> float:
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
    z = zeta(alpha)

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


GENERATORS = {"niah": _niah, "variable_tracking": _vt, "common_words_extraction": _cwe,
               "freq_words_extraction": _fwe}
