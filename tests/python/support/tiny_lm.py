"""Tiny causal LMs and a character-level tokenizer built locally (no downloads) for the evaluator and
command-line tests, plus a scripted passkey model whose behaviour is known exactly."""

from __future__ import annotations

import re
import string
import types
import warnings

import torch

from ropescale import evaluate


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over the printable ASCII characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(sorted(set(string.printable)))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def tiny_llama(vocab_size: int, max_position: int = 128, seed: int = 0, layers: int = 1, **config_overrides):
    """A tiny LlamaForCausalLM (eval mode) from its config; ``config_overrides`` replace any
    LlamaConfig field (head counts, ``attn_implementation``, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(**{**fields, **config_overrides})
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class PasskeyStub(torch.nn.Module):
    """A causal LM that can only copy: it answers the passkey question with the key when the key's
    line lies within its last ``window`` tokens of the prompt, and with ``0`` otherwise. It records
    for every prompt it answers whether the key was visible, so the right accuracy is known."""

    def __init__(self, tokenizer, window: int | None = None):
        super().__init__()
        self.tokenizer = tokenizer
        self.window = window
        self.visible: list[bool] = []
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # so the evaluator finds a device
        self.training = False

    def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs):
        ids = input_ids[0].tolist()
        text = self.tokenizer.decode(ids)
        end = text.rindex(evaluate.PASSKEY_QUESTION) + len(evaluate.PASSKEY_QUESTION)
        prompt, answered = text[:end], text[end:]
        prompt_tokens = len(self.tokenizer(prompt)["input_ids"])
        visible_from = 0 if self.window is None else max(0, prompt_tokens - self.window)
        match = re.search(r"The pass key is (\d+)\. Remember it", prompt)
        key_token = len(self.tokenizer(prompt[: match.start(1)])["input_ids"])
        visible = key_token >= visible_from
        if not answered:
            self.visible.append(visible)
        answer = f" {match.group(1) if visible else 0}."
        next_char = answer[len(answered)] if len(answered) < len(answer) else None
        next_id = self.tokenizer.eos_token_id if next_char is None else self.tokenizer.convert_tokens_to_ids(next_char)
        logits = torch.zeros(1, len(ids), len(self.tokenizer))
        logits[0, -1, next_id] = 1.0
        return types.SimpleNamespace(logits=logits, past_key_values=None)
