"""ropescale.ruler and ``ropescale eval ruler``: RULER's synthetic tasks generated as RULER generates them, scored
as RULER scores them, the effective-length rule, the runner and its prompt cache, and the command.

The generator tests use a word-level tokenizer built here (one token per run of letters and digits or of
punctuation: identical on every machine, and close to a real tokenizer's counts, which a character tokenizer is
not: vt's 500-token one-shot example cannot fit in 500 characters). The pinned digests are those of RULER's own
scripts (NVIDIA/RULER c3f5e3b, ``scripts/data/synthetic/*.py`` run with this tokenizer, RULER's base template and
its synthetic.yaml arguments, seed 42) and of ropescale's generator alike: a change on any machine shows.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import re
import string
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from ropescale import cli, evaluate, ruler, ruler_generators, ruler_words  # noqa: E402
from support.tiny_lm import char_tokenizer, tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
UUID4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def word_tokenizer():
    """Words and punctuation runs (``tokenizers``' Whitespace pre-tokenizer: ``\\w+|[^\\w\\s]+``), one token each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(string.digits + string.ascii_letters) + ["The", "special", "magic", "number", "for", "is", ":", ".",
                                                          ",", "VAR", "=", "Answer"]
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(words))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(autouse=True)
def fresh_prompt_cache():
    ruler.clear_cache()
    yield
    ruler.clear_cache()


def needs_words(task):
    if ruler.TASKS[task].needs_wonderwords:
        pytest.importorskip("wonderwords")


def count(tok, text):
    return len(tok.tokenize(text))


# ---------------------------------------------------------------------------------------------
# The declared tasks are RULER's


def test_tasks_are_rulers_synthetic_yaml_and_constants():
    assert ruler.DEFAULT_TASKS == ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")
    assert ruler.ESSAY_TASKS == ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
                                 "niah_multiquery")
    t = ruler.TASKS
    assert {name: t[name].tokens_to_generate for name in ruler.DEFAULT_TASKS} == {
        "niah_single_1": 128, "niah_multikey_2": 128, "niah_multikey_3": 128, "vt": 30, "cwe": 120, "fwe": 50}
    assert (t["niah_single_1"].args["type_haystack"], t["niah_multikey_2"].args["type_haystack"],
            t["niah_multikey_3"].args["type_haystack"]) == ("noise", "needle", "needle")
    assert (t["niah_multikey_3"].args["type_needle_k"], t["niah_multikey_3"].args["type_needle_v"]) == ("uuids",
                                                                                                        "uuids")
    assert dict(t["vt"].args) == {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}
    assert dict(t["cwe"].args) == {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}
    assert dict(t["fwe"].args) == {"alpha": 2.0}
    assert [name for name in ruler.TASKS if ruler.TASKS[name].needs_wonderwords] == [
        "niah_single_1", "niah_multikey_2", "cwe", *ruler.ESSAY_TASKS]


# ---------------------------------------------------------------------------------------------
# Each task's samples follow RULER's rules

LENGTHS = [1000, 4096]  # RULER's short-context settings below 4096, its standard ones from there


def sample_checks(tok, s, length):
    """What every sample satisfies: the prompt is input + answer prefix, counted as RULER counts, and fits."""
    task = ruler.TASKS[s.task]
    assert s.prompt == s.input + s.answer_prefix and s.length == length
    assert s.tokens == count(tok, s.prompt)
    assert s.tokens <= length - task.tokens_to_generate
    return length - task.tokens_to_generate - s.tokens  # the gap left


def one_more_line_exceeds(tok, s, line, budget):
    """The prompt with one more haystack line (after the first line of the context) no longer fits."""
    head, rest = s.prompt.split("\n", 1)
    first, rest = rest.split("\n", 1)
    assert count(tok, "\n".join([head, first, line, rest])) > budget


NEEDLE_LINE = re.compile(r"^One of the special magic (numbers|uuids) for (.+) is: ([0-9a-f-]+)\.$")


def niah_parts(s, unit):
    """(key, context lines) of a noise/needle niah sample, after checking RULER's singular template around them."""
    head = (f"A special magic {unit} is hidden within the following text. Make sure to memorize it. I will quiz you "
            f"about the {unit} afterwards.\n")
    key = re.fullmatch(rf" The special magic {unit} for (.+) mentioned in the provided text is", s.answer_prefix)
    assert key, s.answer_prefix
    key = key.group(1)
    question = f"\nWhat is the special magic {unit} for {key} mentioned in the provided text?"
    assert s.input.startswith(head) and s.input.endswith(question)
    return key, s.input[len(head):-len(question)].split("\n")


def is_word_key(key):
    from wonderwords import random_word

    adjectives = set(random_word._get_words_from_text_file("adjectivelist.txt"))
    nouns = set(random_word._get_words_from_text_file("nounlist.txt"))
    return any(key.startswith(a + "-") and key[len(a) + 1:] in nouns for a in adjectives)


