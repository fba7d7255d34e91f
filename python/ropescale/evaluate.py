"""Long-context evaluators for any transformers causal LM and tokenizer, as in the YaRN paper.

- ``passkey_retrieval``: a 5-digit key hidden at a uniformly random depth in repeated filler text
  (Mohtashami and Jaggi's prompt, as the YaRN paper uses it); the model answers greedily and
  the first number it writes must equal the key.
- ``perplexity``: sliding-window perplexity (Press et al.; the Hugging Face perplexity guide):
  windows of ``max_length`` tokens start every ``stride`` (256) tokens and each window scores only
  the tokens the previous one did not, so every token is scored once, with up to
  ``max_length - stride`` tokens of context even at the start of a window.

The model only needs the causal-LM call ``model(input_ids=...) -> output with .logits``;
``past_key_values`` is used for generation when the model returns one.

Memory: neither evaluator keeps full-vocabulary logits for every position. ``perplexity`` runs the
model's decoder (``get_decoder()``) and applies the output head and the cross-entropy to the scored
positions only, ``_LOSS_CHUNK_BYTES`` of logits at a time (models without a plain linear head: the
full logits, scored in the same chunks); passkey generation asks for the last position's logits only
(``logits_to_keep=1``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

__all__ = [
    "PASSKEY_TASK",
    "PASSKEY_FILLER",
    "PASSKEY_QUESTION",
    "passkey_prompt",
    "passkey_prompts",
    "PasskeyTrial",
    "PasskeyResult",
    "passkey_retrieval",
    "PerplexityResult",
    "perplexity",
]

PASSKEY_TASK = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize them. I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def _info_line(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def passkey_prompt(n_filler: int, n_before: int, key: int) -> str:
    """The prompt with ``n_filler`` filler blocks, the key line after the first ``n_before`` of them."""
    if not 0 <= n_before <= n_filler:
        raise ValueError(f"passkey_prompt: n_before must be in [0, n_filler = {n_filler}], got {n_before}")
    before = " ".join([PASSKEY_FILLER] * n_before)
    after = " ".join([PASSKEY_FILLER] * (n_filler - n_before))
    return "\n".join([PASSKEY_TASK, before, _info_line(key), after, PASSKEY_QUESTION])


def encode_text(tokenizer: Any, text: str) -> torch.Tensor:
    """``text``'s token ids as a 1-D long tensor, as every evaluation here encodes a prompt."""
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def _device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _last_logits_only(model: torch.nn.Module) -> dict[str, Any]:
    """``{"logits_to_keep": 1}`` for a model whose forward takes it (transformers' causal LMs): the
    prompt's forward then computes one position's logits, not ``prompt x vocabulary``."""
    try:
        takes_it = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_it = False
    return {"logits_to_keep": 1} if takes_it else {}


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int,
                  eos_token_id: int | None) -> list[int]:
    """Greedy continuation of a 1-D prompt; reuses the model's KV cache when it returns one."""
    with _request(model, max_new_tokens):
        return _greedy_loop(model, ids, max_new_tokens, eos_token_id)


