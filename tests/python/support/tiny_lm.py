"""Tiny causal LMs built locally (no downloads): the Llama-family models the hf, checkpoint, distributed and
ReRoPE training tests patch (``tiny``, with ``ids`` and the ``STATIC`` rope settings), the Llama of the evaluator,
command-line and training tests (``tiny_llama``), a character-level tokenizer, and a scripted passkey model whose
behaviour is known exactly. transformers is imported where a model is built, so that a test module can skip
without it (``pytest.importorskip``) before it imports this one."""

from __future__ import annotations

import re
import string
import types
import warnings

import torch

from ropescale import evaluate

from .methods import instance, registered


# ---------------------------------------------------------------------------------------------
# Llama-family models with sharp attention (rope differences show in their logits)

FAMILIES = {  # family: (transformers config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
VOCAB = 101


def tiny(family="llama", rope_parameters=None, layers=2, mpe=64, seed=0, **extra):
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in FAMILIES[family])
    rope_parameters = dict(rope_parameters or {"rope_type": "default"})
    rope_parameters.setdefault("rope_theta", 10000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_cls(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=mpe,
            rope_parameters=rope_parameters, **extra,
        )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Larger weights than the default init make attention sharper, so rope differences show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.mul_(4.0)
    return model


def ids(batch=2, length=40, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# The static tables transformers itself serves, as rope_parameters: one of each such registered method (so a new one
# is patched-equals-native tested without an edit here), and settings of the hand-written cases beside them.
STATIC = {
    **{name: instance(cls, pairs=8, original=16).to_hf()
       for name, cls in registered(transformers_native=True, dynamic=False).items()},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
    "llama3_factor8": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32},
    # no factor: transformers derives it from max_position_embeddings, as ropescale does
    "longrope_derived_factor": {"rope_type": "longrope", "original_max_position_embeddings": 16,
                                "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                "long_factor": [1.0 + 0.5 * i for i in range(8)]},
}


# ---------------------------------------------------------------------------------------------
# The evaluator's and the command line's models: a plain Llama, a character tokenizer, a passkey stub


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