@pytest.mark.parametrize("length", LENGTHS)
def test_niah_single_1_one_needle_in_noise(tok, length):
    needs_words("niah_single_1")
    samples = ruler.generate("niah_single_1", tok, length, 3)
    for s in samples:
        gap = sample_checks(tok, s, length)
        key, lines = niah_parts(s, "number")
        (value,) = s.references
        assert re.fullmatch(r"[1-9]\d{6}", value) and is_word_key(key)
        assert [line for line in lines if line != NOISE] == [f"One of the special magic numbers for {key} is: {value}."]
        assert s.input.count(value) == 1
        # the largest noise haystack that fits: one more sentence does not
        one_more_line_exceeds(tok, s, NOISE, length - 128)
        assert gap < count(tok, NOISE)
    assert len({s.references for s in samples}) == 3  # a fresh key and number per sample


@pytest.mark.parametrize("length", LENGTHS)
def test_niah_multikey_2_needle_among_distractor_needles(tok, length):
    needs_words("niah_multikey_2")
    samples = ruler.generate("niah_multikey_2", tok, length, 3)
    gaps = []
    for s in samples:
        gaps.append(sample_checks(tok, s, length))
        key, lines = niah_parts(s, "number")
        parsed = [NEEDLE_LINE.match(line) for line in lines]
        assert all(parsed) and {p.group(1) for p in parsed} == {"numbers"}
        assert all(is_word_key(p.group(2)) and re.fullmatch(r"[1-9]\d{6}", p.group(3)) for p in parsed)
        # the asked key is in exactly one needle, whose number is the reference
        assert [p.group(3) for p in parsed if p.group(2) == key] == list(s.references)
        assert len({p.group(2) for p in parsed}) > len(lines) - 3  # the others are distractors with fresh keys
    # Distractor needles differ in length, so RULER's search (a fresh draw per probe) lands within a needle or
    # two of the budget, and a draw that does not fit is shrunk by RULER's step (5 needles, 25 from 4096).
    longest = max(count(tok, line) for s in samples for line in s.input.split("\n")[1:-1])
    assert min(gaps) < 2 * longest
    assert max(gaps) < (5 if length < 4096 else 25) * longest


@pytest.mark.parametrize("length", LENGTHS)
def test_niah_multikey_3_uuid_needles(tok, length):
    for s in ruler.generate("niah_multikey_3", tok, length, 3):
        gap = sample_checks(tok, s, length)
        key, lines = niah_parts(s, "uuid")
        parsed = [NEEDLE_LINE.match(line) for line in lines]
        assert all(parsed) and {p.group(1) for p in parsed} == {"uuids"}
        assert all(re.fullmatch(UUID4, p.group(2)) and re.fullmatch(UUID4, p.group(3)) for p in parsed)
        assert [p.group(3) for p in parsed if p.group(2) == key] == list(s.references)
        # every uuid line has the same tokens here: the largest haystack, to the line
        one_more_line_exceeds(tok, s, lines[0], length - 128)
        assert gap < count(tok, lines[0])


def resolve_chains(lines):
    """{variable: value} from 'VAR X = 12345' and 'VAR Y = VAR X ' lines, in order."""
    direct = {}
    for line in lines:
        m = re.fullmatch(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+) ?", line)
        if m:
            direct[m.group(1)] = m.group(2)
    resolved = {}
    for var in direct:
        seen, value = set(), direct[var]
        while value.startswith("VAR "):
            assert value not in seen
            seen.add(value)
            value = direct[value[4:]]
        resolved[var] = value
    return direct, resolved


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_chain_resolves_to_the_references(tok, length):
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    for s in ruler.generate("vt", tok, length, 3):
        gap = sample_checks(tok, s, length)
        # the one-shot example (3-letter names, its answer given), then the task (5-letter names)
        assert s.input.count(head) == 2 and s.input.startswith(head)
        example, task = s.input[len(head):].split(head)
        value = re.fullmatch(r" Answer: According to the chain\(s\) of variable assignment in the text above, 5 "
                             r"variables are assigned the value (\d{5}), they are: ", s.answer_prefix).group(1)
        assert task.endswith(f"\nQuestion: Find all variables that are assigned the value {value} in the text above.")
        body = task[:task.index("\nQuestion: ")].split("\n")
        direct, resolved = resolve_chains(body)
        assert [line for line in body if not line.startswith("VAR ")] == [NOISE] * (len(body) - 5)
        assert sorted(v for v in resolved if resolved[v] == value) == sorted(s.references)
        # the references in chain order: the first is assigned the number, each next one the previous
        refs = s.references
        assert len(refs) == 5 and all(re.fullmatch("[A-Z]{5}", r) for r in refs)
        assert direct[refs[0]] == value and all(direct[refs[i + 1]] == f"VAR {refs[i]}" for i in range(4))
        # the example answers its own question: its 5 names are those assigned its value
        question, names = example.rstrip("\n").rsplit("they are: ", 1)
        ex_value = re.search(r"assigned the value (\d{5}) in the text above", question).group(1)
        ex_names = names.split()
        ex_lines = question[:question.index("\nQuestion: ")].split("\n")
        assert sorted(v for v, x in resolve_chains(ex_lines)[1].items() if x == ex_value) == sorted(ex_names)
        assert len(ex_names) == 5 and all(re.fullmatch("[A-Z]{3}", n) for n in ex_names)
        # the largest noise that fits: one more sentence does not
        lines = task.split("\n")
        longer = head + example + head + "\n".join([lines[0], NOISE, *lines[1:]]) + s.answer_prefix
        assert count(tok, longer) > length - 30
        assert gap < count(tok, NOISE)


