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


def assert_bf16_as_close_as_stock(what: str, bf16, reference, stock_bf16, stock_exact, engine_lp, engine: str) -> None:
    """The trainer's bf16 autocast log-probs (``bf16``) against its float64 ones (``reference``) and against the
    engine's (``engine_lp``, float32): each within twice the error stock transformers makes in bf16 on the same
    weights and tokens (``stock_bf16`` against ``stock_exact``), max and rms (support/training.py's rule)."""
    ours, theirs, to_engine = errors(bf16, reference), errors(stock_bf16, stock_exact), errors(bf16, engine_lp)
    print(f"{what}: bf16 autocast vs float64 max {ours[0]:.3f} rms {ours[1]:.4f}; stock transformers' max "
          f"{theirs[0]:.3f} rms {theirs[1]:.4f}; vs {engine} max {to_engine[0]:.3f} rms {to_engine[1]:.4f}; float32 "
          f"{engine} vs float64 {(engine_lp - reference).abs().max():.1e}")
    assert theirs[1] > 1e-3, "stock bf16 autocast made no error: is autocast on?"
    for against, value in (("vs float64", ours), (f"vs {engine}", to_engine)):
        assert value[0] <= 2 * theirs[0] + 1e-5 and value[1] <= 2 * theirs[1] + 1e-5, (what, against, value, theirs)
