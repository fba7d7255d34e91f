"""Issue 29 in transformers: ``per="request"`` of the dynamic methods (Dynamic YaRN, Dynamic NTK).

A request whose prompt has P tokens and may generate N runs, in every layer and step, the static model of scale
``s = max(factor, (P + N) / L)``: so a short and a long prompt batched together (left padding) each equal their
solo runs, each equals the static ``YaRN(factor=s)`` (Dynamic NTK: ``NTK`` at its base for ``P + N``) model, and a
request with ``P + N <= L`` IS the native model. Then the ways N reaches the model (``max_new_tokens``,
``max_length``, ``hf.request`` around a manual loop), the refusal of a step past the planned length, the serving
core's rule the vLLM plugin shares (``cut_segments``, ``TableCache``, the prefix-cache digest), the checkpoint round
trip and the command line. Tolerance: 1e-5 relative on float32 logits (the static and the per-request paths rotate
with different kernels: fused cos/sin against positions and tables)."""

import dataclasses
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from ropescale import cli, config as config_lib, hf, scaling, serving  # noqa: E402
from support.tiny_lm import ids, tiny  # noqa: E402

warnings.filterwarnings("ignore", message=".*rope.*")
pytestmark = pytest.mark.usefixtures("one_thread")

L = 16  # the tiny model's trained length
TOL = dict(rtol=1e-5, atol=1e-5)

PER_REQUEST = {
    "dynamic_yarn": scaling.DynamicYaRN(original_max_position=L, per="request"),
    "dynamic_ntk": scaling.DynamicNTK(factor=2.0, original_max_position=L, per="request"),
}


def static_equivalent(method: scaling.RopeScaling, length: int) -> scaling.RopeScaling | None:
    """The static method whose table is ``method``'s at ``length`` (None: the native table)."""
    if length <= L and method.factor == 1.0 or isinstance(method, scaling.DynamicNTK) and length <= L:
        return None
    if isinstance(method, scaling.DynamicYaRN):
        return scaling.YaRN(factor=max(method.factor, length / L), original_max_position=L)
    # transformers' dynamic rule: base b * ((s * len / L) - (s - 1))^(d/(d-2)), i.e. NTK-aware at that factor
    return scaling.NTK(factor=method.factor * length / L - (method.factor - 1))


def model_of(method=None, layers=3):
    model = tiny(mpe=L, layers=layers)
    model.generation_config.eos_token_id = None
    return hf.patch(model, method) if method is not None else model


def logits_of(model, x, new_tokens, mask=None, **kwargs):
    budget = {} if new_tokens is None else {"max_new_tokens": new_tokens}
    out = model.generate(x, attention_mask=mask, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **budget, **kwargs)
    return torch.stack(out.logits, 1), out.sequences  # [B, N, V]


def prompts():
    x = ids(2, 12)
    return x[0, :5], x[1]  # a short prompt (5 + 10 <= 16 + ...) and a long one


@pytest.mark.parametrize("name", sorted(PER_REQUEST))
def test_batched_rows_equal_their_solo_runs_and_the_static_model_of_their_scale(name):
    method, new = PER_REQUEST[name], 10
    model = model_of(method)
    short, long_ = prompts()  # planned lengths 15 (<= L: native) and 22 (s = 22/16)
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    batch[0, 7:], mask[0, 7:] = short, 1
    batch[1], mask[1] = long_, 1
    with torch.no_grad():
        batched, _ = logits_of(model, batch, new, mask)
        for row, prompt in enumerate((short, long_)):
            solo, _ = logits_of(model, prompt[None], new)
            torch.testing.assert_close(batched[row], solo[0], **TOL)
            planned = len(prompt) + new
            reference = static_equivalent(method, planned)
            static, _ = logits_of(model_of(reference), prompt[None], new)
            torch.testing.assert_close(solo[0], static[0], **TOL, msg=lambda m: f"{name} at {planned}: {m}")
        # the test can fail: the paper's per-step rule computes the long row otherwise
        step_model = model_of(dataclasses.replace(method, per="step"))
        stepped, _ = logits_of(step_model, long_[None], new)
        assert (stepped[0] - batched[1]).abs().max() > 1e-3