def numbered(context):
    """The words of a '1. w 2. w ...' list, after checking the numbering."""
    parts = re.split(r"(?:^| )(\d+)\. ", context)
    assert parts[0] == ""
    numbers, words = parts[1::2], parts[2::2]
    assert numbers == [str(i + 1) for i in range(len(numbers))]
    return words


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_answers_are_the_most_common_words(tok, length):
    needs_words("cwe")
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")
    question = "\nQuestion: What are the 10 most common words in the above list?"
    common, uncommon = (30, 3) if length >= 4096 else (6, 1)  # RULER's settings for short contexts: 6 and 1
    shot_common, shot_uncommon = (10, 3) if length >= 4096 else (3, 1)
    gaps = []
    for s in ruler.generate("cwe", tok, length, 3):
        gaps.append(sample_checks(tok, s, length))
        assert s.answer_prefix == " Answer: The top 10 words that appear most often in the list are:"
        shot, task = s.input.split("\n" + head)
        assert shot.startswith(head) and task.endswith(question)
        counts = collections.Counter(numbered(task[:-len(question)]))
        assert {w for w, c in counts.items() if c == common} == set(s.references) and len(s.references) == 10
        assert set(counts.values()) == {common, uncommon}
        # the one-shot example: 40 words (20 below 4096), its top 10 listed after its answer prefix
        shot_list, shot_answer = shot[len(head):].split(question + s.answer_prefix + " ")
        shot_counts = collections.Counter(numbered(shot_list))
        assert len(shot_counts) == (40 if length >= 4096 else 20)
        assert set(numbered(shot_answer)) == {w for w, c in shot_counts.items() if c == shot_common}
        assert set(shot_counts.values()) == {shot_common, shot_uncommon}
        gaps[-1] = (gaps[-1], max(count(tok, f"{len(counts) * 3}. {w}") for w in counts) * uncommon)
    # Words differ in tokens and each probe of RULER's search draws new ones: a sample lands within a few words of
    # the budget, RULER's step (10 words) below it at most when its draw did not fit.
    assert min(gap for gap, _ in gaps) < 6 * max(per for _, per in gaps)
    assert all(gap < 10 * per + 2 * per for gap, per in gaps)


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_answers_are_the_three_most_frequent_words(tok, length):
    head = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. ")
    question = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    for s in ruler.generate("fwe", tok, length, 3):
        gap = sample_checks(tok, s, length)
        assert s.answer_prefix == (" Answer: According to the coded text above, the three most frequently appeared "
                                   "words are:")
        assert s.input.startswith(head) and s.input.endswith(question)
        words = s.input[len(head):-len(question)].split(" ")
        ranked = [w for w, _ in collections.Counter(words).most_common()]
        assert ranked[0] == "..." and tuple(ranked[1:4]) == s.references
        counts = collections.Counter(words)
        assert counts["..."] > counts[ranked[1]] > counts[ranked[2]] > counts[ranked[3]] > counts[ranked[4]]
        assert all(re.fullmatch("[a-z]{6}", w) for w in ranked[1:])
        assert len(counts) - 1 <= (length - 50) // 50  # RULER's vocabulary: (length - 50) // 50 coded words
        # RULER grows the text by (length - 50) // 32 words until it no longer fits, then steps back once
        assert gap <= (length - 50) // 32


# ---------------------------------------------------------------------------------------------
# Determinism: the prompts of a seed are fixed, and RULER's own

# sha256 of [[input, answer_prefix, references, tokens] per sample] (json.dumps, ensure_ascii=False), 3 samples,
# seed 42, the word tokenizer above. Each equals the digest of RULER's own output for the same settings.
PINNED = {
    (1000, "niah_single_1"): "1c6aaa9a5939c1c39607fb499cb3c08beddce2248865c83b628523bf9592069a",
    (1000, "niah_multikey_2"): "97ad14e5c3283b696596cbbe687d996f42b88249220ac17aebf8838fb089a859",
    (1000, "niah_multikey_3"): "2bd7317cb5c240fd301d4a7b2f15ee34e40b21b0ab445fa644e492c6126dfd47",
    (1000, "vt"): "8cdb7b9e3458a20cfc491feee519f9d742caf86ed426ab52d1bcf80bb56c383e",
    (1000, "cwe"): "2327dfacd89cc126f66ee0ffd24b51b1c9ac221f3d19c2cf15ce58a3e745a192",
    (1000, "fwe"): "c1e017368f5ee4ddca4a2ccd58d300db2946deba9a7646e96923930ef14ee75f",
    (4096, "niah_single_1"): "f6d921e260445d3e7aefbb5f38830549b17b342a7710af0c4617d04ff68cdef6",
    (4096, "niah_multikey_2"): "94aaa0ed94eccf474fe4f64394d1537e7674760d1cf5970dcd8377c0f2eed78d",
    (4096, "niah_multikey_3"): "436d0f03cb5fbc08d5046c7bae1dabd873ceecd6d688df552fd68504f70a422b",
    (4096, "vt"): "16098f9e6b77a7075d646d5084e5154428d319bd7e3570217487ec7640b8d02d",
    (4096, "cwe"): "0065ccd9358c116c8672c75e0e485c0040dbb5f48f29fc99e69e74414eb693bb",
    (4096, "fwe"): "c06d9b86e7cf2ab956d9bd0b5299340428e95de0c9f7a1f6694cc287a0decd4d",
}


