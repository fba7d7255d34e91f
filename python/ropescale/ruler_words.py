"""RULER's word lists (:mod:`ropescale.ruler`): wonderwords' lists read as RULER reads them, its needle keys and
cwe's words, cached per process."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Iterable, Sequence


WONDERWORDS_INSTALL = "pip install wonderwords==3.0.1"


class WonderwordsMissing(ImportError):
    """A task that draws words from the ``wonderwords`` package's lists, which is not installed."""

def wonderwords_list(name: str) -> list[str]:
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


class AdjectiveNounKeys(Sequence):
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


WORD_CACHE: dict[str, Any] = {}


def needle_words() -> AdjectiveNounKeys:
    if "keys" not in WORD_CACHE:
        WORD_CACHE["keys"] = AdjectiveNounKeys(wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt"))
    return WORD_CACHE["keys"]


def common_words() -> list[str]:
    """cwe's words: wonderwords' nouns, adjectives and verbs, sorted without duplicates (RULER then shuffles
    them with ``random.Random(seed)``)."""
    if "cwe" not in WORD_CACHE:
        WORD_CACHE["cwe"] = sorted(set(wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt")
                                        + wonderwords_list("verblist.txt")))
    return list(WORD_CACHE["cwe"])