def test_a_request_that_fits_the_trained_length_is_the_native_model():
    model, native = model_of(PER_REQUEST["dynamic_yarn"]), model_of()
    x = ids(3, 9)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(model, x, 7)[0], logits_of(native, x, 7)[0], **TOL)  # 9 + 7 = L
        assert (logits_of(model, x, 8)[0] - logits_of(native, x, 8)[0]).abs().max() > 1e-4  # 17 > L: scaled


def test_the_budget_is_the_length_transformers_resolves():
    """max_new_tokens, max_length, the generation config's, and transformers' default (20 new tokens, capped at
    max_position_embeddings): each row's budget is the number of tokens generate may produce."""
    model = model_of(PER_REQUEST["dynamic_yarn"])
    x = ids(1, 12)
    with torch.no_grad():
        want, tokens = logits_of(model, x, 9)
        by_length, tokens_by_length = logits_of(model, x, None, max_length=21)
        model.generation_config.max_new_tokens = 9
        by_config, _ = logits_of(model, x, None)
        model.generation_config.max_new_tokens = None
        by_default, default_tokens = logits_of(model, x, None)  # transformers caps it at 16 = L: native
        native, _ = logits_of(model_of(), x, None)
    assert torch.equal(tokens, tokens_by_length) and default_tokens.shape[1] == L
    torch.testing.assert_close(by_length, want, rtol=0, atol=0)
    torch.testing.assert_close(by_config, want, rtol=0, atol=0)
    torch.testing.assert_close(by_default, native, **TOL)


def test_a_manual_loop_is_one_request_inside_hf_request_and_refused_outside():
    model = model_of(PER_REQUEST["dynamic_yarn"])
    x = ids(1, 12)
    with torch.no_grad():
        want, tokens = logits_of(model, x, 6)
        with hf.request(model, max_new_tokens=6):
            out = model(x, use_cache=True)
            steps = [out.logits[:, -1]]
            for t in range(5):
                out = model(tokens[:, 12 + t:13 + t], past_key_values=out.past_key_values, use_cache=True)
                steps.append(out.logits[:, -1])
        torch.testing.assert_close(torch.stack(steps, 1), want, **TOL)
        out = model(x, use_cache=True)  # outside: the prompt's forward is the whole request
        with pytest.raises(ValueError, match=r"row 0 is now at length 13, past its planned 12.*hf.request"):
            model(tokens[:, 12:13], past_key_values=out.past_key_values, use_cache=True)
        assert out.past_key_values.get_seq_length() == 12  # the refused step left the cache as it was
        # a new request in the same cache object (emptied) starts over: a 12-token prompt, then one step is refused
        # only past 12 again
        out.past_key_values.reset()
        assert out.past_key_values.get_seq_length() == 0
        model(x[:, :11], past_key_values=out.past_key_values, use_cache=True)
        with pytest.raises(ValueError, match=r"length 12, past its planned 11"):
            model(x[:, 11:12], past_key_values=out.past_key_values, use_cache=True)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", None])
def test_hf_request_refuses_bad_budgets(bad):
    model = model_of(PER_REQUEST["dynamic_yarn"])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        hf.request(model, bad)


def test_hf_request_needs_a_patched_model_and_one_request_at_a_time():
    with pytest.raises(RuntimeError, match="not patched by ropescale"):
        hf.request(model_of(), 4)
    model = model_of(PER_REQUEST["dynamic_yarn"])
    with hf.request(model, 4):
        with pytest.raises(RuntimeError, match="already open"):
            with hf.request(model, 4):
                pass
    with hf.request(model, 4):  # closed again
        pass


def test_per_request_checkpoint_round_trips(tmp_path):
    method = PER_REQUEST["dynamic_yarn"]
    model_of(method).save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters["per"] == "request"
    hf.patch(reloaded)
    reloaded.generation_config.eos_token_id = None
    assert reloaded._ropescale_patch.method == method
    x = ids(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(reloaded, x, 8)[0], logits_of(model_of(method), x, 8)[0], **TOL)
    # per="step" (the default) writes no key: checkpoints stay what they were
    assert "per" not in scaling.DynamicYaRN(original_max_position=L).to_hf()
    # unpatch restores generate
    hf.unpatch(reloaded)
    assert "generate" not in vars(reloaded)