def digest(samples):
    rows = [[s.input, s.answer_prefix, list(s.references), s.tokens] for s in samples]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


@pytest.mark.parametrize("length,task", sorted(PINNED))
def test_prompts_are_pinned(tok, length, task):
    needs_words(task)
    assert digest(ruler.generate(task, tok, length, 3, seed=42)) == PINNED[length, task]


def example_noise_lines(s):
    """The noise lines of a vt sample's one-shot example."""
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    example, _ = s.input[len(head):].split(head)
    return example.split("\n").count(NOISE)


def test_vt_follows_rulers_redraw_where_a_name_repeats_and_refuses_where_ruler_crashes(tok):
    # RULER's generate_chains draws names with replacement; a name drawn twice makes it append names and cut all of
    # them into chains, the last one short: an IndexError. Its sample loop catches it and draws again with 5 noise
    # lines fewer; its haystack sizing does not, and the script crashes. With this tokenizer at 1024 tokens, the
    # one-shot example's sample draw repeats a name at seed 1050, its size estimate at seed 35, its binary search at
    # seed 237 (whatever the length: the example is sized to 500 tokens). Every draw of the example has the same
    # token count here, so without the IndexError it keeps the searched size: 17 noise lines (seed 42).
    assert {example_noise_lines(s) for s in ruler.generate("vt", tok, 1024, 2, seed=42)} == {17}
    redrawn = ruler.generate("vt", tok, 1024, 2, seed=1050)
    assert {example_noise_lines(s) for s in redrawn} == {12}
    # RULER's own output (c3f5e3b's variable_tracking.py, this tokenizer, 1024, 2 samples, seed 1050), as pinned above
    assert digest(redrawn) == "fe66789e27580a5ce42f8468e3955be7edd75fc3a9c5940084ca5f6e31d7eb1d"
    for seed in (35, 237):
        with pytest.raises(ValueError, match=rf"seed {seed} RULER's script draws a variable name twice while it "
                                             "sizes the one-shot example .* RULER crashes there"):
            ruler.generate("vt", tok, 1024, 2, seed=seed)


def test_a_seed_gives_the_same_prompts_and_another_seed_others(tok):
    first = ruler.generate("niah_multikey_3", tok, 1000, 2, seed=7)
    ruler.clear_cache()
    again = ruler.generate("niah_multikey_3", tok, 1000, 2, seed=7)
    other = ruler.generate("niah_multikey_3", tok, 1000, 2, seed=8)
    assert first == again and first is not again
    assert {s.references for s in other}.isdisjoint({s.references for s in first})
    default = ruler.generate("fwe", tok, 1000, 1)
    assert default == ruler.generate("fwe", tok, 1000, 1, seed=42) != ruler.generate("fwe", tok, 1000, 1, seed=43)


def test_adjective_noun_keys_are_rulers_sorted_set_without_building_it():
    # RULER: sorted(set(f"{adj}-{noun}")) over wonderwords' 912 x 6782 words. Here on lists with the cases that
    # decide the order: adjectives that start with another one and "-" (high, high-pitched: their strings
    # interleave), one with a space (its "-" sorts after " "), repeated adjectives, and nouns that make the same
    # string from two adjectives (high + pitched-apple = high-pitched + apple).
    adjectives = ["high", "high-pitched", "old", "old-fashioned", "old-fashioned-ish", "ad hoc", "ad", "zany", "a",
                  "a-b", "b", "high", "teeny", "teeny-tiny", "x-rated"]
    nouns = ["apple", "pitched-apple", "b-c", "Z", "zebra", "-dash", "fashioned-ish-cat", "cat", "tiny", "éclair", ""]
    keys = ruler_words.AdjectiveNounKeys(adjectives, nouns)
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    assert len(keys) == len(expected) < len(adjectives) * len(nouns)
    assert [keys[i] for i in range(len(keys))] == expected
    assert keys[-1] == expected[-1]
    with pytest.raises(IndexError):
        keys[len(keys)]


def test_the_real_key_list_has_rulers_size_and_ends():
    pytest.importorskip("wonderwords")
    keys = ruler_words.needle_words()
    assert len(keys) == 6171620 == 910 * 6782  # distinct adjectives x nouns: no string made twice
    assert (keys[0], keys[-1]) == ("Early-ATM", "zonked-zucchini")  # code point order: capitals first


def test_zeta_is_scipys():
    assert ruler_generators.zeta(2.0) == math.pi ** 2 / 6  # scipy.special.zeta(2.0): the same double
    for s, value in [(3.0, 1.2020569031595942), (2.5, 1.3414872572509173), (1.5, 2.612375348685488),
                     (4.0, math.pi ** 4 / 90)]:
        assert ruler_generators.zeta(s) == pytest.approx(value, rel=2e-15)


