"""Every Python example in README.md and the documentation site (docs/**/*.md) runs, and every relative link in
them points to a file that exists (issue 58, item 4).

Each ```python block is run as written, in a fresh namespace, in this process (one transformers import for all),
in a temporary working directory. A block that uses names it does not define (the reader's `model`, `ids`)
says so in an HTML comment right before it, which the site does not show:
    <!-- example: tiny_llama, texts -->     names from SETUPS below, built here on tiny models
    <!-- not run: needs vLLM -->            not run here; the reason is required, and the test lists every one
A block without a comment runs with nothing but what it imports. A comment naming no known setup, or a marker
not followed by a python block, fails.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from support import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# An optional marker comment, then a fenced python block (its code up to the closing fence).
BLOCK = re.compile(r"(?:<!--\s*(?P<mark>(?:example|not run):[^>]*?)\s*-->[ \t]*\n)?^```python[ \t]*\n(?P<code>.*?)^```",
                   re.S | re.M)
MARK = re.compile(r"^<!--\s*(example|not run):", re.M)


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()
    g = torch.Generator().manual_seed(0)
    return {"model": model, "ids": torch.randint(1, 64, (1, 6), generator=g),
            "long_ids": torch.randint(1, 64, (1, 8192), generator=g)}


def texts():
    from types import SimpleNamespace

    import torch

    g = torch.Generator().manual_seed(1)
    return {"tokenizer": SimpleNamespace(pad_token_id=0),
            "texts": [{"input_ids": torch.randint(1, 64, (n,), generator=g).tolist()} for n in (3000, 21000)]}


def tensors():
    """ops.md's q, k, v and tables: [batch, heads, seq, head_dim], GQA (4 query heads, 2 key heads)."""
    import torch

    from ropescale import ops

    g = torch.Generator().manual_seed(2)
    B, L, D = 1, 24, 64
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (4, 2, 2))
    pos = torch.arange(L).expand(B, L).contiguous()
    inv_freq = ops.default_inv_freq(D, 1e4)
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)  # transformers' rotate-half table, [B, L, D]
    return {"q": q, "k": k, "v": v, "cos": emb.cos(), "sin": emb.sin(), "position_ids": pos, "pos": pos,
            "inv_freq": inv_freq, "mscale": 1.0, "q_t": torch.randn(B, 4, 1, D, generator=g),
            "k_t": torch.randn(B, 2, 1, D, generator=g), "v_t": torch.randn(B, 2, 1, D, generator=g),
            "pos_t": torch.full((B, 1), L)}


SETUPS = {"tiny_llama": tiny_llama, "texts": texts, "tensors": tensors}


def blocks():
    """[(where, mark, code)] of every python block, and the markers that precede no python block."""
    found, stray = [], []
    for page in PAGES:
        text = page.read_text()
        used = set()
        for m in BLOCK.finditer(text):
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start('code'))}"
            found.append((where, (m.group("mark") or "").strip(), m.group("code")))
            if m.group("mark"):
                used.add(m.start())
        stray += [f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                  for m in MARK.finditer(text) if m.start() not in used]
    return found, stray


BLOCKS, STRAY = blocks()
RUN = [(where, mark, code) for where, mark, code in BLOCKS if not mark.startswith("not run:")]
NOT_RUN = [(where, mark.split(":", 1)[1].strip()) for where, mark, _ in BLOCKS if mark.startswith("not run:")]


def test_every_marker_precedes_a_python_block_and_every_skip_says_why():
    assert not STRAY, f"example markers followed by no ```python block: {STRAY}"
    assert len(RUN) >= 15, f"only {len(RUN)} runnable blocks found: the extractor no longer sees the docs' examples"
    unexplained = [where for where, reason in NOT_RUN if not reason.startswith("needs ")]
    assert not unexplained, f"a `not run` block must say what it needs ('not run: needs ...'): {unexplained}"
    print(f"\n{len(RUN)} examples run, {len(NOT_RUN)} not run:")
    for where, reason in NOT_RUN:
        print(f"  {where}: {reason}")


@pytest.mark.parametrize("where,mark,code", RUN, ids=[where for where, _, _ in RUN])
def test_example_runs_as_written(where, mark, code, tmp_path, monkeypatch, one_thread):
    names = [n.strip() for n in mark.split(":", 1)[1].split(",")] if mark else []
    unknown = [n for n in names if n not in SETUPS]
    assert not unknown, f"{where}: unknown example setup {unknown} (known: {sorted(SETUPS)})"
    namespace = {"__name__": "__doc_example__"}
    for name in names:
        namespace.update(SETUPS[name]())
    monkeypatch.chdir(tmp_path)  # examples save into the working directory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, where, "exec"), namespace)


# Relative links: [text](path) and [text](path#anchor) in README.md and docs/ point to files that exist. (The site's
# build, `mkdocs build --strict` in scripts/test.sh, checks docs' links and anchors too; README is not on the site.)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def relative_links(page: Path):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        yield target


def broken_links(pages):
    return [f"{page.relative_to(ROOT)}: {target}" for page in pages for target in relative_links(page)
            if not (page.parent / target.split("#", 1)[0]).exists()]


def test_readme_and_docs_relative_links_point_to_existing_files():
    assert sum(1 for page in PAGES for _ in relative_links(page)) >= 20
    assert not broken_links(PAGES)


def test_a_broken_link_is_found(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("[there](page.md) [not there](missing.md#x) `[code](nope.md)` [web](https://example.org)\n")
    monkeypatch.setattr("test_doc_examples.ROOT", tmp_path)
    assert broken_links([page]) == ["page.md: missing.md#x"]
