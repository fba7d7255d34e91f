"""A training step of a model, and the autocast rule the training tests hold it to (CONTRIBUTING: precision is
judged against what transformers' own model does in that dtype on the same inputs)."""

import torch


def loss_and_grads(model, x, dtype=None):
    """One step of next-token loss on ``x`` (under CPU autocast in ``dtype``; None: float32): (every token's logprob,
    every parameter's gradient), flattened, float64."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        out = model(x, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
        token_logprobs = logits.float().log_softmax(-1)[:, :-1].gather(-1, x[:, 1:, None] % logits.shape[-1])
    token_logprobs.mean().neg().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return token_logprobs.detach().double().flatten(), grads.double()


def assert_autocast_as_close_as_native(model, native, x, dtype, step=None, native_step=None):
    """``model``'s step under autocast in ``dtype`` is as close to its float32 step as ``native``'s (transformers'
    own model) is to its own: relative error of the token logprobs and of the gradients within twice native's
    (plus float32 rounding). ``step`` / ``native_step``: the float32 steps, if already taken."""
    lp, grads = step or loss_and_grads(model, x)
    native_lp, native_grads = native_step or loss_and_grads(native, x)
    native_lp_ac, native_grads_ac = loss_and_grads(native, x, dtype)
    lp_ac, grads_ac = loss_and_grads(model, x, dtype)
    assert torch.isfinite(lp_ac).all() and torch.isfinite(grads_ac).all()
    for what, got, want, native_got, native_want in (("token logprobs", lp_ac, lp, native_lp_ac, native_lp),
                                                     ("gradients", grads_ac, grads, native_grads_ac, native_grads)):
        error = (got - want).norm() / want.norm()
        native_error = (native_got - native_want).norm() / native_want.norm()
        assert error <= 2 * native_error + 1e-6, f"{what}: {float(error):.2e}, transformers' {float(native_error):.2e}"


class WithPositions(torch.nn.Module):
    """The model with fixed position ids (what a PoSE/CREAM batch feeds it), called as the model is otherwise."""

    def __init__(self, model, position_ids):
        super().__init__()
        self.model, self.position_ids = model, position_ids

    def forward(self, x, **kwargs):
        return self.model(x, position_ids=self.position_ids, **kwargs)
