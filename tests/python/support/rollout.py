"""The trainer's side of the trainer-equals-rollout tests, shared by every engine's (test_trainer_rollout.py: vLLM,
test_sglang_rollout.py: SGLang): the policy as a trainer holds it, its log-probabilities of a rollout, and the size
of a difference."""

import pytest
import torch

from ropescale import hf
from support.vllm_testing import served_llama


def token_logprobs(model, tokens, dtype=None):
    """The trainer's log p of tokens 1.. (one training forward, no cache; under CPU autocast in ``dtype``)."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        logits = model(tokens, use_cache=False).logits
    return logits.double().log_softmax(-1)[0, :-1].gather(-1, tokens[0, 1:, None])[:, 0].detach()


def trainer(method, dtype=torch.float32):
    """The policy as a trainer holds it: patched, in training mode (its config's dropout: 0)."""
    model = hf.patch(served_llama().to(dtype), method).train()
    assert model.config.attention_dropout == 0.0 and model.training
    return model


def errors(got, want):
    """(max, rms) of ``got - want``."""
    diff = got - want
    return float(diff.abs().max()), float(diff.pow(2).mean().sqrt())


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The trainer's forwards on one thread (the engine's processes take the other core)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