def test_too_short_a_length_is_an_error_not_a_hang(tok):
    with pytest.raises(ValueError, match="too short"):
        ruler.generate("niah_multikey_3", tok, 200, 1)
    with pytest.raises(ValueError, match="must exceed the 128 tokens"):
        ruler.generate("niah_multikey_3", tok, 128, 1)
    with pytest.raises(ValueError, match="unknown RULER task 'nope'; the tasks are: niah_single_1"):
        ruler.generate("nope", tok, 1000, 1)
    with pytest.raises(ValueError, match="give a haystack text"):
        ruler.generate("niah_single_2", tok, 1000, 1)
    # RULER's vt example must fit 500 tokens: 500 characters cannot hold it (RULER would loop forever)
    with pytest.raises(ValueError, match="vt: RULER's one-shot example does not fit its 500 tokens"):
        ruler.generate("vt", char_tokenizer(), 4096, 1)


def test_essay_tasks_place_their_needles_in_the_given_text(tok):
    pytest.importorskip("wonderwords")
    essay = " ".join(f"Sentence {i} of the essay says something about topic {i % 7}." for i in range(400))
    s = ruler.generate("niah_multivalue", tok, 1500, 1, haystack=essay)[0]
    assert sample_checks(tok, s, 1500) < 500  # RULER grows essays by 500 words
    needles = re.findall(r"One of the special magic numbers for (.+?) is: (\d{7})\.", s.input)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 1  # 4 values of one key
    assert sorted(v for _, v in needles) == sorted(s.references)
    assert "Some special magic numbers are hidden" in s.input and s.answer_prefix.endswith("text are")
    assert "Sentence 0 of the essay says something about topic 0." in s.input


# ---------------------------------------------------------------------------------------------
# Scoring: RULER's definitions, numbers worked out by hand


def test_string_match_all_and_part_by_hand():
    preds = ["The special magic number is 1234567.", "nothing here", "abc, and then Def"]
    refs = [["1234567"], ["42"], ["ABC", "def", "ghi"]]
    # all: per prediction the share of references found, case-insensitive: 1, 0, 2/3 -> mean 5/9 -> 55.56
    assert ruler.string_match_all(preds, refs) == 55.56
    # part: 1 when any reference is found: 1, 0, 1 -> 66.67
    assert ruler.string_match_part(preds, refs) == 66.67
    assert ruler.string_match_all(["x"], [["X"]]) == 100.0
    assert ruler.string_match_all(["ab", "ab"], [["a", "b", "c"], ["c", "d", "e"]]) == 33.33  # (2/3 + 0) / 2
    assert ruler.postprocess("  12\x0034\t5 \n") == "12\n34\n5"


def test_effective_length_by_hand():
    assert ruler.THRESHOLD == 85.6
    # 85.6 itself does not exceed the bar; a pass after a failure does not count
    assert ruler.effective_length({4096: 90.0, 8192: 86.0, 16384: 85.6, 32768: 95.0}) == 8192
    assert ruler.effective_length({8192: 90.0, 4096: 99.0}) == 8192  # in length order, whatever the dict's
    assert ruler.effective_length({4096: 85.0, 8192: 99.0}) is None
    assert ruler.effective_length({4096: float("nan"), 8192: 99.0}) is None
    assert ruler.effective_length({}) is None
    assert ruler.effective_length({4096: 60.0, 8192: 50.0}, threshold=55.0) == 4096
    result = ruler.RulerResult(("a", "b"), (4096, 8192), 1, 42, (
        ruler.TaskScore("a", 4096, 100.0), ruler.TaskScore("b", 4096, 72.0),   # average 86.0: passes
        ruler.TaskScore("a", 8192, 100.0), ruler.TaskScore("b", 8192, 71.0)))  # average 85.5: fails
    assert result.averages == {4096: 86.0, 8192: 85.5} and result.effective_length == 4096


# ---------------------------------------------------------------------------------------------
# The runner