@pytest.mark.parametrize("value", ["requests", "", None, 1])
def test_a_bad_per_in_a_config_is_refused(value):
    params = {**PER_REQUEST["dynamic_yarn"].to_hf(), "per": value}
    with pytest.raises(ValueError, match="DynamicYaRN: per must be 'step' or 'request'"):
        scaling.from_hf(params, L)


# ---------------------------------------------------------------------------------------------
# The serving core's rule (what the vLLM plugin runs)


def plan_of(method):
    return serving.PreRopePlan(method, 10000.0, 16, serving.NO_WINDOW)


def test_every_row_of_a_request_takes_the_table_of_its_planned_length():
    # (request, rows, seq_len, table_len): a chunk of a prompt, a decode row, a recompute after preemption: all at
    # the planned length, one segment per request
    got = serving.cut_segments([48, 301, 104], [48, 1, 104], [300, 300, 100], request_lens=[364, 364, 108])
    assert got == [(0, 48, 48, 364), (1, 1, 301, 364), (2, 104, 104, 108)]
    plan = plan_of(PER_REQUEST["dynamic_yarn"])
    assert plan.per_request and plan.table_length(100, 8) == 108
    assert not plan_of(scaling.DynamicYaRN(original_max_position=L)).per_request
    assert plan_of(scaling.DynamicYaRN(original_max_position=L)).table_length(100, 8) == 100


def test_table_cache_needs_the_planned_lengths_and_keys_the_prefix_cache_on_them():
    tables = serving.TableCache(plan_of(PER_REQUEST["dynamic_yarn"]))
    with pytest.raises(RuntimeError, match="needs each request's planned length"):
        tables.step([40], [40], [40])
    step = tables.step([40, 3], [40, 1], [40, 2], request_lens=[50, 10])
    for row, length in enumerate((50, 10)):
        torch.testing.assert_close(step.inv_freq[row], tables.table(length)[0], rtol=0, atol=0)
    # prompts that fit L with any budget that keeps them there share the native table's digest; others do not
    assert tables.prompt_digest(5, 3) == tables.prompt_digest(12, 4) == tables.prompt_digest(16, 0)
    assert tables.prompt_digest(12, 5) != tables.prompt_digest(12, 4)
    assert tables.prompt_digest(12, 20) == tables.prompt_digest(30, 2) != tables.prompt_digest(30, 3)


# ---------------------------------------------------------------------------------------------
# The command line


def test_extend_writes_per_request_and_refuses_it_for_a_static_method(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    model_of().save_pretrained(src)
    assert cli.main(["extend", str(src), str(dst), "--method", "dynamic_yarn", "--per", "request"]) == 0
    assert "per request: each request runs the static model" in capsys.readouterr().out
    parsed = config_lib.read_config(transformers.AutoConfig.from_pretrained(dst))
    assert parsed.method == scaling.DynamicYaRN(original_max_position=L, per="request")
    with pytest.raises(SystemExit):
        cli.main(["extend", str(src), str(tmp_path / "x"), "--method", "yarn", "--factor", "2", "--per", "request"])
    assert "--per request belongs to the dynamic methods" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["extend", str(src), str(tmp_path / "y"), "--method", "dynamic_yarn", "--per", "token"])
    assert "must be one of step, request" in capsys.readouterr().err


def test_evaluators_run_each_continuation_as_one_request():
    """evaluate's greedy loop (passkey retrieval) opens one request per continuation: the tokens generate gives."""
    from ropescale import evaluate

    model = model_of(PER_REQUEST["dynamic_yarn"])
    x = ids(1, 12)
    with torch.no_grad():
        _, tokens = logits_of(model, x, 9)
    assert evaluate.greedy_tokens(model, x[0], 9, None) == tokens[0, 12:].tolist()

    class Wrapper(torch.nn.Module):  # a timer or an adapter around the patched model
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    assert evaluate.greedy_tokens(Wrapper(model), x[0], 9, None) == tokens[0, 12:].tolist()
