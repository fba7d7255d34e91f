"""benchmarks/bench_vllm_mixed.py's checks, without a server (the served run is minutes to hours: the benchmark's
own --help): outputs compared token by token and logprob by logprob, and the load = solo tolerance derived from
stock vLLM's own variance (twice it, never below 1e-5), so a difference beyond the engine's own fails."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from support import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vllm_mixed", ROOT / "benchmarks" / "bench_vllm_mixed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        del sys.modules[spec.name]


def output(bench, tokens, logprobs, prompt):
    return bench.Output(tokens, logprobs, prompt, 0.0)


def test_compare_holds_tokens_and_logprobs_to_the_tolerance(bench):
    base = output(bench, [5, 6, 7], [-1.0, -2.0, -3.0], [-0.5, -0.25])
    assert bench.compare("r", base, output(bench, [5, 6, 7], [-1.0, -2.0 + 9e-6, -3.0], [-0.5, -0.25]), 1e-5)["ok"]
    moved = bench.compare("r", base, output(bench, [5, 6, 7], [-1.0, -2.0, -3.0], [-0.5, -0.25 + 3e-5]), 1e-5)
    assert not moved["ok"] and moved["max_prompt_diff"] == pytest.approx(3e-5)
    other = bench.compare("r", base, output(bench, [5, 9, 7], [-1.0, -2.0, -3.0], [-0.5, -0.25]), 1e-5)
    assert not other["ok"] and other["first_token_diff"] == 1
    assert bench.compare("r", base, output(bench, [5, 6, 7], [-1.0, -2.0, -3.0], None), 1e-5)["ok"]  # none asked


def test_the_solo_tolerance_is_twice_stock_vllms_own_variance(bench):
    assert bench.engine_tolerance([]) == bench.SAME_TOL
    stock = [{"max_gen_diff": 1.5e-5, "max_prompt_diff": 2.8e-5}, {"max_gen_diff": 1.1e-5, "max_prompt_diff": None},
             {"max_gen_diff": math.nan, "max_prompt_diff": 4e-6}]
    tol = bench.engine_tolerance(stock)
    assert tol == pytest.approx(5.6e-5)
    base = output(bench, [1], [-1.0], [-0.5])
    assert bench.compare("r", base, output(bench, [1], [-1.0 + 2.15e-5], [-0.5]), tol)["ok"]  # within the engine's
    assert not bench.compare("r", base, output(bench, [1], [-1.0 + 6e-5], [-0.5]), tol)["ok"]  # beyond it


def test_solo_none_runs_no_server_solo_as_its_help_says(bench):
    assert bench.parse_args(["--solo", "none"]).solo == []
    assert bench.parse_args(["--solo"]).solo == []
    assert bench.parse_args([]).solo == ["per_request"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--solo", "none", "native"])