class ScriptedAnswers(torch.nn.Module):
    """A causal LM (character tokenizer) that continues each known prompt with its scripted answer, then EOS."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        super().__init__()
        self.tokenizer, self.answers = tokenizer, answers
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.prompts_seen = []

    def forward(self, input_ids, **kwargs):
        text = self.tokenizer.decode(input_ids[0].tolist())
        prompt = next(p for p in self.answers if text.startswith(p))
        written = text[len(prompt):]
        if not written:
            self.prompts_seen.append(prompt)
        answer = self.answers[prompt]
        nxt = (self.tokenizer.eos_token_id if len(written) >= len(answer)
               else self.tokenizer.convert_tokens_to_ids(answer[len(written)]))
        logits = torch.zeros(1, input_ids.shape[1], len(self.tokenizer))
        logits[0, -1, nxt] = 1.0
        return types.SimpleNamespace(logits=logits, past_key_values=None)


def test_runner_scores_answers_as_ruler_does():
    tok = char_tokenizer()
    answers = {}
    for length in (1200, 1500):
        for task in ("niah_multikey_3", "fwe"):
            for s in ruler.generate(task, tok, length, 2):
                right = " " + ", ".join(s.references) + "."
                # at 1500, the second sample misses: niah says nothing useful, fwe names 2 of its 3 words
                wrong = " I do not know." if task.startswith("niah") else " " + ", ".join(s.references[:2])
                answers[s.prompt] = wrong if (length == 1500 and s.index == 1) else right
    model = ScriptedAnswers(tok, answers)
    model.train()
    result = ruler.run(model, tok, ["niah_multikey_3", "fwe"], [1200, 1500], samples=2)
    assert model.training  # restored
    assert sorted(model.prompts_seen) == sorted(answers)  # every prompt answered once
    assert result.scores == {"niah_multikey_3": {1200: 100.0, 1500: 50.0}, "fwe": {1200: 100.0, 1500: 83.33}}
    assert result.averages == {1200: 100.0, 1500: pytest.approx(66.665)}
    assert result.effective_length == 1200
    r = next(r for r in result.results if r.task == "fwe" and r.length == 1500)
    assert [x.score for x in r.samples] == [100.0, 66.67]
    assert r.samples[1].prediction == ", ".join(r.samples[1].references[:2])  # stripped as RULER does


def test_runner_end_to_end_on_a_tiny_llama_and_its_prompt_cache(tok, tmp_path, monkeypatch):
    model = tiny_llama(len(tok), max_position=1100)
    calls, answers = [], []
    uncached, greedy = ruler._generate_uncached, evaluate.greedy_tokens

    def counting(task, *args):
        calls.append(task.name)
        return uncached(task, *args)

    def recording(model, ids, max_new_tokens, eos):
        new = greedy(model, ids, max_new_tokens, eos)
        answers.append((max_new_tokens, len(new)))
        return new

    monkeypatch.setattr(ruler, "_generate_uncached", counting)
    monkeypatch.setattr(evaluate, "greedy_tokens", recording)
    tasks, lengths = ["niah_multikey_3", "fwe"], [900, 1000]
    result = ruler.run(model, tok, tasks, lengths, samples=2, cache_dir=tmp_path)
    assert sorted(calls) == sorted(tasks * 2)
    assert [(r.task, r.length) for r in result.results] == [(t, n) for n in lengths for t in tasks]
    # each answer: the task's tokens_to_generate at most (128 for niah, 50 for fwe), greedy
    assert [m for m, _ in answers] == [128, 128, 50, 50] * 2 and all(0 < n <= m for m, n in answers)
    for r in result.results:
        assert len(r.samples) == 2 and 0 <= r.score <= 100
        prompts = {s.index: s.prompt for s in ruler.generate(r.task, tok, r.length, 2)}
        assert [x.prompt_tokens for x in r.samples] == [len(tok(prompts[i])["input_ids"]) for i in (0, 1)]
    data = json.loads(json.dumps(result.to_dict()))
    assert data["tasks"] == tasks and data["lengths"] == lengths and data["seed"] == 42 and data["samples"] == 2
    assert set(data["scores"]) == set(tasks) and set(data["scores"]["fwe"]) == {"900", "1000"}
    assert data["average"]["900"] == pytest.approx(sum(data["scores"][t]["900"] for t in tasks) / 2)
    assert data["effective_length"] is None and data["threshold"] == 85.6 and data["template"] == "base"
    assert len(data["results"]) == 4 and set(data["results"][0]["samples"][0]) == {
        "index", "prompt_tokens", "references", "prediction", "score"}
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".jsonl"] * 4  # no temporary left

    # again in this process: the prompts come from memory (no files named); in a new one (memory cleared) from
    # the files
    calls.clear()
    again = ruler.run(model, tok, tasks, lengths, samples=2)
    ruler.clear_cache()
    from_disk = ruler.run(model, tok, tasks, lengths, samples=2, cache_dir=tmp_path)
    assert calls == [] and again == result == from_disk
    # another seed or sample count is another key
    ruler.clear_cache()
    ruler.generate("fwe", tok, 900, 2, seed=1, cache_dir=tmp_path)
    ruler.generate("fwe", tok, 900, 1, cache_dir=tmp_path)
    assert calls == ["fwe", "fwe"]
    # a file cut short (an interrupted writer elsewhere) is generated again, the same
    (path,) = tmp_path.glob("niah_multikey_3-900-*.jsonl")
    before = path.read_text()
    path.write_text(before[:-20])
    ruler.clear_cache()
    ruler.generate("niah_multikey_3", tok, 900, 2, cache_dir=tmp_path)
    assert calls[-1] == "niah_multikey_3" and path.read_text() == before


def test_tokens_are_counted_as_ruler_counts_them_and_fed_with_bos():
    # RULER counts tokenizer.tokenize(text): no special tokens; the model reads the prompt with them (BOS here)
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "<s>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", bos_token="<s>")
    (s,) = ruler.generate("fwe", tok, 1000, 1)
    assert s.tokens == len(tok.tokenize(s.prompt)) == len(tok(s.prompt)["input_ids"]) - 1
    model = ScriptedAnswers(char_tokenizer(), {})
    seen = []
    model.forward = lambda input_ids, **kw: seen.append(input_ids.shape[1]) or types.SimpleNamespace(
        logits=torch.zeros(1, input_ids.shape[1], 3), past_key_values=None)
    result = ruler.run(model, tok, ["fwe"], [1000], samples=1)
    assert result.results[0].samples[0].prompt_tokens == seen[0] == s.tokens + 1


def test_the_cache_keys_on_the_tokenizer(tok, tmp_path, monkeypatch):
    calls = []
    uncached = ruler._generate_uncached
    monkeypatch.setattr(ruler, "_generate_uncached", lambda task, *a: calls.append(task.name) or uncached(task, *a))
    by_words = ruler.generate("niah_multikey_3", tok, 1500, 1, cache_dir=tmp_path)
    by_chars = ruler.generate("niah_multikey_3", char_tokenizer(), 1500, 1, cache_dir=tmp_path)
    same_words = ruler.generate("niah_multikey_3", word_tokenizer(), 1500, 1, cache_dir=tmp_path)  # another object
    assert calls == ["niah_multikey_3", "niah_multikey_3"] and by_words == same_words
    assert by_chars[0].tokens == len(by_chars[0].prompt) and by_words[0].tokens == count(tok, by_words[0].prompt)
    assert len(by_chars[0].input) < len(by_words[0].input)  # 1500 characters hold fewer needles than 1500 words


def test_without_wonderwords_the_word_tasks_say_what_to_install(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "wonderwords", None)  # import fails, as when not installed
    monkeypatch.setattr(ruler_words, "WORD_CACHE", {})
    for task in ("cwe", "niah_single_1", "niah_multikey_2"):
        with pytest.raises(ruler.WonderwordsMissing, match="pip install wonderwords"):
            ruler.generate(task, tok, 1000, 1)
    assert ruler.generate("vt", tok, 1000, 1) and ruler.generate("niah_multikey_3", tok, 1000, 1)
    with pytest.raises(ruler.WonderwordsMissing, match="niah_single_1, niah_multikey_2, cwe draw words"):
        ruler.run(None, tok, lengths=[1000])  # refused before any work (no model needed to see it)


# ---------------------------------------------------------------------------------------------
# The command


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out


def usage_error(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage: ropescale eval ruler" in err
    return err


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tiny_llama_words")
    tiny_llama(len(tok), max_position=1100).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_cli_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "ruler", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "examples:\n  ropescale eval ruler --gguf --lengths 4096 8192 --samples 5" in out
    for option in ("--lengths", "--tasks", "--samples", "--seed", "--haystack", "--cache-dir", "--plot", "--json",
                   "--method"):
        assert option in out
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    assert "ruler" in capsys.readouterr().out


def test_cli_usage_errors(capsys, tmp_path):
    err = usage_error(capsys, "eval", "ruler", "m", "--lengths", "4096", "--tasks", "vt", "nope")
    assert "--tasks: unknown task nope; the tasks are: niah_single_1, niah_multikey_2, niah_multikey_3, vt, cwe, fwe" \
        in err
    err = usage_error(capsys, "eval", "ruler", "m", "--lengths", "4096", "--tasks", "niah_multivalue")
    assert "give --haystack FILE" in err
    assert "--haystack: cannot read" in usage_error(capsys, "eval", "ruler", "m", "--lengths", "4096", "--haystack",
                                                    str(tmp_path / "missing.txt"))
    assert "--lengths: 100 leaves no room" in usage_error(capsys, "eval", "ruler", "m", "--lengths", "100")
    assert "the following arguments are required: --lengths" in usage_error(capsys, "eval", "ruler", "m")


def test_cli_runs_json_text_and_plot(capsys, tmp_path, saved_model):
    from PIL import Image

    argv = ["eval", "ruler", str(saved_model), "--lengths", "1000", "--tasks", "niah_multikey_3", "fwe",
            "--samples", "1", "--device", "cpu", "--quiet", "--cache-dir", str(tmp_path / "cache")]
    data = json.loads(run_cli(capsys, *argv, "--json").out)
    assert data["tasks"] == ["niah_multikey_3", "fwe"] and data["lengths"] == [1000] and data["samples"] == 1
    assert data["model"] == str(saved_model) and data["method"] is None and data["skipped"] == {}
    assert set(data["scores"]) == {"niah_multikey_3", "fwe"} and "1000" in data["average"]
    assert data["effective_length"] is None
    out = run_cli(capsys, *argv, "--plot", str(tmp_path / "ruler.png")).out
    lines = out.splitlines()
    assert lines[1].split() == ["task", "1000"]
    assert [line.split()[0] for line in lines[3:5]] == ["niah_multikey_3", "fwe"] and lines[6].startswith("average")
    assert "effective length: none" in out and "85.6" in out
    assert Image.open(tmp_path / "ruler.png").size == (960, 540)


def test_cli_skips_the_word_tasks_without_wonderwords(capsys, saved_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "wonderwords", None)
    monkeypatch.setattr(ruler_words, "WORD_CACHE", {})
    out = run_cli(capsys, "eval", "ruler", str(saved_model), "--lengths", "1000", "--samples", "1", "--device", "cpu",
                  "--json", "--tasks", "niah_single_1", "niah_multikey_3", "cwe")
    assert "skipping niah_single_1, cwe" in out.err and "pip install wonderwords" in out.err
    data = json.loads(out.out)
    assert data["tasks"] == ["niah_multikey_3"] and set(data["skipped"]) == {"niah_single_1", "cwe"}
    assert "need the wonderwords package" in usage_error(capsys, "eval", "ruler", str(saved_model), "--lengths", "1000",
                                                          "--tasks", "cwe")


def test_cli_ctrl_c_ends_cleanly(capsys, tmp_path, saved_model, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "greedy_tokens", interrupted)
    code = cli.main(["eval", "ruler", str(saved_model), "--lengths", "1000", "--tasks", "fwe", "--samples", "1",
                     "--device", "cpu", "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err  # (transformers' bar loading the weights, then ours)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    # the prompts made before the interrupt are kept whole for the next run
    (cached,) = tmp_path.glob("fwe-1000-*.jsonl")
    assert len(cached.read_text().splitlines()) == 2 and list(tmp_path.iterdir()) == [cached]


def test_the_cache_files_have_the_users_umask_and_a_cache_dir_that_is_a_file_is_refused_first(tok, tmp_path):
    import os

    for umask, mode in ((0o022, 0o644), (0o002, 0o664)):
        ruler.clear_cache()
        folder = tmp_path / f"cache{umask:o}"
        old = os.umask(umask)
        try:
            ruler.generate("fwe", tok, 1000, 1, cache_dir=folder)
        finally:
            os.umask(old)
        (written,) = folder.iterdir()  # the file alone: no temporary left
        assert written.name.startswith("fwe-1000-") and written.stat().st_mode & 0o777 == mode
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    with pytest.raises(ValueError, match="cache_dir: .*not-a-folder is a file, not a folder"):
        ruler.run(None, tok, ["fwe"], [1000], cache_dir=a_file)  # before any work (no model needed to see it)


def fake_run(calls):
    """ruler.run's stand-in: records the tasks and returns a score of 50 for each (no model work)."""
    def run(model, tokenizer, tasks, lengths, samples=5, seed=42, **kwargs):
        calls.append((list(tasks), kwargs))
        return ruler.RulerResult(tuple(tasks), tuple(lengths), samples, seed,
                                 tuple(ruler.TaskScore(t, n, 50.0) for n in lengths for t in tasks))
    return run