def _request(model: torch.nn.Module, max_new_tokens: int):
    """The forwards of one greedy continuation as one request (``ropescale.hf.request``: a per-request method
    keeps one scale for it) on a model ``ropescale.hf.patch`` patched; nothing on any other model."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else [model]
    # the patched model, or one a wrapper holds (a timer, PEFT)
    state = next((m._ropescale_patch for m in modules if getattr(m, "_ropescale_patch", None) is not None), None)
    return state.request(max_new_tokens) if state is not None else contextlib.nullcontext()


def _greedy_loop(model, ids, max_new_tokens, eos_token_id) -> list[int]:
    device = _device(model)
    out = model(input_ids=ids[None].to(device), use_cache=True, **_last_logits_only(model))
    new: list[int] = []
    context = ids.to(device)
    while True:
        token = int(out.logits[0, -1].argmax())
        new.append(token)
        if len(new) == max_new_tokens or token == eos_token_id:
            return new
        context = torch.cat([context, context.new_tensor([token])])
        cache = getattr(out, "past_key_values", None)
        if cache is not None:
            out = model(input_ids=context[-1:][None], past_key_values=cache, use_cache=True)
        else:
            out = model(input_ids=context[None], use_cache=False)


@dataclass(frozen=True)
class PasskeyTrial:
    key: int
    depth: float  #: fraction of the filler before the key, uniform in [0, 1]
    prompt_tokens: int
    answer: str  #: the model's decoded continuation
    correct: bool


@dataclass(frozen=True)
class PasskeyResult:
    context_length: int
    trials: list[PasskeyTrial] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(t.correct for t in self.trials) / len(self.trials) if self.trials else float("nan")


def _filler_blocks_for(tokenizer: Any, context_length: int, max_new_tokens: int) -> int:
    """Most filler blocks whose prompt (with the longest key) fits ``context_length - max_new_tokens``."""
    budget = context_length - max_new_tokens

    def fits(n: int) -> bool:
        return len(encode_text(tokenizer, passkey_prompt(n, 0, 99999))) <= budget

    if not fits(0):
        raise ValueError(f"passkey_retrieval: context_length {context_length} cannot hold even the empty prompt")
    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def passkey_prompts(
    tokenizer: Any, context_length: int, trials: int, seed: int = 0, max_new_tokens: int = 10
) -> list[tuple[str, int, float]]:
    """``trials`` passkey prompts as ``(prompt, key, depth)``: as many filler blocks as fit in
    ``context_length - max_new_tokens`` tokens, a fresh 5-digit key after a uniformly random number
    of them (``depth`` = that number over the block count)."""
    if context_length <= max_new_tokens:
        raise ValueError(f"passkey_retrieval: context_length must be > max_new_tokens = {max_new_tokens}, got {context_length}")
    if trials < 1:
        raise ValueError(f"passkey_retrieval: trials must be >= 1, got {trials}")
    rng = random.Random(seed)
    n_filler = _filler_blocks_for(tokenizer, context_length, max_new_tokens)
    prompts = []
    for _ in range(trials):
        key = rng.randint(10_000, 99_999)
        n_before = rng.randint(0, n_filler)  # uniform over the block boundaries
        prompts.append((passkey_prompt(n_filler, n_before, key), key, n_before / n_filler if n_filler else 0.0))
    return prompts


def passkey_retrieval(
    model: torch.nn.Module,
    tokenizer: Any,
    context_length: int,
    trials: int = 10,
    seed: int = 0,
    max_new_tokens: int = 10,
    progress: bool = False,
) -> PasskeyResult:
    """Passkey retrieval at ``context_length`` tokens (prompt plus answer): ``trials`` prompts, each
    with a fresh 5-digit key at a uniformly random depth; a trial is correct when the first integer
    in the greedy answer equals the key."""
    prompts = passkey_prompts(tokenizer, context_length, trials, seed, max_new_tokens)
    eos = getattr(tokenizer, "eos_token_id", None)
    was_training = getattr(model, "training", False)
    model.eval()
    results = []
    if progress:
        from tqdm.auto import tqdm

        prompts = tqdm(prompts, desc=f"passkey@{context_length}", leave=False)
    try:
        for prompt, key, depth in prompts:
            ids = encode_text(tokenizer, prompt)
            answer = tokenizer.decode(greedy_tokens(model, ids, max_new_tokens, eos), skip_special_tokens=True)
            found = re.search(r"\d+", answer)
            results.append(
                PasskeyTrial(
                    key=key,
                    depth=depth,
                    prompt_tokens=len(ids),
                    answer=answer,
                    correct=found is not None and int(found.group()) == key,
                )
            )
    finally:
        model.train(was_training)
    return PasskeyResult(context_length, results)


# Logits (float64 while scored) per chunk of positions: peak memory of the loss is one chunk, whatever
# the vocabulary and the window.
_LOSS_CHUNK_BYTES = 8 << 20


def _chunk_nll(logits_of, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """nll of ``targets[i]`` under ``logits_of(slice)`` (float logits ``[len, vocab]`` of those
    positions), a chunk of positions at a time, in float64."""
    chunk = max(1, _LOSS_CHUNK_BYTES // (8 * max(1, vocab)))
    # The result is allocated once, up front: small tensors kept from every chunk, allocated between
    # the chunks' large ones, fragment the heap so that it grows by a chunk per chunk (seen: 3 GB).
    nll = torch.empty(targets.numel(), dtype=torch.float64, device=targets.device)
    for lo in range(0, targets.numel(), chunk):
        piece = slice(lo, min(lo + chunk, targets.numel()))
        nll[piece] = torch.nn.functional.cross_entropy(logits_of(piece).double(), targets[piece], reduction="none")
    return nll


def _head_of(model: torch.nn.Module):
    """``(decoder, head)`` when the causal LM's logits are ``head(decoder(...).last_hidden_state)`` with a
    plain linear head (Llama, Mistral, Qwen, ...), else None (the full logits are then used)."""
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    config = getattr(model, "config", None)
    if get_decoder is None or get_head is None:
        return None
    # Models that post-process the head's output (softcapping, a logit scale) keep the full path.
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in ("final_logit_softcapping", "logit_scale")):
        return None
    try:
        decoder, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or decoder is model or type(head) is not torch.nn.Linear:
        return None
    return decoder, head


def _window_scorer(model: torch.nn.Module):
    """``score(window, first)``: float64 nll of ``window[first + 1:]``, each token predicted from the
    window's tokens before it."""
    parts = _head_of(model)

    def score(window: torch.Tensor, first: int) -> torch.Tensor:
        targets = window[first + 1:]
        if parts is not None:
            decoder, head = parts
            hidden = decoder(input_ids=window[None], use_cache=False).last_hidden_state[0, first:-1]
            return _chunk_nll(lambda piece: head(hidden[piece]), targets, head.out_features)
        if keeps_logits:  # logits of the last len - first positions only (the scored ones, and the last)
            logits = model(input_ids=window[None], logits_to_keep=window.numel() - first).logits[0, :-1]
        else:
            logits = model(input_ids=window[None]).logits[0, first:-1]
        return _chunk_nll(lambda piece: logits[piece], targets, logits.shape[-1])

    keeps_logits = bool(_last_logits_only(model))
    return score


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  #: mean negative log-likelihood per scored token (nats)
    tokens: int  #: number of scored tokens
    windows: int
    #: float64 ``[n]``: entry ``t`` is the nll of token ``t`` given its window's context, NaN where the
    #: method scores nothing (token 0, and a window's first token when ``stride == max_length``)
    token_nll: torch.Tensor = field(repr=False, compare=False, default=None)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    text_or_ids: str | torch.Tensor | Sequence[int],
    tokenizer: Any = None,
    max_length: int | None = None,
    stride: int = 256,
    progress: bool = False,
) -> PerplexityResult:
    """Sliding-window perplexity of one text (a string with ``tokenizer``, or token ids): windows of
    ``max_length`` tokens (default: the model's ``max_position_embeddings``) every ``stride`` tokens;
    each window scores only its tokens past the end of the previous window, with the tokens before
    them in the window as context (the Hugging Face guide's method: with ``stride == max_length`` the
    windows do not overlap and each window's first token, which has no context, is not scored)."""
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("perplexity: a tokenizer is needed to score a string")
        ids = encode_text(tokenizer, text_or_ids)
    else:
        ids = torch.as_tensor(text_or_ids, dtype=torch.long).reshape(-1)
    if max_length is None:
        max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if max_length is None:
            raise ValueError("perplexity: max_length is needed for a model without config.max_position_embeddings")
    if stride < 1 or max_length < 2:
        raise ValueError(f"perplexity: need stride >= 1 and max_length >= 2, got stride={stride}, max_length={max_length}")
    if stride > max_length:
        raise ValueError(f"perplexity: stride ({stride}) must be <= max_length ({max_length}) or tokens go unscored")
    n = ids.numel()
    if n < 2:
        raise ValueError(f"perplexity: the text must have at least 2 tokens, got {n}")
    device = _device(model)
    was_training = getattr(model, "training", False)
    model.eval()
    token_nll = torch.full((n,), math.nan, dtype=torch.float64)
    windows, prev_end = 0, 0
    # Windows start every stride tokens until one reaches the end of the text.
    starts = range(0, max(0, n - max_length) + stride, stride)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="perplexity", leave=False)
    score = _window_scorer(model)
    try:
        for begin in starts:
            end = min(begin + max_length, n)
            window = ids[begin:end].to(device)
            first_new = max(prev_end, begin + 1)  # a window's first token has no prediction
            # Tokens first_new..end-1 are predicted at window positions first_new-begin-1 .. end-begin-2.
            token_nll[first_new:end] = score(window, first_new - begin - 1).cpu()
            windows += 1
            prev_end = end
            if end == n:
                break
    finally:
        model.train(was_training)
    scored = token_nll[~torch.isnan(token_nll)]
    mean = float(scored.mean())
    return PerplexityResult(perplexity=math.exp(mean), nll=mean, tokens=scored.numel(), windows=windows,
                            token_nll=token_nll)