def test_cli_haystack_adds_the_essay_tasks(capsys, tmp_path, saved_model, monkeypatch):
    pytest.importorskip("wonderwords")
    calls = []
    monkeypatch.setattr(ruler, "run", fake_run(calls))
    essays = tmp_path / "essays.txt"
    essays.write_text("An essay. It has sentences. " * 50)
    base = ["eval", "ruler", str(saved_model), "--lengths", "1000", "--samples", "1", "--device", "cpu", "--json"]
    data = json.loads(run_cli(capsys, *base, "--haystack", str(essays)).out)
    assert calls[-1][0] == data["tasks"] == [*ruler.DEFAULT_TASKS, *ruler.ESSAY_TASKS]
    assert calls[-1][1]["haystack"] == essays.read_text()
    run_cli(capsys, *base)
    assert calls[-1][0] == list(ruler.DEFAULT_TASKS)
    out = run_cli(capsys, *base, "--haystack", str(essays), "--tasks", "fwe")  # chosen tasks: those alone
    assert calls[-1][0] == ["fwe"] and "--haystack is not used" in out.err


def test_cli_outputs_are_checked_before_the_model_loads(capsys, tmp_path, saved_model, monkeypatch):
    from ropescale.cli import cmd_eval

    monkeypatch.setattr(cmd_eval, "_load_model", lambda args: pytest.fail("the model was loaded"))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    base = ["eval", "ruler", str(saved_model), "--lengths", "1000", "--tasks", "fwe"]
    err = usage_error(capsys, *base, "--plot", str(a_file / "ruler.png"))
    assert "--plot: " in err and "a-file is a file" in err
    (tmp_path / "folder.png").mkdir()
    assert "folder.png is a folder, not a file" in usage_error(capsys, *base, "--plot", str(tmp_path / "folder.png"))
    err = usage_error(capsys, *base, "--cache-dir", str(a_file))
    assert "--cache-dir: " in err and "is a file, not a folder" in err
    assert "--cache-dir: " in usage_error(capsys, *base, "--cache-dir", str(a_file / "cache"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "folder.png"]  # nothing made


def test_cli_prints_the_scores_before_the_plot_and_a_failed_plot_loses_nothing(capsys, tmp_path, saved_model,
                                                                                  monkeypatch):
    import errno

    from ropescale import plots

    monkeypatch.setattr(ruler, "run", fake_run([]))

    def full_disk(scores, path, **kwargs):  # the disk fills while the PNG is written
        with open(path, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots, "ruler_scores", full_disk)
    argv = ["eval", "ruler", str(saved_model), "--lengths", "1000", "--tasks", "fwe", "--device", "cpu",
            "--plot", str(tmp_path / "plots" / "ruler.png")]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and "Traceback" not in out.err
    assert "--plot: cannot write" in out.err and "No space left on device" in out.err and "printed above" in out.err
    assert "fwe" in out.out and "50.00" in out.out and "effective length: none" in out.out  # the table, printed
    assert list((tmp_path / "plots").iterdir()) == []  # no half-written PNG
    with pytest.raises(SystemExit):
        cli.main(argv + ["--json"])
    assert json.loads(capsys.readouterr().out)["scores"] == {"fwe": {"1000": 50.0}}
